"""OpenAI Responses API adapter (``POST /v1/responses``, the only API Codex CLI speaks):
request bodies in, ``response`` JSON and its SSE events out.

Pure functions, no I/O, as :mod:`~qwengyre.proxy.openai_api` (whose conventions it
shares through :mod:`~qwengyre.proxy.openai_common`: errors name the offending field's
path in ``param``, the ``{"error": {...}}`` shape, content parts, tool arguments).
The server uses them through :class:`OpenAIResponses`, this API's
:class:`~qwengyre.proxy.dialect.Dialect`. ``docs/harnesses.md`` documents how the
items map to chat messages, next to the other two APIs.

What a body's fields become:

- ``instructions``: a leading system message (``lead``); ``input``: a string (one
  user message) or items, in order: a ``message`` (``type`` may be left out) of role
  ``system``/``developer`` (a system message), ``user`` or ``assistant``, its content
  a string or text parts (``input_text``; an assistant's ``output_text`` or
  ``refusal``); a ``function_call`` joins the assistant message before it (or starts
  one), named ``{namespace}__{name}`` when it carries a ``namespace``, its arguments
  parsed; a ``function_call_output`` is a tool message answering the ``function_call``
  with its ``call_id`` (one must come before it); ``reasoning`` items are skipped
  (Codex resends its encrypted reasoning because it sets ``store: false``; the served
  model produces none).
- ``tools``: ``function`` tools; a ``namespace`` tool's functions, flattened to
  ``{namespace}__{name}`` (a call of one answers with ``namespace`` and ``name`` as the
  client sent them); hosted tools (``web_search``, ``file_search``,
  ``code_interpreter``, ``image_generation``, ``mcp``) are ignored: the proxy runs
  none, so the model is not shown them. Other client tools (``custom``,
  ``local_shell``, ...) are refused.
- ``max_output_tokens`` (absent: the rest of the context window), ``temperature``,
  ``top_p``, and as in Chat Completions ``top_k`` and ``stop``: the sampling the
  harness asks for, which the server forces by default (``proxy.force_sampling``).
- ``include: ["message.output_text.logprobs"]``: log-probs on the ``output_text``
  part and its deltas (``top_logprobs``: accepted, alternatives not listed).
- ``tool_choice`` and ``parallel_tool_calls`` are checked but not enforced: the model
  sees the tools and decides, as in Chat Completions. ``store`` is accepted and
  nothing is stored (answers say ``"store": false``); ``previous_response_id``,
  ``conversation``, ``prompt`` and ``background`` need stored state and are refused.
  ``reasoning``, ``text.verbosity``, ``truncation``, ``metadata``, ``user``,
  ``prompt_cache_key``, ``client_metadata``, ``service_tier`` and other fields are
  ignored; a ``text.format`` other than ``text`` is refused.

An answer's ``output`` is a ``reasoning`` item when the model reasoned (its
``reasoning_text``, split out by the model's reasoning parser), a ``message`` item (its
text: present when the reply has text or no tool call), then one ``function_call`` item
per call; a streamed answer is ``response.created``, ``response.in_progress``, the
reasoning item's events (``response.reasoning_text.delta``... and ``.done``), the
message's events as the text is produced (``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta``...), then ``.done``
events, each call's
``response.output_item.added``, ``response.function_call_arguments.delta``...,
``.done`` and ``response.output_item.done``, and ``response.completed`` (or
``response.incomplete`` when the token budget ran out) with the whole response and its
``usage``. A failure after the stream started is ``response.failed``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import Field

from qwengyre.proxy.dialect import ParseWhole
from qwengyre.proxy.jsonsafe import StrictModel
from qwengyre.proxy.openai_common import (
    MAX_TOP_LOGPROBS,
    OpenAIDialect,
    arguments_json,
    error_object,
    forwarded_headers,
    invalid,
    load_body,
    missing,
    parse_stop,
    text_parts,
    token_logprob,
    tool_arguments,
    type_error,
    validate,
)
from qwengyre.proxy.sse import named_event, pieces
from qwengyre.proxy.types import (
    ApiError,
    ChatRequest,
    Completion,
    KnownMessages,
    Message,
    Role,
    SamplingParams,
    TokenLogprob,
    ToolCall,
    ToolSpec,
)

__all__ = [
    "LOGPROBS_INCLUDE",
    "NO_OUTPUT_LIMIT",
    "OpenAIResponses",
    "ResponseStream",
    "parse_responses_doc",
    "parse_responses_request",
    "response_body",
]

NO_OUTPUT_LIMIT = 2**31 - 1
"""The token budget of a call that sets no ``max_output_tokens``: none of its own (the
server caps every call at the room left in the context)."""

LOGPROBS_INCLUDE = "message.output_text.logprobs"
"""The ``include`` value that asks for the output text's log-probs."""

