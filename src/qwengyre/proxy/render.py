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

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from qwengyre.proxy.types import Message, ToolCall, ToolSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_PLACEHOLDER = "\u2063qwengyre-placeholder\u2063"
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


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
        that ended ``history`` so that the prompt for ``history + new`` is complete.

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

    A block whose JSON does not parse, or lacks a name, stays in the text: the harness
    sees what the model wrote.
    """
    calls: list[tuple[str, dict[str, Any]]] = []
    kept: list[str] = []
    last = 0
    for match in _TOOL_CALL.finditer(text):
        try:
            payload = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        name = payload.get("name") if isinstance(payload, dict) else None
        arguments = payload.get("arguments", {}) if isinstance(payload, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(name, str) or not isinstance(arguments, dict):
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append((name, arguments))
    kept.append(text[last:])
    return "".join(kept).strip(), calls
