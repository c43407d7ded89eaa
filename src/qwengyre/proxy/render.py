"""Chat-template rendering that encodes only what is new (token-in/token-out).

A follow-up call repeats the whole conversation, but the tokens of everything up to
the previous reply are already recorded: the engine's own output ids, never a
re-tokenisation of their text. :meth:`ChatRenderer.suffix_ids` renders just the text
the template puts after that reply (the end of the assistant turn, the new messages,
the generation prompt) and encodes it, so the cost of a call does not grow with the
length of the history.

The suffix is found by rendering a short *anchor* — the leading system message (it
carries the tool definitions) and a placeholder assistant turn — with and without the
new messages. That is exact for templates that render each turn locally (Qwen, Llama,
Mistral families); :meth:`ChatRenderer.check_locality` verifies it on a probe
conversation at start-up and the renderer falls back to full renders otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from qwengyre.proxy import jsonsafe
from qwengyre.proxy.types import Message, ToolCall, ToolSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_PLACEHOLDER = "\u2063qwengyre-placeholder\u2063"
# A block holds no other opening tag, and its whitespace is stripped outside the regex:
# both keep the scan linear on degenerate replies ("<tool_call>" thousands of times).
_TOOL_CALL = re.compile(r"<tool_call>((?:(?!<tool_call>).)*?)</tool_call>", re.DOTALL)


class ChatRenderer:
    """Renders conversations with the model's own chat template."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.local = self.check_locality()

    def render(
        self, messages: Sequence[Message], tools: Sequence[ToolSpec], generation_prompt: bool
    ) -> str:
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": generation_prompt}
        if tools:
            kwargs["tools"] = [t.to_template() for t in tools]
        text = self.tokenizer.apply_chat_template([m.to_template() for m in messages], **kwargs)
        assert isinstance(text, str)
        return text

    def prompt_ids(self, messages: Sequence[Message], tools: Sequence[ToolSpec]) -> list[int]:
        """The whole conversation, encoded (a call that extends no recorded node)."""
        return self.encode(self.render(messages, tools, generation_prompt=True))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        text = self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        assert isinstance(text, str)
        return text

    def suffix_ids(
        self,
        history: Sequence[Message],
        new: Sequence[Message],
        tools: Sequence[ToolSpec],
        reply_ids: Sequence[int],
    ) -> list[int] | None:
        """Tokens to append after a recorded reply (``reply_ids``, the engine's output)
        that ended ``history`` so that the prompt for ``history + new`` is complete. A
        local template (:attr:`local`) reads only ``history[:1]``, so a caller may pass
        just that.

        Returns None when the template does not render ``history`` as a prefix of
        ``history + new`` (the caller then treats the call as a new branch).
        """
        text = self._suffix_text(history, new, tools)
        if text is None:
            return None
        produced = self.decode(reply_ids[-1:], skip_special_tokens=False)
        if reply_ids and text.startswith(produced) and reply_ids[-1] == self.tokenizer.eos_token_id:
            text = text[len(produced) :]  # the engine already produced the end-of-turn token
        return self.encode(text)

    def _suffix_text(
        self, history: Sequence[Message], new: Sequence[Message], tools: Sequence[ToolSpec]
    ) -> str | None:
        """The text after the reply's content: end of its turn, ``new``, generation prompt."""
        if self.local:
            anchor = [m for m in history[:1] if m.role == "system"]
            anchor.append(Message("assistant", _PLACEHOLDER))
        else:
            anchor = [*history[:-1], Message("assistant", _PLACEHOLDER)]
        base = self.render(anchor, tools, generation_prompt=False)
        full = self.render([*anchor, *new], tools, generation_prompt=True)
        cut = base.rfind(_PLACEHOLDER)
        if cut < 0 or not full.startswith(base[:cut]):
            return None
        tail = base[cut + len(_PLACEHOLDER) :]
        rest = full[cut + len(_PLACEHOLDER) :]
        if not rest.startswith(tail):
            return None
        return rest

    def check_locality(self) -> bool:
        """Does rendering a short anchor give the same suffix as the full conversation?"""
        history = [
            Message("system", "You are helpful."),
            Message("user", "first"),
            Message("assistant", "one", (ToolCall("c1", "f", {"x": 1}),)),
            Message("tool", "r1", tool_call_id="c1"),
            Message("assistant", "two"),
        ]
        new = [Message("user", "second"), Message("system", "note")]
        tools = [ToolSpec("f", "a tool", {"type": "object", "properties": {}})]
        self.local = True
        local = self._suffix_text(history, new, tools)
        self.local = False
        full = self._suffix_text(history, new, tools)
        return local is not None and local == full


