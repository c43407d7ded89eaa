"""Qwen3-Coder's XML tool calls (vLLM's and SGLang's ``qwen3_coder``; Qwen3-Coder,
Qwen3.5 and later)::

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>
    </tool_call>

Values are written as text; they are typed by the tool's JSON schema as vLLM's
``qwen3_coder`` parser types them (:func:`convert_value`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from qwengyre.proxy import jsonsafe
from qwengyre.proxy.parsers.base import ParsedCall, ToolParser
from qwengyre.proxy.types import ToolSpec

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>)?", re.DOTALL)
# A value holds no other opening tag: the scan stays linear on unclosed parameters.
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>((?:(?!<parameter=).)*?)</parameter>", re.DOTALL)


class Qwen3CoderParser(ToolParser):
    """A block is a call when it is one ``<function=NAME>`` holding only
    ``<parameter=ARG>VALUE</parameter>`` elements (and whitespace); ``</function>`` may
    be missing, as vLLM allows. One newline on each side of a value is the format's,
    not the value's. Any other block stays in the text."""

    name = "qwen3_coder"

    def parse_block(self, inner: str, tools: Mapping[str, ToolSpec]) -> ParsedCall | None:
        function = _FUNCTION.fullmatch(inner)
        if function is None:
            return None
        name = function.group(1).strip()
        body = function.group(2)
        tool = tools.get(name)
        properties = tool.parameters.get("properties", {}) if tool is not None else {}
        if not name or not isinstance(properties, dict):
            return None
        arguments: dict[str, Any] = {}
        last = 0
        for match in _PARAMETER.finditer(body):
            if body[last : match.start()].strip():
                return None
            last = match.end()
            key, value = match.group(1).strip(), match.group(2)
            value = value.removeprefix("\n").removesuffix("\n")
            arguments[key] = convert_value(value, properties.get(key))
        if body[last:].strip():
            return None
        return name, arguments


def convert_value(value: str, schema: Any) -> Any:
    """A parameter's text as the type its JSON ``schema`` declares: ``integer`` an int,
    ``number`` an int or float, ``boolean`` ``true``/``false``, ``null`` (or ``null``
    for any type but ``string``) None, ``object``/``array`` or any other declared type
    its JSON; a ``string``, an undeclared parameter, or text that is not of the declared
    type stays the text as written."""
    kinds = _types(schema)
    if not kinds or "string" in kinds:
        return value
    text = value.strip()
    if text.lower() == "null":
        return None
    for kind in kinds:
        if kind == "integer":
            try:
                return int(text)
            except ValueError:
                continue
        elif kind == "number":
            try:
                number = float(text)
            except ValueError:
                continue
            if math.isfinite(number):  # NaN, Infinity: no JSON could carry them
                return int(number) if number.is_integer() and "." not in text else number
        elif kind == "boolean":
            if text.lower() in ("true", "false"):
                return text.lower() == "true"
        else:
            try:
                return jsonsafe.loads(text, max_depth=jsonsafe.MAX_REPLY_DEPTH - 1)
            except ValueError:
                continue
    return value


def _types(schema: Any) -> list[str]:
    """The types a parameter's schema declares, ``null`` last (none: untyped)."""
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    kinds = [kind] if isinstance(kind, str) else [k for k in kind or () if isinstance(k, str)]
    if not kinds and ("properties" in schema or "items" in schema):
        kinds = ["object" if "properties" in schema else "array"]
    return sorted(kinds, key=lambda k: k == "null")