# Hosted tools run by OpenAI's servers; the proxy runs none, so the model never sees them.
_HOSTED_TOOLS = ("web_search", "file_search", "code_interpreter", "image_generation", "mcp")

_ROLES: dict[str, Role] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
}


# ---------------------------------------------------------------------------------------
# Request models (pydantic v2, strict: "5" is not an integer, 1 is not a boolean)
# ---------------------------------------------------------------------------------------


class _Body(StrictModel):
    model: str = Field(min_length=1)
    input: Any = None  # a string or items: checked by hand for precise error paths
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    stop: Any = None
    stream: bool | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    background: bool | None = None
    text: Any = None


class _FunctionTool(StrictModel):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class _NamespaceTool(StrictModel):
    type: Literal["namespace"]
    name: str = Field(min_length=1)
    tools: list[Any]


class _MessageItem(StrictModel):
    role: str
    content: Any


class _FunctionCallItem(StrictModel):
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    namespace: str | None = None
    arguments: Any = None


class _FunctionCallOutputItem(StrictModel):
    call_id: str = Field(min_length=1)
    output: Any


# ---------------------------------------------------------------------------------------
# Request parsing
# ---------------------------------------------------------------------------------------


def _flat_name(namespace: str, name: str) -> str:
    """How the model sees the function ``name`` of a namespace tool (Codex's own
    flattening of namespaced tool names)."""
    return f"{namespace}__{name}"


def _refuse_unserved(body: _Body) -> None:
    """Fields this server cannot honour: those that continue or reuse state kept by the
    server (it keeps none), background runs, structured output."""
    what_to_do = "send the whole conversation in 'input' (with 'store': false, as Codex does)"
    if body.previous_response_id is not None:
        raise invalid(
            "previous_response_id",
            "Invalid value for 'previous_response_id': this server stores no responses to "
            f"continue from; {what_to_do}.",
        )
    if body.conversation is not None:
        raise invalid(
            "conversation",
            f"Invalid value for 'conversation': this server stores no conversations; {what_to_do}.",
        )
    if body.prompt is not None:
        raise invalid(
            "prompt",
            "Invalid value for 'prompt': stored prompt templates are not served; send the "
            "prompt in 'instructions' and 'input'.",
        )
    if body.background:
        raise invalid(
            "background",
            "Invalid value for 'background': background responses are not served; send the "
            "request with 'background': false (or without it) and read the answer.",
        )
    text = body.text
    if text is None:
        return
    if not isinstance(text, dict):
        raise type_error("text", "an object", text)
    fmt = text.get("format")
    if fmt is None:
        return
    ftype = fmt.get("type") if isinstance(fmt, dict) else None
    if ftype != "text":
        raise invalid(
            "text.format.type",
            f"Invalid value for 'text.format.type': got {json.dumps(ftype)}; only 'text' is "
            "supported (structured JSON output is not enforced by this server).",
        )


