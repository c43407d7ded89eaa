"""Hermes-style tool calls (vLLM's and SGLang's ``hermes``; Qwen2.5, Qwen3):
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

from __future__ import annotations

from collections.abc import Mapping

from qwengyre.proxy import jsonsafe
from qwengyre.proxy.parsers.base import ParsedCall, ToolParser
from qwengyre.proxy.types import ToolSpec


class HermesParser(ToolParser):
    """A block is a call when its JSON (and an ``arguments`` string, if the model
    encoded them twice) parses with :func:`~qwengyre.proxy.jsonsafe.loads` within
    :data:`~qwengyre.proxy.jsonsafe.MAX_REPLY_DEPTH` levels and names the call; any
    other block, e.g. one with ``NaN`` or ``Infinity`` (not JSON: no response could carry
    them), stays in the text. Lone surrogates in the JSON (``"\\ud800"`` escapes) are
    kept as written. The arguments are the model's JSON: no schema is consulted."""

    name = "hermes"

    def parse_block(self, inner: str, tools: Mapping[str, ToolSpec]) -> ParsedCall | None:
        try:
            payload = jsonsafe.loads(inner, max_depth=jsonsafe.MAX_REPLY_DEPTH)
        except ValueError:
            return None
        if not isinstance(payload, dict):
            return None
        name, arguments = payload.get("name"), payload.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = jsonsafe.loads(arguments, max_depth=jsonsafe.MAX_REPLY_DEPTH - 1)
            except ValueError:
                return None
        if not isinstance(name, str) or not isinstance(arguments, dict):
            return None
        return name, arguments
