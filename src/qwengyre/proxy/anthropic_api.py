"""The Anthropic Messages API adapter: request bodies in, response bodies and SSE events out.

Pure functions, no I/O. :func:`parse_messages_request` turns a ``POST /v1/messages`` body
into an API-neutral :class:`~qwengyre.proxy.types.ChatRequest`; :func:`message_body` and
:func:`stream_events` turn a :class:`~qwengyre.proxy.types.Completion` back into the JSON
body or the SSE byte stream the API sends. Errors are :class:`~qwengyre.proxy.types.ApiError`
and render with :func:`error_body` / :func:`error_headers` / :func:`stream_error_event`.
The server uses them through :class:`AnthropicMessages`, this API's
:class:`~qwengyre.proxy.dialect.Dialect`.

What real clients send (see ``docs/harnesses.md``) is accepted: unknown top-level fields
(``thinking``, ``context_management``, ``output_config``, ``metadata``, ...) and
``cache_control`` anywhere are ignored; ``role: "system"`` messages may appear inside
``messages``; an assistant's ``thinking`` blocks in history are its reasoning (the
template renders it where it keeps reasoning), ``redacted_thinking`` blocks are dropped;
server tools are skipped.
Images and documents are refused.

Bodies are read by :func:`qwengyre.proxy.jsonsafe.loads`: UTF-8 JSON nested at most
:data:`~qwengyre.proxy.jsonsafe.MAX_DEPTH` levels, without ``NaN``/``Infinity``; anything
else is a 400 ``invalid_request_error``. Lone surrogates (``"\\ud83d"``, sent by clients
that cut a string mid-emoji) are replaced with U+FFFD, so the model sees, and the store
keeps, exactly what was parsed; a selected header (``anthropic-*``, ``x-claude-code-*``)
that is not UTF-8 is refused. Responses are lossless: SSE events are UTF-8 JSON, with
``\\uXXXX`` escapes when the reply holds a lone surrogate (a model's tool-call JSON can).
"""

from __future__ import annotations

import json
import math
import secrets
import string
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar

from pydantic import Field, ValidationError

from qwengyre.proxy import jsonsafe
from qwengyre.proxy.dialect import Dialect, ErrorAnswer, select_headers
from qwengyre.proxy.jsonsafe import StrictModel
from qwengyre.proxy.sse import named_event, pieces, split_events
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
    "AnthropicMessages",
    "MessageStream",
    "count_tokens_body",
    "error_body",
    "error_headers",
    "message_body",
    "models_body",
    "new_message_id",
    "new_tool_use_id",
    "parse_count_tokens_request",
    "parse_messages_doc",
    "parse_messages_request",
    "prompt_too_long",
    "stream_error_event",
    "stream_events",
]

# --------------------------------------------------------------------------------------
# ids

_BASE62 = string.digits + string.ascii_letters


def _random_base62(n: int) -> str:
    return "".join(secrets.choice(_BASE62) for _ in range(n))


def new_message_id() -> str:
    """A fresh message id: ``msg_`` + 24 random base62 characters."""
    return "msg_" + _random_base62(24)


def new_tool_use_id() -> str:
    """A fresh tool-use id: ``toolu_`` + 24 random base62 characters."""
    return "toolu_" + _random_base62(24)


# --------------------------------------------------------------------------------------
# request validation models (pydantic v2; strict types, unknown fields ignored)

_M = TypeVar("_M", bound=StrictModel)


class _MessageParam(StrictModel):
    role: Literal["user", "assistant", "system"]
    content: Any  # str | list of blocks: checked by hand for precise error paths


class _Body(StrictModel):
    model: str
    messages: list[_MessageParam] = Field(min_length=1)
    system: Any = None  # str | list of text blocks: checked by hand
    tools: list[dict[str, Any]] | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool | None = None


class _MessagesBody(_Body):
    max_tokens: int = Field(ge=1)


class _CountTokensBody(_Body):
    max_tokens: int | None = Field(default=None, ge=1)


class _TextBlock(StrictModel):
    type: Literal["text"]
    text: str