def _convert_tools(
    tools: list[Any] | None,
) -> tuple[tuple[ToolSpec, ...], dict[str, tuple[str, str]]]:
    """The tools the model sees, and each flattened namespace function's (namespace,
    name)."""
    specs: list[ToolSpec] = []
    namespaced: dict[str, tuple[str, str]] = {}
    seen: set[str] = set()

    def add(tool: _FunctionTool, name: str, param: str) -> None:
        if name in seen:
            raise invalid(
                param,
                f"Invalid value for '{param}': tool names must be unique ({name!r} repeated).",
            )
        seen.add(name)
        specs.append(ToolSpec(name, tool.description or "", tool.parameters or {}))

    for i, raw in enumerate(tools or ()):
        param = f"tools[{i}]"
        if not isinstance(raw, dict):
            raise type_error(param, "an object", raw)
        ttype = raw.get("type")
        if ttype == "function":
            tool = validate(_FunctionTool, raw, ("tools", i))
            add(tool, tool.name, f"{param}.name")
        elif ttype == "namespace":
            space = validate(_NamespaceTool, raw, ("tools", i))
            for j, inner in enumerate(space.tools):
                iparam = f"{param}.tools[{j}]"
                if not isinstance(inner, dict) or inner.get("type") != "function":
                    raise invalid(
                        f"{iparam}.type",
                        f"Invalid value for '{iparam}.type': a namespace holds 'function' "
                        "tools only here.",
                    )
                tool = validate(_FunctionTool, inner, ("tools", i, "tools", j))
                name = _flat_name(space.name, tool.name)
                add(tool, name, f"{iparam}.name")
                namespaced[name] = (space.name, tool.name)
        elif isinstance(ttype, str) and ttype.startswith(_HOSTED_TOOLS):
            continue  # hosted: see _HOSTED_TOOLS
        elif "type" not in raw:
            raise missing(f"{param}.type")
        else:
            raise invalid(
                f"{param}.type",
                f"Invalid value for '{param}.type': got {json.dumps(ttype)}; this server "
                "serves 'function' and 'namespace' (of functions) tools, and ignores hosted "
                "tools (" + ", ".join(f"'{t}'" for t in _HOSTED_TOOLS) + "). Describe the "
                "tool as a 'function' with a JSON schema.",
            )
    return tuple(specs), namespaced


def _check_tool_choice(value: object, tools: tuple[ToolSpec, ...]) -> None:
    """A valid ``tool_choice`` (not enforced: see the module docstring)."""
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
    ctype = value.get("type")
    if ctype == "allowed_tools":
        return
    if ctype != "function":
        raise invalid(
            "tool_choice.type",
            f"Invalid value for 'tool_choice.type': got {json.dumps(ctype)}; only 'function' "
            "and 'allowed_tools' choices are served (hosted tools are not).",
        )
    name = value.get("name")
    if not isinstance(name, str):
        raise missing("tool_choice.name")
    namespace = value.get("namespace")
    if isinstance(namespace, str):
        name = _flat_name(namespace, name)
    if all(t.name != name for t in tools):
        raise invalid(
            "tool_choice.name",
            f"Invalid value for 'tool_choice.name': {name!r} is not one of the function tools.",
        )


def _item_type(raw: object, param: str) -> str:
    if not isinstance(raw, dict):
        raise type_error(param, "an object", raw)
    itype = raw.get("type")
    if itype is None and "role" in raw:
        return "message"  # an "easy" input message
    if itype is None:
        raise missing(f"{param}.type")
    if not isinstance(itype, str):
        raise type_error(f"{param}.type", "a string", itype)
    return itype


def _message_text(item: _MessageItem, param: str) -> str:
    if isinstance(item.content, str):
        return item.content
    if not isinstance(item.content, list):
        raise type_error(param, "a string or an array of content parts", item.content)
    allowed = ("output_text", "input_text", "refusal") if item.role == "assistant" else None
    return text_parts(item.content, param, allowed or ("input_text",))


def _called(call_id: str, out: Sequence[Message], before: Sequence[Message]) -> bool:
    """Whether a tool call with this id comes before (searched from the newest: an
    output mostly answers a call of the message just before it)."""
    for messages in (out, before):
        for m in reversed(messages):
            if any(c.id == call_id for c in m.tool_calls):
                return True
    return False


