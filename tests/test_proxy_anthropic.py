"""The Anthropic Messages API adapter, checked against the real ``anthropic`` SDK.

The SDK talks to an in-process handler (``httpx2.MockTransport``) that parses each
request with :mod:`qwengyre.proxy.anthropic_api` and answers with its body / SSE functions,
so the wire format is whatever the SDK accepts, not what we think it is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import anthropic
import httpx2
import pytest

from qwengyre.proxy.anthropic_api import (
    count_tokens_body,
    error_body,
    error_headers,
    message_body,
    new_message_id,
    new_tool_use_id,
    parse_count_tokens_request,
    parse_messages_request,
    prompt_too_long,
    stream_error_event,
    stream_events,
)
from qwengyre.proxy.types import (
    ApiError,
    ChatRequest,
    Completion,
    Message,
    SamplingParams,
    ToolCall,
    ToolSpec,
)

# --------------------------------------------------------------------------------------
# a fake server around the adapter


@dataclass
class FakeServer:
    """Answers /v1/messages and /v1/messages/count_tokens with the adapter's functions."""

    completion: Completion | None = None
    error: ApiError | None = None  # answered instead of the completion
    stream_error: ApiError | None = None  # sent after message_start in a stream
    chunk_chars: int = 64
    input_tokens: int = 0  # for count_tokens
    requests: list[ChatRequest] = field(default_factory=list)
    raw_bodies: list[bytes] = field(default_factory=list)

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        body = request.read()
        self.raw_bodies.append(body)
        headers = dict(request.headers.items())
        try:
            if request.url.path == "/v1/messages/count_tokens":
                req = parse_count_tokens_request(body, headers)
                self.requests.append(req)
                return httpx2.Response(200, json=count_tokens_body(self.input_tokens))
            assert request.url.path == "/v1/messages", request.url.path
            req = parse_messages_request(body, headers)
            self.requests.append(req)
            if self.error is not None:
                raise self.error
        except ApiError as e:
            return httpx2.Response(e.status, json=error_body(e), headers=error_headers(e))
        assert self.completion is not None
        if not req.stream:
            return httpx2.Response(200, json=message_body(self.completion))
        return httpx2.Response(
            200,
            headers={"content-type": "text/event-stream"},
            content=self._events(self.completion),
        )

    def _events(self, c: Completion) -> Iterator[bytes]:
        events = stream_events(c, chunk_chars=self.chunk_chars)
        yield next(events)  # message_start
        if self.stream_error is not None:
            yield stream_error_event(self.stream_error)
            return
        yield from events

    def client(self, **kwargs: Any) -> anthropic.Anthropic:
        return anthropic.Anthropic(
            api_key="k",
            base_url="http://proxy.test",
            http_client=httpx2.Client(transport=httpx2.MockTransport(self.handle)),
            max_retries=0,
            **kwargs,
        )


def completion(
    text: str = "Hello there.",
    tool_calls: tuple[ToolCall, ...] = (),
    stop_reason: Any = "end_turn",
    **kw: Any,
) -> Completion:
    args: dict[str, Any] = {
        "id": "msg_0123456789abcdefghijABCD",
        "model": "qwen-policy",
        "text": text,
        "tool_calls": tool_calls,
        "stop_reason": stop_reason,
        "input_tokens": 321,
        "output_tokens": 17,
    }
    args.update(kw)
    return Completion(**args)


BASH_CALL = ToolCall(
    id="toolu_01AbCdEfGhIjKlMnOpQrStUv",
    name="Bash",
    arguments={"command": 'echo "héllo → 世界" > out.txt', "timeout": 30, "opts": {"a": [1, None]}},
)
READ_CALL = ToolCall(id="toolu_02AbCdEfGhIjKlMnOpQrStUv", name="Read", arguments={})
BASH_TOOL = {
    "name": "Bash",
    "description": "Run a shell command.",
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
    },
}
USER = [{"role": "user", "content": "Say hi."}]


# --------------------------------------------------------------------------------------
# the SDK against the adapter: non-streaming