class _ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class _ThinkingBlock(StrictModel):
    type: Literal["thinking"]
    thinking: str


class _ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Any = None  # None | str | list of text blocks: checked by hand
    is_error: bool | None = None


class _ToolParam(StrictModel):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]


# Block types we accept in ``messages[*].content`` (redacted thinking is accepted and dropped).
_ALLOWED_BLOCKS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")
_DROPPED_BLOCKS = frozenset({"redacted_thinking"})
_ROLE_BLOCKS: dict[str, frozenset[str]] = {
    "user": frozenset({"text", "tool_result"}),
    "assistant": frozenset({"text", "tool_use", "thinking"}),
    "system": frozenset({"text"}),
}
_MEDIA_BLOCKS = {"image": "images", "document": "documents"}

# Header names we copy into ChatRequest.headers (request-class rules look at them).
_HEADER_PREFIXES = ("x-claude-code-", "anthropic-")
# ...unless the name suggests a credential.
_SECRET_HEADER_WORDS = ("key", "auth", "token", "secret", "cookie", "password")


# --------------------------------------------------------------------------------------
# error helpers


def _invalid(loc: str, msg: str) -> ApiError:
    return ApiError("invalid_request_error", f"{loc}: {msg}" if loc else msg, param=loc or None)


def _join_loc(parts: tuple[str | int, ...]) -> str:
    return ".".join(str(p) for p in parts)


