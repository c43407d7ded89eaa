"""OpenAI Chat Completions adapter: request bodies in, ``chat.completion`` JSON and SSE out.

Pure functions, no I/O: the server hands :func:`parse_chat_request` the raw body and the
request headers, runs the engine, and answers with :func:`completion_body` or
:func:`stream_chunks`; an :class:`~qwengyre.proxy.types.ApiError` raised anywhere is
answered with :func:`error_status`, :func:`error_headers` and :func:`error_body`
(OpenAI's conventions, shared with the Responses API: :mod:`~qwengyre.proxy.openai_common`).
The server uses them through :class:`OpenAIChat`, this API's
:class:`~qwengyre.proxy.dialect.Dialect`.

The parser accepts what real clients (the ``openai`` SDK, LiteLLM, agent harnesses) send:
unknown or unsupported-but-harmless top-level fields are ignored (see
:func:`parse_chat_request_with_ignored` for which ones), while anything whose meaning the
proxy cannot honour (images, audio, ``n > 1``, JSON response formats, the legacy
``functions`` API) is refused with an ``invalid_request_error`` naming the field.

Bodies (and the JSON strings in ``tool_calls[].function.arguments``) are read by
:func:`qwengyre.proxy.jsonsafe.loads`: UTF-8 JSON nested at most
:data:`~qwengyre.proxy.jsonsafe.MAX_DEPTH` levels, without ``NaN``/``Infinity``; anything
else is a 400 ``invalid_request_error``. Lone surrogates (``"\\ud83d"``, sent by clients
that cut a string mid-emoji) are replaced with U+FFFD, as the Anthropic adapter does, so
the model sees, and the store keeps, exactly what was parsed; a forwarded ``x-*`` header
that is not UTF-8 is refused. Responses are lossless: SSE chunks are UTF-8 JSON, with
``\\uXXXX`` escapes when the reply holds a lone surrogate (a model's tool-call JSON can).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

from pydantic import Field

from qwengyre.proxy import jsonsafe
from qwengyre.proxy.jsonsafe import StrictModel
from qwengyre.proxy.openai_common import (
    MAX_TOP_LOGPROBS,
    OpenAIDialect,
    arguments_json,
    context_length_exceeded,
    error_body,
    error_headers,
    error_status,
    forwarded_headers,
    invalid,
    load_body,
    missing,
    models_body,
    parse_stop,
    text_parts,
    token_logprob,
    tool_arguments,
    type_error,
    validate,
)
from qwengyre.proxy.sse import pieces, split_events
from qwengyre.proxy.types import (
    ApiError,
    ChatRequest,
    Completion,
    KnownMessages,
    Message,
    SamplingParams,
    TokenLogprob,
    ToolCall,
    ToolSpec,
)

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "MAX_TOP_LOGPROBS",
    "ChunkStream",
    "OpenAIChat",
    "completion_body",
    "context_length_exceeded",
    "error_body",
    "error_headers",
    "error_status",
    "finish_reason",
    "models_body",
    "parse_chat_doc",
    "parse_chat_doc_with_ignored",
    "parse_chat_request",
    "parse_chat_request_with_ignored",
    "stream_chunks",
    "stream_error_event",
]

DEFAULT_MAX_TOKENS = 1024
"""Completion budget when the request sets neither ``max_completion_tokens`` nor ``max_tokens``."""

# Top-level request fields the proxy acts on; every other field present with a non-null
# value is accepted and reported as ignored by parse_chat_request_with_ignored.
_HONOURED_FIELDS = frozenset(
    {
        "model",
        "messages",
        "max_completion_tokens",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop",
        "n",
        "stream",
        "stream_options",
        "logprobs",
        "top_logprobs",
        "tools",
        "response_format",
        "modalities",
        "functions",
        "function_call",
        "audio",
    }
)


# ---------------------------------------------------------------------------------------
# Request models (pydantic v2, strict: "5" is not an integer, 1 is not a boolean)
# ---------------------------------------------------------------------------------------


class _StreamOptions(StrictModel):
    include_usage: bool | None = None


class _FunctionDef(StrictModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class _Tool(StrictModel):
    type: Literal["function"]
    function: _FunctionDef


class _Body(StrictModel):
    model: str = Field(min_length=1)
    messages: list[Any] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    stop: Any = None
    n: int | None = Field(default=None, ge=1)
    stream: bool | None = None
    stream_options: _StreamOptions | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[_Tool] | None = None
    tool_choice: Any = None
    response_format: Any = None
    modalities: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None


class _FunctionCall(StrictModel):
    name: str = Field(min_length=1)
    arguments: Any = None


class _ToolCallIn(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: _FunctionCall


class _SystemMsg(StrictModel):
    content: Any


class _UserMsg(StrictModel):
    content: Any


class _AssistantMsg(StrictModel):
    content: Any = None
    reasoning_content: str | None = None
    tool_calls: list[_ToolCallIn] | None = None
    function_call: Any = None


class _ToolMsg(StrictModel):
    tool_call_id: str
    content: Any


_MESSAGE_MODELS: dict[str, type[StrictModel]] = {
    "system": _SystemMsg,
    "developer": _SystemMsg,
    "user": _UserMsg,
    "assistant": _AssistantMsg,
    "tool": _ToolMsg,
}


# ---------------------------------------------------------------------------------------
# Request parsing
# ---------------------------------------------------------------------------------------


def _content_text(value: object, param: str, *, role: str, allow_null: bool = False) -> str:
    """A message's ``content`` (string, null or list of parts) as one string."""
    if isinstance(value, str):
        return value
    if value is None:
        if allow_null:
            return ""
        raise invalid(
            param,
            f"Invalid type for '{param}': expected a string or an array of text content "
            "parts, but got null instead.",
        )
    if not isinstance(value, list):
        raise type_error(param, "a string or an array of text content parts", value)
    return text_parts(value, param, ("text", "refusal") if role == "assistant" else ("text",))


