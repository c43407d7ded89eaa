"""The OpenAI Chat Completions adapter, driven by the real ``openai`` SDK over a mock transport."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx2
import openai
import pytest

from qwengyre.proxy.openai_api import (
    DEFAULT_MAX_TOKENS,
    completion_body,
    context_length_exceeded,
    error_body,
    error_headers,
    error_status,
    finish_reason,
    models_body,
    parse_chat_request,
    parse_chat_request_with_ignored,
    stream_chunks,
)
from qwengyre.proxy.types import (
    ApiError,
    ChatRequest,
    Completion,
    Message,
    TokenLogprob,
    ToolCall,
    ToolSpec,
)

CREATED = 1_700_000_000
MODEL = "qwen-policy"

_TEXT_TOKENS = ["Hello", ", wörld", "! 你好", " 🌍", " — done."]
TEXT = Completion(
    id="42",
    model=MODEL,
    text="".join(_TEXT_TOKENS),
    tool_calls=(),
    stop_reason="end_turn",
    input_tokens=31,
    output_tokens=len(_TEXT_TOKENS),
    logprobs=tuple(TokenLogprob(t, -0.25 * (i + 1)) for i, t in enumerate(_TEXT_TOKENS)),
)
TOOLS = Completion(
    id="chatcmpl-tools",
    model=MODEL,
    text="",
    tool_calls=(
        ToolCall("call_a", "bash", {"command": "grep -rn 'naïve' . | head", "timeout": 30}),
        ToolCall("call_b", "edit", {"path": "src/ü.py", "lines": [1, 2], "opts": {"dry": True}}),
    ),
    stop_reason="tool_use",
    input_tokens=120,
    output_tokens=40,
)
_MIXED_TOKENS = ["Let", " me", " check", "."]
MIXED = Completion(
    id="mixed",
    model=MODEL,
    text="".join(_MIXED_TOKENS),
    tool_calls=(ToolCall("call_c", "ls", {}),),
    stop_reason="tool_use",
    input_tokens=9,
    output_tokens=8,
    logprobs=tuple(TokenLogprob(t, -1.0) for t in [*_MIXED_TOKENS, "\n", "<tool_call>", "{", "}"]),
)
LENGTH = Completion(
    id="len",
    model=MODEL,
    text="truncated answ",
    tool_calls=(),
    stop_reason="max_tokens",
    input_tokens=5,
    output_tokens=3,
)

USER: list[Any] = [{"role": "user", "content": "hi"}]


class Proxy:
    """A mock-transport handler: parses with our parser, answers with our renderers."""

    def __init__(self, completion: Completion, *, chunk_chars: int = 5) -> None:
        self.completion = completion
        self.chunk_chars = chunk_chars
        self.requests: list[ChatRequest] = []
        self.raw_bodies: list[dict[str, Any]] = []
        self.error: ApiError | None = None

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        try:
            if self.error is not None:
                raise self.error
            if request.url.path == "/v1/models":
                return httpx2.Response(200, json=models_body([MODEL, "other"], CREATED))
            assert request.url.path == "/v1/chat/completions"
            self.raw_bodies.append(json.loads(request.content))
            req = parse_chat_request(request.content, request.headers)
            self.requests.append(req)
        except ApiError as e:
            return httpx2.Response(error_status(e), json=error_body(e), headers=error_headers(e))
        if req.stream:
            body = b"".join(
                stream_chunks(
                    self.completion,
                    CREATED,
                    logprobs=req.logprobs,
                    include_usage=req.include_usage,
                    chunk_chars=self.chunk_chars,
                )
            )
            return httpx2.Response(200, content=body, headers={"content-type": "text/event-stream"})
        return httpx2.Response(
            200, json=completion_body(self.completion, CREATED, logprobs=req.logprobs)
        )


def client_for(handler: Callable[[httpx2.Request], httpx2.Response]) -> openai.OpenAI:
    return openai.OpenAI(
        api_key="k",
        base_url="http://proxy.test/v1",
        http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
        max_retries=0,
    )


def parse(body: dict[str, Any], headers: dict[str, str] | None = None) -> ChatRequest:
    return parse_chat_request(json.dumps(body).encode(), headers or {})


def body_with(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, **fields}


# ---------------------------------------------------------------------------------------
# The real SDK against the adapter
# ---------------------------------------------------------------------------------------


def test_sdk_text_completion_and_request_fields() -> None:
    proxy = Proxy(TEXT)
    out = client_for(proxy).chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, *USER],
        max_tokens=50,
        temperature=0.3,
        top_p=0.9,
        stop=["\n\n", "END"],
        seed=7,
        user="u-1",
        extra_headers={"X-Agent-Id": "agent-7", "X-Api-Key": "secret"},
        extra_body={"top_k": 20},
    )
    (req,) = proxy.requests
    assert req.api == "openai" and req.model == MODEL
    assert req.messages == (Message("system", "Be brief."), Message("user", "hi"))
    assert req.sampling.max_tokens == 50
    assert req.sampling.temperature == pytest.approx(0.3)
    assert req.sampling.top_p == pytest.approx(0.9)
    assert req.sampling.top_k == 20
    assert req.sampling.stop == ("\n\n", "END")
    assert not req.stream and not req.logprobs
    assert req.headers["x-agent-id"] == "agent-7"
    assert "x-api-key" not in req.headers and "authorization" not in req.headers

    assert out.id == "chatcmpl-42" and out.object == "chat.completion"
    assert out.created == CREATED and out.model == MODEL
    (choice,) = out.choices
    assert choice.index == 0 and choice.finish_reason == "stop"
    assert choice.message.role == "assistant" and choice.message.content == TEXT.text
    assert choice.message.tool_calls is None
    assert choice.logprobs is None  # the Completion has them, but they were not asked for
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        31,
        5,
        36,
    )


def test_sdk_tool_calls_round_trip_into_the_next_request() -> None:
    proxy = Proxy(TOOLS)
    client = client_for(proxy)
    tools: list[Any] = [
        {
            "type": "function",
            "function": {
                "name": "bash",
                "description": "Run a shell command.",
                "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
            },
        },
        {"type": "function", "function": {"name": "edit"}},
    ]
    out = client.chat.completions.create(
        model=MODEL, messages=USER, tools=tools, tool_choice="auto", parallel_tool_calls=True
    )
    assert proxy.requests[0].tools == (
        ToolSpec(
            "bash",
            "Run a shell command.",
            {"type": "object", "properties": {"command": {"type": "string"}}},
        ),
        ToolSpec("edit", "", {}),
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 2
    for got, want in zip(calls, TOOLS.tool_calls, strict=True):
        assert got.type == "function" and got.id == want.id
        assert got.function.name == want.name
        assert isinstance(got.function.arguments, str)
        assert json.loads(got.function.arguments) == want.arguments

    # The agent echoes the assistant message back with the tool results.
    history: list[Any] = [
        *USER,
        choice.message.model_dump(),
        {"role": "tool", "tool_call_id": "call_a", "content": "./a.py:1: naïve"},
        {"role": "tool", "tool_call_id": "call_b", "content": [{"type": "text", "text": "ok"}]},
    ]
    client.chat.completions.create(model=MODEL, messages=history, tools=tools)
    assert proxy.requests[1].messages == (
        Message("user", "hi"),
        Message("assistant", "", tool_calls=TOOLS.tool_calls),
        Message("tool", "./a.py:1: naïve", tool_call_id="call_a"),
        Message("tool", "ok", tool_call_id="call_b"),
    )


def test_sdk_logprobs() -> None:
    proxy = Proxy(TEXT)
    out = client_for(proxy).chat.completions.create(
        model=MODEL, messages=USER, logprobs=True, top_logprobs=3
    )
    req = proxy.requests[0]
    assert req.logprobs and req.top_logprobs == 3
    lp = out.choices[0].logprobs
    assert lp is not None and lp.content is not None
    assert [t.token for t in lp.content] == _TEXT_TOKENS
    assert [t.logprob for t in lp.content] == [t.logprob for t in TEXT.logprobs]
    assert [bytes(t.bytes or []) for t in lp.content] == [t.encode() for t in _TEXT_TOKENS]
    assert all(t.top_logprobs == [] for t in lp.content)


def _collect_stream(chunks: Iterator[Any]) -> dict[str, Any]:
    """Reassemble what a client sees from raw ``stream=True`` chunks."""
    content: str | None = None
    roles: list[str] = []
    calls: dict[int, dict[str, str]] = {}
    logprobs: list[tuple[str, float]] = []
    finish: list[str] = []
    usages: list[Any] = []
    for chunk in chunks:
        assert chunk.object == "chat.completion.chunk" and chunk.created == CREATED
        usages.append(chunk.usage)
        for choice in chunk.choices:
            delta = choice.delta
            if delta.role:
                roles.append(delta.role)
            if delta.content is not None:
                content = (content or "") + delta.content
            for tc in delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                if tc.id:
                    slot["id"] += tc.id
                if tc.function and tc.function.name:
                    slot["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    slot["arguments"] += tc.function.arguments
            if choice.logprobs and choice.logprobs.content:
                logprobs += [(t.token, t.logprob) for t in choice.logprobs.content]
            if choice.finish_reason:
                finish.append(choice.finish_reason)
    return {
        "content": content,
        "roles": roles,
        "calls": [calls[i] for i in sorted(calls)],
        "logprobs": logprobs,
        "finish": finish,
        "usages": usages,
    }


@pytest.mark.parametrize("completion", [TEXT, TOOLS, MIXED, LENGTH], ids=lambda c: c.id)
@pytest.mark.parametrize("chunk_chars", [1, 4, 64])
def test_sdk_stream_reassembles_the_completion(completion: Completion, chunk_chars: int) -> None:
    proxy = Proxy(completion, chunk_chars=chunk_chars)
    stream = client_for(proxy).chat.completions.create(
        model=MODEL,
        messages=USER,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
    )
    got = _collect_stream(iter(stream))
    req = proxy.requests[0]
    assert req.stream and req.include_usage and req.logprobs
    assert got["roles"] == ["assistant"]
    assert got["content"] == (
        completion.text if completion.text or not completion.tool_calls else None
    )
    assert got["calls"] == [
        {"id": tc.id, "name": tc.name, "arguments": got["calls"][i]["arguments"]}
        for i, tc in enumerate(completion.tool_calls)
    ]
    assert [json.loads(c["arguments"]) for c in got["calls"]] == [
        tc.arguments for tc in completion.tool_calls
    ]
    assert got["logprobs"] == [(t.token, t.logprob) for t in completion.logprobs]
    assert got["finish"] == [finish_reason(completion)]
    # usage: null on every chunk but the last, which has no choices
    *rest, last = got["usages"]
    assert all(u is None for u in rest)
    assert (
        last is not None and last.total_tokens == completion.input_tokens + completion.output_tokens
    )
    assert last.prompt_tokens == completion.input_tokens


def test_sdk_stream_without_include_usage_has_no_usage_chunk() -> None:
    proxy = Proxy(TEXT)
    chunks = list(
        client_for(proxy).chat.completions.create(model=MODEL, messages=USER, stream=True)
    )
    assert not proxy.requests[0].include_usage and not proxy.requests[0].logprobs
    assert all(c.usage is None for c in chunks)
    assert all(len(c.choices) == 1 for c in chunks)
    assert all(c.choices[0].logprobs is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == TEXT.text


@pytest.mark.parametrize("completion", [TEXT, TOOLS, MIXED], ids=lambda c: c.id)
def test_sdk_stream_helper_final_completion(completion: Completion) -> None:
    proxy = Proxy(completion, chunk_chars=3)
    client = client_for(proxy)
    with client.chat.completions.stream(
        model=MODEL, messages=USER, logprobs=True, stream_options={"include_usage": True}
    ) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_completion()
    assert proxy.requests[0].stream
    assert events.count("content.done") == (1 if completion.text else 0)
    assert events.count("tool_calls.function.arguments.done") == len(completion.tool_calls)
    choice = final.choices[0]
    assert choice.finish_reason == finish_reason(completion)
    assert choice.message.content == (completion.text or None)
    assert [
        (c.id, c.function.name, json.loads(c.function.arguments))
        for c in choice.message.tool_calls or []
    ] == [(tc.id, tc.name, tc.arguments) for tc in completion.tool_calls]
    if completion.logprobs:
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert [t.token for t in choice.logprobs.content] == [t.token for t in completion.logprobs]
    assert final.usage is not None and final.usage.completion_tokens == completion.output_tokens


@pytest.mark.parametrize(
    ("error", "exc_type", "status"),
    [
        (context_length_exceeded(40_000, 32_768), openai.BadRequestError, 400),
        (ApiError("authentication_error", "Invalid API key."), openai.AuthenticationError, 401),
        (ApiError("permission_error", "Forbidden."), openai.PermissionDeniedError, 403),
        (ApiError("not_found_error", "No model 'x'."), openai.NotFoundError, 404),
        (
            ApiError("rate_limit_error", "Slow down.", retry_after_s=2.5),
            openai.RateLimitError,
            429,
        ),
        (ApiError("api_error", "Engine crashed."), openai.InternalServerError, 500),
        (ApiError("overloaded_error", "Busy."), openai.InternalServerError, 503),
    ],
    ids=lambda v: getattr(v, "kind", None) or getattr(v, "__name__", str(v)),
)
def test_sdk_errors(error: ApiError, exc_type: type[openai.APIStatusError], status: int) -> None:
    proxy = Proxy(TEXT)
    proxy.error = error
    with pytest.raises(exc_type) as info:
        client_for(proxy).chat.completions.create(model=MODEL, messages=USER)
    exc = info.value
    assert exc.status_code == status
    assert error.message in exc.message
    assert exc.code == error_body(error)["error"]["code"]
    if error.retry_after_s is not None:
        assert exc.response.headers["retry-after"] == "3"
        assert exc.response.headers["retry-after-ms"] == "2500"


def test_sdk_context_length_error_shape() -> None:
    proxy = Proxy(TEXT)
    proxy.error = context_length_exceeded(40_000, 32_768)
    with pytest.raises(openai.BadRequestError) as info:
        client_for(proxy).chat.completions.create(model=MODEL, messages=USER)
    exc = info.value
    assert exc.code == "context_length_exceeded"
    assert exc.type == "invalid_request_error" and exc.param == "messages"
    assert exc.message.endswith(
        "This model's maximum context length is 32768 tokens. However, your messages resulted "
        "in 40000 tokens. Please reduce the length of the messages."
    )


def test_sdk_sees_parse_errors_as_bad_request() -> None:
    proxy = Proxy(TEXT)
    with pytest.raises(openai.BadRequestError) as info:
        client_for(proxy).chat.completions.create(model=MODEL, messages=USER, n=2)
    assert info.value.param == "n" and info.value.type == "invalid_request_error"
    assert "'n'" in info.value.message
    assert proxy.requests == []


def test_sdk_models_list() -> None:
    page = client_for(Proxy(TEXT)).models.list()
    assert [m.id for m in page.data] == [MODEL, "other"]
    assert all(m.owned_by == "qwengyre" and m.created == CREATED for m in page.data)
    assert all(m.object == "model" for m in page.data)


# ---------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------


def test_parse_multi_turn_tool_conversation() -> None:
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are an agent."},
            {"role": "developer", "content": [{"type": "text", "text": "Use tools."}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Fix the bug"},
                    {"type": "text", "text": "in main.py"},
                ],
                "name": "alice",
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "read", "arguments": '{"path": "main.py"}'},
                    },
                    {
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": "ls", "arguments": ""},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "print(1/0)"},
            {
                "role": "tool",
                "tool_call_id": "call_2",
                "content": [{"type": "text", "text": "main.py"}],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "Fixed."}]},
            {"role": "user", "content": "thanks"},
        ],
    }
    req = parse(body)
    assert req.messages == (
        Message("system", "You are an agent."),
        Message("system", "Use tools."),
        Message("user", "Fix the bug\nin main.py"),
        Message(
            "assistant",
            "",
            tool_calls=(
                ToolCall("call_1", "read", {"path": "main.py"}),
                ToolCall("call_2", "ls", {}),
            ),
        ),
        Message("tool", "print(1/0)", tool_call_id="call_1"),
        Message("tool", "main.py", tool_call_id="call_2"),
        Message("assistant", "Fixed."),
        Message("user", "thanks"),
    )
    assert req.messages[3].to_template()["tool_calls"][0]["function"]["arguments"] == {
        "path": "main.py"
    }


def test_parse_defaults_and_token_budget() -> None:
    req = parse(body_with())
    assert req.sampling.max_tokens == DEFAULT_MAX_TOKENS
    assert (req.sampling.temperature, req.sampling.top_p, req.sampling.top_k) == (1.0, 1.0, -1)
    assert req.sampling.stop == ()
    assert req.tools == () and not req.stream and not req.include_usage
    assert req.logprobs is False and req.top_logprobs == 0
    assert parse(body_with(max_tokens=77)).sampling.max_tokens == 77
    both = parse(body_with(max_tokens=77, max_completion_tokens=99))
    assert both.sampling.max_tokens == 99
    assert parse(body_with(stop="###")).sampling.stop == ("###",)
    assert parse(body_with(stop=["", "\n"])).sampling.stop == ("\n",)  # "" stops nothing
    assert parse(body_with(stop="")).sampling.stop == ()
    assert parse(body_with(stop=None, temperature=None, n=1)).sampling.temperature == 1.0
    assert parse(body_with(temperature=0)).sampling.temperature == 0.0
    assert parse(body_with(top_k=0)).sampling.top_k == -1
    # include_usage only means something when streaming
    assert not parse(body_with(stream_options={"include_usage": True})).include_usage
    assert parse(body_with(stream=True, stream_options={"include_usage": True})).include_usage


def test_parse_ignores_unknown_and_unhonoured_fields() -> None:
    req, ignored = parse_chat_request_with_ignored(
        json.dumps(
            body_with(
                user="u",
                seed=3,
                n=1,
                parallel_tool_calls=False,
                response_format={"type": "text"},
                store=False,
                metadata={"run": "7"},
                tool_choice={"type": "function", "function": {"name": "bash"}},
                frequency_penalty=0.0,
                some_future_field={"x": 1},
                service_tier=None,
            )
        ).encode(),
        {},
    )
    assert req.messages == (Message("user", "hi"),)
    assert ignored == (
        "frequency_penalty",
        "metadata",
        "parallel_tool_calls",
        "seed",
        "some_future_field",
        "store",
        "tool_choice",
        "user",
    )


def test_parse_headers_keep_x_headers_without_credentials() -> None:
    req = parse(
        body_with(),
        {
            "Authorization": "Bearer sk-1",
            "X-Api-Key": "sk-2",
            "x-goog-api-key": "sk-3",
            "X-Auth-Token": "sk-4",
            "X-Agent-Id": "agent-1",
            "X-Stainless-Lang": "python",
            "Content-Type": "application/json",
        },
    )
    assert req.headers == {"x-agent-id": "agent-1", "x-stainless-lang": "python"}


def test_parse_unicode_survives() -> None:
    text = "naïve café — 你好, мир 🌍 e\u0301 \u2028 \x00"
    raw = json.dumps(
        {
            "model": MODEL,
            "messages": [
                {"role": "user", "content": text},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {
                                "name": "say",
                                "arguments": json.dumps({"msg": text}, ensure_ascii=False),
                            },
                        }
                    ],
                },
            ],
            "stop": ["🛑"],
        },
        ensure_ascii=True,  # \ud83c\udf0d escapes in the wire body
    ).encode()
    req = parse_chat_request(raw, {})
    assert req.messages[0].content == text
    assert req.messages[1].tool_calls[0].arguments == {"msg": text}
    assert req.sampling.stop == ("🛑",)
    # and on the way out
    c = Completion(
        id="u",
        model=MODEL,
        text=text,
        tool_calls=(ToolCall("c", "say", {"msg": text}),),
        stop_reason="tool_use",
        input_tokens=1,
        output_tokens=1,
    )
    body = json.loads(json.dumps(completion_body(c, CREATED)))
    assert body["choices"][0]["message"]["content"] == text
    assert json.loads(body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == {
        "msg": text
    }
    events = b"".join(stream_chunks(c, CREATED, logprobs=False, include_usage=False, chunk_chars=2))
    deltas = [
        json.loads(line[len(b"data: ") :])["choices"][0]["delta"]
        for line in events.split(b"\n\n")
        if line.startswith(b"data: {")
    ]
    assert "".join(d.get("content") or "" for d in deltas) == text


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        (
            body_with(
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this?"},
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}},
                        ],
                    }
                ]
            ),
            "messages[0].content[1].type",
            "image",
        ),
        (
            body_with(
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "input_audio", "input_audio": {"data": ""}}],
                    }
                ]
            ),
            "messages[0].content[0].type",
            "audio",
        ),
        (body_with(n=2), "n", "must be 1"),
        (body_with(n=0), "n", "greater than or equal to 1"),
        (
            body_with(
                messages=[
                    *USER,
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "f", "arguments": '{"a": 1'},
                            }
                        ],
                    },
                ]
            ),
            "messages[1].tool_calls[0].function.arguments",
            "message 1",
        ),
        (
            body_with(
                messages=[
                    *USER,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "f", "arguments": "[1]"},
                            }
                        ],
                    },
                ]
            ),
            "messages[1].tool_calls[0].function.arguments",
            "JSON object",
        ),
        (
            body_with(messages=[*USER, {"role": "function", "name": "f", "content": "1"}]),
            "messages[1].role",
            "legacy 'function' role",
        ),
        (body_with(messages=[{"role": "robot", "content": "x"}]), "messages[0].role", "'tool'"),
        (body_with(messages=[{"content": "x"}]), "messages[0].role", "Missing required"),
        (body_with(messages=[{"role": "user", "content": 5}]), "messages[0].content", "an integer"),
        (body_with(messages=[{"role": "user"}]), "messages[0].content", "Missing required"),
        (
            body_with(messages=[{"role": "tool", "content": "out"}]),
            "messages[0].tool_call_id",
            "Missing required",
        ),
        (body_with(messages=["hi"]), "messages[0]", "expected an object"),
        (body_with(messages=[]), "messages", "at least 1"),
        (body_with(messages="hi"), "messages", "an array"),
        ({"messages": USER}, "model", "Missing required parameter: 'model'"),
        (body_with(model=3), "model", "a string"),
        (body_with(max_tokens="100"), "max_tokens", "an integer"),
        (body_with(max_completion_tokens=0), "max_completion_tokens", "greater than or equal to 1"),
        (body_with(temperature=2.5), "temperature", "less than or equal to 2"),
        (body_with(temperature="hot"), "temperature", "a number"),
        (body_with(top_p=0), "top_p", "greater than 0"),
        (body_with(stream="yes"), "stream", "a boolean"),
        (
            body_with(stream=True, stream_options={"include_usage": 1}),
            "stream_options.include_usage",
            "a boolean",
        ),
        (body_with(stop=[1]), "stop[0]", "a string"),
        (body_with(stop=7), "stop", "a string or an array"),
        (body_with(top_logprobs=2), "top_logprobs", "'logprobs' is true"),
        (body_with(logprobs=True, top_logprobs=21), "top_logprobs", "less than or equal to 20"),
        (body_with(logprobs="true"), "logprobs", "a boolean"),
        (
            body_with(tools=[{"type": "custom", "custom": {"name": "x"}}]),
            "tools[0].type",
            "'function'",
        ),
        (
            body_with(tools=[{"type": "function", "function": {}}]),
            "tools[0].function.name",
            "Missing",
        ),
        (body_with(tools={"type": "function"}), "tools", "an array"),
        (body_with(tool_choice="sometimes"), "tool_choice", "'required'"),
        (
            body_with(response_format={"type": "json_schema", "json_schema": {}}),
            "response_format.type",
            "'text'",
        ),
        (body_with(functions=[{"name": "f"}]), "functions", "use 'tools'"),
        (body_with(modalities=["text", "audio"]), "modalities", "only ['text']"),
    ],
)
def test_parse_rejects_bad_input(body: dict[str, Any], param: str, needle: str) -> None:
    with pytest.raises(ApiError) as info:
        parse(body)
    err = info.value
    assert err.kind == "invalid_request_error" and err.status == 400
    assert err.param == param
    assert needle in err.message
    assert f"'{param}'" in err.message or param in err.message


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b'{"model": "m", "messages": [', "Could not parse the JSON body"),
        (b"", "Could not parse the JSON body"),
        (b"\xff\xfe{}", "Could not parse the JSON body"),
        (b'{"model": "m", "messages": [], "temperature": NaN}', "NaN"),
        (b"[1, 2]", "must be a JSON object, but got an array"),
        (b'"hello"', "must be a JSON object, but got a string"),
    ],
)
def test_parse_rejects_malformed_bodies(raw: bytes, needle: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_chat_request(raw, {})
    assert info.value.kind == "invalid_request_error" and info.value.param is None
    assert needle in info.value.message


# ---------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stop_reason", "tool_calls", "expected"),
    [
        ("end_turn", (), "stop"),
        ("stop_sequence", (), "stop"),
        ("max_tokens", (), "length"),
        ("tool_use", (ToolCall("c", "f", {}),), "tool_calls"),
        ("end_turn", (ToolCall("c", "f", {}),), "tool_calls"),
    ],
)
def test_finish_reasons(stop_reason: Any, tool_calls: tuple[ToolCall, ...], expected: str) -> None:
    c = Completion(
        id="x",
        model=MODEL,
        text="t",
        tool_calls=tool_calls,
        stop_reason=stop_reason,
        input_tokens=1,
        output_tokens=1,
    )
    assert completion_body(c, CREATED)["choices"][0]["finish_reason"] == expected
    events = list(stream_chunks(c, CREATED, logprobs=False, include_usage=False))
    final = json.loads(events[-2][len(b"data: ") :])
    assert final["choices"][0]["finish_reason"] == expected and final["choices"][0]["delta"] == {}


def test_completion_body_content_null_only_with_tool_calls() -> None:
    assert completion_body(TOOLS, CREATED)["choices"][0]["message"]["content"] is None
    empty = Completion(
        id="e",
        model=MODEL,
        text="",
        tool_calls=(),
        stop_reason="end_turn",
        input_tokens=1,
        output_tokens=0,
    )
    message = completion_body(empty, CREATED)["choices"][0]["message"]
    assert message["content"] == "" and "tool_calls" not in message
    assert completion_body(MIXED, CREATED)["choices"][0]["message"]["content"] == MIXED.text
    # logprobs asked for but absent: null, not an empty list
    assert completion_body(TOOLS, CREATED, logprobs=True)["choices"][0]["logprobs"] is None


def test_stream_wire_format() -> None:
    events = list(stream_chunks(MIXED, CREATED, logprobs=True, include_usage=True, chunk_chars=4))
    assert all(e.startswith(b"data: ") and e.endswith(b"\n\n") for e in events)
    assert all(e.count(b"\n") == 2 for e in events)  # one data line per event
    assert events[-1] == b"data: [DONE]\n\n"
    objs = [json.loads(e[len(b"data: ") :]) for e in events[:-1]]
    assert len({o["id"] for o in objs}) == 1 and objs[0]["id"] == "chatcmpl-mixed"
    assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["total_tokens"] == 17
    # as OpenAI does: with include_usage every other chunk carries an explicit null usage
    assert all("usage" in o and o["usage"] is None for o in objs[:-1])
    plain = [
        json.loads(e[len(b"data: ") :])
        for e in stream_chunks(MIXED, CREATED, logprobs=False, include_usage=False)
        if e.startswith(b"data: {")
    ]
    assert all("usage" not in o and len(o["choices"]) == 1 for o in plain)
    assert all(o["choices"][0]["logprobs"] is None for o in plain)
    first_call = next(o for o in objs if o["choices"] and "tool_calls" in o["choices"][0]["delta"])
    assert first_call["choices"][0]["delta"]["tool_calls"] == [
        {
            "index": 0,
            "id": "call_c",
            "type": "function",
            "function": {"name": "ls", "arguments": ""},
        }
    ]
    # tool-call markup tokens ride on the final chunk
    final = objs[-2]["choices"][0]
    assert [t["token"] for t in final["logprobs"]["content"]] == ["\n", "<tool_call>", "{", "}"]
    with pytest.raises(ValueError):
        next(stream_chunks(TEXT, CREATED, logprobs=False, include_usage=False, chunk_chars=0))


def _content_deltas(c: Completion, *, logprobs: bool, chunk_chars: int) -> list[str]:
    out = []
    for e in stream_chunks(
        c, CREATED, logprobs=logprobs, include_usage=False, chunk_chars=chunk_chars
    ):
        if e.startswith(b"data: {"):
            content = json.loads(e[len(b"data: ") :])["choices"][0]["delta"].get("content")
            if content:
                out.append(content)
    return out


def test_stream_chunking() -> None:
    # without logprobs: fixed-size character slices
    assert _content_deltas(TEXT, logprobs=False, chunk_chars=1) == list(TEXT.text)
    assert _content_deltas(TEXT, logprobs=False, chunk_chars=10) == [
        TEXT.text[i : i + 10] for i in range(0, len(TEXT.text), 10)
    ]
    # with logprobs: whole tokens, grouped until a delta reaches chunk_chars
    assert _content_deltas(TEXT, logprobs=True, chunk_chars=1) == _TEXT_TOKENS
    assert _content_deltas(TEXT, logprobs=True, chunk_chars=10) == [
        "Hello, wörld",
        "! 你好 🌍 — done.",
    ]


def test_stream_logprobs_when_tokens_do_not_spell_the_text() -> None:
    c = Completion(
        id="odd",
        model=MODEL,
        text="Hello world",
        tool_calls=(),
        stop_reason="end_turn",
        input_tokens=1,
        output_tokens=3,
        logprobs=(
            TokenLogprob("<think>", -0.5),
            TokenLogprob("Hello", -1.0),
            TokenLogprob(" world", -2.0),
        ),
    )
    objs = [
        json.loads(e[len(b"data: ") :])
        for e in stream_chunks(c, CREATED, logprobs=True, include_usage=False, chunk_chars=3)
        if e != b"data: [DONE]\n\n"
    ]
    text = "".join(o["choices"][0]["delta"].get("content") or "" for o in objs)
    tokens = [
        t["token"]
        for o in objs
        if o["choices"][0]["logprobs"]
        for t in o["choices"][0]["logprobs"]["content"]
    ]
    assert text == "Hello world"
    assert tokens == ["<think>", "Hello", " world"]


def test_error_rendering() -> None:
    over = ApiError("overloaded_error", "Busy.", retry_after_s=0.2)
    assert error_status(over) == 503
    assert error_headers(over) == {"retry-after": "1", "retry-after-ms": "200"}
    assert error_body(over)["error"]["type"] == "server_error"
    assert error_headers(ApiError("api_error", "x")) == {}
    bad = ApiError("invalid_request_error", "Bad.", param="messages[0].content")
    assert error_body(bad) == {
        "error": {
            "message": "Bad.",
            "type": "invalid_request_error",
            "param": "messages[0].content",
            "code": None,
        }
    }
    assert error_status(bad) == 400
    assert error_status(ApiError("request_too_large", "big")) == 413
    rl = error_body(ApiError("rate_limit_error", "slow"))["error"]
    assert rl["code"] == "rate_limit_exceeded"
    ctx = context_length_exceeded(10, 5)
    assert ctx.code == "context_length_exceeded" and error_status(ctx) == 400


def test_models_body() -> None:
    assert models_body(["a", "b"], 5) == {
        "object": "list",
        "data": [
            {"id": "a", "object": "model", "created": 5, "owned_by": "qwengyre"},
            {"id": "b", "object": "model", "created": 5, "owned_by": "qwengyre"},
        ],
    }


# ---------------------------------------------------------------------------------------
# Bounds on what is parsed, lossless answers (each test failed before its fix)
# ---------------------------------------------------------------------------------------


def test_lone_surrogates_are_replaced_as_the_anthropic_adapter_does() -> None:
    # They used to reach the tokenizer, which raised (a 500 after authentication).
    arguments = json.dumps({"s": "x\ud800"})  # a "\ud800" escape inside the string
    raw = (
        b'{"model":"m","messages":[{"role":"user","content":"a\\ud83d|\\ud83c\\udf89"},'
        b'{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function",'
        b'"function":{"name":"f","arguments":' + json.dumps(arguments).encode() + b"}}]}]}"
    )
    req = parse_chat_request(raw, {})
    assert req.messages[0].content == "a\ufffd|🎉"
    assert req.messages[1].tool_calls[0].arguments == {"s": "x\ufffd"}


def test_deep_json_is_a_400_naming_the_limit() -> None:
    deep = b'{"model":"m","messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(ApiError, match="nesting exceeds the limit of 64 levels"):
        parse_chat_request(deep, {})
    arguments = "[" * 70 + "]" * 70
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    with pytest.raises(ApiError, match="64 levels") as info:
        parse(body_with(messages=[*USER, {"role": "assistant", "tool_calls": [call]}]))
    assert info.value.param == "messages[1].tool_calls[0].function.arguments"


@pytest.mark.parametrize("number", [b"1e999", b"-1e999"])
def test_numbers_that_overflow_are_refused(number: bytes) -> None:
    # json.loads reads them as inf, which used to be written back as "Infinity".
    raw = b'{"model":"m","messages":[{"role":"user","content":"x"}],"stop":[' + number + b"]}"
    with pytest.raises(ApiError, match="out of range"):
        parse_chat_request(raw, {})


def test_a_forwarded_header_that_is_not_utf8_is_refused() -> None:
    with pytest.raises(ApiError, match="'x-agent-id' is not valid UTF-8"):
        parse(body_with(), {"x-agent-id": "a\udcff"})
    parse(body_with(), {"user-agent": "a\udcff"})  # not forwarded: ignored


def test_a_lone_surrogate_in_a_reply_streams_losslessly() -> None:
    call = ToolCall("call_1", "f", {"s": "a\ud800b"})
    c = Completion(
        id="u",
        model=MODEL,
        text="hé",
        tool_calls=(call,),
        stop_reason="tool_use",
        input_tokens=1,
        output_tokens=1,
    )
    arguments = ""
    for chunk in stream_chunks(c, CREATED, logprobs=False, include_usage=False, chunk_chars=3):
        data = chunk.decode("utf-8").removeprefix("data: ").removesuffix("\n\n")
        if data != "[DONE]":
            for tc in json.loads(data)["choices"][0]["delta"].get("tool_calls", ()):
                arguments += tc["function"]["arguments"]
    assert json.loads(arguments) == call.arguments
