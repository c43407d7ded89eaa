"""Reply parsers per model family (proxy/parsers): qwen3_coder XML tool calls typed by
the tool's schema, ``<think>`` reasoning split out, both streamed as parsed whole; the
choice by name or from the chat template; and, through the proxy with the tiny
Qwen3-Coder-style model, what the OpenAI and Anthropic SDKs receive and what the
template renders back."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import anthropic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from qwengyre.config import ReasoningParserName, ToolParserName
from qwengyre.engines.scripted import ScriptedEngine
from qwengyre.proxy.parsers import (
    PROBE_REASONING,
    REASONING_PARSERS,
    TOOL_PARSERS,
    ReplyFormat,
    detect,
    reply_format,
)
from qwengyre.proxy.parsers.qwen3_coder import convert_value
from qwengyre.proxy.render import ChatRenderer
from qwengyre.proxy.types import Message, ToolCall, ToolSpec
from test_proxy_render_stream import chunked
from test_proxy_server import Running, claude, gpt, start

CODER = TOOL_PARSERS["qwen3_coder"]
QWEN3 = REASONING_PARSERS["qwen3"]
TOOL = ToolSpec(
    "edit",
    "Edit a file",
    {
        "type": "object",
        "properties": {
            "path": {"type": "string"},
            "line": {"type": "integer"},
            "scale": {"type": "number"},
            "dry_run": {"type": "boolean"},
            "options": {"type": "object"},
            "lines": {"type": "array", "items": {"type": "integer"}},
            "note": {"type": ["string", "null"]},
            "limit": {"type": ["integer", "null"]},
        },
    },
)


def xml_call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


# ------------------------------------------------------------------------- qwen3_coder


def test_qwen3_coder_values_are_typed_by_the_tools_schema() -> None:
    call = xml_call(
        "edit",
        path="007.py",
        line="42",
        scale="1.5",
        dry_run="True",
        options='{"a": [1, null]}',
        lines="[3, 4]",
        note="null",
        limit="null",
        extra="12",
    )
    text, calls = CODER.parse("Editing.\n" + call, [TOOL])
    assert text == "Editing."
    assert calls == [
        (
            "edit",
            {
                "path": "007.py",  # a string stays one, digits and all
                "line": 42,
                "scale": 1.5,
                "dry_run": True,
                "options": {"a": [1, None]},
                "lines": [3, 4],
                "note": "null",  # a string may say null
                "limit": None,
                "extra": "12",  # not in the schema: the text
            },
        )
    ]


@pytest.mark.parametrize(
    ("value", "schema", "expected"),
    [
        ("12", {"type": "number"}, 12),
        ("1e3", {"type": "number"}, 1000),
        ("2.0", {"type": "number"}, 2.0),
        ("NaN", {"type": "number"}, "NaN"),
        ("twelve", {"type": "integer"}, "twelve"),
        ("yes", {"type": "boolean"}, "yes"),
        ("{not json", {"type": "object"}, "{not json"),
        ("[1, 2]", {"items": {}}, [1, 2]),
        ("  spaced \n", {"type": "string"}, "  spaced \n"),
        ("5", None, "5"),
        ("5", {"type": ["integer", "string"]}, "5"),
    ],
)
def test_qwen3_coder_value_conversion(value: str, schema: Any, expected: Any) -> None:
    got = convert_value(value, schema)
    assert got == expected and type(got) is type(expected)


def test_qwen3_coder_multiline_values_keep_inner_newlines_and_unknown_tools_get_text() -> None:
    code = "def f():\n    return 1\n"
    text, calls = CODER.parse(xml_call("write", content=code, n="3"), [TOOL])
    assert text == "" and calls == [("write", {"content": code, "n": "3"})]


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>\n<function=edit>\nstray<parameter=line>\n1\n</parameter>\n</function>\n"
        "</tool_call>",
        '<tool_call>\n{"name": "edit", "arguments": {}}\n</tool_call>',  # hermes, not XML
        "<tool_call>\n<function=>\n</function>\n</tool_call>",
        "<tool_call>\n<parameter=line>\n1\n</parameter>\n</tool_call>",
    ],
)
def test_a_block_that_is_not_a_qwen3_coder_call_stays_text(block: str) -> None:
    assert CODER.parse(f"a {block} b", [TOOL]) == (f"a {block} b", [])


def test_a_missing_function_close_is_allowed_as_vllm_allows_it() -> None:
    reply = "<tool_call>\n<function=edit>\n<parameter=line>\n7\n</parameter>\n</tool_call>"
    assert CODER.parse(reply, [TOOL]) == ("", [("edit", {"line": 7})])


# ------------------------------------------------------------------------------ <think>


@pytest.mark.parametrize(
    ("reply", "prompt_tail", "parser", "expected"),
    [
        ("<think>\nHmm.\n</think>\n\nAnswer.", "assistant\n", "qwen3", ("Hmm.", "\n\nAnswer.")),
        ("  <think>a</think>b", "", "qwen3", ("a", "b")),
        ("Answer, no thinking.", "", "qwen3", ("", "Answer, no thinking.")),
        ("a </think> stray", "", "qwen3", ("", "a </think> stray")),
        ("Hmm.\n</think>\n\nAnswer.", "assistant\n<think>\n", "qwen3", ("Hmm.", "\n\nAnswer.")),
        ("<think>cut short by max_tokens", "", "qwen3", ("cut short by max_tokens", "")),
        ("Hmm.</think>Answer.", "", "deepseek_r1", ("Hmm.", "Answer.")),
        ("<think>Hmm.</think>Answer.", "", "deepseek_r1", ("Hmm.", "Answer.")),
        ("never closed", "", "deepseek_r1", ("never closed", "")),
    ],
)
def test_reasoning_split(reply: str, prompt_tail: str, parser: str, expected: tuple) -> None:
    assert REASONING_PARSERS[parser].split(reply, prompt_tail) == expected


THINK = "<think>\nLet me think.\n</think>\n\n"
FRAGMENTS = [
    THINK,
    "<think>",
    "</think>",
    "<thi",
    "nk>",
    "</th",
    xml_call("edit", line="3", path="a.py"),
    xml_call("edit", options="{bad"),
    "<tool_call>\n<function=edit>\n",
    "<parameter=line>\n5\n</parameter>\n",
    "</function>\n</tool_call>",
    "<tool_call>",
    "</tool_call>",
    "<function=",
    "<",
    " ",
    "\n",
    "Hi",
    "STOP",
]
texts = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=3), max_size=20).map("".join)


@pytest.mark.parametrize("reasoning", ["qwen3", "deepseek_r1", "none"])
@settings(max_examples=400, deadline=None)
@given(full=texts, data=st.data())
def test_a_streamed_reply_shows_exactly_what_the_whole_reply_parses_to(
    reasoning: str, full: str, data: st.DataObject
) -> None:
    replies = reply_format("qwen3_coder", reasoning, "")
    tail = data.draw(st.sampled_from(["assistant\n", "assistant\n<think>\n"]))
    stops = data.draw(st.sampled_from([(), ("STOP",), ("</tool_call>", "Hi")]))
    stream = replies.stream(stops, [TOOL], tail)
    pieces = [stream.feed(chunk) for chunk in chunked(data, full)]  # type: ignore[arg-type]
    last, reply = stream.finish()
    pieces.append(last)
    assert reply == replies.parse(full, stops, [TOOL], tail)
    assert "".join(p.reasoning for p in pieces) == reply.reasoning
    assert "".join(p.text for p in pieces) == reply.text
    # Nothing of the text shows before the last of the reasoning.
    kinds = [k for p in pieces for k, v in (("r", p.reasoning), ("t", p.text)) if v]
    assert kinds == sorted(kinds)


@pytest.mark.parametrize(
    "degenerate",
    [
        "<tool_call><function=f><parameter=x>" * 4000,
        "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n" * 3000,
        "</thin" * 6000,
        "<tool_call>" * 10000,
    ],
    ids=["unclosed-parameters", "unclosed-calls", "end-tag-prefixes", "open-tags"],
)
def test_degenerate_replies_stream_as_they_parse_whole(degenerate: str) -> None:
    replies = reply_format("qwen3_coder", "qwen3", "")
    stream = replies.stream((), [TOOL], "<think>\n")
    for at in range(0, len(degenerate), 7):
        stream.feed(degenerate[at : at + 7])
    _, reply = stream.finish()
    whole = replies.parse(degenerate, (), [TOOL], "<think>\n")
    assert reply == whole


# ------------------------------------------------------------------ choice by name / auto


def test_the_config_names_are_the_registries() -> None:
    assert set(get_args(ToolParserName)) == {"auto", *TOOL_PARSERS}
    assert set(get_args(ReasoningParserName)) == {"auto", "none", *REASONING_PARSERS}


def test_unknown_parser_names_are_refused_naming_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match="allowed: auto, hermes, qwen3_coder"):
        reply_format("mistral", "auto", "")
    with pytest.raises(ValueError, match="allowed: auto, none, qwen3, deepseek_r1"):
        reply_format("auto", "granite", "")


def test_the_config_refuses_an_unknown_parser_naming_the_key() -> None:
    from qwengyre.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"proxy\.tool_parser.*hermes.*qwen3_coder"):
        load_config(None, ["proxy.tool_parser=mistral"])


@pytest.mark.parametrize(
    ("probe", "expected"),
    [
        ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', ("hermes", "none")),
        ("<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>", ("qwen3_coder", "none")),
        (f"<think>\n{PROBE_REASONING}\n</think>\n\none", ("hermes", "qwen3")),
        (f"[THINK]{PROBE_REASONING}[/THINK]", ("hermes", "qwen3")),  # kept: reasons
        ("<think>\n\n</think>\n\none", ("hermes", "qwen3")),  # dropped, yet thinks
    ],
)
def test_detect_reads_what_the_template_rendered(probe: str, expected: tuple) -> None:
    assert detect(probe) == expected


def test_auto_reads_the_formats_from_the_chat_template(
    tiny_model_dir: Path, coder_model_dir: Path
) -> None:
    plain = AutoTokenizer.from_pretrained(tiny_model_dir)
    coder = AutoTokenizer.from_pretrained(coder_model_dir)
    assert ChatRenderer(plain).replies == ReplyFormat(TOOL_PARSERS["hermes"], None)
    assert ChatRenderer(coder).replies == ReplyFormat(CODER, QWEN3)
    assert ChatRenderer(coder, "auto", "none").replies == ReplyFormat(CODER, None)
    assert ChatRenderer(coder, "hermes", "deepseek_r1").replies == ReplyFormat(
        TOOL_PARSERS["hermes"], REASONING_PARSERS["deepseek_r1"]
    )


# ------------------------------------------------------------- the Qwen3-Coder tiny model


@pytest.fixture(scope="module")
def coder(coder_model_dir: Path) -> ChatRenderer:
    return ChatRenderer(AutoTokenizer.from_pretrained(coder_model_dir))


def test_the_coder_template_renders_xml_calls_and_reasoning_locally(coder: ChatRenderer) -> None:
    assert coder.local and coder.replies == ReplyFormat(CODER, QWEN3)
    reply = Message(
        "assistant",
        "Editing.",
        (ToolCall("c1", "edit", {"line": 3, "options": {"a": 1}, "path": "x.py"}),),
        reasoning="\nFirst, look.\n",
    )
    text = coder.render([Message("user", "fix"), reply], [TOOL], generation_prompt=False)
    assert text.endswith(
        "<|im_start|>assistant\n<think>\nFirst, look.\n</think>\n\nEditing.\n"
        + xml_call("edit", line="3", options='{"a": 1}', path="x.py")
        + "<|im_end|>\n"
    )
    assert "<name>edit</name>" in text and "<function=example_function_name>" in text
    # What the template writes, the parsers read back.
    body = text.rsplit("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")
    parsed = coder.replies.parse(body, (), [TOOL], "<|im_start|>assistant\n")
    assert (parsed.reasoning, parsed.text) == ("First, look.", "Editing.")
    assert parsed.calls == [("edit", {"line": 3, "options": {"a": 1}, "path": "x.py"})]


THOUGHT = "<think>\nThe user wants the files.\n</think>\n\n"
CODER_CALL = xml_call("bash", cmd="ls -la", timeout="30", verbose="false")
CODER_SCRIPT = {"default": [THOUGHT + "Let me look.\n" + CODER_CALL, THOUGHT + "Two files."]}
SCHEMA = {
    "type": "object",
    "properties": {
        "cmd": {"type": "string"},
        "timeout": {"type": "integer"},
        "verbose": {"type": "boolean"},
    },
}
ARGS = {"cmd": "ls -la", "timeout": 30, "verbose": False}


@pytest.fixture
def coder_proxy(tmp_path: Path, coder_model_dir: Path) -> Iterator[Running]:
    tokenizer = AutoTokenizer.from_pretrained(coder_model_dir)
    yield from start(tmp_path, coder_model_dir, [ScriptedEngine(tokenizer, CODER_SCRIPT)])


OPENAI_TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": SCHEMA}}]
ANTHROPIC_TOOLS = [{"name": "bash", "input_schema": SCHEMA}]


@pytest.mark.parametrize("stream", [False, True])
def test_openai_sdk_gets_typed_xml_tool_calls_and_reasoning(
    coder_proxy: Running, stream: bool
) -> None:
    ex = coder_proxy.new_execution()
    client = gpt(coder_proxy, ex)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "List the files."}]
    kwargs: dict[str, Any] = {"model": "tiny", "tools": OPENAI_TOOLS, "max_tokens": 300}
    if stream:
        chunks = list(client.chat.completions.create(messages=messages, stream=True, **kwargs))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
        calls = [tc for d in deltas for tc in d.tool_calls or ()]
        name, arguments = calls[0].function.name, "".join(c.function.arguments for c in calls)
        call_id = calls[0].id
    else:
        message = client.chat.completions.create(messages=messages, **kwargs).choices[0].message
        reasoning, content = message.reasoning_content, message.content  # type: ignore[attr-defined]
        (made,) = message.tool_calls or ()
        name, arguments, call_id = made.function.name, made.function.arguments, made.id
    assert reasoning == "The user wants the files." and content == "Let me look."
    assert name == "bash" and json.loads(arguments) == ARGS
    # The harness sends the reasoning back; the call extends the recorded turn.
    messages += [
        {
            "role": "assistant",
            "content": content,
            "reasoning_content": reasoning,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "a.txt\nb.txt"},
    ]
    second = client.chat.completions.create(messages=messages, **kwargs).choices[0].message
    assert second.content == "Two files."
    nodes = coder_proxy.tree(ex["id"])
    assert [n["parent"] for n in nodes] == [None, 0]
    # The recorded tokens are the engine's: the reply's <think> block included.
    assert coder_proxy.tokenizer.decode(nodes[0]["output_ids"]).startswith(THOUGHT)


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_sdk_gets_a_thinking_block_and_a_typed_tool_use(
    coder_proxy: Running, stream: bool
) -> None:
    ex = coder_proxy.new_execution()
    client = claude(coder_proxy, ex)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "List the files."}]
    kwargs: dict[str, Any] = {"model": "tiny", "tools": ANTHROPIC_TOOLS, "max_tokens": 300}
    if stream:
        with client.messages.stream(messages=messages, **kwargs) as events:  # type: ignore[arg-type]
            kinds = [e.delta.type for e in events if e.type == "content_block_delta"]
            first = events.get_final_message()
        assert kinds.index("signature_delta") < kinds.index("text_delta")
        assert "thinking_delta" in kinds and "input_json_delta" in kinds
    else:
        first = client.messages.create(messages=messages, **kwargs)  # type: ignore[arg-type]
    thinking, text, tool_use = first.content
    assert isinstance(thinking, anthropic.types.ThinkingBlock)
    assert thinking.thinking == "The user wants the files." and text.text == "Let me look."  # type: ignore[union-attr]
    assert tool_use.name == "bash" and tool_use.input == ARGS  # type: ignore[union-attr]
    assert first.stop_reason == "tool_use"
    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "a.txt"}],  # type: ignore[union-attr]
        },
    ]
    second = client.messages.create(messages=messages, **kwargs)  # type: ignore[arg-type]
    assert [b.type for b in second.content] == ["thinking", "text"]
    assert [n["parent"] for n in coder_proxy.tree(ex["id"])] == [None, 0]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_sdk_gets_a_reasoning_item_and_a_typed_function_call(
    coder_proxy: Running, stream: bool
) -> None:
    """The Responses API answers reasoning as an output item of its own (``reasoning_text``
    content), before the message and the calls; streamed, its deltas come and its item
    is done before the message's text starts, and every item's ``output_index`` is its
    place in the finished response."""
    client = gpt(coder_proxy, coder_proxy.new_execution())
    tools = [{"type": "function", "name": "bash", "parameters": SCHEMA}]
    kwargs: dict[str, Any] = {"model": "tiny", "input": "List the files.", "tools": tools}
    if stream:
        events = list(client.responses.create(stream=True, **kwargs))
        kinds = [e.type for e in events]
        said = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert said == "The user wants the files."
        done = kinds.index("response.reasoning_text.done")
        assert done < kinds.index("response.output_text.delta")
        response = events[-1].response  # type: ignore[union-attr]
        items = [
            (e.output_index, e.item.type) for e in events if e.type == "response.output_item.done"
        ]
        assert items == [(i, item.type) for i, item in enumerate(response.output)]
    else:
        response = client.responses.create(**kwargs)
    reasoning, message, call = response.output
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert [c.text for c in reasoning.content] == ["The user wants the files."]
    assert message.type == "message" and message.content[0].text == "Let me look."  # type: ignore[union-attr]
    assert call.type == "function_call" and call.name == "bash"
    assert json.loads(call.arguments) == ARGS


def test_history_reasoning_from_the_harness_is_rendered_by_the_template(
    coder_proxy: Running,
) -> None:
    """A conversation the proxy did not record (its assistant turn written by the
    harness, thinking included) is rendered whole, the thinking as the template has it."""
    ex = coder_proxy.new_execution()
    claude(coder_proxy, ex).messages.create(
        model="tiny",
        max_tokens=300,
        tools=ANTHROPIC_TOOLS,  # type: ignore[arg-type]
        messages=[
            {"role": "user", "content": "Hi"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Greet back.", "signature": "s"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "Hello!"},
                ],
            },
            {"role": "user", "content": "List the files."},
        ],
    )
    (node,) = coder_proxy.tree(ex["id"])
    prompt = coder_proxy.tokenizer.decode(node["input_ids"])
    assert "<|im_start|>assistant\n<think>\nGreet back.\n</think>\n\nHello!<|im_end|>" in prompt
    assert "opaque" not in prompt


# ------------------------------------------ the tiny model whose prompt opens the reasoning

# Its generation prompt ends "<|im_start|>assistant\n<think>\n" (Qwen3 thinking models):
# the model writes no <think>, only the reasoning's end.
OPENED_CALL = (
    '<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls -la", "timeout": 30}}\n</tool_call>'
)
OPENED_SCRIPT = {
    "default": [
        "The user wants the files.\n</think>\n\nLet me look.\n" + OPENED_CALL,
        "Both are listed.\n</think>\n\nTwo files: a.txt and b.txt.",
    ]
}


@pytest.fixture
def thinking_proxy(tmp_path: Path, thinking_model_dir: Path) -> Iterator[Running]:
    tokenizer = AutoTokenizer.from_pretrained(thinking_model_dir)
    yield from start(tmp_path, thinking_model_dir, [ScriptedEngine(tokenizer, OPENED_SCRIPT)])


def test_the_thinking_template_opens_the_reasoning_in_its_generation_prompt(
    thinking_model_dir: Path,
) -> None:
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(thinking_model_dir))
    assert renderer.local and renderer.replies == ReplyFormat(TOOL_PARSERS["hermes"], QWEN3)
    prompt = renderer.render([Message("user", "Hi")], [], generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    turn = Message("assistant", "Hello.", reasoning="Greet.")
    text = renderer.render([Message("user", "Hi"), turn], [], generation_prompt=False)
    assert text.endswith("<|im_start|>assistant\n<think>\nGreet.\n</think>\n\nHello.<|im_end|>\n")


def _engine_ids(proxy: Running, reply: str) -> list[int]:
    """The scripted engine's tokens for ``reply``: its text, then end-of-sequence."""
    tokenizer: Any = proxy.tokenizer
    return [*tokenizer.encode(reply, add_special_tokens=False), tokenizer.eos_token_id]


