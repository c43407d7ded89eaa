"""The OpenAI Responses API dialect: request items to chat messages, answers and their SSE
events, and the live proxy driven by the official ``openai`` SDK (streamed and not)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest
from tests.test_proxy_server import Running, start
from transformers import AutoTokenizer

from qwengyre.engines.scripted import ScriptedEngine
from qwengyre.proxy.body import BodyMemo, split_whole
from qwengyre.proxy.dialect import ParseWhole
from qwengyre.proxy.responses_api import (
    LOGPROBS_INCLUDE,
    NO_OUTPUT_LIMIT,
    ResponseStream,
    parse_responses_doc,
    parse_responses_request,
    response_body,
)
from qwengyre.proxy.types import (
    ApiError,
    ChatRequest,
    Completion,
    KnownMessages,
    Message,
    TokenLogprob,
    ToolCall,
    ToolSpec,
)

BASH = {
    "type": "function",
    "name": "bash",
    "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
}
SPAWN = {"type": "function", "name": "spawn", "parameters": {"type": "object"}}
AGENTS = {"type": "namespace", "name": "agents", "description": "Sub-agents.", "tools": [SPAWN]}
TOOLS: list[Any] = [BASH, AGENTS, {"type": "web_search", "external_web_access": True}]
# What Codex sends, in its order: developer instructions, context, the task; then, once
# the model has called a tool, its (encrypted) reasoning, reply, call and the output.
CODEX_INPUT: list[dict[str, Any]] = [
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be"}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<env/>"}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List."}]},
    {"type": "reasoning", "summary": [], "encrypted_content": "gAAAA..."},
    {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "Looking.", "annotations": []}],
    },
    {"type": "function_call", "call_id": "call_1", "name": "bash", "arguments": '{"cmd":"ls"}'},
    {
        "type": "function_call",
        "call_id": "call_2",
        "name": "spawn",
        "namespace": "agents",
        "arguments": "{}",
    },
    {"type": "function_call_output", "call_id": "call_1", "output": "a.py"},
    {
        "type": "function_call_output",
        "call_id": "call_2",
        "output": [{"type": "input_text", "text": "agent 7"}],
    },
]
CODEX_MESSAGES = (
    Message("system", "Be"),
    Message("user", "<env/>"),
    Message("user", "List."),
    Message(
        "assistant",
        "Looking.",
        (ToolCall("call_1", "bash", {"cmd": "ls"}), ToolCall("call_2", "agents__spawn", {})),
    ),
    Message("tool", "a.py", tool_call_id="call_1"),
    Message("tool", "agent 7", tool_call_id="call_2"),
)


def body_with(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "input": "hi", **fields}


def parse(body: dict[str, Any], headers: dict[str, str] | None = None) -> ChatRequest:
    return parse_responses_request(json.dumps(body).encode(), headers or {})


# ---------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------


def test_codex_items_map_to_chat_messages() -> None:
    body = body_with(
        input=CODEX_INPUT,
        tools=TOOLS,
        tool_choice="auto",
        parallel_tool_calls=True,
        reasoning={"summary": "auto"},
        store=False,
        include=["reasoning.encrypted_content"],
        prompt_cache_key="k",
        client_metadata={"x": "y"},
        stream=True,
    )
    chat = parse(body, {"X-Codex-Window-Id": "w:0", "Authorization": "Bearer k"})
    assert chat.api == "responses" and chat.stream and not chat.logprobs
    assert chat.messages == CODEX_MESSAGES and chat.lead == 0
    # The namespace's function is flattened as Codex flattens it; web_search is not shown.
    assert chat.tools == (
        ToolSpec("bash", "Run a shell command", BASH["parameters"]),
        ToolSpec("agents__spawn", "", {"type": "object"}),
    )
    assert chat.tool_namespaces == {"agents__spawn": ("agents", "spawn")}
    assert chat.last_user_texts == ("List.",)
    assert chat.headers == {"x-codex-window-id": "w:0"}
    # No budget of its own: the server caps it at the room left in the context.
    assert chat.sampling.max_tokens == NO_OUTPUT_LIMIT
    assert (chat.sampling.temperature, chat.sampling.top_p, chat.sampling.top_k) == (1, 1, -1)


def test_instructions_sampling_and_logprobs() -> None:
    chat = parse(
        body_with(
            instructions="Be brief.",
            input=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
            max_output_tokens=50,
            temperature=0.3,
            top_p=0.9,
            top_k=20,
            stop=["END"],
            include=[LOGPROBS_INCLUDE],
            top_logprobs=3,
        )
    )
    assert chat.messages == (
        Message("system", "Be brief."),
        Message("user", "hi"),
        Message("assistant", "yo"),
    )
    assert chat.lead == 1
    s = chat.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.stop) == (50, 0.3, 0.9, 20, ("END",))
    assert chat.logprobs and chat.top_logprobs == 3
    assert parse(body_with()).messages == (Message("user", "hi"),)  # a string is a user turn


def test_a_call_after_an_output_or_a_user_turn_starts_its_own_assistant_message() -> None:
    call = {"type": "function_call", "call_id": "c", "name": "bash", "arguments": ""}
    out = {"type": "function_call_output", "call_id": "c", "output": "x"}
    again = {**call, "call_id": "d"}
    chat = parse(body_with(input=[{"role": "user", "content": "go"}, call, out, again]))
    assert chat.messages == (
        Message("user", "go"),
        Message("assistant", "", (ToolCall("c", "bash", {}),)),
        Message("tool", "x", tool_call_id="c"),
        Message("assistant", "", (ToolCall("d", "bash", {}),)),
    )


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        (body_with(previous_response_id="resp_1"), "previous_response_id", "whole conversation"),
        (body_with(conversation="conv_1"), "conversation", "whole conversation"),
        (body_with(background=True), "background", "not served"),
        (body_with(prompt={"id": "p"}), "prompt", "'instructions'"),
        (body_with(text={"format": {"type": "json_schema"}}), "text.format.type", "'text'"),
        ({"model": "m"}, "input", "Missing required"),
        (body_with(input=[]), "input", "at least 1"),
        (body_with(input=5), "input", "an integer"),
        (body_with(input=[{"role": "tool", "content": "x"}]), "input[0].role", "'developer'"),
        (body_with(input=[{"content": "x"}]), "input[0].type", "Missing required"),
        (
            body_with(input=[{"type": "item_reference", "id": "msg_1"}]),
            "input[0].type",
            "send the item itself",
        ),
        (
            body_with(input=[{"type": "custom_tool_call", "call_id": "c", "input": ""}]),
            "input[0].type",
            "'function_call_output'",
        ),
        (
            body_with(
                input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]
            ),
            "input[0].content[0].type",
            "text only",
        ),
        (
            body_with(input=[{"type": "function_call_output", "call_id": "c9", "output": "x"}]),
            "input[0].call_id",
            "'c9'",
        ),
        (
            body_with(
                input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]
            ),
            "input[0].arguments",
            "not valid JSON",
        ),
        (body_with(tools=[{"type": "custom", "name": "apply_patch"}]), "tools[0].type", '"custom"'),
        (
            body_with(tools=[{"type": "namespace", "name": "n", "tools": [{"type": "custom"}]}]),
            "tools[0].tools[0].type",
            "'function' tools only",
        ),
        (body_with(tools=[BASH, BASH]), "tools[1].name", "unique"),
        (body_with(tools=[{"type": "function"}]), "tools[0].name", "Missing required"),
        (body_with(tool_choice="sometimes"), "tool_choice", "'required'"),
        (body_with(tool_choice={"type": "function", "name": "nope"}), "tool_choice.name", "nope"),
        (body_with(tool_choice={"type": "web_search"}), "tool_choice.type", "hosted"),
        (body_with(max_output_tokens=0), "max_output_tokens", "greater than or equal to 1"),
        (body_with(temperature="hot"), "temperature", "a number"),
        (body_with(include=[1]), "include[0]", "a string"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(body: dict[str, Any], param: str, needle: str) -> None:
    with pytest.raises(ApiError) as info:
        parse(body)
    err = info.value
    assert (err.kind, err.status, err.param) == ("invalid_request_error", 400, param)
    assert needle in err.message and param in err.message


def test_a_tool_choice_naming_a_namespaced_function_is_valid() -> None:
    choice = {"type": "function", "namespace": "agents", "name": "spawn"}
    assert parse(body_with(tools=TOOLS, tool_choice=choice)).tools[1].name == "agents__spawn"


def test_bodies_after_a_known_prefix_parse_as_the_whole_body() -> None:
    """What the server does with a growing conversation: only the new items are
    converted, to the messages a whole parse gives."""
    memo = BodyMemo()
    for n in range(3, len(CODEX_INPUT) + 1):
        raw = json.dumps(body_with(input=CODEX_INPUT[:n], tools=TOOLS)).encode()
        split = memo.split(raw, "input")
        assert split is not None
        before = split.known.state if split.known else None
        whole = parse_responses_request(raw, {})
        try:
            chat = parse_responses_doc(split.doc, {}, before)
        except ParseWhole:
            # The known items end with the assistant's message, the new with its calls.
            assert n in (6, 7) and before is not None and before.messages[-1].role == "assistant"
            split = split_whole(raw, "input")
            assert split is not None
            chat = parse_responses_doc(split.doc, {}, None)
        assert chat.messages == whole.messages and chat.tools == whole.tools
        memo.remember(raw, split, KnownMessages(chat.messages, chat.last_user_texts))
    assert split.known is not None and len(split.doc["input"]) == 1


# ---------------------------------------------------------------------------------------
# Answers
# ---------------------------------------------------------------------------------------

CHAT = ChatRequest(
    api="responses",
    model="m",
    messages=(Message("user", "hi"),),
    sampling=parse(body_with()).sampling,
    tools=(ToolSpec("bash"), ToolSpec("agents__spawn")),
    logprobs=True,
    tool_namespaces={"agents__spawn": ("agents", "spawn")},
)
MIXED = Completion(
    id="resp_abc",
    model="m",
    text="Let me see.",
    tool_calls=(
        ToolCall("call_x", "bash", {"cmd": "ls é"}),
        ToolCall("call_y", "agents__spawn", {}),
    ),
    stop_reason="tool_use",
    input_tokens=9,
    output_tokens=12,
    logprobs=(TokenLogprob("Let", -0.5), TokenLogprob(" me see.", -0.25)),
)


def sse_events(data: bytes) -> list[dict[str, Any]]:
    """The JSON of each event, checking that its ``event:`` line names its type."""
    out = []
    for block in data.decode().split("\n\n")[:-1]:
        if block.startswith(":"):
            continue
        name, payload = block.split("\n")
        event = json.loads(payload.removeprefix("data: "))
        assert name == "event: " + event["type"]
        out.append(event)
    return out


def stream(c: Completion, pieces: list[tuple[str, list[TokenLogprob]]]) -> list[dict[str, Any]]:
    events = ResponseStream(c.id, c.model, CHAT, created=7, chunk_chars=4)
    data = events.start() + events.ping()
    for text, logprobs in pieces:
        data += events.text(text, logprobs)
    return sse_events(data + events.finish(c))


def test_a_streamed_response_folds_into_the_whole_answer() -> None:
    whole = response_body(MIXED, CHAT, created=7)
    assert whole["status"] == "completed" and whole["usage"]["total_tokens"] == 21
    message, bash, spawn = whole["output"]
    assert message["content"][0]["text"] == "Let me see."
    assert [t["logprob"] for t in message["content"][0]["logprobs"]] == [-0.5, -0.25]
    assert (bash["call_id"], bash["name"], json.loads(bash["arguments"])) == (
        "call_x",
        "bash",
        {"cmd": "ls é"},
    )
    assert "namespace" not in bash
    assert (spawn["namespace"], spawn["name"]) == ("agents", "spawn")  # as the client knows it

    events = stream(
        MIXED, [("Let", [MIXED.logprobs[0]]), ("", [MIXED.logprobs[1]]), (" me see.", [])]
    )
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events][:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"] == {**whole, "created_at": 7}
    assert [e["item"] for e in events if e["type"] == "response.output_item.done"] == [
        message,
        bash,
        spawn,
    ]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(e["delta"] for e in deltas) == MIXED.text
    # a token given with empty text rides on the next delta
    assert [[t["logprob"] for t in e["logprobs"]] for e in deltas] == [[-0.5], [-0.25]]
    for call in (bash, spawn):
        arguments = [
            e["delta"]
            for e in events
            if e["type"] == "response.function_call_arguments.delta" and e["item_id"] == call["id"]
        ]
        assert len(arguments) > 1 or call is spawn  # in pieces of chunk_chars
        assert "".join(arguments) == call["arguments"]


def test_a_spent_budget_is_incomplete_and_a_failure_is_response_failed() -> None:
    cut = Completion(
        id="resp_c",
        model="m",
        text="trunc",
        tool_calls=(),
        stop_reason="max_tokens",
        input_tokens=1,
        output_tokens=2,
    )
    whole = response_body(cut, CHAT, created=7)
    assert whole["status"] == "incomplete"
    assert whole["incomplete_details"] == {"reason": "max_output_tokens"}
    events = stream(cut, [("trunc", [])])
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"] == whole

    failing = ResponseStream("resp_f", "m", CHAT, created=1)
    opened = sse_events(failing.start() + failing.text("partial"))
    [failed] = sse_events(failing.error(ApiError("overloaded_error", "no engine")))
    assert failed["type"] == "response.failed"
    assert failed["sequence_number"] == len(opened)
    assert failed["response"]["id"] == "resp_f" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "overloaded"


# ---------------------------------------------------------------------------------------
# The live proxy and the official SDK
# ---------------------------------------------------------------------------------------

CALLS = [
    {"name": "bash", "arguments": {"cmd": "ls -la"}},
    {"name": "agents__spawn", "arguments": {"task": "look"}},
]
SCRIPT = {
    "main.task": [
        "Let me look.\n" + "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in CALLS),
        "All done: two files.",
    ],
    "default": ["ok"],
}


@pytest.fixture
def proxy(tmp_path: Path, tiny_model_dir: Path) -> Iterator[Running]:
    engine = ScriptedEngine(AutoTokenizer.from_pretrained(tiny_model_dir), SCRIPT)
    yield from start(tmp_path, tiny_model_dir, engines=[engine])


def sdk(ex: dict[str, str]) -> openai.OpenAI:
    return openai.OpenAI(api_key=ex["key"], base_url=ex["openai_base_url"], max_retries=0)


@pytest.mark.parametrize("streamed", [False, True])
def test_sdk_tool_loop_records_one_chain(proxy: Running, streamed: bool) -> None:
    ex = proxy.new_execution()
    client = sdk(ex)
    first = client.responses.create(
        model="tiny", instructions="Be brief.", input="List the files.", tools=TOOLS, store=False
    )
    assert first.status == "completed" and first.id.startswith("resp_")
    message, bash, spawn = first.output
    assert message.type == "message" and first.output_text == "Let me look."
    assert bash.type == "function_call" and spawn.type == "function_call"
    assert (bash.name, json.loads(bash.arguments)) == ("bash", {"cmd": "ls -la"})
    assert (spawn.namespace, spawn.name, json.loads(spawn.arguments)) == (
        "agents",
        "spawn",
        {"task": "look"},
    )

    # The harness echoes the items back (arguments reformatted: restored by call_id).
    echoed = [item.model_dump(exclude_none=True) for item in first.output]
    echoed[1]["arguments"] = '{ "cmd" : "ls -la" }'
    history = [
        {"role": "user", "content": "List the files."},
        *echoed,
        {"type": "function_call_output", "call_id": bash.call_id, "output": "a.py b.py"},
        {"type": "function_call_output", "call_id": spawn.call_id, "output": "agent 1"},
    ]
    kw: dict[str, Any] = {"instructions": "Be brief.", "input": history, "tools": TOOLS}
    if streamed:
        events = list(
            client.responses.create(model="tiny", include=[LOGPROBS_INCLUDE], stream=True, **kw)
        )
        assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
        assert events[-1].type == "response.completed"
        second = events[-1].response
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        assert "".join(deltas) == second.output_text
    else:
        second = client.responses.create(model="tiny", include=[LOGPROBS_INCLUDE], **kw)
    assert second.output_text == "All done: two files."

    nodes = proxy.tree(ex["id"])
    assert [(n["parent"], n["class"]) for n in nodes] == [(None, "main.task"), (0, "main.task")]
    prompt = proxy.tokenizer.decode(nodes[1]["input_ids"])  # type: ignore[attr-defined]
    assert "a.py b.py" in prompt and "List the files" not in prompt  # only what is new
    usage = second.usage
    assert usage is not None
    assert usage.output_tokens == len(nodes[1]["output_ids"])
    assert usage.input_tokens == len(nodes[0]["input_ids"]) + len(nodes[0]["output_ids"]) + len(
        nodes[1]["input_ids"]
    )
    message = second.output[0]
    assert message.type == "message"
    [part] = message.content
    assert part.type == "output_text" and part.logprobs is not None
    # the engine's log-probs, which the store keeps as float32
    assert [t.logprob for t in part.logprobs] == pytest.approx(nodes[1]["logprobs"], rel=1e-6)


def test_errors_answer_in_openai_shape_and_name_the_routes(proxy: Running) -> None:
    ex = proxy.new_execution()
    client = sdk(ex)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_1")
    assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as long:
        client.responses.create(model="tiny", input="word " * 5000)
    assert long.value.code == "context_length_exceeded"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            api_key="wrong", base_url=ex["openai_base_url"], max_retries=0
        ).responses.create(model="tiny", input="hi")
    auth = {"authorization": f"Bearer {ex['key']}"}
    for method, path in [
        ("GET", "/v1/responses/resp_1"),  # unknown, under the API's path
        ("DELETE", ex["openai_base_url"].removeprefix(proxy.url) + "/responses"),
        ("POST", "/v1/embeddings"),
    ]:
        answer = httpx2.request(method, proxy.url + path, headers=auth)
        assert answer.status_code == 404, answer.text
        body = answer.json()
        error = body["error"]
        if "responses" in path:  # OpenAI's shape, not Anthropic's
            assert "type" not in body and error["type"] == "not_found_error"
            assert set(error) == {"message", "type", "param", "code"}
        assert "POST /v1/responses" in error["message"]
        assert "POST /v1/chat/completions" in error["message"]
    assert proxy.tree(ex["id"]) == []  # nothing recorded for a refused call


def test_the_same_reply_whole_and_streamed_over_raw_http(proxy: Running) -> None:
    """The wire format without the SDK's help: ``event:`` lines, and a body that is
    the ``response`` object (each execution's first call gets the same reply)."""
    answers = []
    with contextlib.closing(httpx2.Client(timeout=30)) as http:
        for stream in (False, True):
            ex = proxy.new_execution()
            auth = {"authorization": f"Bearer {ex['key']}"}
            body = body_with(tools=[BASH], stream=stream)
            answers.append(http.post(ex["openai_base_url"] + "/responses", json=body, headers=auth))
    whole, streamed = answers[0].json(), answers[1]
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert whole["object"] == "response" and whole["status"] == "completed"
    events = sse_events(streamed.content)
    assert events[-1]["type"] == "response.completed"
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call", "function_call"]
    assert [i["type"] for i in whole["output"]] == ["message", "function_call", "function_call"]
    assert final["output"][0]["content"] == whole["output"][0]["content"]
    assert [i["arguments"] for i in final["output"][1:]] == [
        i["arguments"] for i in whole["output"][1:]
    ]


def test_a_call_joining_the_last_known_message_is_parsed_whole(proxy: Running) -> None:
    """A body that repeats an earlier one ending in an assistant message, then adds that
    message's call: the call joins the message, so the server converts every item (and
    the next body, which repeats this one, only its new items)."""
    ex = proxy.new_execution()
    url = ex["openai_base_url"] + "/responses"
    auth = {"authorization": f"Bearer {ex['key']}"}
    start: list[Any] = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "x"}]
    called = [
        *start,
        {"type": "function_call", "call_id": "c1", "name": "bash", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "done"},
    ]
    with contextlib.closing(httpx2.Client(timeout=30)) as http:
        for items in (start, called, [*called, {"role": "user", "content": "more"}]):
            answer = http.post(url, json=body_with(input=items, tools=[BASH]), headers=auth)
            assert answer.status_code == 200, answer.text
    recorder = proxy.server.residency.executions[ex["id"]].recorder
    assert recorder is not None
    merged = (
        Message("user", "go"),
        Message("assistant", "x", (ToolCall("c1", "bash", {}),)),
        Message("tool", "done", tool_call_id="c1"),
    )
    # Each request's messages (none extends an earlier call's reply: three roots).
    assert [turn.new_messages[:-1] for turn in recorder.turns] == [
        (Message("user", "go"), Message("assistant", "x")),
        merged,
        (*merged, Message("user", "more")),
    ]