def test_sdk_create_text() -> None:
    server = FakeServer(completion=completion())
    msg = server.client().messages.create(
        model="qwen-policy",
        max_tokens=100,
        system="Be brief.",
        messages=USER,
        stop_sequences=["STOP"],
        # SDK 2.x dropped temperature/top_p/top_k from create(); clients still send them
        extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 20},
        extra_headers={"X-Claude-Code-Agent-Id": "agent-7"},
    )
    (req,) = server.requests
    assert req.api == "anthropic"
    assert req.model == "qwen-policy"
    assert req.stream is False
    assert req.messages == (
        Message(role="system", content="Be brief."),
        Message(role="user", content="Say hi."),
    )
    assert req.sampling == SamplingParams(
        max_tokens=100, temperature=0.5, top_p=0.9, top_k=20, stop=("STOP",)
    )
    assert req.headers["x-claude-code-agent-id"] == "agent-7"
    # whatever version the SDK pins (2.14 sends 2026-10-21, not 2023-06-01)
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", req.headers["anthropic-version"])
    assert all(k.startswith(("x-claude-code-", "anthropic-")) for k in req.headers)
    assert "k" not in req.headers.values()  # the api key is never copied

    assert isinstance(msg, anthropic.types.Message)
    assert msg.id == "msg_0123456789abcdefghijABCD"
    assert msg.model == "qwen-policy"
    assert msg.role == "assistant"
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].type == "text" and msg.content[0].text == "Hello there."
    assert msg.stop_reason == "end_turn"
    assert msg.stop_sequence is None
    assert msg.usage.input_tokens == 321
    assert msg.usage.output_tokens == 17
    assert msg.usage.cache_read_input_tokens == 0
    assert msg.usage.cache_creation_input_tokens == 0


def test_sdk_create_tool_use() -> None:
    server = FakeServer(completion=completion("Let me run it.", (BASH_CALL, READ_CALL), "tool_use"))
    msg = server.client().messages.create(
        model="qwen-policy", max_tokens=100, messages=USER, tools=[BASH_TOOL]
    )
    (req,) = server.requests
    assert req.tools == (
        ToolSpec(
            name="Bash", description="Run a shell command.", parameters=BASH_TOOL["input_schema"]
        ),
    )
    assert [b.type for b in msg.content] == ["text", "tool_use", "tool_use"]
    text, bash, read = msg.content
    assert text.type == "text" and text.text == "Let me run it."
    assert bash.type == "tool_use" and read.type == "tool_use"
    assert (bash.id, bash.name, bash.input) == (BASH_CALL.id, "Bash", BASH_CALL.arguments)
    assert (read.id, read.name, read.input) == (READ_CALL.id, "Read", {})
    assert msg.stop_reason == "tool_use"


def test_stop_sequence_round_trips() -> None:
    server = FakeServer(
        completion=completion("abc", stop_reason="stop_sequence", stop_sequence="X")
    )
    msg = server.client().messages.create(
        model="m", max_tokens=5, messages=USER, stop_sequences=["X"]
    )
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", "X")


# --------------------------------------------------------------------------------------
# the SDK against the adapter: streaming

STREAM_CASES = {
    "text": completion("Hello, wörld! 🎉 " * 5),
    "tool_use": completion("Running: 日本語 ✓", (BASH_CALL, READ_CALL), "tool_use"),
    "tool_only": completion("", (BASH_CALL,), "tool_use"),
    "empty": completion("", output_tokens=1),
    "max_tokens": completion("cut off mid", stop_reason="max_tokens"),
}


@pytest.mark.parametrize("chunk_chars", [1, 7, 64])
@pytest.mark.parametrize("case", sorted(STREAM_CASES))
def test_stream_final_message_equals_non_streaming(case: str, chunk_chars: int) -> None:
    c = STREAM_CASES[case]
    server = FakeServer(completion=c, chunk_chars=chunk_chars)
    client = server.client()
    plain = client.messages.create(model="m", max_tokens=50, messages=USER, tools=[BASH_TOOL])
    with client.messages.stream(
        model="m", max_tokens=50, messages=USER, tools=[BASH_TOOL]
    ) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert [r.stream for r in server.requests] == [False, True]
    assert streamed_text == c.text
    assert final.model_dump() == plain.model_dump()
    # and both are what the Completion said
    tool_inputs = [b.input for b in final.content if b.type == "tool_use"]
    assert tool_inputs == [t.arguments for t in c.tool_calls]
    assert final.usage.input_tokens == c.input_tokens
    assert final.usage.output_tokens == c.output_tokens
    assert final.stop_reason == c.stop_reason