def _parse_message(raw: object, i: int) -> Message:
    param = f"messages[{i}]"
    if not isinstance(raw, dict):
        raise type_error(param, "an object", raw)
    if "role" not in raw:
        raise missing(f"{param}.role")
    role = raw["role"]
    if not isinstance(role, str):
        raise type_error(f"{param}.role", "a string", role)
    if role == "function":
        raise invalid(
            f"{param}.role",
            f"Invalid value for '{param}.role': the legacy 'function' role is not supported; "
            "send tool results as role 'tool' messages with a 'tool_call_id'.",
        )
    model = _MESSAGE_MODELS.get(role)
    if model is None:
        raise invalid(
            f"{param}.role",
            f"Invalid value for '{param}.role': got {json.dumps(role)}, expected one of "
            "'system', 'developer', 'user', 'assistant', 'tool'.",
        )
    msg = validate(model, raw, ("messages", i))
    cparam = f"{param}.content"
    if isinstance(msg, _SystemMsg):
        return Message("system", _content_text(msg.content, cparam, role=role))
    if isinstance(msg, _UserMsg):
        return Message("user", _content_text(msg.content, cparam, role=role))
    if isinstance(msg, _ToolMsg):
        return Message(
            "tool", _content_text(msg.content, cparam, role=role), tool_call_id=msg.tool_call_id
        )
    assert isinstance(msg, _AssistantMsg)
    if msg.function_call is not None:
        raise invalid(
            f"{param}.function_call",
            f"Invalid value for '{param}.function_call': the legacy 'function_call' field is "
            "not supported; send 'tool_calls' instead.",
        )
    calls = tuple(
        ToolCall(
            id=tc.id,
            name=tc.function.name,
            arguments=tool_arguments(
                tc.function.arguments,
                f"{param}.tool_calls[{j}].function.arguments",
                f"message {i}",
            ),
        )
        for j, tc in enumerate(msg.tool_calls or ())
    )
    content = _content_text(msg.content, cparam, role=role, allow_null=True)
    return Message("assistant", content, tool_calls=calls, reasoning=msg.reasoning_content or "")


