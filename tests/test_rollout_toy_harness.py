"""The bundled toy harness through a live proxy: tool use, a sub-agent, one compaction."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web
from tests.test_proxy_server import Running, start

from qwengyre.engines.scripted import ScriptedEngine
from qwengyre.rollout.toy_harness import (
    ModelCallError,
    ToyResult,
    _arguments,
    run_toy_agent,
    write_file,
)


def call(name: str, **arguments: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


SCRIPT = {
    "main.task": [
        "I will write the first file.\n" + call("write_file", path="a.txt", content="alpha"),
        call("delegate", task="Write notes/sub.txt saying hi."),
        call("write_file", path="b.txt", content="beta"),
        "Done.",
    ],
    "sub.task": [call("write_file", path="notes/sub.txt", content="hi"), "Sub-task done."],
    "main.summary": ["Summary: wrote files."],
}
ESCAPE_SCRIPT = {
    "main.task": [
        call("write_file", path="../escape.txt", content="x"),
        call("write_file", path="/tmp/qwengyre-toy-abs.txt", content="x"),
        call("rm", path="a.txt"),
        "Gave up.",
    ],
    "main.summary": ["Summary: nothing written."],
}
TASK = "Write a.txt and b.txt, and have a helper write notes/sub.txt."


def _proxy(tmp_path: Path, model_dir: Path, script: dict[str, list[str]]) -> Iterator[Running]:
    from transformers import AutoTokenizer

    engine = ScriptedEngine(AutoTokenizer.from_pretrained(model_dir), script)
    yield from start(tmp_path, model_dir, engines=[engine], max_context=1_000_000)


@pytest.fixture
def proxy(tmp_path: Path, tiny_model_dir: Path) -> Iterator[Running]:
    yield from _proxy(tmp_path, tiny_model_dir, SCRIPT)


@pytest.fixture
def escape_proxy(tmp_path: Path, tiny_model_dir: Path) -> Iterator[Running]:
    yield from _proxy(tmp_path, tiny_model_dir, ESCAPE_SCRIPT)


def _workspace(tmp_path: Path, name: str) -> Path:
    ws = tmp_path / name
    ws.mkdir()
    return ws


def _check_tree(nodes: list[dict]) -> None:
    classes = [n["class"] for n in nodes]
    assert {"main.task", "sub.task", "main.summary"} <= set(classes), classes
    assert classes.count("main.summary") == 1
    roots = [n["id"] for n in nodes if n["parent"] is None]
    children: dict[int | None, int] = {}
    for n in nodes:
        children[n["parent"]] = children.get(n["parent"], 0) + 1
    # A branch: several roots (main, sub-agent, post-compaction) or a fork.
    assert len(roots) >= 2 or max(v for k, v in children.items() if k is not None) >= 2
    # Every sub-agent call lives in its own chain, away from the main agent's.
    by_id = {n["id"]: n for n in nodes}

    def root_of(node: dict) -> int:
        while node["parent"] is not None:
            node = by_id[node["parent"]]
        return node["id"]

    main_roots = {root_of(n) for n in nodes if n["class"].startswith("main.")}
    sub_roots = {root_of(n) for n in nodes if n["class"] == "sub.task"}
    assert sub_roots and not main_roots & sub_roots
    # After the compaction the main agent starts a fresh chain from the root.
    summary = next(n for n in nodes if n["class"] == "main.summary")
    before = [n for n in nodes if n["class"] == "main.task" and n["id"] < summary["id"]]
    after = [n for n in nodes if n["class"] == "main.task" and n["id"] > summary["id"]]
    assert before and after and after[0]["parent"] is None
    assert root_of(before[-1]) != after[0]["id"] and root_of(after[-1]) == after[0]["id"]


def test_toy_agent_in_process_records_every_class_and_a_branch(proxy: Running, tmp_path: Path):
    ex = proxy.new_execution()
    ws = _workspace(tmp_path, "ws")
    result = asyncio.run(run_toy_agent(ex["openai_base_url"], ex["key"], TASK, ws))
    assert result == ToyResult(
        turns=4,
        calls=7,
        compacted=True,
        subagent_calls=2,
        final_text="Done.",
        finished=True,
    )
    assert (ws / "a.txt").read_text() == "alpha"
    assert (ws / "b.txt").read_text() == "beta"
    assert (ws / "notes" / "sub.txt").read_text() == "hi"
    nodes = proxy.tree(ex["id"])
    assert len(nodes) == 7
    _check_tree(nodes)
    # main 0 -> 1 | sub-1 2 -> 3 | summary 4 (no tools, so the Qwen render shares no
    # prefix with the tool-bearing history) | post-compaction main 5 -> 6.
    assert [(n["parent"], n["class"]) for n in nodes] == [
        (None, "main.task"),
        (0, "main.task"),
        (None, "sub.task"),
        (2, "sub.task"),
        (None, "main.summary"),
        (None, "main.task"),
        (5, "main.task"),
    ]
    assert [n["agent_id"] for n in nodes if n["class"] == "sub.task"] == ["sub-1", "sub-1"]
    tok = proxy.tokenizer
    # The sub-agent's report went back to the main agent as the delegate tool's result.
    summary = next(n for n in nodes if n["class"] == "main.summary")
    summary_input = tok.decode(summary["input_ids"])  # type: ignore[attr-defined]
    assert "Sub-task done." in summary_input
    assert "CRITICAL: Respond with TEXT ONLY" in summary_input
    # The continuation carries the summary and the task.
    restart = next(n for n in nodes if n["class"] == "main.task" and n["id"] > summary["id"])
    restart_input = tok.decode(restart["input_ids"])  # type: ignore[attr-defined]
    assert "This session is being continued" in restart_input
    assert "Summary: wrote files." in restart_input and TASK in restart_input


def test_toy_agent_as_a_module(proxy: Running, tmp_path: Path):
    ex = proxy.new_execution()
    ws = _workspace(tmp_path, "ws")
    env = {**os.environ, "OPENAI_BASE_URL": ex["openai_base_url"], "OPENAI_API_KEY": ex["key"]}
    done = subprocess.run(
        [sys.executable, "-m", "qwengyre.rollout.toy_harness", TASK],
        cwd=ws,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "Done." and "retries=0" in done.stderr
    assert sorted(p.relative_to(ws).as_posix() for p in ws.rglob("*.txt")) == [
        "a.txt",
        "b.txt",
        "notes/sub.txt",
    ]
    _check_tree(proxy.tree(ex["id"]))


def test_module_without_a_key_exits_1(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
    done = subprocess.run(
        [sys.executable, "-m", "qwengyre.rollout.toy_harness", TASK],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "usage" in done.stderr


def test_path_escapes_and_unknown_tools_are_refused(escape_proxy: Running, tmp_path: Path):
    ex = escape_proxy.new_execution()
    ws = _workspace(tmp_path, "ws")
    abs_target = Path("/tmp/qwengyre-toy-abs.txt")
    abs_target.unlink(missing_ok=True)
    result = asyncio.run(run_toy_agent(ex["openai_base_url"], ex["key"], TASK, ws))
    assert result.finished and result.final_text == "Gave up." and result.compacted
    assert not (tmp_path / "escape.txt").exists() and not abs_target.exists()
    assert list(ws.iterdir()) == []
    nodes = escape_proxy.tree(ex["id"])
    sent = "".join(escape_proxy.tokenizer.decode(n["input_ids"]) for n in nodes)  # type: ignore[attr-defined]
    assert "error: refused path '../escape.txt'" in sent
    assert "error: refused path '/tmp/qwengyre-toy-abs.txt'" in sent
    assert "error: unknown tool 'rm'" in sent


def test_write_file_and_argument_parsing_edge_cases(tmp_path: Path):
    assert write_file(tmp_path, "ok/x.txt", "1").startswith("wrote")
    assert (tmp_path / "ok" / "x.txt").read_text() == "1"
    for bad in ("../x", "a/../../x", "a/../inside.txt", "/etc/x", "", None):
        assert write_file(tmp_path, bad, "1").startswith("error")
    assert write_file(tmp_path, "y.txt", 3).startswith("error")
    (tmp_path / "link").symlink_to(tmp_path.parent)
    assert write_file(tmp_path, "link/escape.txt", "1").startswith("error")
    assert not (tmp_path.parent / "escape.txt").exists()
    assert _arguments({"function": {"name": "f", "arguments": "{bad"}})[1].startswith("error")
    assert _arguments({"function": {"name": "f", "arguments": "[1]"}})[1].startswith("error")
    assert _arguments({"function": {"name": "f", "arguments": '{"a": 1}'}}) == ("f", {"a": 1})
    assert _arguments({"nope": 1})[1].startswith("error")


def _fake_openai(statuses: list[int]) -> tuple[web.Application, list[int]]:
    """A fake endpoint answering the given statuses in turn (200: a final answer)."""
    seen: list[int] = []

    async def chat(request: web.Request) -> web.Response:
        status = statuses[min(len(seen), len(statuses) - 1)]
        seen.append(status)
        if status != 200:
            return web.json_response({"error": {"message": "nope"}}, status=status)
        message = {"role": "assistant", "content": "ok"}
        return web.json_response({"choices": [{"index": 0, "message": message}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app, seen


async def _against(statuses: list[int], tmp_path: Path) -> tuple[ToyResult | Exception, list[int]]:
    app, seen = _fake_openai(statuses)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    try:
        agent = run_toy_agent(url, "k", "t", tmp_path, retry_backoff_s=0.01, retry_for_s=0.5)
        return await agent, seen
    except ModelCallError as exc:
        return exc, seen
    finally:
        await runner.cleanup()


def test_retries_5xx_and_429_then_gives_up(tmp_path: Path):
    result, seen = asyncio.run(_against([503, 429, 500, 200], tmp_path))
    assert isinstance(result, ToyResult) and result.final_text == "ok" and result.finished
    assert seen == [503, 429, 500, 200] and result.retries == 3
    result, seen = asyncio.run(_against([502], tmp_path))  # retried for retry_for_s, then not
    assert isinstance(result, ModelCallError) and f"after {len(seen) - 1} retries" in str(result)
    assert len(seen) > 4 and set(seen) == {502}
    result, seen = asyncio.run(_against([401], tmp_path))
    assert isinstance(result, ModelCallError) and "HTTP 401" in str(result)
    assert seen == [401]


def test_connection_errors_give_up(tmp_path: Path):
    async def go() -> None:
        # A port that was just free: connection refused on every attempt.
        runner = web.AppRunner(web.Application())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        await runner.cleanup()
        with pytest.raises(ModelCallError, match=r"after \d+ retries: Client\w*Error"):
            url = f"http://127.0.0.1:{port}/v1"
            await run_toy_agent(url, "k", "t", tmp_path, retry_backoff_s=0, retry_for_s=0.2)

    asyncio.run(go())


def test_max_turns_stops_unfinished(tmp_path: Path):
    async def chat(request: web.Request) -> web.Response:
        tool_call = {
            "id": "c1",
            "type": "function",
            "function": {"name": "write_file", "arguments": '{"path": "x.txt", "content": "1"}'},
        }
        message = {"role": "assistant", "content": None, "tool_calls": [tool_call]}
        body = await request.json()
        if "tools" not in body:  # the compaction request
            message = {"role": "assistant", "content": "summary"}
        return web.json_response({"choices": [{"index": 0, "message": message}]})

    async def go() -> ToyResult:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
        try:
            return await run_toy_agent(url, "k", "t", tmp_path, max_turns=5)
        finally:
            await runner.cleanup()

    result = asyncio.run(go())
    assert not result.finished and result.turns == 5 and result.compacted
    assert result.calls == 6 and (tmp_path / "x.txt").read_text() == "1"