def test_raw_stream_event_order() -> None:
    c = completion("abcdef", (BASH_CALL,), "tool_use")
    server = FakeServer(completion=c, chunk_chars=4)
    events = list(
        server.client().messages.create(model="m", max_tokens=50, messages=USER, stream=True)
    )
    n_json = -(
        -len(json.dumps(BASH_CALL.arguments, ensure_ascii=False, separators=(",", ":"))) // 4
    )
    assert [e.type for e in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        *["content_block_delta"] * n_json,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0]
    assert start.type == "message_start"
    assert start.message.content == []
    assert start.message.stop_reason is None
    assert (start.message.usage.input_tokens, start.message.usage.output_tokens) == (321, 1)
    indices = [e.index for e in events if e.type.startswith("content_block")]
    assert indices == [0] * 4 + [1] * (n_json + 2)
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert [d.type for d in deltas[:2]] == ["text_delta", "text_delta"]
    assert "".join(d.text for d in deltas[:2] if d.type == "text_delta") == "abcdef"
    partial = "".join(d.partial_json for d in deltas[2:] if d.type == "input_json_delta")
    assert json.loads(partial) == BASH_CALL.arguments
    tool_start = events[5]
    assert tool_start.type == "content_block_start"
    assert tool_start.content_block.type == "tool_use"
    assert tool_start.content_block.input == {}
    assert tool_start.content_block.id == BASH_CALL.id
    end = events[-2]
    assert end.type == "message_delta"
    assert end.delta.stop_reason == "tool_use"
    assert end.usage.output_tokens == 17


def test_sse_bytes_format() -> None:
    c = completion('a\nb "q" é🎉', (BASH_CALL,), "tool_use")
    raw = b"".join(stream_events(c, chunk_chars=3))
    assert raw.endswith(b"\n\n")
    frames = raw.decode("utf-8").split("\n\n")[:-1]
    names = []
    for frame in frames:
        m = re.fullmatch(r"event: (\w+)\ndata: (.+)", frame)
        assert m is not None, frame
        name, payload = m.groups()
        data = json.loads(payload)
        assert data["type"] == name
        assert payload == json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        names.append(name)
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    assert names.count("ping") == 1
    assert "é🎉".encode() in b"".join(stream_events(c))  # UTF-8, not \u escapes
    assert b"\\u00e9" not in raw


def test_stream_events_rejects_bad_chunk_size() -> None:
    with pytest.raises(ValueError, match="chunk_chars"):
        list(stream_events(completion(), chunk_chars=0))


def test_stream_error_event_raises_in_sdk() -> None:
    server = FakeServer(
        completion=completion(),
        stream_error=ApiError("overloaded_error", "Overloaded"),
    )
    with (
        pytest.raises(anthropic.APIStatusError) as info,
        server.client().messages.stream(model="m", max_tokens=5, messages=USER) as stream,
    ):
        stream.get_final_message()
    assert info.value.body == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "Overloaded"},
    }
    assert stream_error_event(ApiError("api_error", "boom")) == (
        b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"boom"}}\n\n'
    )


# --------------------------------------------------------------------------------------
# errors through the SDK


@pytest.mark.parametrize(
    ("error", "exc_type", "headers"),
    [
        (ApiError("invalid_request_error", "bad thing"), anthropic.BadRequestError, {}),
        (ApiError("authentication_error", "invalid x-api-key"), anthropic.AuthenticationError, {}),
        (ApiError("not_found_error", "no such model"), anthropic.NotFoundError, {}),
        (
            ApiError("rate_limit_error", "slow down", retry_after_s=2.2),
            anthropic.RateLimitError,
            {"retry-after": "3", "x-should-retry": "true"},
        ),
        (
            ApiError("api_error", "internal"),
            anthropic.InternalServerError,
            {"x-should-retry": "true"},
        ),
        (
            ApiError("overloaded_error", "Overloaded"),
            anthropic.InternalServerError,
            {"x-should-retry": "true"},
        ),
    ],
)
def test_errors_surface_as_sdk_exceptions(
    error: ApiError, exc_type: type[anthropic.APIStatusError], headers: dict[str, str]
) -> None:
    server = FakeServer(completion=completion(), error=error)
    with pytest.raises(exc_type) as info:
        server.client().messages.create(model="m", max_tokens=5, messages=USER)
    exc = info.value
    assert exc.status_code == error.status
    assert exc.api_message == error.message
    assert exc.type == error.kind
    assert error.message in exc.message
    for name, value in headers.items():
        assert exc.response.headers[name] == value
    if "retry-after" not in headers:
        assert "retry-after" not in exc.response.headers
    if error.kind == "overloaded_error":
        assert isinstance(exc, anthropic.OverloadedError)
        assert exc.status_code == 529


