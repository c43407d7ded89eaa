"""Reasoning between ``<think>`` and ``</think>`` (vLLM's and SGLang's ``qwen3`` and
``deepseek_r1`` reasoning parsers)."""

from __future__ import annotations

from dataclasses import dataclass

from qwengyre.proxy.parsers.base import ReasoningParser, ReasoningStream, Trimmer, held_back


@dataclass(frozen=True)
class ThinkParser(ReasoningParser):
    """Reasoning is the text up to ``end``; a leading ``start`` (after whitespace) is the
    format's. It is open from the reply's first token when the reply begins with
    ``start``, when the prompt ends with it (templates that open the reasoning in the
    generation prompt: Qwen3 thinking models, DeepSeek-R1), or always
    (``always_open``: DeepSeek-R1, which may leave out ``start``). A reply whose
    reasoning never closes is all reasoning; one where it never opened all content.
    The reasoning's surrounding whitespace is stripped; the content is passed on as
    written."""

    name: str
    always_open: bool
    start: str = "<think>"
    end: str = "</think>"

    def stream(self, prompt_tail: str) -> ReasoningStream:
        opened = self.always_open or prompt_tail.rstrip().endswith(self.start)
        return _ThinkStream(self, opened)


class _ThinkStream:
    """:class:`ReasoningStream` of :class:`ThinkParser`; a feed costs O(its text +
    the tags' lengths)."""

    def __init__(self, parser: ThinkParser, opened: bool) -> None:
        self.parser = parser
        self._state = "lead"  # "lead": not yet known whether start opens the reply
        self._opened = opened
        self._held = ""
        self._reasoning = Trimmer()

    def feed(self, text: str) -> tuple[str, str]:
        if self._state == "content":
            return "", text
        self._held += text
        reasoning = ""
        if self._state == "lead":
            lead = self._held.lstrip()
            start = self.parser.start
            if lead.startswith(start):
                self._held = lead[len(start) :]
                self._state = "reasoning"
            elif start.startswith(lead):
                return "", ""  # may still become start
            else:
                self._state = "reasoning" if self._opened else "content"
        if self._state == "reasoning":
            end = self.parser.end
            at = self._held.find(end)
            if at < 0:
                cut = held_back(self._held, len(self._held), end)
                reasoning = self._reasoning.add(self._held[:cut])
                self._held = self._held[cut:]
                return reasoning, ""
            reasoning = self._reasoning.add(self._held[:at])
            self._held = self._held[at + len(end) :]
            self._state = "content"
        content, self._held = self._held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self._state == "content" or (self._state == "lead" and not self._opened):
            return "", held
        return self._reasoning.add(held), ""