def _check_tool_choice(value: object) -> None:
    if value is None:
        return
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise invalid(
                "tool_choice",
                f"Invalid value for 'tool_choice': got {json.dumps(value)}, expected 'auto', "
                "'none', 'required' or an object naming a function.",
            )
        return
    if not isinstance(value, dict):
        raise type_error("tool_choice", "a string or an object", value)
    if not isinstance(value.get("type"), str):
        raise missing("tool_choice.type")


def _check_unsupported(body: _Body) -> None:
    if body.n is not None and body.n > 1:
        raise invalid(
            "n",
            f"Invalid value for 'n': {body.n}; this server returns exactly one choice per "
            "request, so 'n' must be 1 (or omitted). Send separate requests for more samples.",
        )
    if body.functions is not None or body.function_call is not None:
        name = "functions" if body.functions is not None else "function_call"
        raise invalid(
            name,
            f"Invalid value for '{name}': the legacy functions API is not supported; "
            "use 'tools' (type 'function') and 'tool_choice' instead.",
        )
    if body.audio is not None:
        raise invalid("audio", "Invalid value for 'audio': audio output is not supported.")
    if body.modalities is not None:
        if not isinstance(body.modalities, list):
            raise type_error("modalities", "an array of strings", body.modalities)
        if any(m != "text" for m in body.modalities):
            raise invalid(
                "modalities",
                f"Invalid value for 'modalities': {json.dumps(body.modalities)}; only "
                "['text'] is supported.",
            )
    rf = body.response_format
    if rf is not None:
        if not isinstance(rf, dict):
            raise type_error("response_format", "an object", rf)
        rtype = rf.get("type")
        if rtype != "text":
            raise invalid(
                "response_format.type",
                f"Invalid value for 'response_format.type': got {json.dumps(rtype)}; only "
                "'text' is supported (structured JSON output is not enforced by this server).",
            )
    if body.top_logprobs and not body.logprobs:
        raise invalid(
            "top_logprobs",
            "Invalid value for 'top_logprobs': it may only be set when 'logprobs' is true.",
        )


def _last_user_texts(messages: list[Any]) -> tuple[str, ...] | None:
    """The text parts of the last user message, as sent (already validated); None when
    there is none."""
    last = next((m for m in reversed(messages) if m["role"] == "user"), None)
    if last is None:
        return None
    if isinstance(last["content"], str):
        return (last["content"],)
    return tuple(part["text"] for part in last["content"])


def parse_chat_request_with_ignored(
    body: bytes, headers: Mapping[str, str]
) -> tuple[ChatRequest, tuple[str, ...]]:
    """Like :func:`parse_chat_request`, also returning the sorted names of the top-level
    fields that were present (non-null) but are not acted on, e.g. ``tool_choice``,
    ``seed``, ``user``, ``parallel_tool_calls``, penalties, ``metadata``."""
    return parse_chat_doc_with_ignored(load_body(body), headers)


def parse_chat_doc(
    data: dict[str, Any], headers: Mapping[str, str], before: KnownMessages | None = None
) -> ChatRequest:
    """:func:`parse_chat_request` of a decoded body. With ``before``, ``data``'s
    ``messages`` are the elements that follow those ``before`` was made from (an error's
    path then counts from them: reparse the whole body to report it)."""
    return parse_chat_doc_with_ignored(data, headers, before)[0]