def test_parser_errors_surface_as_bad_request() -> None:
    server = FakeServer(completion=completion())
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iV"}}
    with pytest.raises(anthropic.BadRequestError) as info:
        server.client().messages.create(
            model="m",
            max_tokens=5,
            messages=[{"role": "user", "content": [{"type": "text", "text": "look"}, image]}],
        )
    assert info.value.api_message is not None
    assert info.value.api_message.startswith("messages.0.content.1.type: 'image' is not supported")
    assert "images are not supported" in info.value.api_message
    assert server.requests == []


def test_error_headers_and_body() -> None:
    assert error_body(ApiError("permission_error", "nope")) == {
        "type": "error",
        "error": {"type": "permission_error", "message": "nope"},
    }
    assert error_headers(ApiError("invalid_request_error", "x")) == {}
    assert error_headers(ApiError("invalid_request_error", "x", retry_after_s=0.1)) == {
        "retry-after": "1"
    }
    assert error_headers(ApiError("overloaded_error", "x", retry_after_s=5)) == {
        "retry-after": "5",
        "x-should-retry": "true",
    }
    assert error_headers(ApiError("authentication_error", "x")) == {}


def test_prompt_too_long_message() -> None:
    e = prompt_too_long(210_345, 200_000)
    assert e.kind == "invalid_request_error"
    assert e.status == 400
    assert e.message == "prompt is too long: 210345 tokens > 200000 maximum"


# --------------------------------------------------------------------------------------
# count_tokens


def test_sdk_count_tokens() -> None:
    server = FakeServer(input_tokens=4242)
    result = server.client().messages.count_tokens(
        model="qwen-policy", system="sys", messages=USER, tools=[BASH_TOOL]
    )
    assert result.input_tokens == 4242
    (req,) = server.requests
    assert req.sampling.max_tokens == 1
    assert req.messages == (
        Message(role="system", content="sys"),
        Message(role="user", content="Say hi."),
    )
    assert [t.name for t in req.tools] == ["Bash"]
    assert count_tokens_body(7) == {"input_tokens": 7}


def test_count_tokens_validates_like_messages() -> None:
    body = {"model": "m", "messages": USER, "max_tokens": 9}
    assert parse_count_tokens_request(json.dumps(body).encode(), {}).sampling.max_tokens == 9
    with pytest.raises(ApiError, match=r"^max_tokens: Input should be greater than or equal to 1"):
        parse_count_tokens_request(json.dumps({**body, "max_tokens": 0}).encode(), {})
    with pytest.raises(ApiError, match=r"^model: Field required"):
        parse_count_tokens_request(json.dumps({"messages": USER}).encode(), {})


# --------------------------------------------------------------------------------------
# parsing what Claude Code sends


def claude_code_body() -> dict[str, Any]:
    cc = {"type": "ephemeral"}
    return {
        "model": "claude-sonnet-4-5",
        "max_tokens": 32000,
        "stream": True,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197;"},
            {"type": "text", "text": "You are Claude Code.", "cache_control": cc},
            {"type": "text", "text": "Be careful.", "cache_control": cc},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                    {"type": "text", "text": "Create out.txt", "cache_control": cc},
                ],
            },
            {"role": "system", "content": "Available agents: general-purpose"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                    {"type": "text", "text": "I'll create it."},
                    {
                        "type": "tool_use",
                        "id": "toolu_A",
                        "name": "Bash",
                        "input": {"command": "touch out.txt"},
                    },
                    {"type": "tool_use", "id": "toolu_B", "name": "Read", "input": {"p": "x"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_A",
                        "content": [{"type": "text", "text": "(no output)"}],
                    },
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_B",
                        "content": "<tool_use_error>no such file</tool_use_error>",
                        "is_error": True,
                        "cache_control": cc,
                    },
                ],
            },
        ],
        "tools": [
            {**BASH_TOOL, "cache_control": cc},
            {"name": "Read", "description": "Read a file.", "input_schema": {"type": "object"}},
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
        ],
        "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "s"})},
        "thinking": {"type": "enabled", "budget_tokens": 31999},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "service_tier": "auto",
        "temperature": 1,
    }


