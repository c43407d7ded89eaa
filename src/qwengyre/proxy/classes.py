"""Request-class rule sets from YAML: the built-in ones (``claude-code``, ``codex``,
``opencode``, ``qwen-code``, in ``qwengyre/presets/classes/``) and a user's own
(``proxy.classes: path/to/rules.yaml``). docs/harnesses.md ("Request classes") shows the
format; :mod:`qwengyre.trajectories.classes` says how a rule set applies.

A file is validated whole: an unknown key, a marker of two forms at once, a text marker
with no text, refuse to load with one line naming the file and the key.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from qwengyre.config import DEFAULT_RULE_SET, RULE_SETS, describe_error, rule_set_names
from qwengyre.trajectories.classes import (
    AgentHeaders,
    HeaderField,
    HeaderMarker,
    Marker,
    RuleSet,
    TextMarker,
    TextPart,
)

__all__ = ["RuleSetError", "default_rule_set", "load_rule_set", "parse_rule_set"]


class RuleSetError(ValueError):
    """A rule set that does not load; the message is one line naming where and why."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Text(_Strict):
    starts_with: str = ""
    contains: str = ""

    @model_validator(mode="after")
    def _one_text(self) -> _Text:
        if bool(self.starts_with) == bool(self.contains):
            raise ValueError("give exactly one of starts_with or contains (a non-empty text)")
        return self


def _header_name(name: str | None) -> str | None:
    """Header names compare lower-cased (the dialects keep them so)."""
    return None if name is None else name.strip().lower()


class _Header(_Strict):
    header: str = Field(min_length=1, description="a header name (any case)")
    field: str = Field("", description="a key of the JSON object the header holds")

    _lower = field_validator("header")(_header_name)

    def to_field(self) -> HeaderField:
        return HeaderField(self.header, self.field)


class _HeaderValues(_Header):
    values: list[str] = Field(default_factory=list, description="empty: any non-empty value")

    def to_marker(self) -> HeaderMarker:
        return HeaderMarker(self.to_field(), tuple(self.values))


class _Marker(_Strict):
    """One marker: a text of the request (``system`` or ``last_user``) or a header."""

    system: _Text | None = None
    last_user: _Text | None = None
    header: str | None = Field(None, min_length=1)
    field: str = ""
    values: list[str] = Field(default_factory=list)

    _lower = field_validator("header")(_header_name)

    @model_validator(mode="after")
    def _one_form(self) -> _Marker:
        forms = [self.system, self.last_user, self.header]
        if sum(form is not None for form in forms) != 1:
            raise ValueError("give exactly one of system, last_user or header")
        if self.header is None and (self.field or self.values):
            raise ValueError("field and values go with header")
        return self

    def to_marker(self) -> Marker:
        if self.header is not None:
            return HeaderMarker(HeaderField(self.header, self.field), tuple(self.values))
        part: TextPart = "system" if self.system is not None else "last_user"
        text = self.system or self.last_user
        assert text is not None  # _one_form
        return TextMarker(part, text.starts_with, text.contains)


class _Agents(_Strict):
    sub: _HeaderValues
    agent_id: _Header | None = None
    main: _Header | None = None

    def to_headers(self) -> AgentHeaders:
        return AgentHeaders(
            self.sub.to_marker(),
            self.agent_id.to_field() if self.agent_id else None,
            self.main.to_field() if self.main else None,
        )


class _RuleSet(_Strict):
    name: str = Field(min_length=1)
    identity: bool = True
    side_without_tools: bool = True
    agents: list[_Agents] = Field(default_factory=list)
    summary: list[_Marker] = Field(default_factory=list)
    side: list[_Marker] = Field(default_factory=list)

    def to_rules(self) -> RuleSet:
        return RuleSet(
            name=self.name,
            agents=tuple(a.to_headers() for a in self.agents),
            identity=self.identity,
            summary=tuple(m.to_marker() for m in self.summary),
            side=tuple(m.to_marker() for m in self.side),
            side_without_tools=self.side_without_tools,
        )


def parse_rule_set(doc: Any, source: str) -> RuleSet:
    """The rule set a decoded YAML document describes (``source`` names it in errors)."""
    if not isinstance(doc, dict):
        raise RuleSetError(f"rule set {source} must hold a mapping at the top level")
    try:
        return _RuleSet.model_validate(doc).to_rules()
    except ValidationError as exc:
        raise RuleSetError(f"rule set {source}: {describe_error(exc, _RuleSet, 'rule')}") from None


def load_rule_set(spec: str) -> RuleSet:
    """The rule set ``spec`` names: a built-in one, or a YAML file (``.yaml``/``.yml``,
    read anew at each call). :class:`RuleSetError` if it does not exist or is not valid."""
    if spec in rule_set_names():
        return _builtin(spec)
    if not spec.endswith((".yaml", ".yml")):
        raise RuleSetError(
            f"{spec!r} is neither a built-in rule set ({', '.join(rule_set_names())})"
            " nor a .yaml file"
        )
    return _read(Path(spec).expanduser())


@cache
def _builtin(name: str) -> RuleSet:
    return _read(RULE_SETS / f"{name}.yaml")


def _read(path: Path) -> RuleSet:
    try:
        text = path.read_text()
    except OSError as exc:
        raise RuleSetError(f"cannot read rule set {path}: {exc.strerror}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RuleSetError(f"rule set {path} is not valid YAML: {exc}") from None
    return parse_rule_set(doc, str(path))


def default_rule_set() -> RuleSet:
    """The rule set of a harness that brings none (``claude-code``)."""
    return load_rule_set(DEFAULT_RULE_SET)