def parse_chat_doc_with_ignored(
    data: dict[str, Any], headers: Mapping[str, str], before: KnownMessages | None = None
) -> tuple[ChatRequest, tuple[str, ...]]:
    """:func:`parse_chat_request_with_ignored` of a decoded body (see :func:`parse_chat_doc`)."""
    parsed: _Body = validate(_Body, data)
    _check_unsupported(parsed)
    _check_tool_choice(parsed.tool_choice)
    known = before.messages if before else ()
    messages = known + tuple(_parse_message(m, i) for i, m in enumerate(parsed.messages))
    texts = _last_user_texts(parsed.messages)
    if texts is None and before is not None:
        texts = before.last_user_texts
    tools = tuple(
        ToolSpec(
            name=t.function.name,
            description=t.function.description or "",
            parameters=t.function.parameters or {},
        )
        for t in parsed.tools or ()
    )
    if parsed.max_completion_tokens is not None:
        max_tokens = parsed.max_completion_tokens
    elif parsed.max_tokens is not None:
        max_tokens = parsed.max_tokens
    else:
        max_tokens = DEFAULT_MAX_TOKENS
    top_k = parsed.top_k if parsed.top_k is not None and parsed.top_k > 0 else -1
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if parsed.temperature is None else parsed.temperature,
        top_p=1.0 if parsed.top_p is None else parsed.top_p,
        top_k=top_k,
        stop=parse_stop(parsed.stop),
    )
    stream = bool(parsed.stream)
    include_usage = bool(
        stream and parsed.stream_options is not None and parsed.stream_options.include_usage
    )
    logprobs = bool(parsed.logprobs)
    request = ChatRequest(
        api="openai",
        model=parsed.model,
        messages=messages,
        sampling=sampling,
        tools=tools,
        stream=stream,
        logprobs=logprobs,
        top_logprobs=(parsed.top_logprobs or 0) if logprobs else 0,
        include_usage=include_usage,
        headers=forwarded_headers(headers),
        last_user_texts=texts or (),
    )
    ignored = tuple(
        sorted(k for k, v in data.items() if k not in _HONOURED_FIELDS and v is not None)
    )
    return request, ignored


def parse_chat_request(body: bytes, headers: Mapping[str, str]) -> ChatRequest:
    """Validate a ``POST /v1/chat/completions`` body into a :class:`ChatRequest`.

    Raises :class:`ApiError` (``invalid_request_error``, ``param`` = the offending field's
    path such as ``messages[2].tool_calls[0].function.arguments``) on malformed input.
    """
    return parse_chat_request_with_ignored(body, headers)[0]


# ---------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------


def _completion_id(c: Completion) -> str:
    return c.id if c.id.startswith("chatcmpl-") else f"chatcmpl-{c.id}"


def finish_reason(c: Completion) -> Literal["stop", "length", "tool_calls"]:
    """OpenAI's ``finish_reason``: ``length`` when the token budget ran out, ``tool_calls``
    when the model called tools, else ``stop`` (end of turn or a stop sequence)."""
    if c.stop_reason == "max_tokens":
        return "length"
    if c.stop_reason == "tool_use" or c.tool_calls:
        return "tool_calls"
    return "stop"


def _usage(c: Completion) -> dict[str, int]:
    return {
        "prompt_tokens": c.input_tokens,
        "completion_tokens": c.output_tokens,
        "total_tokens": c.input_tokens + c.output_tokens,
    }


def _tool_call_json(tc: ToolCall) -> dict[str, Any]:
    return {
        "id": tc.id,
        "type": "function",
        "function": {"name": tc.name, "arguments": arguments_json(tc)},
    }


