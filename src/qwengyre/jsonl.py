"""Reading JSONL files of pydantic records with errors that name ``file:line`` and field.

Shared by the execution traces (:mod:`qwengyre.records.trace`) and the task datasets
(:mod:`qwengyre.rollout.tasks`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError, ValidationInfo
from pydantic_core import ErrorDetails

T = TypeVar("T")

Rewrite = Callable[[tuple[int | str, ...], ErrorDetails, str], tuple[tuple[int | str, ...], str]]
"""A format's own wording: (location, pydantic error, message) -> (location, message)."""


def resolved(path: Path, info: ValidationInfo) -> Path:
    """``path`` from a line, made absolute against the directory of the file it came
    from (the validation context's ``base_dir``; the current directory without one)."""
    context = info.context if isinstance(info.context, dict) else {}
    return (Path(context.get("base_dir") or Path.cwd()) / path.expanduser()).resolve()


class JsonlError(ValueError):
    """A JSONL file that cannot be read; the message names the file, line and field."""

    def __init__(self, path: Path, message: str, line: int | None = None) -> None:
        where = f"{path}:{line}" if line is not None else f"{path}"
        super().__init__(f"{where}: {message}")
        self.path = path
        self.line = line


def field_location(loc: tuple[int | str, ...]) -> str:
    """``("calls", 2, "end_s")`` -> ``calls[2].end_s``."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def describe(error: ValidationError, rewrite: Rewrite | None = None) -> str:
    """One line for every distinct problem: ``field 'x.y': what is wrong``."""
    parts = []
    for item in error.errors(include_url=False):
        message = str(item["msg"]).removeprefix("Value error, ")
        loc = tuple(item["loc"])
        if item["type"] == "missing":
            message = "missing (required)"
        elif item["type"] == "extra_forbidden":
            message = "unknown field"
        if rewrite is not None:
            loc, message = rewrite(loc, item, message)
        field = field_location(loc)
        parts.append(f"field {field!r}: {message}" if field else message)
    return "; ".join(dict.fromkeys(parts))


def parse_line(
    text: str,
    path: Path,
    line: int | None,
    validate: Callable[[dict[str, Any]], T],
    error: type[JsonlError],
    rewrite: Rewrite | None = None,
) -> T:
    """Decode one JSON object and validate it; problems raise ``error`` naming the line."""
    try:
        data: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(path, f"invalid JSON: {exc}", line) from None
    if not isinstance(data, dict):
        raise error(path, f"expected a JSON object, got {type(data).__name__}", line)
    try:
        return validate(data)
    except ValidationError as exc:
        raise error(path, describe(exc, rewrite), line) from None
