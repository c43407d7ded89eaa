"""The two parser interfaces: tool calls (:class:`ToolParser`) and reasoning
(:class:`ReasoningParser`), each for a whole reply and for one streamed as it is decoded.

Parsers work on the reply's decoded text only: they never touch token ids (the recorded
tokens are the engine's, whatever the split) and know no API (a dialect formats what
they return).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from qwengyre.proxy.types import ToolSpec

ParsedCall = tuple[str, dict[str, Any]]
"""A tool call as parsed: its name and its arguments (a JSON object)."""


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """``text`` up to the first occurrence of any stop string, and that string (the
    first listed among those found at the same place); :class:`ToolCallStream` cuts a
    streamed reply by the same rule."""
    best: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop) if stop else -1
        if at >= 0 and (best is None or at < best[0]):
            best = (at, stop)
    return (text, None) if best is None else (text[: best[0]], best[1])


class ToolParser(ABC):
    """A model family's tool-call format: blocks from ``open`` to the first ``close``
    after it, each judged by :meth:`parse_block`.

    A block is a call when :meth:`parse_block` says so; any other block stays in the
    text (the harness sees what the model wrote). A block holds no other ``open`` tag
    and its whitespace is stripped outside the regex: both keep the scan linear on
    degenerate replies (``open`` thousands of times).
    """

    name: ClassVar[str]
    open: ClassVar[str] = "<tool_call>"
    close: ClassVar[str] = "</tool_call>"

    def __init__(self) -> None:
        o, c = re.escape(self.open), re.escape(self.close)
        self.pattern = re.compile(f"{o}((?:(?!{o}).)*?){c}", re.DOTALL)

    @abstractmethod
    def parse_block(self, inner: str, tools: Mapping[str, ToolSpec]) -> ParsedCall | None:
        """The call a block's text between the tags (``inner``, whitespace stripped)
        makes, typed by the schema of the tool it names in ``tools`` where the format
        needs it; None when it is not a call."""

    def parse(self, text: str, tools: Sequence[ToolSpec] = ()) -> tuple[str, list[ParsedCall]]:
        """Split a reply's text into what stays text (stripped) and its calls."""
        by_name = {t.name: t for t in tools}
        calls: list[ParsedCall] = []
        kept: list[str] = []
        last = 0
        for match in self.pattern.finditer(text):
            call = self.parse_block(match.group(1).strip(), by_name)
            if call is None:
                continue
            kept.append(text[last : match.start()])
            last = match.end()
            calls.append(call)
        kept.append(text[last:])
        return "".join(kept).strip(), calls

    def stream(self, stop: Sequence[str], tools: Sequence[ToolSpec] = ()) -> ToolCallStream:
        """A splitter for one reply's text fed as it is decoded (:class:`ToolCallStream`)."""
        return ToolCallStream(self, stop, tools)