def completion_body(c: Completion, created: int, *, logprobs: bool = False) -> dict[str, Any]:
    """A ``chat.completion`` object for ``c``. ``logprobs``: the request asked for them
    (``choices[0].logprobs`` stays null otherwise, or when ``c`` carries none)."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": None if not c.text and c.tool_calls else c.text,
        "refusal": None,
    }
    if c.reasoning:
        message["reasoning_content"] = c.reasoning
    if c.tool_calls:
        message["tool_calls"] = [_tool_call_json(tc) for tc in c.tool_calls]
    lp = (
        {"content": [token_logprob(t) for t in c.logprobs], "refusal": None}
        if logprobs and c.logprobs
        else None
    )
    return {
        "id": _completion_id(c),
        "object": "chat.completion",
        "created": created,
        "model": c.model,
        "choices": [
            {"index": 0, "message": message, "logprobs": lp, "finish_reason": finish_reason(c)}
        ],
        "usage": _usage(c),
        "system_fingerprint": None,
    }


def _sse(obj: Mapping[str, Any]) -> bytes:
    return b"data: " + jsonsafe.dumps(obj) + b"\n\n"


def _aligned_pieces(
    text: str, tokens: Sequence[TokenLogprob], chunk_chars: int
) -> tuple[list[tuple[str, list[TokenLogprob]]], str]:
    """Split ``text`` into content deltas along token boundaries while the tokens spell
    it out. Returns the (text, tokens) pieces and the text left over once the tokens
    stop matching (streamed without logprobs)."""
    out: list[tuple[str, list[TokenLogprob]]] = []
    buf_text = ""
    buf_toks: list[TokenLogprob] = []
    pos = 0
    k = 0
    while k < len(tokens) and pos < len(text) and text.startswith(tokens[k].token, pos):
        tok = tokens[k]
        buf_text += tok.token
        buf_toks.append(tok)
        pos += len(tok.token)
        k += 1
        if len(buf_text) >= chunk_chars:
            out.append((buf_text, buf_toks))
            buf_text, buf_toks = "", []
    if buf_toks:
        out.append((buf_text, buf_toks))
    return out, text[pos:]


def stream_chunks(
    c: Completion,
    created: int,
    *,
    logprobs: bool,
    include_usage: bool,
    chunk_chars: int = 64,
) -> Iterator[bytes]:
    """The SSE body of a streamed answer, event by event: a :class:`ChunkStream` given
    ``c.reasoning`` in reasoning deltas of ``chunk_chars`` characters, then ``c.text``
    in content deltas of ``chunk_chars`` characters or, with ``logprobs``,
    of whole tokens while ``c.logprobs`` spell the text (each delta then carries the
    logprobs of its tokens; the rest ride on the final chunk)."""
    events = ChunkStream(
        _completion_id(c),
        created,
        c.model,
        logprobs=logprobs,
        include_usage=include_usage,
        chunk_chars=chunk_chars,
    )
    deltas, rest = _aligned_pieces(c.text, c.logprobs if logprobs else (), chunk_chars)
    deltas += [(text, []) for text in pieces(rest, chunk_chars)]
    yield from split_events(events.start())
    for piece in pieces(c.reasoning, chunk_chars):
        yield from split_events(events.reasoning(piece))
    for text, tokens in deltas:
        yield from split_events(events.text(text, tokens))
    yield from split_events(events.finish(c))


class ChunkStream:
    """The SSE body of one streamed answer, made as its text arrives.

    Call :meth:`start`, then :meth:`reasoning` with each new piece of reasoning and
    :meth:`text` with each new piece of text (reasoning first) and :meth:`ping` at will,
    then :meth:`finish` once with the completion, whose ``reasoning`` and ``text`` must
    be the pieces given to them, concatenated. The events are ``data:
    {chat.completion.chunk}`` lines: a role delta (content ``""``, or null for an
    answer of tool calls only, as :func:`completion_body` has it: so it goes out with
    the first reasoning or text or at the end, when that is known), ``reasoning_content``
    deltas (as vLLM and SGLang send them), content deltas, tool-call deltas
    (arguments in pieces of ``chunk_chars`` characters), a final chunk carrying
    ``finish_reason``, with ``include_usage`` the usage chunk with empty ``choices``
    (every other chunk then has ``"usage": null``), and ``data: [DONE]``.

    Logprobs (when the request asked for them): give :meth:`text` the logprobs of the
    completion's tokens in order, each call those of the tokens after the ones already
    given (possibly none; tokens given with empty text ride on the next content delta).
    :meth:`finish` sends the completion's logprobs that no delta carried on the final
    chunk, so the logprobs a client concatenates are exactly ``c.logprobs``.
    """

    def __init__(
        self,
        completion_id: str,
        created: int,
        model: str,
        *,
        logprobs: bool,
        include_usage: bool,
        chunk_chars: int = 64,
    ) -> None:
        if chunk_chars < 1:
            raise ValueError(f"chunk_chars must be >= 1, got {chunk_chars}")
        self.completion_id = completion_id
        self.created = created
        self.model = model
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.chunk_chars = chunk_chars
        self._role_sent = False
        self._pending: list[TokenLogprob] = []  # given, not yet sent
        self._sent = 0  # logprobs sent on content deltas

    def start(self) -> bytes:
        """Nothing yet (the role delta waits for the first text or the end): empty."""
        return b""

    def ping(self) -> bytes:
        """An SSE comment: keeps the connection busy, clients skip it."""
        return b": ping\n\n"

    def reasoning(self, delta: str) -> bytes:
        """A ``reasoning_content`` delta (empty reasoning: nothing); the reasoning's
        logprobs wait for the next content delta."""
        if not delta:
            return b""
        return self._role("") + self._chunk({"reasoning_content": delta})

    def text(self, delta: str, logprobs: Sequence[TokenLogprob] | None = None) -> bytes:
        """A content delta (empty text: nothing, the logprobs wait for the next one)."""
        if self.logprobs and logprobs:
            self._pending.extend(logprobs)
        if not delta:
            return b""
        carried = self._pending if self._pending else None
        self._sent += len(self._pending)
        self._pending = []
        return self._role("") + self._chunk({"content": delta}, lp=carried)

    def finish(self, c: Completion) -> bytes:
        """The tool calls, the final chunk (finish reason, logprobs not yet sent), the
        usage chunk and ``[DONE]``."""
        out = [self._role(None if c.tool_calls else "")]
        for i, tc in enumerate(c.tool_calls):
            head = {"index": i, "id": tc.id, "type": "function"}
            out.append(
                self._chunk(
                    {"tool_calls": [{**head, "function": {"name": tc.name, "arguments": ""}}]}
                )
            )
            for piece in pieces(arguments_json(tc), self.chunk_chars):
                out.append(
                    self._chunk({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
                )
        rest = c.logprobs[self._sent :] if self.logprobs else ()
        out.append(self._chunk({}, finish=finish_reason(c), lp=rest or None))
        if self.include_usage:
            out.append(_sse({**self._head(), "choices": [], "usage": _usage(c)}))
        out.append(b"data: [DONE]\n\n")
        return b"".join(out)

    def error(self, e: ApiError) -> bytes:
        """A data line holding the error (:func:`stream_error_event`)."""
        return stream_error_event(e)

    def _role(self, content: str | None) -> bytes:
        """The role delta, if it has not gone out yet."""
        if self._role_sent:
            return b""
        self._role_sent = True
        return self._chunk({"role": "assistant", "content": content})

    def _head(self) -> dict[str, Any]:
        return {
            "id": self.completion_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }

    def _chunk(
        self,
        delta: dict[str, Any],
        *,
        finish: str | None = None,
        lp: Sequence[TokenLogprob] | None = None,
    ) -> bytes:
        obj: dict[str, Any] = {
            **self._head(),
            "choices": [
                {
                    "index": 0,
                    "delta": delta,
                    "logprobs": (
                        None
                        if lp is None
                        else {"content": [token_logprob(t) for t in lp], "refusal": None}
                    ),
                    "finish_reason": finish,
                }
            ],
        }
        if self.include_usage:
            obj["usage"] = None
        return _sse(obj)


def stream_error_event(e: ApiError) -> bytes:
    """An error after the stream started: a data line holding :func:`error_body`, which
    OpenAI's clients read as an error."""
    return b"data: " + json.dumps(error_body(e)).encode() + b"\n\n"


# ---------------------------------------------------------------------------------------
# The dialect
# ---------------------------------------------------------------------------------------


class OpenAIChat(OpenAIDialect):
    """Chat Completions (``POST /v1/chat/completions``) as the server serves it: this
    module's functions under the :class:`Dialect` names. Errors on any ``/chat/`` path
    answer in its shape."""

    name = "openai"
    call_path = "/v1/chat/completions"
    id_prefix = "chatcmpl-"
    tool_id_prefix = "call_"
    path_marker = "/chat/"
    conversation_param = "messages"

    def parse_doc(
        self, doc: dict[str, Any], headers: Mapping[str, str], before: KnownMessages | None
    ) -> ChatRequest:
        return parse_chat_doc(doc, headers, before)

    def answer(self, c: Completion, chat: ChatRequest) -> dict[str, Any]:
        return completion_body(c, int(time.time()), logprobs=chat.logprobs)

    def events(
        self, completion_id: str, model: str, chat: ChatRequest, *, created: int, input_tokens: int
    ) -> ChunkStream:
        return ChunkStream(
            completion_id,
            created,
            model,
            logprobs=chat.logprobs,
            include_usage=chat.include_usage,
        )