def test_parse_claude_code_body() -> None:
    headers = {
        "X-Api-Key": "secret-key",
        "Authorization": "Bearer secret",
        "Anthropic-Api-Key": "secret-too",  # credential-looking names are never copied
        "x-claude-code-auth-token": "secret-three",
        "Anthropic-Version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
        "X-Claude-Code-Session-Id": "sess-1",
        "x-claude-code-agent-id": "agent-9",
        "User-Agent": "claude-cli/2.1.197",
    }
    req = parse_messages_request(json.dumps(claude_code_body()).encode(), headers)
    assert req.model == "claude-sonnet-4-5"
    assert req.stream is True
    assert req.sampling == SamplingParams(max_tokens=32000, temperature=1.0)
    assert req.messages == (
        Message(
            role="system",
            content="x-anthropic-billing-header: cc_version=2.1.197;\n\n"
            "You are Claude Code.\n\nBe careful.",
        ),
        Message(role="user", content="<system-reminder>ctx</system-reminder>\n\nCreate out.txt"),
        Message(role="system", content="Available agents: general-purpose"),
        Message(
            role="assistant",
            content="I'll create it.",
            tool_calls=(
                ToolCall(id="toolu_A", name="Bash", arguments={"command": "touch out.txt"}),
                ToolCall(id="toolu_B", name="Read", arguments={"p": "x"}),
            ),
        ),
        Message(role="tool", content="(no output)", tool_call_id="toolu_A"),
        Message(
            role="tool",
            content="<tool_use_error>no such file</tool_use_error>",
            tool_call_id="toolu_B",
        ),
    )
    assert req.tools == (
        ToolSpec("Bash", "Run a shell command.", BASH_TOOL["input_schema"]),
        ToolSpec("Read", "Read a file.", {"type": "object"}),
    )
    assert req.headers == {
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
        "x-claude-code-session-id": "sess-1",
        "x-claude-code-agent-id": "agent-9",
    }
    # the templates' view of it
    assert req.messages[3].to_template()["tool_calls"][0]["function"]["name"] == "Bash"


def test_tool_results_then_user_text() -> None:
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "first"},
                    {"type": "tool_result", "tool_use_id": "t1"},
                    {"type": "tool_result", "tool_use_id": "t2", "content": []},
                    {"type": "text", "text": "second"},
                ],
            },
            {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]},
            {"role": "user", "content": []},
        ],
    }
    req = parse_messages_request(json.dumps(body).encode(), {})
    assert req.messages == (
        Message(role="tool", content="", tool_call_id="t1"),
        Message(role="tool", content="", tool_call_id="t2"),
        Message(role="user", content="first\n\nsecond"),
        Message(role="assistant", content=""),
        Message(role="user", content=""),
    )


def test_sampling_defaults_and_ranges() -> None:
    base = {"model": "m", "max_tokens": 7, "messages": USER}
    req = parse_messages_request(json.dumps(base).encode(), {})
    assert req.sampling == SamplingParams(max_tokens=7)
    assert req.stream is False
    req = parse_messages_request(
        json.dumps({**base, "temperature": 1.5, "top_k": 0, "stream": False}).encode(), {}
    )
    assert (req.sampling.temperature, req.sampling.top_k) == (1.5, -1)
    nulls = {**base, "temperature": None, "top_p": None, "system": None, "tools": None}
    assert parse_messages_request(json.dumps(nulls).encode(), {}).sampling == SamplingParams(
        max_tokens=7
    )


@pytest.mark.parametrize(
    ("block", "where"),
    [
        ({"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}, "images"),
        ({"type": "document", "source": {"type": "text", "data": "x"}}, "documents"),
    ],
)
def test_images_and_documents_refused(block: dict[str, Any], where: str) -> None:
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [block]}]}
    with pytest.raises(ApiError) as info:
        parse_messages_request(json.dumps(body).encode(), {})
    assert info.value.kind == "invalid_request_error"
    assert info.value.status == 400
    assert info.value.message.startswith(f"messages.0.content.0.type: '{block['type']}'")
    assert f"{where} are not supported" in info.value.message
    assert "allowed: text, tool_use, tool_result, thinking" in info.value.message


def test_image_inside_tool_result_refused() -> None:
    result = {
        "type": "tool_result",
        "tool_use_id": "t",
        "content": [{"type": "text", "text": "shot"}, {"type": "image", "source": {}}],
    }
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": [
            USER[0],
            {"role": "assistant", "content": "x"},
            {"role": "user", "content": [result]},
        ],
    }
    with pytest.raises(ApiError, match=r"^messages\.2\.content\.0\.content\.1\.type: 'image'"):
        parse_messages_request(json.dumps(body).encode(), {})


