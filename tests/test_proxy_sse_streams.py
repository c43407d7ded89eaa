"""Incremental SSE encoders: anthropic_api.MessageStream and openai_api.ChunkStream.

Text arrives in arbitrary pieces (empty ones too) with pings in between; the events
must fold into the non-streaming body, and the official SDKs must read them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anthropic
import httpx2
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qwengyre.proxy.anthropic_api import MessageStream, message_body
from qwengyre.proxy.openai_api import ChunkStream, completion_body, finish_reason
from qwengyre.proxy.types import Completion, TokenLogprob, ToolCall

MODEL = "qwen-policy"
CALL = ToolCall("toolu_01", "Bash", {"command": 'echo "héllo → 世界"', "n": [1, None]})
CALL2 = ToolCall("toolu_02", "Read", {})


def completion(text: str, calls: tuple[ToolCall, ...] = (), **kw: Any) -> Completion:
    stop = "tool_use" if calls else "end_turn"
    args: dict[str, Any] = {"stop_reason": stop, "input_tokens": 40, "output_tokens": 9}
    args.update(kw)
    return Completion(id="msg_abc", model=MODEL, text=text, tool_calls=calls, **args)


CASES = {
    "text": completion("Hello, wörld 🎉\nbye"),
    "text+tools": completion("Let me run it.", (CALL, CALL2)),
    "tools": completion("", (CALL,)),
    "empty": completion(""),
    "stop_sequence": completion("cut", stop_reason="stop_sequence", stop_sequence="END"),
    "length": completion("trunc", stop_reason="max_tokens"),
}


def pieces_of(text: str) -> list[str]:
    """``text`` in uneven pieces, with empty ones."""
    out, k, size = [""], 0, 1
    while k < len(text):
        out += [text[k : k + size], ""]
        k, size = k + size, size % 4 + 1
    return out


def sse_frames(raw: bytes) -> list[tuple[str | None, str]]:
    """(event name or None, data) per SSE frame; a comment gives ("", the comment)."""
    frames: list[tuple[str | None, str]] = []
    for frame in raw.decode().split("\n\n")[:-1]:
        if frame.startswith(":"):
            frames.append(("", frame))
            continue
        fields = dict(line.split(": ", 1) for line in frame.split("\n"))
        frames.append((fields.get("event"), fields["data"]))
    return frames


# ----------------------------------------------------------------------------- Anthropic


def anthropic_bytes(c: Completion) -> list[bytes]:
    events = MessageStream("msg_abc", MODEL, c.input_tokens, chunk_chars=5)
    out = [events.start(), events.ping()]
    for piece in pieces_of(c.text):
        out += [events.text(piece), events.ping()]
    return [*out, events.finish(c)]


@pytest.mark.parametrize("case", CASES)
def test_message_stream_folds_into_the_message_body(case: str) -> None:
    c = CASES[case]
    parts = anthropic_bytes(c)
    assert [name for name, _ in sse_frames(parts[0])] == ["message_start"]
    assert parts[2] == b""  # an empty piece opens no block
    frames = sse_frames(b"".join(parts))
    names = [name for name, _ in frames]
    first_block = names.index("content_block_start")
    assert names[first_block + 1] == "ping"  # as the API: a ping after the first block start
    msg: dict[str, Any] = {}
    partial: dict[int, str] = {}
    for name, data in frames:
        event = json.loads(data)
        assert event["type"] == name
        if name == "message_start":
            msg = event["message"]
            assert msg["usage"]["output_tokens"] == 1 and msg["stop_reason"] is None
        elif name == "content_block_start":
            assert event["index"] == len(msg["content"])
            msg["content"].append(event["content_block"])
        elif name == "content_block_delta":
            assert event["index"] == len(msg["content"]) - 1  # the open block
            delta = event["delta"]
            if delta["type"] == "text_delta":
                msg["content"][-1]["text"] += delta["text"]
            else:
                partial[event["index"]] = partial.get(event["index"], "") + delta["partial_json"]
        elif name == "content_block_stop":
            if event["index"] in partial:
                msg["content"][event["index"]]["input"] = json.loads(partial[event["index"]])
        elif name == "message_delta":
            msg.update(event["delta"])
            msg["usage"]["output_tokens"] = event["usage"]["output_tokens"]
    assert names[-2:] == ["message_delta", "message_stop"]
    assert msg == message_body(c)


def sdk_handler(body: Callable[[], list[bytes]]) -> Callable[[httpx2.Request], httpx2.Response]:
    def handle(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(
            200, headers={"content-type": "text/event-stream"}, content=iter(body())
        )

    return handle


@pytest.mark.parametrize("case", CASES)
def test_the_anthropic_sdk_reads_the_incremental_stream(case: str) -> None:
    c = CASES[case]
    client = anthropic.Anthropic(
        api_key="k",
        base_url="http://proxy.test",
        http_client=httpx2.Client(
            transport=httpx2.MockTransport(sdk_handler(lambda: anthropic_bytes(c)))
        ),
        max_retries=0,
    )
    with client.messages.stream(model=MODEL, max_tokens=9, messages=[]) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == c.text
    assert final.model_dump(exclude_none=True) == anthropic.types.Message.model_validate(
        message_body(c)
    ).model_dump(exclude_none=True)


def test_message_stream_rejects_bad_chunk_size() -> None:
    with pytest.raises(ValueError, match="chunk_chars"):
        MessageStream("m", MODEL, 1, chunk_chars=0)


# -------------------------------------------------------------------------------- OpenAI


def chunk_objects(raw: bytes) -> list[dict[str, Any]]:
    objs = [json.loads(data) for name, data in sse_frames(raw) if name is None and data != "[DONE]"]
    assert raw.endswith(b"data: [DONE]\n\n")
    return objs


def openai_stream(
    c: Completion, groups: list[tuple[str, list[TokenLogprob]]], *, logprobs: bool = True
) -> bytes:
    events = ChunkStream("chatcmpl-1", 7, MODEL, logprobs=logprobs, include_usage=True)
    out = [events.start(), events.ping()]
    for text, tokens in groups:
        out += [events.text(text, tokens), events.ping()]
    return b"".join([*out, events.finish(c)])


@settings(max_examples=200, deadline=None)
@given(data=st.data(), calls=st.sampled_from([(), (CALL,)]))
def test_chunk_stream_logprobs_add_up_to_the_completions(
    data: st.DataObject, calls: tuple[ToolCall, ...]
) -> None:
    tokens = [TokenLogprob(f"t{i}", -0.1 * i) for i in range(data.draw(st.integers(0, 12)))]
    sizes = data.draw(st.lists(st.integers(0, 3), max_size=8))
    texts = data.draw(st.lists(st.sampled_from(["", "a", "bc", "é🎉"]), min_size=len(sizes)))
    groups: list[tuple[str, list[TokenLogprob]]] = []
    given_so_far = 0
    for size, text in zip(sizes, texts, strict=False):
        groups.append((text, tokens[given_so_far : given_so_far + size]))
        given_so_far += size
    c = completion("".join(t for t, _ in groups), calls, logprobs=tuple(tokens))

    objs = chunk_objects(openai_stream(c, groups))

    content = [o["choices"][0] for o in objs if o["choices"]]
    assert "".join(ch["delta"].get("content") or "" for ch in content) == c.text
    carried = [t["token"] for ch in content if ch["logprobs"] for t in ch["logprobs"]["content"]]
    assert carried == [t.token for t in tokens]
    # a content delta carries what was given with it and with the empty texts before it
    waiting: list[str] = []
    deltas = iter(ch for ch in content if ch["delta"].get("content"))
    for text, toks in groups:
        waiting += [t.token for t in toks]
        if text:
            lp = next(deltas)["logprobs"]
            assert (lp and [t["token"] for t in lp["content"]]) == (waiting or None)
            waiting = []
    final = content[-1]
    assert final["finish_reason"] == finish_reason(c)
    never_given = [t.token for t in tokens[given_so_far:]]
    assert ([t["token"] for t in final["logprobs"]["content"]] if final["logprobs"] else []) == (
        waiting + never_given
    )


@pytest.mark.parametrize("case", CASES)
def test_chunk_stream_role_delta_and_shapes(case: str) -> None:
    c = CASES[case]
    groups: list[tuple[str, list[TokenLogprob]]] = [(p, []) for p in pieces_of(c.text)]
    raw = openai_stream(c, groups, logprobs=False)
    assert raw.count(b": ping\n\n") == len(groups) + 1
    objs = chunk_objects(raw)
    first = objs[0]["choices"][0]["delta"]
    assert first == {"role": "assistant", "content": None if not c.text and c.tool_calls else ""}
    assert all(o["choices"][0]["logprobs"] is None for o in objs if o["choices"])
    assert all("role" not in o["choices"][0]["delta"] for o in objs[1:] if o["choices"])
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] == 9
    assert all(o["usage"] is None for o in objs[:-1])
    assert len({(o["id"], o["created"], o["model"]) for o in objs}) == 1


@pytest.mark.parametrize("case", ["text", "text+tools", "tools", "empty"])
def test_the_openai_sdk_reads_the_incremental_stream(case: str) -> None:
    base = CASES[case]
    calls = tuple(ToolCall(f"call_{i}", t.name, t.arguments) for i, t in enumerate(base.tool_calls))
    tokens = [TokenLogprob(p, -1.0) for p in pieces_of(base.text) if p]
    c = completion(base.text, calls, logprobs=(*tokens, TokenLogprob("<tool_call>", -2.0)))
    groups = [(t.token, [t]) for t in tokens]
    client = openai.OpenAI(
        api_key="k",
        base_url="http://proxy.test/v1",
        http_client=httpx2.Client(
            transport=httpx2.MockTransport(sdk_handler(lambda: [openai_stream(c, groups)]))
        ),
        max_retries=0,
    )
    with client.chat.completions.stream(model=MODEL, messages=[], logprobs=True) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    expected = completion_body(c, 7, logprobs=True)["choices"][0]
    choice = final.choices[0]
    assert choice.finish_reason == expected["finish_reason"]
    assert choice.message.content == expected["message"]["content"]
    assert [
        (t.id, t.function.name, json.loads(t.function.arguments))
        for t in choice.message.tool_calls or []
    ] == [(t.id, t.name, t.arguments) for t in calls]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [t.token for t in choice.logprobs.content] == [t.token for t in c.logprobs]
