"""Request classes: which agent made a model call, and what for (docs/design.md §2, Eq 7).

A class is (agent, kind): ``agent`` is ``main`` or ``sub``; ``kind`` is ``task``
(task-driving), ``summary`` (a compaction summary) or ``side`` (anything else, e.g. a
title or a quota probe). Rules are plain functions tried in order; the first that
returns a class wins. The defaults recognise Claude Code and plain OpenAI agents.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

Agent = Literal["main", "sub"]
Kind = Literal["task", "summary", "side"]

COMPACTION_PREFIX = "CRITICAL: Respond with TEXT ONLY"
"""Claude Code's compaction instruction starts with this. It arrives as its own user
message after a tool result, but as a further text block of the last user message after
a user text turn (``/compact`` and auto-compaction alike)."""
SUBAGENT_HEADER = "x-claude-code-agent-id"
"""Claude Code marks sub-agent requests with this header."""


@dataclass(frozen=True)
class RequestClass:
    agent: Agent
    kind: Kind
    agent_id: str = "main"

    @property
    def name(self) -> str:
        return f"{self.agent}.{self.kind}"


@dataclass(frozen=True)
class RequestFacts:
    """What the rules look at: lower-cased headers, whether tools were offered, and the
    text blocks of the last user message as the client split them."""

    headers: dict[str, str]
    has_tools: bool
    last_user_texts: tuple[str, ...]


Rule = Callable[[RequestFacts], RequestClass | None]


def _agent(facts: RequestFacts) -> tuple[Agent, str]:
    agent_id = facts.headers.get(SUBAGENT_HEADER)
    return ("sub", agent_id) if agent_id else ("main", "main")


def claude_code_summary(facts: RequestFacts) -> RequestClass | None:
    if any(text.lstrip().startswith(COMPACTION_PREFIX) for text in facts.last_user_texts):
        agent, agent_id = _agent(facts)
        return RequestClass(agent, "summary", agent_id)
    return None


def side_request_without_tools(facts: RequestFacts) -> RequestClass | None:
    if not facts.has_tools:
        agent, agent_id = _agent(facts)
        return RequestClass(agent, "side", agent_id)
    return None


def task_driving(facts: RequestFacts) -> RequestClass | None:
    agent, agent_id = _agent(facts)
    return RequestClass(agent, "task", agent_id)


DEFAULT_RULES: tuple[Rule, ...] = (claude_code_summary, side_request_without_tools, task_driving)


def classify(facts: RequestFacts, rules: Sequence[Rule] = DEFAULT_RULES) -> RequestClass:
    """The class of the first rule that answers; ``main.task`` when none does."""
    for rule in rules:
        found = rule(facts)
        if found is not None:
            return found
    return RequestClass("main", "task")