def _check_recorded(proxy: Running, execution: str) -> None:
    """Two calls, one chain, each node's output the engine's own tokens; the prompts
    end with the opened reasoning, and the second prompt adds only the new turn."""
    tokenizer: Any = proxy.tokenizer
    first, second = proxy.tree(execution)
    assert (first["parent"], second["parent"]) == (None, 0)
    for node, reply in zip((first, second), OPENED_SCRIPT["default"], strict=True):
        assert node["output_ids"] == _engine_ids(proxy, reply)
        assert tokenizer.decode(node["input_ids"]).endswith("<|im_start|>assistant\n<think>\n")
    assert tokenizer.decode(second["input_ids"]) == (
        "\n<|im_start|>user\n<tool_response>\na.txt\nb.txt\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )


def test_openai_sdk_reasoning_opened_by_the_prompt_streams_as_it_answers_whole(
    thinking_proxy: Running,
) -> None:
    answers = []
    for stream in (False, True):
        ex = thinking_proxy.new_execution()
        client = gpt(thinking_proxy, ex)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "List the files."}]
        kwargs: dict[str, Any] = {"model": "tiny", "tools": OPENAI_TOOLS, "max_tokens": 300}
        for _ in range(2):
            if stream:
                chunks = client.chat.completions.create(messages=messages, stream=True, **kwargs)
                deltas = [c.choices[0].delta for c in chunks if c.choices]
                reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
                content = "".join(d.content or "" for d in deltas)
                calls = [
                    {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments}
                    for d in deltas
                    for tc in d.tool_calls or ()
                ]
                if calls:  # a call streams as its header, then its arguments
                    arguments = "".join(c["arguments"] or "" for c in calls)
                    calls = [{**calls[0], "arguments": arguments}]
            else:
                made = client.chat.completions.create(messages=messages, **kwargs)
                message = made.choices[0].message
                reasoning, content = getattr(message, "reasoning_content", None), message.content
                calls = [
                    {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments}
                    for tc in message.tool_calls or ()
                ]
            answers.append(
                (stream, reasoning, content, [(c["name"], c["arguments"]) for c in calls])
            )
            if not calls:
                break
            [call] = calls
            messages += [
                {
                    "role": "assistant",
                    "content": content,
                    "reasoning_content": reasoning,
                    "tool_calls": [
                        {
                            "id": call["id"],
                            "type": "function",
                            "function": {"name": call["name"], "arguments": call["arguments"]},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": call["id"], "content": "a.txt\nb.txt"},
            ]
        _check_recorded(thinking_proxy, ex["id"])
    whole, streamed = answers[:2], answers[2:]
    assert [a[1:] for a in streamed] == [a[1:] for a in whole]
    [(_, reasoning, content, [(name, arguments)]), (_, *last)] = whole
    assert (reasoning, content, name) == ("The user wants the files.", "Let me look.", "bash")
    assert json.loads(arguments) == {"cmd": "ls -la", "timeout": 30}
    assert last == ["Both are listed.", "Two files: a.txt and b.txt.", []]


def test_anthropic_sdk_reasoning_opened_by_the_prompt_is_a_thinking_block_streamed_or_whole(
    thinking_proxy: Running,
) -> None:
    answers = []
    for stream in (False, True):
        ex = thinking_proxy.new_execution()
        client = claude(thinking_proxy, ex)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "List the files."}]
        kwargs: dict[str, Any] = {"model": "tiny", "tools": ANTHROPIC_TOOLS, "max_tokens": 300}
        for _ in range(2):
            if stream:
                with client.messages.stream(messages=messages, **kwargs) as events:  # type: ignore[arg-type]
                    deltas = [e.delta for e in events if e.type == "content_block_delta"]
                    reply = events.get_final_message()
                thought = "".join(d.thinking for d in deltas if d.type == "thinking_delta")
                said = "".join(d.text for d in deltas if d.type == "text_delta")
                thinking = [b.thinking for b in reply.content if b.type == "thinking"]
                assert [thought] == thinking and [said] == [
                    b.text for b in reply.content if b.type == "text"
                ]
            else:
                reply = client.messages.create(messages=messages, **kwargs)  # type: ignore[arg-type]
            answers.append(
                (
                    [b.model_dump(exclude={"id", "signature"}) for b in reply.content],
                    reply.stop_reason,
                )
            )
            uses = [b for b in reply.content if b.type == "tool_use"]
            if not uses:
                break
            messages += [
                {"role": "assistant", "content": [b.model_dump() for b in reply.content]},
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": uses[0].id,
                            "content": "a.txt\nb.txt",
                        }
                    ],
                },
            ]
        _check_recorded(thinking_proxy, ex["id"])
    whole, streamed = answers[:2], answers[2:]
    assert streamed == whole
    (first, stop), (second, end) = whole
    assert [(b["type"], b.get("thinking") or b.get("text") or b.get("input")) for b in first] == [
        ("thinking", "The user wants the files."),
        ("text", "Let me look."),
        ("tool_use", {"cmd": "ls -la", "timeout": 30}),
    ]
    assert stop == "tool_use" and end == "end_turn"
    assert [(b["type"], b.get("thinking") or b.get("text")) for b in second] == [
        ("thinking", "Both are listed."),
        ("text", "Two files: a.txt and b.txt."),
    ]