def _convert_input(items: list[Any], before: KnownMessages | None) -> list[Message]:
    """``input`` items as chat messages (see the module docstring); with ``before``,
    the items that follow the messages ``before`` holds."""
    known = before.messages if before else ()
    out: list[Message] = []
    for i, raw in enumerate(items):
        param = f"input[{i}]"
        itype = _item_type(raw, param)
        if itype == "reasoning":
            continue
        if itype == "message":
            item = validate(_MessageItem, raw, ("input", i))
            role = _ROLES.get(item.role)
            if role is None:
                raise invalid(
                    f"{param}.role",
                    f"Invalid value for '{param}.role': got {json.dumps(item.role)}, expected "
                    "one of 'system', 'developer', 'user', 'assistant'.",
                )
            out.append(Message(role, _message_text(item, f"{param}.content")))
        elif itype == "function_call":
            fc = validate(_FunctionCallItem, raw, ("input", i))
            name = fc.name if fc.namespace is None else _flat_name(fc.namespace, fc.name)
            args = tool_arguments(fc.arguments, f"{param}.arguments", f"input item {i}")
            call = ToolCall(fc.call_id, name, args)
            if not out and known and known[-1].role == "assistant":
                raise ParseWhole("a function_call joins the known last assistant message")
            if out and out[-1].role == "assistant":
                last = out.pop()
                out.append(Message("assistant", last.content, (*last.tool_calls, call)))
            else:
                out.append(Message("assistant", "", (call,)))
        elif itype == "function_call_output":
            fo = validate(_FunctionCallOutputItem, raw, ("input", i))
            if not _called(fo.call_id, out, known):
                raise invalid(
                    f"{param}.call_id",
                    f"Invalid value for '{param}.call_id': no function_call item with call_id "
                    f"{fo.call_id!r} comes before this output; a function_call_output answers "
                    "an earlier function_call with the same call_id.",
                )
            text = fo.output
            if isinstance(fo.output, list):
                text = text_parts(fo.output, f"{param}.output", ("input_text",))
            elif not isinstance(fo.output, str):
                raise type_error(f"{param}.output", "a string or an array of content parts", text)
            out.append(Message("tool", text, tool_call_id=fo.call_id))
        elif itype == "item_reference":
            raise invalid(
                f"{param}.type",
                f"Invalid value for '{param}.type': this server stores no items to refer to; "
                "send the item itself.",
            )
        else:
            raise invalid(
                f"{param}.type",
                f"Invalid value for '{param}.type': got {json.dumps(itype)}, expected "
                "'message', 'function_call', 'function_call_output' or 'reasoning' (ignored).",
            )
    return out


def _last_user_texts(items: list[Any]) -> tuple[str, ...] | None:
    """The text parts of the last user message item, as sent (already validated); None
    when there is none."""
    last = next((m for m in reversed(items) if _is_user_message(m)), None)
    if last is None:
        return None
    if isinstance(last["content"], str):
        return (last["content"],)
    return tuple(part["text"] for part in last["content"])


def _is_user_message(item: dict[str, Any]) -> bool:
    return item.get("type", "message") == "message" and item.get("role") == "user"


def parse_responses_request(body: bytes, headers: Mapping[str, str]) -> ChatRequest:
    """Validate a ``POST /v1/responses`` body into a :class:`ChatRequest`.

    Raises :class:`ApiError` (``invalid_request_error``, ``param`` = the offending
    field's path such as ``input[3].arguments``) on malformed or refused input.
    """
    return parse_responses_doc(load_body(body), headers)


