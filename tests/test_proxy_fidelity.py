"""What the harness sent is what the model saw, and what the model sampled is what the
harness got: whitespace, stop sequences, sampling parameters, real streaming."""

from __future__ import annotations

import json
import time
from pathlib import Path

import anthropic
import httpx2
import pytest
from tests.test_proxy_server import TOOLS_ANTHROPIC, Running, claude, gpt, start
from transformers import AutoTokenizer

from qwengyre.engines.base import GenerateRequest
from qwengyre.engines.scripted import ScriptedEngine

TOOL_REPLY = 'Look.\n<tool_call>\n{"name": "bash", "arguments": {"cmd": "cat f.py"}}\n</tool_call>'


class Recording(ScriptedEngine):
    """Remembers the sampling parameters of every request it gets."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.requests: list[GenerateRequest] = []

    def stream(self, request):  # type: ignore[no-untyped-def]
        self.requests.append(request)
        return super().stream(request)


def running(tmp_path: Path, model: Path, script: dict, **kw):  # type: ignore[no-untyped-def]
    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = Recording(tokenizer, script, **kw.pop("engine_kw", {}))
    gen = start(tmp_path, model, engines=[engine], **kw)
    return gen, next(gen), engine


def test_whitespace_reaches_the_model_exactly_and_an_edit_in_it_branches(
    tmp_path: Path, tiny_model_dir: Path
):
    gen, proxy, _ = running(tmp_path, tiny_model_dir, {"default": [TOOL_REPLY, "ok"]})
    try:
        ex = proxy.new_execution()
        messages: list[dict] = [{"role": "user", "content": "  show f.py\n"}]
        first = claude(proxy, ex).messages.create(
            model="tiny", max_tokens=64, tools=TOOLS_ANTHROPIC, messages=messages
        )
        use = first.content[1]
        code = "    def f():\n\treturn 1  \n"
        result = {"type": "tool_result", "tool_use_id": use.id, "content": code}
        messages += [
            {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {"role": "user", "content": [result]},
        ]
        claude(proxy, ex).messages.create(
            model="tiny", max_tokens=64, tools=TOOLS_ANTHROPIC, messages=messages
        )
        nodes = proxy.tree(ex["id"])
        assert "  show f.py\n<|im_end|>" in proxy.tokenizer.decode(nodes[0]["input_ids"])
        assert f"<tool_response>\n{code}\n</tool_response>" in proxy.tokenizer.decode(
            nodes[1]["input_ids"]
        )
        assert nodes[1]["parent"] == 0
        # The same history with the reply's text edited only in whitespace is not the
        # recorded call's history: it does not extend it.
        edited = json.loads(json.dumps(messages))
        edited[1]["content"][0]["text"] = first.content[0].text + " "
        claude(proxy, ex).messages.create(
            model="tiny", max_tokens=64, tools=TOOLS_ANTHROPIC, messages=edited
        )
        assert proxy.tree(ex["id"])[2]["parent"] is None
    finally:
        gen.close()


@pytest.mark.parametrize("force", [True, False])
def test_the_engine_samples_the_distribution_the_log_probs_are_recorded_for(
    tmp_path: Path, tiny_model_dir: Path, force: bool
):
    gen, proxy, engine = running(
        tmp_path, tiny_model_dir, {"default": ["hi"]}, force_sampling=force, temperature=0.7
    )
    try:
        ex = proxy.new_execution()
        claude(proxy, ex).messages.create(
            model="tiny",
            max_tokens=8,
            messages=[{"role": "user", "content": "x"}],
            # Claude Code sends them; this SDK release no longer takes them as arguments.
            extra_body={"temperature": 0.2, "top_p": 0.5, "top_k": 3},
        )
        gpt(proxy, ex).chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "y"}],
            temperature=0.2,
            top_p=0.5,
            max_tokens=8,
        )
        seen = [
            (r.sampling.temperature, r.sampling.top_p, r.sampling.top_k) for r in engine.requests
        ]
        assert seen == ([(0.7, 1.0, -1)] * 2 if force else [(0.2, 0.5, 3), (0.2, 0.5, -1)])
    finally:
        gen.close()


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences_stop_the_engine_and_are_reported_in_both_apis(
    tmp_path: Path, tiny_model_dir: Path, stream: bool
):
    gen, proxy, _ = running(tmp_path, tiny_model_dir, {"default": ["Alpha beta STOP gamma"]})
    try:
        ex = proxy.new_execution()
        ask = {"model": "tiny", "max_tokens": 32, "messages": [{"role": "user", "content": "x"}]}
        if stream:
            with claude(proxy, ex).messages.stream(**ask, stop_sequences=["STOP"]) as s:
                message = s.get_final_message()
        else:
            message = claude(proxy, ex).messages.create(**ask, stop_sequences=["STOP", "zzz"])
        assert message.content[0].text == "Alpha beta"
        assert message.stop_reason == "stop_sequence" and message.stop_sequence == "STOP"
        completion = gpt(proxy, ex).chat.completions.create(**ask, stop=["STOP"], stream=stream)
        if stream:
            chunks = list(completion)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            text, finish = (
                completion.choices[0].message.content,
                completion.choices[0].finish_reason,
            )
        assert (text, finish) == ("Alpha beta", "stop")
        for node in proxy.tree(ex["id"]):  # the engine's tokens, up to the stop string
            decoded = proxy.tokenizer.decode(node["output_ids"])
            assert decoded.endswith("STOP") and "gamma" not in decoded
    finally:
        gen.close()


def test_streaming_sends_tokens_as_the_engine_makes_them_and_pings_before(
    tmp_path: Path, tiny_model_dir: Path
):
    reply = "one two three four five six seven eight nine ten"
    gen, proxy, engine = running(
        tmp_path,
        tiny_model_dir,
        {"default": [reply]},
        engine_kw={"prefill_s": 0.6, "delay_s": 2.0},
        ping_s=0.1,
    )
    try:
        ex = proxy.new_execution()
        body = {
            "model": "tiny",
            "max_tokens": 64,
            "stream": True,
            "messages": [{"role": "user", "content": "count"}],
        }
        headers = {"x-api-key": ex["key"]}
        events: list[tuple[str, int]] = []  # (event, engine load when it arrived)
        with httpx2.stream(
            "POST", proxy.url + "/v1/messages", json=body, headers=headers, timeout=30
        ) as response:
            for line in response.iter_lines():
                if line.startswith("event: "):
                    events.append((line[7:], engine.load))
        names = [name for name, _ in events]
        assert names[0] == "message_start" and names[-1] == "message_stop"
        first_text = names.index("content_block_delta")
        assert "ping" in names[:first_text]  # kept alive during the prefill
        assert events[first_text][1] == 1  # the first text arrived while generating
        deltas = [name for name in names if name == "content_block_delta"]
        assert len(deltas) > 1
        deadline = time.monotonic() + 5  # marked just after the last event was written
        while not proxy.tree(ex["id"])[0]["delivered"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [n["delivered"] for n in proxy.tree(ex["id"])] == [True]
    finally:
        gen.close()


def test_head_on_an_execution_base_url_answers_200(proxy: Running):
    ex = proxy.new_execution()
    for url in (ex["base_url"], ex["base_url"] + "/"):
        assert httpx2.head(url, timeout=10).status_code == 200


@pytest.fixture
def proxy(tmp_path: Path, tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    yield from start(tmp_path, tiny_model_dir)


def test_a_streamed_reply_matches_the_recorded_one_and_extends_it(
    tmp_path: Path, tiny_model_dir: Path
):
    gen, proxy, _ = running(tmp_path, tiny_model_dir, {"default": [TOOL_REPLY, "done"]})
    try:
        ex = proxy.new_execution()
        messages: list[dict] = [{"role": "user", "content": "go"}]
        client = claude(proxy, ex)
        with client.messages.stream(
            model="tiny", max_tokens=64, tools=TOOLS_ANTHROPIC, messages=messages
        ) as s:
            first = s.get_final_message()
        assert first.content[0].text == "Look." and first.stop_reason == "tool_use"
        messages += [
            {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": first.content[1].id, "content": "x"}
                ],
            },
        ]
        client.messages.create(
            model="tiny", max_tokens=64, tools=TOOLS_ANTHROPIC, messages=messages
        )
        assert [n["parent"] for n in proxy.tree(ex["id"])] == [None, 0]
    finally:
        gen.close()


def test_anthropic_overloaded_before_the_stream_started_is_a_plain_error(proxy: Running):
    ex = proxy.new_execution()
    proxy.run(proxy.server.router.drain("scripted"))
    with (
        pytest.raises(anthropic.APIStatusError) as err,
        claude(proxy, ex).messages.stream(
            model="tiny", max_tokens=8, messages=[{"role": "user", "content": "x"}]
        ) as s,
    ):
        s.get_final_message()
    assert err.value.status_code == 529


def test_openai_streamed_logprobs_arrive_with_the_text_and_add_up_to_the_record(
    tmp_path: Path, tiny_model_dir: Path
):
    reply = "one two three four five six seven eight nine ten eleven twelve"
    gen, proxy, _ = running(
        tmp_path, tiny_model_dir, {"default": [reply]}, engine_kw={"delay_s": 0.4}
    )
    try:
        ex = proxy.new_execution()
        chunks = list(
            gpt(proxy, ex).chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "count"}],
                logprobs=True,
                stream=True,
            )
        )
        with_lp = [c for c in chunks if c.choices and c.choices[0].logprobs is not None]
        assert len(with_lp) > 1  # not all on the final chunk
        streamed = [t.logprob for c in with_lp for t in c.choices[0].logprobs.content]
        (node,) = proxy.tree(ex["id"])
        assert streamed == pytest.approx(node["logprobs"])
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == reply
    finally:
        gen.close()
