"""Request classes: which agent made a model call, and what for (docs/design.md §2, Eq 7).

A class is (agent, kind): ``agent`` is ``main`` or ``sub``; ``kind`` is ``task``
(task-driving), ``summary`` (a compaction summary) or ``side`` (anything else: a
title, a memory helper, a quota probe). A :class:`RuleSet` says how one harness shows
them (docs/harnesses.md, "Request classes"); :func:`classify` applies it:

1. the kind: ``summary`` if a summary marker matches, else ``side`` if a side marker
   matches (or no tools were offered, with ``side_without_tools``), else ``task``;
2. the agent: a harness that names its agents in headers (:class:`AgentHeaders`) is
   believed; otherwise, with ``identity``, the system prompt and the tool set decide.
   The first recorded task call's identity is the main agent's; a task call of another
   identity is a sub-agent whose id (``sub-`` and 12 hex digits) is derived from that
   identity, so it is the same in every call and every execution. A summary or side
   call of an identity no task call had (a harness's own summariser or helper) belongs
   to the agent whose conversation it opens with, else to the main agent.

:class:`Agents` holds what an execution's recorded task calls taught (identities and
openings); the recorder feeds it every node it adds, so it rebuilds the same from a
reloaded tree. Everything here is pure: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, cast, get_args

Agent = Literal["main", "sub"]
Kind = Literal["task", "summary", "side"]
TextPart = Literal["system", "last_user"]


@dataclass(frozen=True)
class RequestClass:
    agent: Agent
    kind: Kind
    agent_id: str = "main"

    @property
    def name(self) -> str:
        return f"{self.agent}.{self.kind}"

    @classmethod
    def named(cls, name: str, agent_id: str) -> RequestClass:
        """The class a node records as ``name`` (e.g. ``sub.task``) and ``agent_id``."""
        agent, _, kind = name.partition(".")
        if agent not in get_args(Agent) or kind not in get_args(Kind):
            raise ValueError(f"not a request class: {name!r}")
        return cls(cast(Agent, agent), cast(Kind, kind), agent_id)


@dataclass(frozen=True)
class RequestFacts:
    """What the rules look at: lower-cased headers, whether tools were offered, the
    text blocks of the last user message as the client split them, the leading system
    prompt, the caller's identity (:func:`identity_key` of that prompt and the tool
    set) and the key of the conversation's first message after the system prompt
    (:func:`message_key`)."""

    headers: Mapping[str, str]
    has_tools: bool
    last_user_texts: tuple[str, ...]
    system: str = ""
    identity: str = ""
    opening: str = ""


@dataclass(frozen=True)
class HeaderField:
    """A request header (lower-case name) or, with ``field``, one key of the JSON
    object the header holds (Codex's ``x-codex-turn-metadata``)."""

    header: str
    field: str = ""

    def read(self, headers: Mapping[str, str]) -> str:
        """The value ("" when the header, or its field, is absent or not a string)."""
        value = headers.get(self.header, "")
        if not self.field or not value:
            return value
        try:
            doc = json.loads(value)
        except ValueError:
            return ""
        found = doc.get(self.field) if isinstance(doc, dict) else None
        return found if isinstance(found, str) else ""


@dataclass(frozen=True)
class HeaderMarker:
    """A header (or its field) that is set, to one of ``values`` when any are given."""

    source: HeaderField
    values: tuple[str, ...] = ()

    def matches(self, facts: RequestFacts) -> bool:
        value = self.source.read(facts.headers)
        return bool(value) and (not self.values or value in self.values)


@dataclass(frozen=True)
class TextMarker:
    """A text of the request that starts with ``starts_with`` (leading whitespace
    ignored) or contains ``contains`` (one of the two is set): the leading system
    prompt (``part="system"``) or any text block of the last user message
    (``part="last_user"``)."""

    part: TextPart
    starts_with: str = ""
    contains: str = ""

    def matches(self, facts: RequestFacts) -> bool:
        texts = (facts.system,) if self.part == "system" else facts.last_user_texts
        if self.starts_with:
            return any(text.lstrip().startswith(self.starts_with) for text in texts)
        return any(self.contains in text for text in texts)


Marker = HeaderMarker | TextMarker


@dataclass(frozen=True)
class AgentHeaders:
    """How a harness names its agents in headers. A request that ``sub`` matches is a
    sub-agent's, its id read from ``agent_id`` (else ``sub``'s own value); one that
    carries ``main`` instead is the main agent's, whatever its identity (Claude Code
    resumes a session with another system prompt)."""

    sub: HeaderMarker
    agent_id: HeaderField | None = None
    main: HeaderField | None = None

    def agent(self, facts: RequestFacts) -> tuple[Agent, str] | None:
        """(agent, id) if these headers say whose the request is; None if not."""
        if self.sub.matches(facts):
            named = self.agent_id.read(facts.headers) if self.agent_id else ""
            return "sub", named or self.sub.source.read(facts.headers)
        if self.main is not None and self.main.read(facts.headers):
            return "main", "main"
        return None


@dataclass(frozen=True)
class RuleSet:
    """One harness's request-class rules (the module docstring says how they apply)."""

    name: str
    agents: tuple[AgentHeaders, ...] = ()
    identity: bool = True
    summary: tuple[Marker, ...] = ()
    side: tuple[Marker, ...] = ()
    side_without_tools: bool = True

    def kind(self, facts: RequestFacts) -> Kind:
        if any(marker.matches(facts) for marker in self.summary):
            return "summary"
        if any(marker.matches(facts) for marker in self.side):
            return "side"
        return "side" if self.side_without_tools and not facts.has_tools else "task"


@dataclass
class Agents:
    """What one execution's recorded task calls taught: whose each identity and each
    opening message is (the first task call to show one decides)."""

    by_identity: dict[str, RequestClass] = field(default_factory=dict)
    by_opening: dict[str, RequestClass] = field(default_factory=dict)

    def learn(self, identity: str, opening: str, klass: RequestClass) -> None:
        """A recorded call that started a conversation: a task call's identity and
        opening now name its agent."""
        if klass.kind != "task":
            return
        self.by_identity.setdefault(identity, klass)
        self.by_opening.setdefault(opening, klass)

    @property
    def has_main(self) -> bool:
        return any(k.agent == "main" for k in self.by_identity.values())


def classify(facts: RequestFacts, rules: RuleSet, agents: Agents | None = None) -> RequestClass:
    """The class of a request under ``rules``, given what the execution's recorded
    calls taught (``agents``; None: nothing yet). Changes nothing."""
    kind = rules.kind(facts)
    for headers in rules.agents:
        said = headers.agent(facts)
        if said is not None:
            return RequestClass(said[0], kind, said[1])
    if not rules.identity:
        return RequestClass("main", kind)
    known = agents or Agents()
    found = known.by_identity.get(facts.identity)
    if found is None and kind != "task":
        found = known.by_opening.get(facts.opening)
    if found is not None:
        return RequestClass(found.agent, kind, found.agent_id)
    if kind == "task" and known.has_main:
        return RequestClass("sub", kind, "sub-" + facts.identity[:12])
    return RequestClass("main", kind)


def identity_key(system: str, toolset: str) -> str:
    """Who a call's author is: the SHA-256 (hex) of its system prompt and the key of
    its tool set."""
    return hashlib.sha256(f"{toolset}\0{system}".encode("utf-8", "surrogatepass")).hexdigest()


def message_key(role: str, content: str) -> str:
    """A message's key (SHA-256, hex): an opening compared without keeping its text."""
    return hashlib.sha256(f"{role}\0{content}".encode("utf-8", "surrogatepass")).hexdigest()