def _validate(model: type[_M], data: Any, loc: tuple[str | int, ...] = ()) -> _M:
    """Validate ``data`` as ``model``; the first error becomes an ``invalid_request_error``
    whose message names the full field path (``messages.2.content.0.text: ...``)."""
    if not isinstance(data, dict):
        raise _invalid(_join_loc(loc), "Input should be an object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        raise _invalid(_join_loc((*loc, *first["loc"])), first["msg"]) from None


# --------------------------------------------------------------------------------------
# request parsing


def _load_body(body: bytes) -> dict[str, Any]:
    """The body as a JSON object (see the module docstring for the bounds and for lone
    surrogates)."""
    try:
        return jsonsafe.load_object(body)
    except jsonsafe.TooDeep as exc:
        raise ApiError("invalid_request_error", f"The request body is too deep: {exc}") from None
    except jsonsafe.NotAnObject as exc:
        raise ApiError(
            "invalid_request_error",
            f"The request body should be a JSON object, not {type(exc.value).__name__}",
        ) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, NaN/Infinity
        raise ApiError(
            "invalid_request_error", f"The request body is not valid JSON: {exc}"
        ) from None


def _text_content(content: Any, loc: tuple[str | int, ...], what: str) -> str:
    """A string, or a list of text blocks joined with blank lines (``system``, system
    messages, tool_result content). ``None`` is the empty string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid(_join_loc(loc), f"Input should be a valid string or a list of {what}")
    texts: list[str] = []
    for j, block in enumerate(content):
        btype = _block_type(block, (*loc, j))
        if btype != "text":
            raise _unsupported_block(btype, (*loc, j), ("text",))
        texts.append(_validate(_TextBlock, block, (*loc, j)).text)
    return "\n\n".join(texts)


def _block_type(block: Any, loc: tuple[str | int, ...]) -> str:
    if not isinstance(block, dict):
        raise _invalid(_join_loc(loc), "Input should be an object (a content block)")
    if "type" not in block:
        raise _invalid(_join_loc((*loc, "type")), "Field required")
    btype = block["type"]
    if not isinstance(btype, str):
        raise _invalid(_join_loc((*loc, "type")), "Input should be a valid string")
    return btype


def _unsupported_block(
    btype: str, loc: tuple[str | int, ...], allowed: tuple[str, ...]
) -> ApiError:
    media = _MEDIA_BLOCKS.get(btype)
    why = f" ({media} are not supported)" if media else ""
    return _invalid(
        _join_loc((*loc, "type")),
        f"{btype!r} is not supported{why}; allowed: {', '.join(allowed)}",
    )


def _convert_message(m: _MessageParam, i: int) -> list[Message]:
    loc: tuple[str | int, ...] = ("messages", i, "content")
    if m.role == "system":
        return [Message(role="system", content=_text_content(m.content, loc, "text blocks"))]
    if isinstance(m.content, str):
        return [Message(role=m.role, content=m.content)]
    if not isinstance(m.content, list):
        raise _invalid(_join_loc(loc), "Input should be a valid string or a list of content blocks")

    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCall] = []
    results: list[Message] = []
    for j, block in enumerate(m.content):
        bloc = (*loc, j)
        btype = _block_type(block, bloc)
        if btype in _DROPPED_BLOCKS or (btype == "thinking" and m.role != "assistant"):
            continue  # reasoning is an assistant's; elsewhere it is dropped, as before
        if btype not in _ALLOWED_BLOCKS:
            raise _unsupported_block(btype, bloc, _ALLOWED_BLOCKS)
        if btype not in _ROLE_BLOCKS[m.role]:
            raise _invalid(
                _join_loc((*bloc, "type")),
                f"{btype!r} blocks are not allowed in {m.role} messages; "
                f"allowed: {', '.join(sorted(_ROLE_BLOCKS[m.role]))}",
            )
        if btype == "text":
            texts.append(_validate(_TextBlock, block, bloc).text)
        elif btype == "thinking":
            thoughts.append(_validate(_ThinkingBlock, block, bloc).thinking)
        elif btype == "tool_use":
            tu = _validate(_ToolUseBlock, block, bloc)
            calls.append(ToolCall(id=tu.id, name=tu.name, arguments=tu.input))
        else:  # tool_result
            tr = _validate(_ToolResultBlock, block, bloc)
            text = _text_content(tr.content, (*bloc, "content"), "text blocks")
            results.append(Message(role="tool", content=text, tool_call_id=tr.tool_use_id))

    if m.role == "assistant":
        return [
            Message(
                role="assistant",
                content="\n\n".join(texts),
                tool_calls=tuple(calls),
                reasoning="\n\n".join(thoughts),
            )
        ]
    if results and not texts:
        return results
    return [*results, Message(role="user", content="\n\n".join(texts))]


def _convert_tools(tools: list[dict[str, Any]] | None) -> tuple[ToolSpec, ...]:
    out: list[ToolSpec] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools or ()):
        ttype = tool.get("type")
        if "input_schema" not in tool and isinstance(ttype, str) and ttype != "custom":
            # Server tools (web_search_20250305, ...) and Anthropic-defined client tools
            # (bash_20250124, ...) carry no schema we could show the model: skip them.
            continue
        spec = _validate(_ToolParam, tool, ("tools", i))
        if spec.name in seen:
            raise _invalid(f"tools.{i}.name", f"tool names must be unique ({spec.name!r} repeated)")
        seen.add(spec.name)
        out.append(
            ToolSpec(
                name=spec.name, description=spec.description or "", parameters=spec.input_schema
            )
        )
    return tuple(out)


def _select_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return select_headers(
        headers,
        prefixes=_HEADER_PREFIXES,
        secret_words=_SECRET_HEADER_WORDS,
        not_utf8="header {name} is not valid UTF-8",
    )


def _to_chat_request(
    b: _Body, max_tokens: int, headers: Mapping[str, str], before: KnownMessages | None = None
) -> ChatRequest:
    lead: list[Message] = []
    if b.system is not None:
        system = _text_content(b.system, ("system",), "text blocks")
        if system:
            lead.append(Message(role="system", content=system))
    converted: list[Message] = []
    for i, m in enumerate(b.messages):
        converted.extend(_convert_message(m, i))
    messages = (*lead, *converted) if before is None else (*lead, *before.messages, *converted)
    texts = _last_user_texts(b.messages)
    if texts is None and before is not None:
        texts = before.last_user_texts
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if b.temperature is None else float(b.temperature),
        top_p=1.0 if b.top_p is None else float(b.top_p),
        top_k=b.top_k if b.top_k else -1,  # None or 0: no top-k
        stop=tuple(b.stop_sequences or ()),
    )
    return ChatRequest(
        api="anthropic",
        model=b.model,
        messages=messages,
        sampling=sampling,
        tools=_convert_tools(b.tools),
        stream=bool(b.stream),
        headers=_select_headers(headers),
        last_user_texts=texts or (),
        lead=len(lead),
    )


def _last_user_texts(messages: list[_MessageParam]) -> tuple[str, ...] | None:
    """The text blocks of the last user message, as sent (already validated); None
    when there is none."""
    last = next((m for m in reversed(messages) if m.role == "user"), None)
    if last is None:
        return None
    if isinstance(last.content, str):
        return (last.content,)
    return tuple(block["text"] for block in last.content if block["type"] == "text")


def parse_messages_request(body: bytes, headers: Mapping[str, str]) -> ChatRequest:
    """Parse and validate a ``POST /v1/messages`` body.

    Raises :class:`ApiError` (``invalid_request_error``) naming the offending field path.
    """
    return parse_messages_doc(_load_body(body), headers)


def parse_messages_doc(
    doc: dict[str, Any], headers: Mapping[str, str], before: KnownMessages | None = None
) -> ChatRequest:
    """:func:`parse_messages_request` of a decoded body. With ``before``, ``doc``'s
    ``messages`` are the elements that follow those ``before`` was made from (an error's
    path then counts from them: reparse the whole body to report it)."""
    b = _validate(_MessagesBody, doc)
    return _to_chat_request(b, b.max_tokens, headers, before)


def parse_count_tokens_request(body: bytes, headers: Mapping[str, str]) -> ChatRequest:
    """Parse ``POST /v1/messages/count_tokens``: like a messages body, ``max_tokens``
    optional (1 when absent)."""
    b = _validate(_CountTokensBody, _load_body(body))
    return _to_chat_request(b, b.max_tokens or 1, headers)


def count_tokens_body(input_tokens: int) -> dict[str, Any]:
    """The count_tokens response body."""
    return {"input_tokens": input_tokens}


def models_body(model: str) -> dict[str, Any]:
    """``GET /v1/models``: ``model``, the only one."""
    entry = {
        "type": "model",
        "id": model,
        "display_name": model,
        "created_at": "2026-01-01T00:00:00Z",
    }
    return {"data": [entry], "has_more": False, "first_id": model, "last_id": model}


# --------------------------------------------------------------------------------------
# responses


def _message_id(c: Completion) -> str:
    if c.id.startswith("msg_"):
        return c.id
    return "msg_" + c.id if c.id else new_message_id()


def _content(c: Completion) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if c.reasoning:
        blocks.append(_thinking_block(c.reasoning))
    if c.text or not c.tool_calls:
        blocks.append({"type": "text", "text": c.text})
    blocks.extend(_tool_use_block(call) for call in c.tool_calls)
    return blocks


def _thinking_block(thinking: str) -> dict[str, Any]:
    """A ``thinking`` block; its signature is empty (the proxy signs nothing, and it
    reads a thinking block sent back by its text alone)."""
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def _tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": call.id or new_tool_use_id(),
        "name": call.name,
        "input": call.arguments,
    }


def _usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": input_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": output_tokens,
    }


def message_body(c: Completion) -> dict[str, Any]:
    """The non-streaming ``/v1/messages`` response body for ``c``."""
    return {
        "id": _message_id(c),
        "type": "message",
        "role": "assistant",
        "model": c.model,
        "content": _content(c),
        "stop_reason": c.stop_reason,
        "stop_sequence": c.stop_sequence,
        "usage": _usage(c.input_tokens, c.output_tokens),
    }


def stream_events(c: Completion, chunk_chars: int = 64) -> Iterator[bytes]:
    """The SSE stream for ``c``, event by event, as the API sends it: a
    :class:`MessageStream` given ``c.text`` in ``text_delta`` chunks of ``chunk_chars``
    characters (tool input goes in ``input_json_delta`` chunks of as many)."""
    events = MessageStream(_message_id(c), c.model, c.input_tokens, chunk_chars=chunk_chars)
    yield from split_events(events.start())
    for piece in pieces(c.reasoning, chunk_chars):
        yield from split_events(events.reasoning(piece))
    for piece in pieces(c.text, chunk_chars):
        yield from split_events(events.text(piece))
    yield from split_events(events.finish(c))


class MessageStream:
    """The SSE events of one streamed message, made as its text arrives.

    Call :meth:`start` first (``message_start``: empty content, ``output_tokens`` 1),
    then :meth:`reasoning` with each new piece of reasoning, :meth:`text` with each new
    piece of text (reasoning first) and :meth:`ping` at will, then :meth:`finish` once
    with the completion, whose ``reasoning`` and ``text`` must be the pieces given to
    them, concatenated. Each content block goes as ``content_block_start``,
    ``content_block_delta``\\* and ``content_block_stop`` (a ``ping`` follows the first
    ``content_block_start``, as in the API): a ``thinking`` block opens with the first
    reasoning (``thinking_delta`` pieces, then an empty ``signature_delta``), the text
    block opens with the first non-empty text, the ``tool_use`` blocks follow at the end
    with their input as ``input_json_delta`` pieces of ``chunk_chars`` characters of its
    compact JSON, and an answer with neither gets an empty text block. Then ``message_delta`` (stop
    reason, stop sequence, final ``output_tokens``) and ``message_stop``. Folding the
    events gives :func:`message_body` of the completion.
    """

    def __init__(
        self, message_id: str, model: str, input_tokens: int, *, chunk_chars: int = 64
    ) -> None:
        if chunk_chars < 1:
            raise ValueError(f"chunk_chars must be >= 1, got {chunk_chars}")
        self.message_id = message_id
        self.model = model
        self.input_tokens = input_tokens
        self.chunk_chars = chunk_chars
        self._blocks = 0  # content blocks started
        self._text_open = False
        self._thinking_open = False

    def start(self) -> bytes:
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(self.input_tokens, 1),
        }
        return named_event("message_start", {"type": "message_start", "message": message})

    def ping(self) -> bytes:
        return named_event("ping", {"type": "ping"})

    def text(self, delta: str, logprobs: Sequence[TokenLogprob] | None = None) -> bytes:
        """The text block's next ``text_delta`` (nothing for empty text); the API
        carries no log-probs: ``logprobs`` is not sent."""
        if not delta:
            return b""
        opening = b""
        if not self._text_open:
            self._text_open = True
            opening = self._close_thinking() + self._open({"type": "text", "text": ""})
        return opening + self._delta({"type": "text_delta", "text": delta})

    def reasoning(self, delta: str) -> bytes:
        """The thinking block's next ``thinking_delta`` (nothing for empty reasoning)."""
        if not delta:
            return b""
        opening = b""
        if not self._thinking_open:
            self._thinking_open = True
            opening = self._open(_thinking_block(""))
        return opening + self._delta({"type": "thinking_delta", "thinking": delta})

    def finish(self, c: Completion) -> bytes:
        """The rest of the message: the tool calls, stop reason and usage of ``c``."""
        out: list[bytes] = [self._close_thinking()]
        if not self._text_open and not c.tool_calls:
            out.append(self._open({"type": "text", "text": ""}))
            self._text_open = True
        if self._text_open:
            out.append(self._close())
        for call in c.tool_calls:
            block = _tool_use_block(call)
            out.append(self._open({**block, "input": {}}))
            js = json.dumps(block["input"], ensure_ascii=False, separators=(",", ":"))
            for piece in pieces(js, self.chunk_chars):
                out.append(self._delta({"type": "input_json_delta", "partial_json": piece}))
            out.append(self._close())
        out.append(
            named_event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": c.stop_reason, "stop_sequence": c.stop_sequence},
                    "usage": {"output_tokens": c.output_tokens},
                },
            )
        )
        out.append(named_event("message_stop", {"type": "message_stop"}))
        return b"".join(out)

    def error(self, e: ApiError) -> bytes:
        """An ``error`` event (:func:`stream_error_event`)."""
        return stream_error_event(e)

    def _open(self, block: dict[str, Any]) -> bytes:
        index = self._blocks
        self._blocks += 1
        start = named_event(
            "content_block_start",
            {"type": "content_block_start", "index": index, "content_block": block},
        )
        return start + self.ping() if index == 0 else start

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return named_event(
            "content_block_delta",
            {"type": "content_block_delta", "index": self._blocks - 1, "delta": delta},
        )

    def _close_thinking(self) -> bytes:
        """The thinking block's signature and end, if it is open."""
        if not self._thinking_open:
            return b""
        self._thinking_open = False
        return self._delta({"type": "signature_delta", "signature": ""}) + self._close()

    def _close(self) -> bytes:
        return named_event(
            "content_block_stop", {"type": "content_block_stop", "index": self._blocks - 1}
        )


