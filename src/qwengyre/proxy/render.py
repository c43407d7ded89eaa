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

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from qwengyre.proxy.parsers import AUTO, PROBE_REASONING, ReplyFormat, reply_format
from qwengyre.proxy.types import Message, ToolCall, ToolSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_PLACEHOLDER = "\u2063qwengyre-placeholder\u2063"
_TAIL_TOKENS = 8  # ample for "<|im_start|>assistant\n<think>\n"


class ChatRenderer:
    """Renders conversations with the model's own chat template; :attr:`replies` is how
    the model writes its replies: the tool-call and reasoning parsers named (by the
    registries' names, :mod:`qwengyre.proxy.parsers`; ``auto``: those
    :func:`~qwengyre.proxy.parsers.detect` finds in what the template renders for a
    probe turn). ValueError naming the allowed values for an unknown name."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        tool_parser: str = AUTO,
        reasoning_parser: str = AUTO,
    ) -> None:
        self.tokenizer = tokenizer
        probe = self.render(*_probe(), generation_prompt=False)
        self.replies: ReplyFormat = reply_format(tool_parser, reasoning_parser, probe)
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

    def prompt_tail(self, prompt_ids: Sequence[int]) -> str:
        """The end of a prompt's text (its last few tokens), where a template may open
        the reply's reasoning (:meth:`~qwengyre.proxy.parsers.ReasoningParser.stream`)."""
        return self.decode(prompt_ids[-_TAIL_TOKENS:], skip_special_tokens=False)

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


def _probe() -> tuple[list[Message], list[ToolSpec]]:
    """A turn with reasoning and a tool call, for :func:`~qwengyre.proxy.parsers.detect`
    to read the template's formats from how it renders them."""
    call = ToolCall("c1", "f", {"x": 1})
    turn = Message("assistant", "one", (call,), reasoning=PROBE_REASONING)
    tools = [ToolSpec("f", "a tool", {"type": "object", "properties": {"x": {}}})]
    return [Message("user", "first"), turn], tools
