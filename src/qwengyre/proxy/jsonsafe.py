"""JSON as the proxy reads it from clients and the model, and writes it back.

Reading (:func:`loads`) accepts RFC 8259 JSON only, within bounds:

- bytes must be UTF-8 (no UTF-16/32 detection, no raw surrogate bytes);
- nesting is at most ``max_depth`` levels (the root counts as one), checked on the text
  before anything recurses, so neither the parser, the validators, the chat template
  nor the response encoder can run out of stack on what was accepted
  (:class:`TooDeep`);
- ``NaN``, ``Infinity``, ``-Infinity`` and numbers that overflow a float (``1e999``)
  are refused: they are not JSON, and would be written back as invalid JSON;
- lone surrogates (``"\\ud800"``: clients that cut a string mid-emoji) are kept, or
  replaced with U+FFFD (``surrogates="replace"``).

Every failure is a :class:`ValueError` whose message says what is wrong. A request body
(:func:`load_object`) must be an object, whose fields a :class:`StrictModel` validates.

Writing (:func:`dumps`) is compact and lossless: raw UTF-8 (what the APIs stream) unless
the value holds a lone surrogate, which UTF-8 cannot carry; then the whole document is
written with ``\\uXXXX`` escapes, so the bytes are always valid UTF-8 and decode to the
same value.
"""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

__all__ = [
    "DECODER",
    "MAX_DEPTH",
    "MAX_REPLY_DEPTH",
    "NotAnObject",
    "StrictModel",
    "TooDeep",
    "check_depth",
    "clean_surrogates",
    "dumps",
    "has_surrogate",
    "load_object",
    "loads",
]

MAX_DEPTH = 64
"""Nesting limit of a client's JSON document (a request body, an OpenAI ``arguments``
string). Real harnesses stay far below it: Claude Code's deepest requests (a tool schema
holding an array of objects, such as TodoWrite's) nest about 10 levels."""

MAX_REPLY_DEPTH = MAX_DEPTH - 8
"""Nesting limit of a tool call the model writes (``{"name": ..., "arguments": ...}``).
Its arguments come back inside the next request body (Anthropic: 6 levels down, in
``messages[i].content[j].input``), which must still fit :data:`MAX_DEPTH`."""

# A string literal; unterminated, it runs to the end (the match never fails, so the scan
# stays linear; the parser reports the missing quote).
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1, +1, -1, -1 as signed bytes
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class TooDeep(ValueError):
    """The document nests deeper than the limit."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"JSON nesting exceeds the limit of {limit} levels")
        self.limit = limit


class NotAnObject(ValueError):
    """A request body that is JSON but not an object (``value``: what it is)."""

    def __init__(self, value: Any) -> None:
        super().__init__(f"the document is not a JSON object but {type(value).__name__}")
        self.value = value


class StrictModel(BaseModel):
    """A request body's model: strict types (``"5"`` is not an integer, ``1`` is not a
    boolean), unknown fields ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)


def has_surrogate(text: str) -> bool:
    """Whether ``text`` holds a lone surrogate (bytes that were not UTF-8, as the HTTP
    server hands them over, or a ``\\ud800`` escape once parsed)."""
    return _SURROGATE.search(text) is not None


def _depth(text: str, start: int = 0) -> int:
    """The deepest bracket nesting of ``text`` outside strings, ``text`` beginning
    ``start`` levels deep, in C time: strings are cut out, every byte but a bracket is
    deleted, the rest map to +1/-1 and are summed."""
    skeleton = _STRING.sub("", text).encode("utf-8", "surrogatepass")
    steps = skeleton.translate(_STEPS, _NOT_BRACKETS)
    return max(accumulate(memoryview(steps).cast("b"), initial=start))


def check_depth(text: str, *, start: int = 0, max_depth: int = MAX_DEPTH) -> None:
    """Raise :class:`TooDeep` if ``text`` (a whole document, or the rest of one that
    begins ``start`` levels deep, e.g. inside its top-level object and an array) nests
    deeper than ``max_depth``."""
    if _depth(text, start) > max_depth:
        raise TooDeep(max_depth)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise ValueError(f"the number {literal[:40]} is out of range")
    return value


def clean_surrogates(value: Any, text: str) -> Any:
    """``value``, parsed from ``text``, with lone surrogates replaced by U+FFFD (itself
    when ``text`` holds none)."""
    if _SURROGATE_ESCAPE.search(text) or has_surrogate(text):
        return _replace_surrogates(value)
    return value


def _replace_surrogates(value: Any) -> Any:
    """``value`` (parsed JSON) with every lone surrogate in strings and keys replaced by
    U+FFFD."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [_replace_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {_replace_surrogates(k): _replace_surrogates(v) for k, v in value.items()}
    return value


DECODER = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)
"""A decoder for this module's rules (no NaN/Infinity, finite floats); pair it with
:func:`check_depth` and :func:`clean_surrogates`."""


def loads(
    document: str | bytes,
    *,
    max_depth: int = MAX_DEPTH,
    surrogates: Literal["keep", "replace"] = "keep",
) -> Any:
    """Parse ``document`` within the bounds the module docstring lists; lone surrogates
    are kept or replaced with U+FFFD (``surrogates``).

    Raises :class:`TooDeep` past ``max_depth`` levels and :class:`ValueError` for
    anything else that is not JSON (``UnicodeDecodeError`` and ``JSONDecodeError`` are
    ValueErrors too).
    """
    text = document.decode("utf-8") if isinstance(document, bytes) else document
    check_depth(text, max_depth=max_depth)
    value = DECODER.decode(text)
    return clean_surrogates(value, text) if surrogates == "replace" else value


def load_object(body: bytes) -> dict[str, Any]:
    """A client's request body: a JSON object, read by :func:`loads` with lone
    surrogates replaced. Raises :class:`TooDeep`, :class:`NotAnObject`, or another
    :class:`ValueError` for what is not JSON."""
    value = loads(body, surrogates="replace")
    if not isinstance(value, dict):
        raise NotAnObject(value)
    return value


def dumps(value: Any) -> bytes:
    """Compact JSON of ``value`` as valid UTF-8 bytes that decode to ``value`` exactly.

    Raises ValueError for NaN or infinite floats (they have no JSON form).
    """
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: escape it (and, with it, all non-ASCII)
        return json.dumps(value, separators=(",", ":"), allow_nan=False).encode("ascii")