# --------------------------------------------------------------------------------------
# errors


def error_body(e: ApiError) -> dict[str, Any]:
    """The Anthropic error body: ``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": e.kind, "message": e.message}}


_RETRYABLE_STATUS = frozenset({429, 500, 529})


def error_headers(e: ApiError) -> dict[str, str]:
    """Extra response headers for an error: ``retry-after`` (whole seconds, rounded up)
    when ``e.retry_after_s`` is set; ``x-should-retry: true`` for 429/500/529."""
    out: dict[str, str] = {}
    if e.retry_after_s is not None:
        out["retry-after"] = str(max(0, math.ceil(e.retry_after_s)))
    if e.status in _RETRYABLE_STATUS:
        out["x-should-retry"] = "true"
    return out


def stream_error_event(e: ApiError) -> bytes:
    """An ``event: error`` SSE event, for errors after a stream has started."""
    return named_event("error", error_body(e))


def prompt_too_long(tokens: int, limit: int) -> ApiError:
    """The 400 Claude Code reacts to by compacting its history (the text must not change)."""
    return ApiError(
        "invalid_request_error",
        f"prompt is too long: {tokens} tokens > {limit} maximum",
        code="context_length_exceeded",
    )


# --------------------------------------------------------------------------------------
# the dialect


class AnthropicMessages(Dialect):
    """The Messages API (``POST /v1/messages``, ``?beta=true`` too, and its token count),
    as the server serves it: this module's functions under the :class:`Dialect` names.
    The admin API and unknown routes answer in its error shape too."""

    name = "anthropic"
    call_path = "/v1/messages"
    count_tokens_path = "/v1/messages/count_tokens"
    id_prefix = "msg_"
    tool_id_prefix = "toolu_"
    path_marker = "/v1/messages"

    def owns_headers(self, headers: Mapping[str, str]) -> bool:
        return "anthropic-version" in headers

    def parse(self, body: bytes, headers: Mapping[str, str]) -> ChatRequest:
        return parse_messages_request(body, headers)

    def parse_doc(
        self, doc: dict[str, Any], headers: Mapping[str, str], before: KnownMessages | None
    ) -> ChatRequest:
        return parse_messages_doc(doc, headers, before)

    def answer(self, c: Completion, chat: ChatRequest) -> dict[str, Any]:
        return message_body(c)

    def events(
        self, completion_id: str, model: str, chat: ChatRequest, *, created: int, input_tokens: int
    ) -> MessageStream:
        return MessageStream(completion_id, model, input_tokens)

    def error(self, e: ApiError) -> ErrorAnswer:
        return ErrorAnswer(e.status, error_body(e), error_headers(e))

    def context_too_long(self, tokens: int, limit: int) -> ApiError:
        return prompt_too_long(tokens, limit)

    def models_body(self, model: str) -> dict[str, Any]:
        return models_body(model)

    def parse_count_tokens(self, body: bytes, headers: Mapping[str, str]) -> ChatRequest:
        return parse_count_tokens_request(body, headers)

    def count_tokens_body(self, input_tokens: int) -> dict[str, Any]:
        return count_tokens_body(input_tokens)
