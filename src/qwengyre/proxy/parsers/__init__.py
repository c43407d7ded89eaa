"""Reply parsers by model family: tool calls and reasoning, chosen per model.

Registries by the names vLLM and SGLang give their parsers (``--tool-call-parser``,
``--reasoning-parser``): :data:`TOOL_PARSERS` (``hermes``, ``qwen3_coder``) and
:data:`REASONING_PARSERS` (``qwen3``, ``deepseek_r1``; ``none``: no reasoning).
:func:`reply_format` picks them by name or, for ``auto``, from the chat template
(:func:`detect`). A :class:`ReplyFormat` splits a reply's decoded text, whole
(:meth:`ReplyFormat.parse`) or streamed (:class:`ReplyStream`): reasoning first, then
the rest cut at a stop string and split into text and tool calls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from qwengyre.proxy.parsers.base import (
    ParsedCall,
    ReasoningParser,
    ReasoningStream,
    Reply,
    ToolCallStream,
    ToolParser,
    cut_at_stop,
)
from qwengyre.proxy.parsers.hermes import HermesParser
from qwengyre.proxy.parsers.qwen3_coder import Qwen3CoderParser
from qwengyre.proxy.parsers.think import ThinkParser
from qwengyre.proxy.types import ToolSpec

__all__ = [
    "AUTO",
    "NO_REASONING",
    "PROBE_REASONING",
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ParsedCall",
    "ReasoningParser",
    "Reply",
    "ReplyFormat",
    "ReplyStream",
    "ToolParser",
    "cut_at_stop",
    "detect",
    "reply_format",
]

AUTO: Final = "auto"
NO_REASONING: Final = "none"

TOOL_PARSERS: Final[Mapping[str, ToolParser]] = MappingProxyType(
    {p.name: p for p in (HermesParser(), Qwen3CoderParser())}
)
REASONING_PARSERS: Final[Mapping[str, ReasoningParser]] = MappingProxyType(
    {
        p.name: p
        for p in (
            ThinkParser(name="qwen3", always_open=False),
            ThinkParser(name="deepseek_r1", always_open=True),
        )
    }
)


PROBE_REASONING: Final = "\u2063qwengyre-probe-reasoning\u2063"
"""The reasoning of the probe turn :func:`detect` reads (``ChatRenderer`` renders it)."""


def detect(probe: str) -> tuple[str, str]:
    """(tool parser, reasoning parser) names for a chat template, from what it renders
    for a probe conversation whose last turn is an assistant's with a tool call and
    :data:`PROBE_REASONING` as its ``reasoning_content``: a template that writes the
    call as ``<function=`` is ``qwen3_coder``'s, any other ``hermes``' (the JSON
    ``<tool_call>`` blocks of Qwen2.5 / Qwen3 and the tiny model's default template);
    one that keeps the reasoning or writes ``<think>`` reasons as ``qwen3``, any other
    not at all (``none``)."""
    tools = "qwen3_coder" if "<function=" in probe else "hermes"
    reasoning = "qwen3" if PROBE_REASONING in probe or "<think>" in probe else NO_REASONING
    return tools, reasoning


@dataclass(frozen=True)
class ReplyFormat:
    """How a model writes its replies: its tool calls and, if it reasons, its reasoning."""

    tools: ToolParser
    reasoning: ReasoningParser | None

    def parse(
        self, text: str, stop: Sequence[str], tools: Sequence[ToolSpec], prompt_tail: str
    ) -> Reply:
        """A whole reply's decoded ``text`` split: the reasoning, then the rest cut at
        the first ``stop`` string and split into text and calls (typed by ``tools``).
        ``prompt_tail``: the end of the prompt it answers."""
        reasoning, content = ("", text)
        if self.reasoning is not None:
            reasoning, content = self.reasoning.split(text, prompt_tail)
        cut, stopped = cut_at_stop(content, stop)
        kept, calls = self.tools.parse(cut, tools)
        return Reply(reasoning, kept, calls, stopped)

    def stream(
        self, stop: Sequence[str], tools: Sequence[ToolSpec], prompt_tail: str
    ) -> ReplyStream:
        """A splitter for one reply streamed as it is decoded (:class:`ReplyStream`)."""
        splitter = None if self.reasoning is None else self.reasoning.stream(prompt_tail)
        return ReplyStream(splitter, self.tools.stream(stop, tools))


@dataclass(frozen=True)
class Shown:
    """What a streamed reply can show now: reasoning, then text (either maybe empty)."""

    reasoning: str = ""
    text: str = ""


class ReplyStream:
    """A reply's text fed as it is decoded, split as :meth:`ReplyFormat.parse` splits
    it. Contract: the reasoning and text every :meth:`feed` and :meth:`finish` show,
    concatenated, are the :class:`Reply`'s ``reasoning`` and ``text`` that
    :meth:`finish` returns, which equals ``parse`` of the whole text; nothing shown is
    taken back (the reasoning all comes before the text, see
    :class:`~qwengyre.proxy.parsers.base.ToolCallStream` for what text waits for)."""

    def __init__(self, reasoning: ReasoningStream | None, tools: ToolCallStream) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._thought: list[str] = []

    def feed(self, text: str) -> Shown:
        """Add the next text of the reply; what can be shown now."""
        if self._reasoning is None:
            return Shown(text=self._tools.feed(text))
        reasoning, content = self._reasoning.feed(text)
        return self._shown(reasoning, content)

    def finish(self) -> tuple[Shown, Reply]:
        """What is left to show, and the whole reply."""
        shown = Shown()
        if self._reasoning is not None:
            shown = self._shown(*self._reasoning.finish())
        last, text, calls, stop = self._tools.finish()
        final = Shown(shown.reasoning, shown.text + last)
        return final, Reply("".join(self._thought), text, calls, stop)

    def _shown(self, reasoning: str, content: str) -> Shown:
        self._thought.append(reasoning)
        return Shown(reasoning, self._tools.feed(content) if content else "")


def reply_format(tool_parser: str, reasoning_parser: str, probe: str) -> ReplyFormat:
    """The parsers named (``auto``: :func:`detect`\\ ed from the template's ``probe``
    rendering; reasoning ``none``: no reasoning parser); ValueError naming the allowed
    values for an unknown name."""
    detected = detect(probe)
    tools = detected[0] if tool_parser == AUTO else tool_parser
    reasoning = detected[1] if reasoning_parser == AUTO else reasoning_parser
    if tools not in TOOL_PARSERS:
        allowed = ", ".join([AUTO, *TOOL_PARSERS])
        raise ValueError(f"unknown tool parser {tool_parser!r}; allowed: {allowed}")
    if reasoning != NO_REASONING and reasoning not in REASONING_PARSERS:
        allowed = ", ".join([AUTO, NO_REASONING, *REASONING_PARSERS])
        raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; allowed: {allowed}")
    return ReplyFormat(
        TOOL_PARSERS[tools], None if reasoning == NO_REASONING else REASONING_PARSERS[reasoning]
    )