def _body(**over: Any) -> bytes:
    return json.dumps({"model": "m", "max_tokens": 5, "messages": USER, **over}).encode()


def _msgs(*content: Any, role: str = "user") -> bytes:
    return _body(messages=[{"role": role, "content": list(content)}])


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "The request body is not valid JSON"),
        (b"", "The request body is not valid JSON"),
        (b"\xff\xfe\x00", "The request body is not valid JSON"),
        (
            b'{"model": "m", "max_tokens": 5, "temperature": NaN, "messages": []}',
            "The request body is not valid JSON",
        ),
        (b"[1, 2]", "The request body should be a JSON object, not list"),
        (b'"hi"', "The request body should be a JSON object, not str"),
        (json.dumps({"model": "m", "messages": USER}).encode(), "max_tokens: Field required"),
        (_body(max_tokens="5"), "max_tokens: Input should be a valid integer"),
        (_body(max_tokens=2.5), "max_tokens: Input should be a valid integer"),
        (_body(max_tokens=0), "max_tokens: Input should be greater than or equal to 1"),
        (_body(model=3), "model: Input should be a valid string"),
        (_body(messages={"role": "user"}), "messages: Input should be a valid list"),
        (_body(messages=[]), "messages: List should have at least 1 item"),
        (_body(messages=["hi"]), "messages.0: Input should be a valid dictionary"),
        (_body(messages=[{"role": "user"}]), "messages.0.content: Field required"),
        (
            _body(messages=[{"role": "bot", "content": "x"}]),
            "messages.0.role: Input should be 'user', 'assistant' or 'system'",
        ),
        (
            _body(messages=[{"role": "user", "content": 5}]),
            "messages.0.content: Input should be a valid string or a list of content blocks",
        ),
        (_msgs("text"), "messages.0.content.0: Input should be an object"),
        (_msgs({"text": "x"}), "messages.0.content.0.type: Field required"),
        (_msgs({"type": "text"}), "messages.0.content.0.text: Field required"),
        (
            _msgs({"type": "text", "text": 1}),
            "messages.0.content.0.text: Input should be a valid string",
        ),
        (
            _msgs({"type": "audio"}),
            "messages.0.content.0.type: 'audio' is not supported; "
            "allowed: text, tool_use, tool_result, thinking, redacted_thinking",
        ),
        (
            _msgs({"type": "tool_result", "tool_use_id": "t"}, role="assistant"),
            "messages.0.content.0.type: 'tool_result' blocks are not allowed in assistant messages",
        ),
        (
            _msgs({"type": "tool_use", "id": "t", "name": "x", "input": {}}),
            "messages.0.content.0.type: 'tool_use' blocks are not allowed in user messages",
        ),
        (
            _msgs({"type": "tool_use", "id": "t", "name": "x", "input": "{}"}, role="assistant"),
            "messages.0.content.0.input: Input should be a valid dictionary",
        ),
        (_msgs({"type": "tool_result"}), "messages.0.content.0.tool_use_id: Field required"),
        (
            _msgs({"type": "tool_result", "tool_use_id": "t", "content": 3}),
            "messages.0.content.0.content: Input should be a valid string or a list of text blocks",
        ),
        (
            _msgs({"type": "tool_result", "tool_use_id": "t", "is_error": "yes"}),
            "messages.0.content.0.is_error: Input should be a valid boolean",
        ),
        (_body(system=5), "system: Input should be a valid string or a list of text blocks"),
        (
            _body(system=[{"type": "image"}]),
            "system.0.type: 'image' is not supported (images are not supported); allowed: text",
        ),
        (_body(temperature=2.5), "temperature: Input should be less than or equal to 2"),
        (_body(temperature="hot"), "temperature: Input should be a valid number"),
        (_body(top_p=0), "top_p: Input should be greater than 0"),
        (_body(top_k=-1), "top_k: Input should be greater than or equal to 0"),
        (_body(stop_sequences="STOP"), "stop_sequences: Input should be a valid list"),
        (_body(stream="yes"), "stream: Input should be a valid boolean"),
        (_body(tools={"name": "x"}), "tools: Input should be a valid list"),
        (_body(tools=[{"name": "x"}]), "tools.0.input_schema: Field required"),
        (_body(tools=[{"input_schema": {}}]), "tools.0.name: Field required"),
        (
            _body(tools=[{"name": "x", "input_schema": "object"}]),
            "tools.0.input_schema: Input should be a valid dictionary",
        ),
        (
            _body(tools=[BASH_TOOL, {"type": "custom", **BASH_TOOL}]),
            "tools.1.name: tool names must be unique ('Bash' repeated)",
        ),
    ],
)
def test_invalid_requests_name_the_field(body: bytes, message: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_messages_request(body, {})
    assert info.value.kind == "invalid_request_error"
    assert info.value.status == 400
    assert info.value.message.startswith(message), info.value.message


def test_server_tools_skipped() -> None:
    tools = [
        {"type": "web_search_20250305", "name": "web_search"},
        {"type": "bash_20250124", "name": "bash"},
        {"type": "custom", **BASH_TOOL},
    ]
    req = parse_messages_request(_body(tools=tools), {})
    assert [t.name for t in req.tools] == ["Bash"]


def test_unicode_survives() -> None:
    text = 'héllo 世界 🎉 e\u0301 \u2028 \x00 "quoted" \\back'
    body = {
        "model": "m",
        "max_tokens": 5,
        "system": text,
        "messages": [
            {"role": "user", "content": text},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t", "name": "w", "input": {"s": text}}],
            },
        ],
    }
    for ensure_ascii in (True, False):
        raw = json.dumps(body, ensure_ascii=ensure_ascii).encode()
        req = parse_messages_request(raw, {})
        assert req.messages[0].content == text
        assert req.messages[1].content == text
        assert req.messages[2].tool_calls[0].arguments == {"s": text}
    # a lone surrogate (a client cut a string mid-emoji) becomes U+FFFD; pairs survive
    raw = (
        b'{"model":"m","max_tokens":5,"messages":'
        b'[{"role":"user","content":"a\\ud83d|\\ud83c\\udf89"}]}'
    )
    req = parse_messages_request(raw, {})
    assert req.messages[0].content == "a\ufffd|🎉"
    req.messages[0].content.encode("utf-8")