def parse_reply(text: str) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """Split a decoded reply into its text and ``<tool_call>{json}</tool_call>`` calls.

    A block is a call when its JSON (and an ``arguments`` string, if the model encoded
    them twice) parses with :func:`~qwengyre.proxy.jsonsafe.loads` within
    :data:`~qwengyre.proxy.jsonsafe.MAX_REPLY_DEPTH` levels and names the call; any
    other block, e.g. one with ``NaN`` or ``Infinity`` (not JSON: no response could carry
    them), stays in the text: the harness sees what the model wrote. Lone surrogates in
    the JSON (``"\\ud800"`` escapes) are kept as written.
    """
    calls: list[tuple[str, dict[str, Any]]] = []
    kept: list[str] = []
    last = 0
    for match in _TOOL_CALL.finditer(text):
        try:
            payload = jsonsafe.loads(match.group(1).strip(), max_depth=jsonsafe.MAX_REPLY_DEPTH)
        except ValueError:
            continue
        name = payload.get("name") if isinstance(payload, dict) else None
        arguments = payload.get("arguments", {}) if isinstance(payload, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = jsonsafe.loads(arguments, max_depth=jsonsafe.MAX_REPLY_DEPTH - 1)
            except ValueError:
                arguments = None
        if not isinstance(name, str) or not isinstance(arguments, dict):
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append((name, arguments))
    kept.append(text[last:])
    return "".join(kept).strip(), calls


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """``text`` up to the first occurrence of any stop string, and that string (the
    first listed among those found at the same place); :class:`ReplyStream` cuts a
    streamed reply by the same rule."""
    best: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop) if stop else -1
        if at >= 0 and (best is None or at < best[0]):
            best = (at, stop)
    return (text, None) if best is None else (text[: best[0]], best[1])


