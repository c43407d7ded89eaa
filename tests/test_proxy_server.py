"""The proxy end to end: a live server on 127.0.0.1, the official SDKs as clients."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx2
import openai
import pytest
from aiohttp import web
from transformers import AutoTokenizer

from qwengyre.apps.serve import ADMIN_TOKEN_ENV, resolve_admin_token
from qwengyre.cli import main as cli_main
from qwengyre.engines.scripted import ScriptedEngine
from qwengyre.proxy.render import ChatRenderer
from qwengyre.proxy.routing import Router
from qwengyre.proxy.server import ProxyServer
from qwengyre.proxy.store import Store

ADMIN = "admin-token-for-tests-0123456789"
TOOL_REPLY = (
    'Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls -la"}}\n</tool_call>'
)
SCRIPT = {
    "main.task": [TOOL_REPLY, "All done: two files."],
    "sub.task": ["Sub-agent report: nothing to fix."],
    "main.summary": ["Summary: listed files."],
    "main.side": ["A title"],
}
TOOLS_ANTHROPIC = [
    {
        "name": "bash",
        "description": "Run a shell command",
        "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}},
    }
]
TOOLS_OPENAI = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        },
    }
]


@dataclass
class Running:
    url: str
    server: ProxyServer
    tokenizer: object
    loop: asyncio.AbstractEventLoop

    def admin(self, method: str, path: str) -> httpx2.Response:
        headers = {"authorization": f"Bearer {ADMIN}"}
        return httpx2.request(method, self.url + path, headers=headers, timeout=30)

    def new_execution(self) -> dict[str, str]:
        response = self.admin("POST", "/admin/executions")
        assert response.status_code == 201, response.text
        return response.json()

    def tree(self, execution_id: str) -> list[dict]:
        response = self.admin("GET", f"/admin/executions/{execution_id}/tree")
        assert response.status_code == 200, response.text
        return response.json()["nodes"]

    def run(self, coro):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)


def start(
    store_dir: Path, model_dir: Path, engines: list[ScriptedEngine] | None = None, **kw
) -> Iterator[Running]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    router = Router()
    for i, engine in enumerate(engines or [ScriptedEngine(tokenizer, SCRIPT)]):
        router.register(engine, preference=i)
    server = ProxyServer(
        ChatRenderer(tokenizer),
        router,
        kw.pop("store", None) or Store(store_dir / "proxy.sqlite"),
        model="tiny",
        max_context=kw.pop("max_context", 4096),
        admin_token=ADMIN,
        **kw,
    )
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, object] = {}

    async def boot() -> None:
        runner = web.AppRunner(server.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        holder["runner"], holder["url"] = runner, f"http://127.0.0.1:{port}"
        server.base_url = holder["url"]
        ready.set()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(boot(), loop)
    assert ready.wait(30)
    try:
        yield Running(str(holder["url"]), server, tokenizer, loop)
    finally:
        asyncio.run_coroutine_threadsafe(holder["runner"].cleanup(), loop).result(30)  # type: ignore[attr-defined]
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        server.store.close()


@pytest.fixture
def proxy(tmp_path: Path, tiny_model_dir: Path) -> Iterator[Running]:
    yield from start(tmp_path, tiny_model_dir)


def claude(proxy: Running, ex: dict[str, str], **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key=ex["key"], base_url=proxy.url, max_retries=0, **kw)


def gpt(proxy: Running, ex: dict[str, str]) -> openai.OpenAI:
    return openai.OpenAI(api_key=ex["key"], base_url=proxy.url + "/v1", max_retries=0)


def test_anthropic_tool_loop_records_a_chain_with_only_new_tokens(proxy: Running):
    ex = proxy.new_execution()
    client = claude(proxy, ex)
    messages: list[dict] = [{"role": "user", "content": "List the files."}]
    first = client.messages.create(
        model="tiny",
        max_tokens=200,
        system="You are a coder.",
        tools=TOOLS_ANTHROPIC,
        messages=messages,
    )
    assert first.stop_reason == "tool_use"
    text, tool_use = first.content
    assert text.text == "Let me look." and tool_use.input == {"cmd": "ls -la"}
    # Claude Code streams; the reply goes back with the tool result (reformatted JSON).
    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": tool_use.id,
                    "content": [{"type": "text", "text": "a.txt\nb.txt"}],
                }
            ],
        },
    ]
    with client.messages.stream(
        model="tiny",
        max_tokens=200,
        system="You are a coder.",
        tools=TOOLS_ANTHROPIC,
        messages=messages,
    ) as stream:
        second = stream.get_final_message()
    assert second.content[0].text == "All done: two files." and second.stop_reason == "end_turn"
    nodes = proxy.tree(ex["id"])
    assert [n["parent"] for n in nodes] == [None, 0]
    assert [n["class"] for n in nodes] == ["main.task", "main.task"]
    tok = proxy.tokenizer
    # The engine's own output tokens are reused verbatim; only the new turn is encoded.
    suffix = tok.decode(nodes[1]["input_ids"])
    assert suffix.startswith("\n<|im_start|>user\n<tool_response>\na.txt\nb.txt")
    assert "List the files." not in suffix
    assert suffix.endswith("<|im_start|>assistant\n")
    assert nodes[1]["provenance"] == [0] * len(nodes[1]["input_ids"]) + [1] * len(
        nodes[1]["output_ids"]
    )
    assert second.usage.input_tokens == sum(
        len(n["input_ids"]) + len(n["output_ids"]) for n in nodes[:1]
    ) + len(nodes[1]["input_ids"])


def test_openai_with_logprobs_streaming_and_a_tool_round(proxy: Running):
    ex = proxy.new_execution()
    client = gpt(proxy, ex)
    messages: list[dict] = [
        {"role": "system", "content": "You are a coder."},
        {"role": "user", "content": "List the files."},
    ]
    first = client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS_OPENAI, logprobs=True, max_tokens=200
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert json.loads(call.function.arguments) == {"cmd": "ls -la"}
    nodes = proxy.tree(ex["id"])
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(nodes[0]["logprobs"])
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "a.txt\nb.txt"},
    ]
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=TOOLS_OPENAI,
        stream=True,
        max_tokens=200,
        stream_options={"include_usage": True},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "All done: two files."
    assert [n["parent"] for n in proxy.tree(ex["id"])] == [None, 0]


def test_credentials_isolate_executions_and_revocation_records_nothing(proxy: Running):
    a, b = proxy.new_execution(), proxy.new_execution()
    with pytest.raises(anthropic.AuthenticationError):
        claude(proxy, {"key": "qg-unknown"}).messages.create(
            model="tiny", max_tokens=10, messages=[{"role": "user", "content": "hi"}]
        )
    # A's key on B's base-URL prefix is refused.
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(
            api_key=a["key"], base_url=b["base_url"], max_retries=0
        ).messages.create(model="tiny", max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    # The prefix with its own key works.
    ok = anthropic.Anthropic(api_key=b["key"], base_url=b["base_url"], max_retries=0)
    ok.messages.create(model="tiny", max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    assert proxy.admin("DELETE", f"/admin/executions/{b['id']}").status_code == 200
    with pytest.raises(anthropic.AuthenticationError):
        ok.messages.create(model="tiny", max_tokens=10, messages=[{"role": "user", "content": "x"}])
    assert len(proxy.tree(b["id"])) == 1 and proxy.tree(a["id"]) == []
    assert httpx2.post(proxy.url + "/admin/executions").status_code == 401
    assert proxy.admin("GET", "/admin/executions/..%2F..%2Fetc/tree").status_code == 404


def test_an_execution_s_base_url_serves_both_sdks(proxy: Running):
    """The one ``base_url`` an execution gets works for Anthropic and OpenAI clients
    alike (``openai_base_url``, ending in /v1, too)."""
    ex = proxy.new_execution()
    hi = [{"role": "user", "content": "hi"}]
    for base in (ex["base_url"], ex["openai_base_url"]):
        client = openai.OpenAI(api_key=ex["key"], base_url=base, max_retries=0)
        assert client.chat.completions.create(model="tiny", max_tokens=5, messages=hi).choices
    anthropic.Anthropic(api_key=ex["key"], base_url=ex["base_url"], max_retries=0).messages.create(
        model="tiny", max_tokens=5, messages=hi
    )
    assert len(proxy.tree(ex["id"])) == 3


def test_subagents_and_compaction_are_classified_and_branch(proxy: Running):
    ex = proxy.new_execution()
    client = claude(proxy, ex)
    client.messages.create(
        model="tiny",
        max_tokens=50,
        system="Main.",
        tools=TOOLS_ANTHROPIC,
        messages=[{"role": "user", "content": "Fix the bug."}],
    )
    client.messages.create(
        model="tiny",
        max_tokens=50,
        system="You are a sub-agent.",
        tools=TOOLS_ANTHROPIC,
        messages=[{"role": "user", "content": "Investigate."}],
        extra_headers={"x-claude-code-agent-id": "agent-7"},
    )
    client.messages.create(
        model="tiny",
        max_tokens=50,
        system="Main.",
        tools=TOOLS_ANTHROPIC,
        messages=[{"role": "user", "content": "CRITICAL: Respond with TEXT ONLY. Summarise."}],
    )
    client.messages.create(
        model="tiny", max_tokens=50, messages=[{"role": "user", "content": "Title?"}]
    )
    nodes = proxy.tree(ex["id"])
    assert [(n["class"], n["agent_id"], n["parent"]) for n in nodes] == [
        ("main.task", "main", None),
        ("sub.task", "agent-7", None),
        ("main.summary", "main", None),
        ("main.side", "main", None),
    ]


def test_context_limits_answer_in_each_apis_shape(tmp_path: Path, tiny_model_dir: Path):
    for running in start(tmp_path, tiny_model_dir, max_context=64):
        ex = running.new_execution()
        long = "word " * 200
        with pytest.raises(anthropic.BadRequestError, match=r"prompt is too long: \d+ tokens > 64"):
            claude(running, ex).messages.create(
                model="tiny", max_tokens=10, messages=[{"role": "user", "content": long}]
            )
        with pytest.raises(openai.BadRequestError) as err:
            gpt(running, ex).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": long}]
            )
        assert err.value.code == "context_length_exceeded"
        assert running.tree(ex["id"]) == []


def test_bad_input_gets_api_shaped_errors_and_the_server_keeps_serving(
    tmp_path: Path, tiny_model_dir: Path
):
    for running in start(tmp_path, tiny_model_dir, max_body_bytes=4096):
        ex = running.new_execution()
        headers = {"x-api-key": ex["key"], "content-type": "application/json"}
        bad = httpx2.post(running.url + "/v1/messages", content=b"{not json", headers=headers)
        assert bad.status_code == 400 and bad.json()["type"] == "error"
        assert bad.json()["error"]["type"] == "invalid_request_error"
        huge = httpx2.post(
            running.url + "/v1/messages", content=b"x" * 10000, headers=headers, timeout=30
        )
        assert huge.status_code == 413 and huge.json()["error"]["type"] == "request_too_large"
        wrong = httpx2.post(
            running.url + "/v1/chat/completions",
            json={"model": "t", "messages": "hello"},
            headers={"authorization": f"Bearer {ex['key']}"},
        )
        assert wrong.status_code == 400 and "messages" in wrong.json()["error"]["message"]
        assert running.tree(ex["id"]) == []
        claude(running, ex).messages.create(
            model="tiny", max_tokens=10, messages=[{"role": "user", "content": "still ok?"}]
        )
        assert len(running.tree(ex["id"])) == 1


def test_a_restarted_proxy_serves_the_same_executions_and_trees(
    tmp_path: Path, tiny_model_dir: Path
):
    messages: list[dict] = [{"role": "user", "content": "List the files."}]
    for running in start(tmp_path, tiny_model_dir):
        ex = running.new_execution()
        first = claude(running, ex).messages.create(
            model="tiny", max_tokens=200, tools=TOOLS_ANTHROPIC, messages=messages
        )
        before = running.tree(ex["id"])
    tool_use = first.content[1]
    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "a.txt"}],
        },
    ]
    for running in start(tmp_path, tiny_model_dir):
        assert running.tree(ex["id"]) == before
        claude(running, ex).messages.create(
            model="tiny", max_tokens=200, tools=TOOLS_ANTHROPIC, messages=messages
        )
        assert [n["parent"] for n in running.tree(ex["id"])] == [None, 0]


def test_draining_an_engine_mid_call_reroutes_without_error_or_duplicate(
    tmp_path: Path, tiny_model_dir: Path
):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    slow = ScriptedEngine(tokenizer, SCRIPT, name="cell-1", delay_s=5.0)
    other = ScriptedEngine(tokenizer, SCRIPT, name="standalone", delay_s=0.0)
    # "cell-1" is preferred, so every execution starts there.
    for running in start(tmp_path, tiny_model_dir, engines=[other, slow]):
        executions = [running.new_execution() for _ in range(4)]
        results: dict[str, str] = {}

        def call(ex: dict[str, str], running: Running = running, results: dict = results) -> None:
            reply = claude(running, ex).messages.create(
                model="tiny", max_tokens=50, messages=[{"role": "user", "content": "hi"}]
            )
            results[ex["id"]] = reply.content[0].text

        threads = [threading.Thread(target=call, args=(ex,)) for ex in executions]
        for t in threads:
            t.start()
        for _ in range(1000):  # up to 10 s on a loaded machine
            if slow.load == 4:
                break
            threading.Event().wait(0.01)
        assert slow.load == 4
        moved = running.run(running.server.router.drain("cell-1"))
        assert sorted(moved) == sorted(e["id"] for e in executions)
        for t in threads:
            t.join(20)
        assert len(results) == 4 and set(results.values()) == {"A title"}
        for ex in executions:
            nodes = running.tree(ex["id"])
            assert len(nodes) == 1 and nodes[0]["engine"] == "standalone"


class DyingEngine(ScriptedEngine):
    """Fails like a crashed server once its calls are in flight."""

    async def stream(self, request):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.2)
        raise ConnectionResetError("engine process died")
        yield  # an async generator, as the router consumes engines


def test_a_dying_engine_is_drained_and_its_calls_retried_elsewhere(
    tmp_path: Path, tiny_model_dir: Path
):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    dying = DyingEngine(tokenizer, SCRIPT, name="cell-2")
    healthy = ScriptedEngine(tokenizer, SCRIPT, name="cell-1")
    for running in start(tmp_path, tiny_model_dir, engines=[healthy, dying]):
        ex = running.new_execution()
        reply = claude(running, ex).messages.create(
            model="tiny", max_tokens=20, messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.content[0].text == "A title"
        nodes = running.tree(ex["id"])
        assert len(nodes) == 1 and nodes[0]["engine"] == "cell-1"
        assert running.server.router.route_of(ex["id"]) == "cell-1"


def test_no_accepting_engine_answers_overloaded_with_retry_after(proxy: Running):
    ex = proxy.new_execution()
    proxy.run(proxy.server.router.drain("scripted"))
    raw = httpx2.post(
        proxy.url + "/v1/messages",
        json={"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
        headers={"x-api-key": ex["key"]},
    )
    assert raw.status_code == 529 and raw.json()["error"]["type"] == "overloaded_error"
    assert raw.headers["retry-after"] == "1"
    with pytest.raises(openai.APIStatusError) as err:
        gpt(proxy, ex).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}]
        )
    assert err.value.status_code == 503
    proxy.server.router.resume("scripted")
    claude(proxy, ex).messages.create(
        model="tiny", max_tokens=5, messages=[{"role": "user", "content": "x"}]
    )
    assert len(proxy.tree(ex["id"])) == 1


def test_unknown_routes_and_internal_failures_answer_in_api_shape(proxy: Running):
    ex = proxy.new_execution()
    missing = httpx2.get(proxy.url + "/v1/nothing-here", headers={"x-api-key": ex["key"]})
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "not_found_error"

    async def explode(*args):  # type: ignore[no-untyped-def]
        raise RuntimeError("disk on fire")

    proxy.server._reply = explode  # type: ignore[method-assign]
    with pytest.raises(openai.InternalServerError):
        gpt(proxy, ex).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}]
        )
    assert proxy.tree(ex["id"]) == []


# ------------------------------------------------------------ bad input (each failed unfixed)


def _raw(proxy: Running, path: str, content: bytes, headers: dict[str, object]) -> httpx2.Response:
    return httpx2.post(proxy.url + path, content=content, headers=headers, timeout=30)  # type: ignore[arg-type]


def _anthropic_error(response: httpx2.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return str(body["error"]["message"])


def test_deep_json_and_deep_tool_schemas_are_400s_logged_in_one_line(
    proxy: Running, caplog: pytest.LogCaptureFixture
):
    ex = proxy.new_execution()
    headers = {"x-api-key": ex["key"]}
    deep = b'{"model":"m","max_tokens":5,"messages":[' + b"[" * 50_000 + b"]" * 50_000 + b"]}"
    schema = '{"type":"string"}'
    for _ in range(250):  # ~500 levels: it used to recurse through the chat template
        schema = '{"type":"object","properties":{"a":' + schema + "}}"
    tools = '[{"name":"t","input_schema":' + schema + "}]"
    body = '{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"x"}],"tools":'
    with caplog.at_level(logging.INFO):
        for content in (deep, (body + tools + "}").encode()):
            message = _anthropic_error(
                _raw(proxy, "/v1/messages", content, headers), 400, "invalid_request_error"
            )
            assert "nesting exceeds the limit of 64 levels" in message
    assert not [r for r in caplog.records if r.exc_info]
    assert len(caplog.text) < 2000  # was 294 KB of traceback for a 3.7 KB request
    assert proxy.tree(ex["id"]) == []


def test_a_lone_surrogate_in_openai_content_becomes_u_fffd(proxy: Running):
    ex = proxy.new_execution()
    body = b'{"model":"tiny","max_tokens":5,"messages":[{"role":"user","content":"hi\\ud800"}]}'
    answer = _raw(proxy, "/v1/chat/completions", body, {"authorization": f"Bearer {ex['key']}"})
    assert answer.status_code == 200, answer.text
    (node,) = proxy.tree(ex["id"])
    assert "hi\ufffd" in proxy.tokenizer.decode(node["input_ids"])  # type: ignore[attr-defined]


def test_content_encodings_decode_or_answer_400(tmp_path: Path, tiny_model_dir: Path):
    body = json.dumps(
        {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    ).encode()
    for running in start(tmp_path, tiny_model_dir, max_body_bytes=4096):
        ex = running.new_execution()
        key = {"x-api-key": ex["key"]}
        for encoding, content in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body))):
            answer = _raw(running, "/v1/messages", content, {**key, "content-encoding": encoding})
            assert answer.status_code == 200, answer.text
        # gzip said, not gzip sent: aiohttp used to raise inside read() (a 500, a traceback)
        bad = _raw(running, "/v1/messages", body, {**key, "content-encoding": "gzip"})
        assert "not valid gzip data" in _anthropic_error(bad, 400, "invalid_request_error")
        cut = _raw(
            running,
            "/v1/chat/completions",
            gzip.compress(body)[:-4],
            {**key, "content-encoding": "gzip"},
        )
        assert cut.status_code == 400 and "truncated" in cut.json()["error"]["message"]
        for unknown in ("br", "compress", "gzip, gzip"):
            answer = _raw(running, "/v1/messages", body, {**key, "content-encoding": unknown})
            assert "is not supported" in _anthropic_error(answer, 400, "invalid_request_error")
        bomb = gzip.compress(b" " * 100_000)  # small when sent, too large decoded
        answer = _raw(running, "/v1/messages", bomb, {**key, "content-encoding": "gzip"})
        _anthropic_error(answer, 413, "request_too_large")
        assert len(running.tree(ex["id"])) == 2


def test_non_utf8_credentials_are_401s_on_both_apis_and_the_admin_api(proxy: Running):
    ex = proxy.new_execution()
    body = json.dumps(
        {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    )
    for credential in (
        {"x-api-key": ex["key"].encode() + b"\xff"},
        {"authorization": b"Bearer \xff\xfe" + ex["key"].encode()},
    ):
        answer = _raw(proxy, "/v1/messages", body.encode(), credential)
        _anthropic_error(answer, 401, "authentication_error")
        answer = _raw(proxy, "/v1/chat/completions", body.encode(), credential)
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
    admin = {"authorization": b"Bearer " + ADMIN.encode() + b"\xff"}
    answer = httpx2.post(proxy.url + "/admin/executions", headers=admin)  # type: ignore[arg-type]
    _anthropic_error(answer, 401, "authentication_error")
    assert proxy.tree(ex["id"]) == []


def test_the_bearer_scheme_works_in_any_case(proxy: Running):
    for scheme in ("bearer", "BEARER", "bEaReR"):
        created = httpx2.post(
            proxy.url + "/admin/executions", headers={"authorization": f"{scheme} {ADMIN}"}
        )
        assert created.status_code == 201, created.text
        ex = created.json()
        answer = httpx2.post(
            proxy.url + "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
            headers={"authorization": f"{scheme}  {ex['key']}"},
        )
        assert answer.status_code == 200, answer.text


def test_admin_errors_are_json_in_the_anthropic_shape(proxy: Running):
    ex = proxy.new_execution()
    anonymous = httpx2.get(proxy.url + f"/admin/executions/{ex['id']}/tree")
    assert "admin token required" in _anthropic_error(anonymous, 401, "authentication_error")
    missing = proxy.admin("DELETE", "/admin/executions/ex_nope")
    assert "no execution 'ex_nope'" in _anthropic_error(missing, 404, "not_found_error")
    _anthropic_error(proxy.admin("GET", "/admin/executions"), 404, "not_found_error")
    _anthropic_error(proxy.admin("GET", "/admin/nothing"), 404, "not_found_error")


def _strict(data: bytes) -> object:
    def refuse(name: str) -> object:
        raise ValueError(name)

    return json.loads(data.decode("utf-8"), parse_constant=refuse)


def test_replies_with_nan_infinity_or_lone_surrogates_answer_valid_json(
    tmp_path: Path, tiny_model_dir: Path
):
    nan = '<tool_call>\n{"name": "bash", "arguments": {"x": NaN, "y": -Infinity}}\n</tool_call>'
    surrogate = '<tool_call>\n{"name": "bash", "arguments": {"s": "a\\ud800b"}}\n</tool_call>'
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = ScriptedEngine(tokenizer, {"default": [nan]})
    for running in start(tmp_path, tiny_model_dir, engines=[engine]):
        ex = running.new_execution()
        key = {"x-api-key": ex["key"]}
        for stream in (False, True):
            request = {
                "model": "tiny",
                "max_tokens": 200,
                "stream": stream,
                "messages": [{"role": "user", "content": "go"}],
            }
            engine.script = {"default": [nan]}
            answer = _raw(running, "/v1/messages", json.dumps(request).encode(), key)
            assert answer.status_code == 200, answer.text
            if not stream:  # the block stays text: it was passed through as invalid JSON
                body = _strict(answer.content)
                assert body["content"] == [{"type": "text", "text": nan}]  # type: ignore[index]
            engine.script = {"default": [surrogate]}
            answer = _raw(running, "/v1/chat/completions", json.dumps(request).encode(), key)
            assert answer.status_code == 200, answer.text
            if stream:
                lines = answer.content.decode("utf-8").split("\n\n")
                chunks = [_strict(x[6:].encode()) for x in lines if x[6:] not in ("", "[DONE]")]
                arguments = "".join(
                    call["function"]["arguments"]
                    for chunk in chunks
                    for call in chunk["choices"][0]["delta"].get("tool_calls", ())  # type: ignore[index]
                )
            else:
                message = _strict(answer.content)["choices"][0]["message"]  # type: ignore[index]
                arguments = message["tool_calls"][0]["function"]["arguments"]
            assert json.loads(arguments) == {"s": "a\ud800b"}  # lossless


def test_the_admin_token_comes_from_argv_a_file_or_the_environment(tmp_path: Path):
    token = "t" * 16
    path = tmp_path / "token"
    path.write_text(f"  {token}-file\n")
    env = {ADMIN_TOKEN_ENV: f"{token}-env"}
    assert resolve_admin_token(f"{token}-argv", None, env) == f"{token}-argv"
    assert resolve_admin_token(None, path, env) == f"{token}-file"
    assert resolve_admin_token(None, None, env) == f"{token}-env"
    assert resolve_admin_token(None, None, {ADMIN_TOKEN_ENV: ""}) is None  # generated
    with pytest.raises(ValueError, match="cannot read the admin token file"):
        resolve_admin_token(None, tmp_path / "missing", env)
    with pytest.raises(ValueError, match=r"from \$QWENGYRE_ADMIN_TOKEN has 5 characters"):
        resolve_admin_token(None, None, {ADMIN_TOKEN_ENV: "short"})
    with pytest.raises(ValueError, match="not both"):
        resolve_admin_token(token, path, env)
    args = ["proxy", "serve", "--model", "m", "--store", str(tmp_path), "--admin-token-file"]
    assert cli_main([*args, str(tmp_path / "missing")]) == 2  # before any model is loaded


def test_a_run_s_reply_limit_caps_every_reply_whatever_the_harness_asks(
    tmp_path: Path, tiny_model_dir: Path
):
    """``proxy.max_reply_tokens``: a reply stops at the limit (``length``), below what the
    call asks and what the context leaves; a call asking less gets what it asked."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    long_reply = {"main.task": ["one two three four five six seven eight nine ten"] * 3}
    engine = ScriptedEngine(tokenizer, long_reply)
    for running in start(tmp_path, tiny_model_dir, [engine], max_reply_tokens=4):
        ex = running.new_execution()
        ask = [{"role": "user", "content": "Count."}]
        capped = gpt(running, ex).chat.completions.create(
            model="tiny", max_tokens=100, messages=ask
        )
        assert capped.choices[0].finish_reason == "length"
        assert capped.usage is not None and capped.usage.completion_tokens == 4
        fewer = gpt(running, ex).chat.completions.create(model="tiny", max_tokens=2, messages=ask)
        assert fewer.usage is not None and fewer.usage.completion_tokens == 2
        unasked = claude(running, ex).messages.create(model="tiny", max_tokens=4096, messages=ask)
        assert unasked.stop_reason == "max_tokens" and unasked.usage.output_tokens == 4
        assert [len(n["output_ids"]) for n in running.tree(ex["id"])] == [4, 2, 4]