class ToolCallStream:
    """Splits a reply's text, fed as it is decoded, into what can be shown at once and,
    at the end, the text and tool calls of :meth:`ToolParser.parse`.

    Contract: feed a reply's text ``full`` in any chunks, then call :meth:`finish` once.
    Let ``cut`` be ``full`` up to the first occurrence of any of the ``stop`` strings
    (the earliest; at one position, the first listed), that string excluded, or
    ``full`` if none occurs. Then :meth:`finish` returns ``(last, text, calls, stop)``
    with ``(text, calls) == parser.parse(cut, tools)`` and ``stop`` the string matched
    (None if none), and what every :meth:`feed` returned followed by ``last`` is exactly
    ``text``: nothing shown is ever taken back. So a feed holds back a tail that may
    begin a stop string or the parser's open tag, an open block until it closes (a
    valid call is then never shown, an invalid block shows as text), the leading
    whitespace (``parse`` strips it), and trailing whitespace until text follows it.
    Blocks are split and judged by the parser's own pattern and parser, so the two
    cannot disagree (a block ends at the first close tag after its open tag, so text
    up to that close is settled whatever follows).

    A feed costs O(its text + the stop strings' squared lengths), amortised: while an
    open block waits for its close tag, a feed whose text (with the few characters
    before it) holds neither that tag nor a stop string only puts the text aside; the
    block's text is joined once it may close (``benchmarks/bench_parsers.py``).
    """

    def __init__(
        self, parser: ToolParser, stop: Sequence[str], tools: Sequence[ToolSpec] = ()
    ) -> None:
        self.parser = parser
        self.tools = tuple(tools)
        self.stop = tuple(s for s in stop if s)
        self._open, self._close = parser.open, parser.close
        self._held = ""  # the text after what is settled (shown, whitespace, or calls)
        self._aside: list[str] = []  # text after _held, fed while a block waits to close
        self._waiting = False  # _held is an open block whose close tag was not found
        # How many of the last characters fed a feed's text is searched with: enough to
        # hold a close tag or stop string that ends in the text, or a close tag left
        # past the limit by a stop string's beginning. _tail: those characters.
        self._overlap = max([len(self._close), *map(len, self.stop)]) * 2
        self._tail = ""
        self._scan = len(self._open)  # no close tag starts in _held before this
        self._stop_at: int | None = None  # the earliest stop string found in _held
        self._out = Trimmer()  # what was shown
        self._calls: list[ParsedCall] = []

    def feed(self, text: str) -> str:
        """Add the next text of the reply; the text that can be shown now (maybe empty)."""
        window = self._tail + text
        self._tail = window[-self._overlap :]
        if (
            self._waiting
            and self._stop_at is None
            and self._close not in window
            and not any(stop in window for stop in self.stop)
        ):
            self._aside.append(text)  # the block cannot close yet, nor the reply stop
            return ""
        self._join()
        seen = len(self._held)
        self._held += text
        self._waiting = False
        for stop in self.stop:
            at = self._held.find(stop, max(0, seen - len(stop) + 1))
            if at >= 0 and (self._stop_at is None or at < self._stop_at):
                self._stop_at = at
        shown: list[str] = []
        limit = self._limit()
        while True:
            held = self._held
            opened = held.find(self._open, 0, limit)
            if opened < 0:
                self._settle(held[: held_back(held, limit, self._open)], shown)
                return "".join(shown)
            if opened > 0:
                self._settle(held[:opened], shown)
                limit -= opened
            closed = self._held.find(self._close, self._scan, limit)
            if closed < 0:  # wait for the block to close
                self._scan = max(self._scan, limit - len(self._close) + 1)
                self._waiting = True
                return "".join(shown)
            end = closed + len(self._close)
            self._settle(self._held[:end], shown)
            limit -= end

    def finish(self) -> tuple[str, str, list[ParsedCall], str | None]:
        """(the text left to show, the whole final text, the tool calls, the stop string
        the reply was cut at or None); see the class docstring."""
        self._join()
        stop = None
        cut = len(self._held)
        if self._stop_at is not None:
            cut = self._stop_at
            stop = next(s for s in self.stop if self._held.startswith(s, cut))
        shown: list[str] = []
        self._settle(self._held[:cut], shown)
        return "".join(shown), "".join(self._out.pieces), self._calls, stop

    def _join(self) -> None:
        """The text put aside, back at the end of the held text."""
        if self._aside:
            self._held += "".join(self._aside)
            self._aside.clear()

    def _limit(self) -> int:
        """Where the text may still be cut: the earliest stop string found, or the
        start of the longest tail that begins one."""
        held = self._held
        limit = len(held) if self._stop_at is None else self._stop_at
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(held)), 0, -1):
                if held.endswith(stop[:k]):
                    limit = min(limit, len(held) - k)
                    break
        return limit

    def _settle(self, text: str, shown: list[str]) -> None:
        """Settle the held ``text`` (its start): blocks that are calls are taken out,
        the rest is shown as ``parse`` keeps it; appends what to show to ``shown``."""
        last = 0
        for match in self.parser.pattern.finditer(text):
            _, calls = self.parser.parse(match.group(0), self.tools)
            if calls:
                self._show(text[last : match.start()], shown)
                self._calls.extend(calls)
                last = match.end()
        self._show(text[last:], shown)
        self._held = self._held[len(text) :]
        self._scan = len(self._open)
        if self._stop_at is not None:
            self._stop_at -= len(text)

    def _show(self, text: str, shown: list[str]) -> None:
        piece = self._out.add(text)
        if piece:
            shown.append(piece)


def held_back(text: str, limit: int, tag: str) -> int:
    """Where ``text[:limit]`` stops being settled: at a last ``<`` whose tail may still
    become ``tag``, else ``limit``."""
    at = text.rfind("<", 0, limit)
    if at >= 0 and tag.startswith(text[at:limit]):
        return at
    return limit


class Trimmer:
    """Text shown piece by piece with its leading and trailing whitespace stripped and
    the whitespace in between kept: trailing whitespace waits until text follows it."""

    def __init__(self) -> None:
        self.pieces: list[str] = []  # what was shown
        self._space = ""  # whitespace waiting for text to follow it

    def add(self, text: str) -> str:
        """Take the next ``text``; what of it (with whitespace that waited) shows now."""
        if not self.pieces:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            self._space += text
            return ""
        piece = self._space + body
        self.pieces.append(piece)
        self._space = text[len(body) :]
        return piece


class ReasoningStream(Protocol):
    """Splits a reply's text, fed as it is decoded, into reasoning and the rest (its
    content). :meth:`feed` returns ``(reasoning, content)`` that can be passed on now;
    :meth:`finish` those held back. Concatenated, the pieces are the whole split of
    :meth:`ReasoningParser.split`."""

    def feed(self, text: str) -> tuple[str, str]: ...

    def finish(self) -> tuple[str, str]: ...


class ReasoningParser(ABC):
    """A model family's reasoning format: which part of a reply is reasoning."""

    name: str

    @abstractmethod
    def stream(self, prompt_tail: str) -> ReasoningStream:
        """A splitter for one reply; ``prompt_tail``: the end of the prompt it answers
        (a template may open the reasoning in the generation prompt)."""

    def split(self, text: str, prompt_tail: str) -> tuple[str, str]:
        """(reasoning, content) of a whole reply: the stream's split, fed at once."""
        splitter = self.stream(prompt_tail)
        reasoning, content = splitter.feed(text)
        more_reasoning, more_content = splitter.finish()
        return reasoning + more_reasoning, content + more_content


@dataclass(frozen=True)
class Reply:
    """A reply as parsers split it: reasoning (empty: none), text, calls, the stop
    string it was cut at."""

    reasoning: str
    text: str
    calls: list[ParsedCall]
    stop: str | None
