"""The proxy's API-neutral request and response, shared by every API adapter (dialect).

An adapter turns its API's request body into a :class:`ChatRequest` (messages in the
shape HF chat templates render: role, content, tool_calls, tool_call_id) and turns a
:class:`Completion` back into its API's JSON body or SSE events. Errors are raised as
:class:`ApiError` and rendered in each API's own error shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

# Re-exported: the adapters build it from request bodies.
from qwengyre.types import SamplingParams as SamplingParams

Role = Literal["system", "user", "assistant", "tool"]
StopReason = Literal["end_turn", "max_tokens", "tool_use", "stop_sequence"]


@dataclass(frozen=True)
class ToolCall:
    """A tool call: ``arguments`` is the parsed JSON object (never a string)."""

    id: str
    name: str
    arguments: dict[str, Any]

    def to_template(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class Message:
    """One chat message as chat templates see it. ``reasoning``: an assistant turn's
    reasoning, given to the template as ``reasoning_content`` (a template that keeps it
    renders it). Messages compare without it: a reply's reasoning is in its recorded
    tokens, so a harness that sends it back, or leaves it out, extends the same turn."""

    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    reasoning: str = field(default="", compare=False)

    def to_template(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [c.to_template() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


@dataclass(frozen=True)
class ToolSpec:
    """A tool definition: name, description and JSON-schema parameters."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)

    def to_template(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters or {"type": "object", "properties": {}},
            },
        }


@dataclass(kw_only=True, frozen=True)
class ChatRequest:
    """An API request, API-neutral. ``headers`` keeps the lower-cased request headers
    that request-class rules look at (e.g. ``x-claude-code-agent-id``);
    ``last_user_texts`` the text blocks of the last user message as the client split
    them (None: not given, take the last user message's content whole)."""

    api: str  # the name of the dialect that parsed it (Dialect.name)
    model: str
    messages: tuple[Message, ...]
    sampling: SamplingParams
    tools: tuple[ToolSpec, ...] = ()
    stream: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    include_usage: bool = False  # OpenAI stream_options.include_usage
    headers: dict[str, str] = field(default_factory=dict)
    last_user_texts: tuple[str, ...] | None = None
    lead: int = 0  # messages from fields other than ``messages`` (Anthropic's ``system``)
    # The Responses API's namespace tools, flattened for the model: each flat tool name
    # -> (namespace, name), so that the answer names a call as the client knows it.
    tool_namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)


@dataclass(frozen=True)
class KnownMessages:
    """What an earlier body's message elements were made into, for a body that repeats
    them and adds more (:mod:`qwengyre.proxy.body`): the adapters then convert only the
    new elements. ``last_user_texts`` is None when none of them was a user message."""

    messages: tuple[Message, ...]
    last_user_texts: tuple[str, ...] | None


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token: its text and its behaviour log-probability."""

    token: str
    logprob: float


@dataclass(kw_only=True, frozen=True)
class Completion:
    """What the model answered, parsed back into reasoning (empty: none), text and
    tool calls."""

    id: str
    model: str
    text: str
    tool_calls: tuple[ToolCall, ...]
    stop_reason: StopReason
    input_tokens: int
    output_tokens: int
    stop_sequence: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    reasoning: str = ""


ErrorKind = Literal[
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "rate_limit_error",
    "api_error",
    "overloaded_error",
]

ERROR_STATUS: dict[str, int] = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "overloaded_error": 529,
}


class ApiError(Exception):
    """An error to answer in the caller's API shape (Anthropic kinds; OpenAI maps them).

    ``code`` carries a machine-readable detail, e.g. ``context_length_exceeded``.
    """

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s

    @property
    def status(self) -> int:
        return ERROR_STATUS[self.kind]