def parse_responses_doc(
    data: dict[str, Any], headers: Mapping[str, str], before: KnownMessages | None = None
) -> ChatRequest:
    """:func:`parse_responses_request` of a decoded body. With ``before``, ``data``'s
    ``input`` items are those that follow the ones ``before`` was made from (an error's
    path then counts from them: reparse the whole body to report it); raises
    :class:`ParseWhole` when they cannot be converted apart."""
    body: _Body = validate(_Body, data)
    _refuse_unserved(body)
    items = body.input
    if items is None:
        raise missing("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    if not isinstance(items, list):
        raise type_error("input", "a string or an array of input items", items)
    if not items and before is None:
        raise invalid("input", "Invalid value for 'input': expected at least 1 item, but got none.")
    tools, namespaced = _convert_tools(body.tools)
    _check_tool_choice(body.tool_choice, tools)
    lead = (Message("system", body.instructions),) if body.instructions else ()
    known = before.messages if before else ()
    messages = (*lead, *known, *_convert_input(items, before))
    texts = _last_user_texts(items)
    if texts is None and before is not None:
        texts = before.last_user_texts
    sampling = SamplingParams(
        max_tokens=body.max_output_tokens or NO_OUTPUT_LIMIT,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k if body.top_k is not None and body.top_k > 0 else -1,
        stop=parse_stop(body.stop),
    )
    logprobs = LOGPROBS_INCLUDE in (body.include or ())
    return ChatRequest(
        api=OpenAIResponses.name,
        model=body.model,
        messages=messages,
        sampling=sampling,
        tools=tools,
        stream=bool(body.stream),
        logprobs=logprobs,
        top_logprobs=(body.top_logprobs or 0) if logprobs else 0,
        headers=forwarded_headers(headers),
        last_user_texts=texts or (),
        lead=len(lead),
        tool_namespaces=namespaced,
    )


# ---------------------------------------------------------------------------------------
# Answers
# ---------------------------------------------------------------------------------------


def _usage(c: Completion) -> dict[str, Any]:
    return {
        "input_tokens": c.input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": c.output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": c.input_tokens + c.output_tokens,
    }


def _message_id(response_id: str) -> str:
    return "msg_" + response_id.removeprefix(OpenAIResponses.id_prefix)


def _text_part(text: str, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    return {
        "type": "output_text",
        "text": text,
        "annotations": [],
        "logprobs": [token_logprob(t) for t in logprobs],
    }


def _reasoning_id(response_id: str) -> str:
    return "rs_" + response_id.removeprefix(OpenAIResponses.id_prefix)


def _reasoning_item(response_id: str, text: str, status: str) -> dict[str, Any]:
    """The model's reasoning as an output item (``reasoning_text`` content, as open
    models served by vLLM answer; no summary, nothing encrypted)."""
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {
        "id": _reasoning_id(response_id),
        "type": "reasoning",
        "status": status,
        "summary": [],
        "content": content,
    }


def _message_item(response_id: str, content: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {
        "id": _message_id(response_id),
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _call_item(tc: ToolCall, chat: ChatRequest, *, arguments: str, status: str) -> dict[str, Any]:
    """A ``function_call`` item, named as the client knows the tool."""
    item: dict[str, Any] = {
        "id": _call_item_id(tc),
        "type": "function_call",
        "status": status,
        "call_id": tc.id,
        "name": tc.name,
        "arguments": arguments,
    }
    if tc.name in chat.tool_namespaces:
        item["namespace"], item["name"] = chat.tool_namespaces[tc.name]
    return item


def _call_item_id(tc: ToolCall) -> str:
    return "fc_" + tc.id.removeprefix(OpenAIResponses.tool_id_prefix)


def _has_message(c: Completion) -> bool:
    return bool(c.text) or not c.tool_calls


def _truncated(c: Completion) -> bool:
    return c.stop_reason == "max_tokens"


def _output(c: Completion, chat: ChatRequest, response_id: str) -> list[dict[str, Any]]:
    """The answer's output items: its reasoning (if any), its message (see
    :func:`_has_message`), then its calls."""
    out = [_reasoning_item(response_id, c.reasoning, "completed")] if c.reasoning else []
    if _has_message(c):
        part = _text_part(c.text, c.logprobs if chat.logprobs else ())
        out.append(_message_item(response_id, [part], _item_status(c)))
    for tc in c.tool_calls:
        out.append(_call_item(tc, chat, arguments=arguments_json(tc), status="completed"))
    return out


def _item_status(c: Completion) -> str:
    return "incomplete" if _truncated(c) else "completed"


def _response(
    response_id: str,
    model: str,
    created: int,
    chat: ChatRequest,
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``response`` object. ``tools``: the function tools the model saw;
    ``tool_choice`` ``auto``: the model chooses (see the module docstring)."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [{**t.to_template()["function"], "type": "function"} for t in chat.tools],
        "store": False,
        "previous_response_id": None,
        "usage": usage,
    }


def response_body(c: Completion, chat: ChatRequest, created: int) -> dict[str, Any]:
    """The ``response`` object answering ``chat`` with ``c`` (status ``incomplete`` when
    the token budget ran out, else ``completed``)."""
    rid = _response_id(c)
    return _response(
        rid,
        c.model,
        created,
        chat,
        status=_item_status(c),
        output=_output(c, chat, rid),
        usage=_usage(c),
    )


def _response_id(c: Completion) -> str:
    prefix = OpenAIResponses.id_prefix
    return c.id if c.id.startswith(prefix) else prefix + c.id


class ResponseStream:
    """The SSE events of one streamed response, made as its text arrives.

    Call :meth:`start`, then :meth:`reasoning` with each new piece of reasoning, then
    :meth:`text` with each new piece of text, and :meth:`ping` at will, then
    :meth:`finish` once with the completion, whose ``reasoning`` and ``text`` must be
    the pieces given to :meth:`reasoning` and :meth:`text`, concatenated, or
    :meth:`error` once. Reasoning is an output item of its own, before the message. Every event is
    ``event: TYPE`` with ``data: {"type": TYPE, "sequence_number": N, ...}``, N counting
    from 0 (the order is in the module docstring); folding them gives
    :func:`response_body` of the completion.

    Log-probs (when the request asked for them): give :meth:`text` the log-probs of the
    completion's tokens in order, each call those of the tokens after the ones already
    given; each text delta carries those given since the last one, and the finished
    ``output_text`` part all of the completion's.
    """

    def __init__(
        self,
        response_id: str,
        model: str,
        chat: ChatRequest,
        *,
        created: int,
        chunk_chars: int = 64,
    ) -> None:
        if chunk_chars < 1:
            raise ValueError(f"chunk_chars must be >= 1, got {chunk_chars}")
        self.response_id = response_id
        self.model = model
        self.chat = chat
        self.created = created
        self.chunk_chars = chunk_chars
        self._sequence = 0
        self._text_open = False
        self._reasoning: list[str] | None = None  # the reasoning item's text, while open
        self._message_index = 0  # the message item's output_index, once it opens
        self._pending: list[TokenLogprob] = []  # given, not yet sent
        self._items: list[dict[str, Any]] = []  # output items done

    def start(self) -> bytes:
        """``response.created`` and ``response.in_progress``."""
        response = self._state("in_progress", usage=None)
        return self._event("response.created", response=response) + self._event(
            "response.in_progress", response=response
        )

    def ping(self) -> bytes:
        """An SSE comment: keeps the connection busy, clients skip it."""
        return b": ping\n\n"

    def reasoning(self, delta: str) -> bytes:
        """A ``reasoning_text.delta`` (the reasoning item opens with the first one; empty
        reasoning: nothing)."""
        if not delta:
            return b""
        opened = b""
        if self._reasoning is None:
            self._reasoning = []
            item = _reasoning_item(self.response_id, "", "in_progress")
            opened = self._event("response.output_item.added", output_index=0, item=item)
        self._reasoning.append(delta)
        return opened + self._event(
            "response.reasoning_text.delta", **self._reasoning_at(), delta=delta
        )

    def text(self, delta: str, logprobs: Sequence[TokenLogprob] | None = None) -> bytes:
        """An ``output_text.delta`` (the message item opens with the first one; empty
        text: nothing, its log-probs wait for the next delta)."""
        if self.chat.logprobs and logprobs:
            self._pending.extend(logprobs)
        if not delta:
            return b""
        carried = [token_logprob(t) for t in self._pending]
        self._pending = []
        return self._open_message() + self._event(
            "response.output_text.delta", **self._text_at(), delta=delta, logprobs=carried
        )

    def finish(self, c: Completion) -> bytes:
        """The message's ``.done`` events, each call's events, and
        ``response.completed`` (``response.incomplete`` when the budget ran out)."""
        out: list[bytes] = [self._close_reasoning()]
        if _has_message(c):
            out.append(self._open_message())
            part = _text_part(c.text, c.logprobs if self.chat.logprobs else ())
            out.append(
                self._event(
                    "response.output_text.done",
                    **self._text_at(),
                    text=c.text,
                    logprobs=part["logprobs"],
                )
            )
            out.append(self._event("response.content_part.done", **self._text_at(), part=part))
            out.append(self._done(_message_item(self.response_id, [part], _item_status(c))))
        for tc in c.tool_calls:
            index = len(self._items)
            at = {"item_id": _call_item_id(tc), "output_index": index}
            opened = _call_item(tc, self.chat, arguments="", status="in_progress")
            out.append(self._event("response.output_item.added", output_index=index, item=opened))
            arguments = arguments_json(tc)
            for piece in pieces(arguments, self.chunk_chars):
                out.append(self._event("response.function_call_arguments.delta", **at, delta=piece))
            out.append(
                self._event(
                    "response.function_call_arguments.done", **at, name=tc.name, arguments=arguments
                )
            )
            out.append(
                self._done(_call_item(tc, self.chat, arguments=arguments, status="completed"))
            )
        status = _item_status(c)
        response = self._state(status, usage=_usage(c))
        out.append(self._event(f"response.{status}", response=response))
        return b"".join(out)

    def error(self, e: ApiError) -> bytes:
        """``response.failed`` with the error (Codex reads its ``code``: e.g.
        ``context_length_exceeded``) and the items done so far."""
        response = self._state("failed", usage=None, error=error_object(e))
        return self._event("response.failed", response=response)

    def _state(
        self, status: str, *, usage: dict[str, Any] | None, error: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return _response(
            self.response_id,
            self.model,
            self.created,
            self.chat,
            status=status,
            output=list(self._items),
            usage=usage,
            error=error,
        )

    def _reasoning_at(self) -> dict[str, Any]:
        return {"item_id": _reasoning_id(self.response_id), "output_index": 0, "content_index": 0}

    def _close_reasoning(self) -> bytes:
        """The reasoning item's ``.done`` events, once it is open (all reasoning comes
        before any text)."""
        if self._reasoning is None:
            return b""
        text, self._reasoning = "".join(self._reasoning), None
        done = self._event("response.reasoning_text.done", **self._reasoning_at(), text=text)
        return done + self._done(_reasoning_item(self.response_id, text, "completed"))

    def _text_at(self) -> dict[str, Any]:
        return {
            "item_id": _message_id(self.response_id),
            "output_index": self._message_index,
            "content_index": 0,
        }

    def _open_message(self) -> bytes:
        """The message item's and its text part's ``added`` events, once (after the
        reasoning item's ``.done`` events, when there is reasoning)."""
        if self._text_open:
            return b""
        closed = self._close_reasoning()
        self._text_open = True
        self._message_index = len(self._items)
        item = _message_item(self.response_id, [], "in_progress")
        added = self._event(
            "response.output_item.added", output_index=self._message_index, item=item
        )
        return (
            closed
            + added
            + self._event("response.content_part.added", **self._text_at(), part=_text_part("", ()))
        )

    def _done(self, item: dict[str, Any]) -> bytes:
        self._items.append(item)
        return self._event(
            "response.output_item.done", output_index=len(self._items) - 1, item=item
        )

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return named_event(kind, data)


# ---------------------------------------------------------------------------------------
# The dialect
# ---------------------------------------------------------------------------------------


class OpenAIResponses(OpenAIDialect):
    """The Responses API (``POST /v1/responses``) as the server serves it: this
    module's functions under the :class:`Dialect` names. Errors on any
    ``/responses`` path (unknown ones under it too) answer in OpenAI's shape."""

    name = "responses"
    call_path = "/v1/responses"
    id_prefix = "resp_"
    tool_id_prefix = "call_"
    path_marker = "/responses"
    messages_key = "input"
    conversation_param = "input"

    def parse_doc(
        self, doc: dict[str, Any], headers: Mapping[str, str], before: KnownMessages | None
    ) -> ChatRequest:
        return parse_responses_doc(doc, headers, before)

    def answer(self, c: Completion, chat: ChatRequest) -> dict[str, Any]:
        return response_body(c, chat, int(time.time()))

    def events(
        self, completion_id: str, model: str, chat: ChatRequest, *, created: int, input_tokens: int
    ) -> ResponseStream:
        return ResponseStream(completion_id, model, chat, created=created)