def test_unicode_survives_the_sdk_round_trip() -> None:
    text = "Grüße 🎉 — 日本語 \u2028 e\u0301"
    call = ToolCall(id="toolu_x", name="Write", arguments={"content": text})
    server = FakeServer(completion=completion(text, (call,), "tool_use"), chunk_chars=2)
    with server.client().messages.stream(
        model="m", max_tokens=5, messages=[{"role": "user", "content": text}]
    ) as stream:
        final = stream.get_final_message()
    assert server.requests[0].messages == (Message(role="user", content=text),)
    assert final.content[0].type == "text" and final.content[0].text == text
    assert final.content[1].type == "tool_use" and final.content[1].input == {"content": text}


# --------------------------------------------------------------------------------------
# response bodies and ids


def test_message_body_shapes() -> None:
    body = message_body(completion("", output_tokens=0))
    assert body["content"] == [{"type": "text", "text": ""}]
    body = message_body(completion("", (READ_CALL,), "tool_use"))
    assert body["content"] == [
        {"type": "tool_use", "id": READ_CALL.id, "name": "Read", "input": {}}
    ]
    body = message_body(completion("hi"))
    assert set(body) == {
        "id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"
    }  # fmt: skip
    assert body["usage"] == {
        "input_tokens": 321,
        "output_tokens": 17,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }
    # the id is always msg_-prefixed and stable for one Completion
    other = completion(id="cmpl-42")
    assert message_body(other)["id"] == message_body(other)["id"] == "msg_cmpl-42"
    assert re.fullmatch(r"msg_[0-9A-Za-z]{24}", message_body(completion(id=""))["id"])


def test_generated_ids() -> None:
    ids = [new_message_id() for _ in range(50)]
    assert all(re.fullmatch(r"msg_[0-9A-Za-z]{24}", i) for i in ids)
    assert len(set(ids)) == 50
    tool_ids = [new_tool_use_id() for _ in range(50)]
    assert all(re.fullmatch(r"toolu_[0-9A-Za-z]{24}", i) for i in tool_ids)
    assert len(set(tool_ids)) == 50
    # a tool call without an id gets a fresh toolu_ id
    nameless = ToolCall(id="", name="Read", arguments={})
    block = message_body(completion("", (nameless,), "tool_use"))["content"][0]
    assert re.fullmatch(r"toolu_[0-9A-Za-z]{24}", block["id"])