class IncrementalDecoder:
    """Decodes a reply's ids as they arrive, for streaming its text.

    Contract: what :meth:`push` and then :meth:`flush` return, concatenated, is
    ``tokenizer.decode(all_ids, skip_special_tokens=True)``. As vLLM's
    ``detokenize_incrementally``, each call decodes a small window: the ids of the text
    returned last (context: a tokenizer may decode a token differently at the start of
    a text) and the ids since, and returns what the new ids add, so a push costs
    O(window), not O(reply). Text that ends in an incomplete UTF-8 sequence (U+FFFD),
    or that the new ids do not lengthen (skipped special tokens), is held back until
    more ids arrive or :meth:`flush`.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._window: list[int] = []  # the ids of the text returned last, then newer ids
        self._read = 0  # how many ids of the window were returned as text

    def push(self, ids: Sequence[int]) -> str:
        """Add the next ids; the text they complete (maybe empty)."""
        self._window.extend(ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text held back (the reply is over)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self._decode(self._window[: self._read])
        text = self._decode(self._window)
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        del self._window[: self._read]
        self._read = len(self._window)
        return text[len(before) :]

    def _decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        assert isinstance(text, str)
        return text


# ReplyStream relies on this of _TOOL_CALL: a block ends at the first "</tool_call>"
# after its "<tool_call>", so text up to that close is settled whatever follows.
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


class ReplyStream:
    """Splits a reply's text, fed as it is decoded, into what can be shown at once and,
    at the end, the text and tool calls of :func:`parse_reply`.

    Contract: feed a reply's text ``full`` in any chunks, then call :meth:`finish` once.
    Let ``cut`` be ``full`` up to the first occurrence of any of the ``stop`` strings
    (the earliest; at one position, the first listed), that string excluded, or
    ``full`` if none occurs. Then :meth:`finish` returns ``(last, text, calls, stop)``
    with ``(text, calls) == parse_reply(cut)`` and ``stop`` the string matched (None if
    none), and what every :meth:`feed` returned followed by ``last`` is exactly
    ``text``: nothing shown is ever taken back. So a feed holds back a tail that may
    begin a stop string or ``<tool_call>``, an open ``<tool_call>`` block until it
    closes (a valid call is then never shown, an invalid block shows as text), the
    leading whitespace (``parse_reply`` strips it), and trailing whitespace until text
    follows it. Blocks are split and judged by ``parse_reply``'s own pattern and
    parser, so the two cannot disagree.

    A feed costs O(its text + the held text + the stop strings' squared lengths).
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = tuple(s for s in stop if s)
        self._held = ""  # the text after what is settled (shown, whitespace, or calls)
        self._scan = len(_OPEN)  # no "</tool_call>" starts in _held before this
        self._stop_at: int | None = None  # the earliest stop string found in _held
        self._shown: list[str] = []
        self._space = ""  # settled trailing whitespace, shown once text follows
        self._calls: list[tuple[str, dict[str, Any]]] = []

    def feed(self, text: str) -> str:
        """Add the next text of the reply; the text that can be shown now (maybe empty)."""
        seen = len(self._held)
        self._held += text
        for stop in self.stop:
            at = self._held.find(stop, max(0, seen - len(stop) + 1))
            if at >= 0 and (self._stop_at is None or at < self._stop_at):
                self._stop_at = at
        shown: list[str] = []
        limit = self._limit()
        while True:
            held = self._held
            opened = held.find(_OPEN, 0, limit)
            if opened < 0:
                end = limit
                tag = held.rfind("<", 0, limit)
                if tag >= 0 and _OPEN.startswith(held[tag:limit]):
                    end = tag  # may become "<tool_call>"
                self._settle(held[:end], shown)
                return "".join(shown)
            if opened > 0:
                self._settle(held[:opened], shown)
                limit -= opened
            closed = self._held.find(_CLOSE, self._scan, limit)
            if closed < 0:  # wait for the block to close
                self._scan = max(self._scan, limit - len(_CLOSE) + 1)
                return "".join(shown)
            end = closed + len(_CLOSE)
            self._settle(self._held[:end], shown)
            limit -= end

    def finish(self) -> tuple[str, str, list[tuple[str, dict[str, Any]]], str | None]:
        """(the text left to show, the whole final text, the tool calls, the stop string
        the reply was cut at or None); see the class docstring."""
        stop = None
        cut = len(self._held)
        if self._stop_at is not None:
            cut = self._stop_at
            stop = next(s for s in self.stop if self._held.startswith(s, cut))
        shown: list[str] = []
        self._settle(self._held[:cut], shown)
        return "".join(shown), "".join(self._shown), self._calls, stop

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
        the rest is shown as ``parse_reply`` keeps it; appends what to show to ``shown``."""
        last = 0
        for match in _TOOL_CALL.finditer(text):
            _, calls = parse_reply(match.group(0))
            if calls:
                self._show(text[last : match.start()], shown)
                self._calls.extend(calls)
                last = match.end()
        self._show(text[last:], shown)
        self._held = self._held[len(text) :]
        self._scan = len(_OPEN)
        if self._stop_at is not None:
            self._stop_at -= len(text)

    def _show(self, text: str, shown: list[str]) -> None:
        if not self._shown:
            text = text.lstrip()
        body = text.rstrip()
        if body:
            self._shown.append(self._space + body)
            shown.append(self._space + body)
            self._space = text[len(body) :]
        else:
            self._space += text