def test_stream_and_body_agree_on_raw_events() -> None:
    """Folding the raw SSE events by hand gives the non-streaming body (no SDK involved)."""
    c = completion("Some text, then tools.", (BASH_CALL, READ_CALL), "tool_use")
    msg: dict[str, Any] = {}
    json_bufs: dict[int, str] = {}
    for raw in stream_events(c, chunk_chars=5):
        name, payload = raw.decode().removesuffix("\n\n").split("\n", 1)
        event = json.loads(payload.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        if event["type"] == "message_start":
            msg = event["message"]
        elif event["type"] == "content_block_start":
            assert event["index"] == len(msg["content"])
            msg["content"].append(event["content_block"])
        elif event["type"] == "content_block_delta":
            delta = event["delta"]
            if delta["type"] == "text_delta":
                msg["content"][event["index"]]["text"] += delta["text"]
            else:
                json_bufs[event["index"]] = (
                    json_bufs.get(event["index"], "") + delta["partial_json"]
                )
        elif event["type"] == "content_block_stop":
            if event["index"] in json_bufs:
                msg["content"][event["index"]]["input"] = json.loads(json_bufs[event["index"]])
        elif event["type"] == "message_delta":
            msg.update(event["delta"])
            msg["usage"]["output_tokens"] = event["usage"]["output_tokens"]
    assert msg == message_body(c)


# --------------------------------------------------------------------------------------
# bounds on what is parsed, lossless answers (each test failed before its fix)


def _nested_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_deep_json_is_a_400_naming_the_limit_not_a_recursion_error() -> None:
    deep = b'{"model":"m","max_tokens":5,"messages":[' + b"[" * 100_000 + b"]" * 100_000 + b"]}"
    with pytest.raises(ApiError, match="nesting exceeds the limit of 64 levels") as err:
        parse_messages_request(deep, {})
    assert err.value.kind == "invalid_request_error"
    # A tool schema ~500 levels deep (it used to recurse through the chat template).
    tools = [{"name": "t", "input_schema": _nested_schema(250)}]
    with pytest.raises(ApiError, match="64 levels"):
        parse_count_tokens_request(_body(tools=tools), {})
    # 64 levels are fine: body, tools, tool, then 30 schema levels of 2 (object, properties)
    # and the innermost schema.
    fits = [{"name": "t", "input_schema": _nested_schema(30)}]
    assert (
        parse_messages_request(_body(tools=fits), {}).tools[0].parameters == fits[0]["input_schema"]
    )
    with pytest.raises(ApiError, match="64 levels"):
        parse_messages_request(_body(tools=[{"name": "t", "input_schema": _nested_schema(31)}]), {})


@pytest.mark.parametrize("number", [b"1e999", b"-1e999", b"Infinity", b"-Infinity", b"NaN"])
def test_non_finite_numbers_anywhere_are_refused(number: bytes) -> None:
    body = (
        b'{"model":"m","max_tokens":5,"messages":[{"role":"assistant","content":'
        b'[{"type":"tool_use","id":"t","name":"f","input":{"x":' + number + b"}}]}]}"
    )
    with pytest.raises(ApiError, match="The request body is not valid JSON"):
        parse_messages_request(body, {})


def test_a_selected_header_that_is_not_utf8_is_refused() -> None:
    # aiohttp hands non-UTF-8 header bytes over as lone surrogates (surrogateescape).
    with pytest.raises(ApiError, match="'x-claude-code-agent-id' is not valid UTF-8"):
        parse_messages_request(_body(), {"x-claude-code-agent-id": "a\udcff"})
    parse_messages_request(_body(), {"user-agent": "a\udcff"})  # not selected: ignored


def _events(raw: list[bytes]) -> list[dict[str, Any]]:
    """Each SSE event's data, decoded as strict UTF-8 JSON."""
    out = []
    for chunk in raw:
        data = chunk.decode("utf-8").removesuffix("\n\n").split("\n", 1)[1]
        out.append(json.loads(data.removeprefix("data: ")))
    return out


def test_a_lone_surrogate_in_a_reply_streams_losslessly() -> None:
    # A model's tool-call JSON can hold "\ud800" escapes: the events stay valid UTF-8
    # (they used to be encoded with 'replace', which turned the surrogate into '?').
    call = ToolCall(id="toolu_x", name="f", arguments={"s": "a\ud800b", "\udc00": "é"})
    events = _events(list(stream_events(completion("", (call,), "tool_use"), chunk_chars=3)))
    partial = "".join(
        e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"
    )
    assert json.loads(partial) == call.arguments
    # Without a surrogate the events stay raw UTF-8, as the API sends them.
    plain = b"".join(stream_events(completion("héllo"), chunk_chars=64))
    assert "héllo".encode() in plain
