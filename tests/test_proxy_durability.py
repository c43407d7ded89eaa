"""The proxy's records: on disk or not at all, in order, lossless, loaded per execution,
marked when never delivered, and kept in memory only while an execution is in use."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import anthropic
import httpx2
import pytest
from tests.test_proxy_server import ADMIN, SCRIPT, TOOLS_ANTHROPIC, Running, claude, start
from transformers import AutoTokenizer

from qwengyre.engines.scripted import ScriptedEngine
from qwengyre.proxy.store import Store
from qwengyre.trajectories.selection import select_trajectories

SURROGATE_REPLY = (
    'Odd.\n<tool_call>\n{"name": "bash", "arguments": {"cmd": "echo \\ud800 x"}}\n</tool_call>'
)


def ask(proxy: Running, ex: dict, messages: list[dict], **kw) -> anthropic.types.Message:
    return claude(proxy, ex).messages.create(
        model="tiny", max_tokens=64, messages=messages, tools=TOOLS_ANTHROPIC, **kw
    )


def loop_turns(proxy: Running, ex: dict, turns: int) -> list[dict]:
    """A tool loop of ``turns`` calls; the conversation it ends with."""
    messages: list[dict] = [{"role": "user", "content": "list the files"}]
    for _ in range(turns):
        reply = ask(proxy, ex, messages)
        messages.append({"role": "assistant", "content": [b.model_dump() for b in reply.content]})
        calls = [b for b in reply.content if b.type == "tool_use"]
        if calls:
            results = [
                {"type": "tool_result", "tool_use_id": c.id, "content": "a b"} for c in calls
            ]
            messages.append({"role": "user", "content": results})
        else:
            messages.append({"role": "user", "content": "and now?"})
    return messages


class FlakyStore(Store):
    """Fails the commits whose numbers are in ``fail`` (0-based), as a full disk would."""

    def __init__(self, path: Path, fail: set[int]) -> None:
        super().__init__(path)
        self.fail = fail
        self.commits = 0

    def add_call(self, execution_id, node, turn):  # type: ignore[no-untyped-def]
        n, self.commits = self.commits, self.commits + 1
        if n in self.fail:
            raise sqlite3.OperationalError("database or disk is full")
        super().add_call(execution_id, node, turn)


def restarted_trees(tmp_path: Path, tiny_model_dir: Path, ids: list[str]) -> list[list[dict]]:
    gen = start(tmp_path, tiny_model_dir)
    again = next(gen)
    try:
        return [again.tree(i) for i in ids]
    finally:
        gen.close()


def test_a_failed_commit_records_nothing_and_leaves_no_gap(tmp_path: Path, tiny_model_dir: Path):
    store = FlakyStore(tmp_path / "proxy.sqlite", fail={1})
    gen = start(tmp_path, tiny_model_dir, store=store)
    proxy = next(gen)
    try:
        ex = proxy.new_execution()
        messages = [{"role": "user", "content": "list the files"}]
        ask(proxy, ex, messages)
        with pytest.raises(anthropic.InternalServerError, match="could not be recorded"):
            ask(proxy, ex, [{"role": "user", "content": "again"}])
        assert len(proxy.tree(ex["id"])) == 1  # the failed call is not in memory either
        ask(proxy, ex, [{"role": "user", "content": "once more"}])
        served = proxy.tree(ex["id"])
        assert [n["id"] for n in served] == [0, 1]
    finally:
        gen.close()
    assert restarted_trees(tmp_path, tiny_model_dir, [ex["id"]]) == [served]


def test_commits_of_one_execution_land_in_node_order(tmp_path: Path, tiny_model_dir: Path):
    order: list[int] = []

    class SlowStore(Store):
        def add_call(self, execution_id, node, turn):  # type: ignore[no-untyped-def]
            time.sleep(random.uniform(0, 0.02))  # commits overlap without ordering
            super().add_call(execution_id, node, turn)
            order.append(node.id)

    gen = start(tmp_path, tiny_model_dir, store=SlowStore(tmp_path / "proxy.sqlite"))
    proxy = next(gen)
    try:
        ex = proxy.new_execution()

        async def burst() -> None:
            async with anthropic.AsyncAnthropic(
                api_key=ex["key"], base_url=proxy.url, max_retries=0
            ) as client:
                await asyncio.gather(
                    *(
                        client.messages.create(
                            model="tiny",
                            max_tokens=16,
                            messages=[{"role": "user", "content": f"call {i}"}],
                            tools=TOOLS_ANTHROPIC,
                        )
                        for i in range(24)
                    )
                )

        asyncio.run(burst())
        served = proxy.tree(ex["id"])
    finally:
        gen.close()
    assert order == list(range(24))
    assert restarted_trees(tmp_path, tiny_model_dir, [ex["id"]]) == [served]


def test_lone_surrogates_from_model_and_client_round_trip(tmp_path: Path, tiny_model_dir: Path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = ScriptedEngine(tokenizer, {"default": [SURROGATE_REPLY, "fine"]})
    gen = start(tmp_path, tiny_model_dir, engines=[engine])
    proxy = next(gen)
    try:
        ex = proxy.new_execution()
        reply = ask(proxy, ex, [{"role": "user", "content": "go"}])
        (call,) = [b for b in reply.content if b.type == "tool_use"]
        assert call.input == {"cmd": "echo \ud800 x"}
        # The harness echoes the call back; its id carries a lone surrogate of its own.
        body = {
            "model": "tiny",
            "max_tokens": 16,
            "tools": TOOLS_ANTHROPIC,
            "messages": [
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": [b.model_dump() for b in reply.content]},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "ok"}],
                },
            ],
        }
        raw = json.dumps(body)  # ASCII escapes: the surrogate travels as \\ud800
        headers = {"x-api-key": ex["key"], "content-type": "application/json"}
        answer = httpx2.post(proxy.url + "/v1/messages", content=raw, headers=headers, timeout=30)
        assert answer.status_code == 200, answer.text
        served = proxy.tree(ex["id"])
        assert served[1]["parent"] == 0  # it extended the call with the surrogate
    finally:
        gen.close()
    assert restarted_trees(tmp_path, tiny_model_dir, [ex["id"]]) == [served]


def test_a_damaged_execution_is_quarantined_and_the_rest_keep_working(
    tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
):
    gen = start(tmp_path, tiny_model_dir)
    proxy = next(gen)
    try:
        good, bad = proxy.new_execution(), proxy.new_execution()
        loop_turns(proxy, good, 2)
        loop_turns(proxy, bad, 2)
        served = proxy.tree(good["id"])
    finally:
        gen.close()
    with sqlite3.connect(tmp_path / "proxy.sqlite") as db:
        db.execute("UPDATE nodes SET meta = '{not json' WHERE execution = ?", (bad["id"],))
    gen = start(tmp_path, tiny_model_dir)
    again = next(gen)
    try:
        assert again.tree(good["id"]) == served
        loop_turns(again, good, 1)  # keeps working
        with pytest.raises(anthropic.PermissionDeniedError, match="quarantined"):
            ask(again, bad, [{"role": "user", "content": "hi"}])
        with pytest.raises(anthropic.PermissionDeniedError, match="quarantined"):
            ask(again, bad, [{"role": "user", "content": "hi"}])
        warnings = [r for r in caplog.records if "quarantined" in r.getMessage()]
        assert len(warnings) == 1 and bad["id"] in warnings[0].getMessage()
    finally:
        gen.close()


def test_idle_and_revoked_executions_leave_memory_and_reload_exactly(
    tmp_path: Path, tiny_model_dir: Path
):
    gen = start(tmp_path, tiny_model_dir, max_resident=2)
    proxy = next(gen)
    try:
        executions = [proxy.new_execution() for _ in range(4)]
        conversations = [loop_turns(proxy, ex, 2) for ex in executions]
        states = [proxy.server.residency.executions[ex["id"]] for ex in executions]
        assert sum(s.recorder is not None for s in states) == 2
        trees = [proxy.tree(ex["id"]) for ex in executions]
        # An evicted execution continues where it was: its next call extends its tree.
        ask(proxy, executions[0], conversations[0])
        assert proxy.tree(executions[0]["id"])[-1]["parent"] == len(trees[0]) - 1
        proxy.admin("DELETE", f"/admin/executions/{executions[0]['id']}")
        assert states[0].recorder is None
        proxy.server.residency.idle_s = 0.0
        ask(proxy, executions[1], conversations[1])
        assert sum(s.recorder is not None for s in states) == 1  # only the one just used
    finally:
        gen.close()


def test_idle_executions_leave_memory_without_another_call(tmp_path: Path, tiny_model_dir: Path):
    gen = start(tmp_path, tiny_model_dir, idle_s=0.3)
    proxy = next(gen)
    try:
        executions = [proxy.new_execution() for _ in range(3)]
        for ex in executions:
            loop_turns(proxy, ex, 2)
        states = [proxy.server.residency.executions[ex["id"]] for ex in executions]
        deadline = time.monotonic() + 10
        while any(s.recorder is not None for s in states) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(s.recorder is None for s in states)
        assert [len(proxy.tree(ex["id"])) for ex in executions] == [2, 2, 2]
    finally:
        gen.close()


def test_a_client_that_hangs_up_aborts_the_engine_and_its_call_is_undelivered(
    tmp_path: Path, tiny_model_dir: Path
):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = ScriptedEngine(tokenizer, SCRIPT, delay_s=20.0)
    gen = start(tmp_path, tiny_model_dir, engines=[engine])
    proxy = next(gen)
    try:
        ex = proxy.new_execution()
        for stream in (False, True):
            body = {
                "model": "tiny",
                "max_tokens": 64,
                "stream": stream,
                "messages": [{"role": "user", "content": "list the files"}],
            }
            with socket.create_connection(("127.0.0.1", int(proxy.url.rsplit(":", 1)[1]))) as s:
                data = json.dumps(body).encode()
                s.sendall(
                    b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                    + f"x-api-key: {ex['key']}\r\ncontent-length: {len(data)}\r\n\r\n".encode()
                    + data
                )
                deadline = time.monotonic() + 10
                while engine.load == 0 and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert engine.load == 1
            gone = time.monotonic()
            while engine.load and time.monotonic() - gone < 10:
                time.sleep(0.01)
            # Aborted, not finished: the engine would have taken 20 s (the proxy notices
            # within ~50 ms; the bound is loose for a loaded machine).
            assert engine.load == 0 and time.monotonic() - gone < 10
        deadline = time.monotonic() + 5
        while len(proxy.tree(ex["id"])) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        nodes = proxy.tree(ex["id"])
        assert [n["delivered"] for n in nodes] == [False, False]
        assert all(n["finish_reason"] == "abort" for n in nodes)
        engine.delay_s = 0.0
        ask(proxy, ex, [{"role": "user", "content": "list the files"}])  # the retry
        tree = proxy.run(proxy.server.tree(ex["id"]))
        deadline = time.monotonic() + 5  # marked just after the answer was written
        while not tree.nodes[2].meta.delivered and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [n.meta.delivered for n in tree.nodes] == [False, False, True]
        chosen = select_trajectories(tree, j_max=5, rng=random.Random(0))
        assert [t.leaf for t in chosen] == [2]
    finally:
        gen.close()


# ---------------------------------------------------------------- kill -9


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(store: Path, model: Path, script: Path, port: int) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "qwengyre",
        "proxy",
        "serve",
        "--model",
        str(model),
        f"proxy.script={script}",
        "--store",
        str(store),
        "--port",
        str(port),
        "--admin-token",
        ADMIN,
        "engine.max_context=100000",
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx2.head(f"http://127.0.0.1:{port}/", timeout=1)
            return process
        except httpx2.TransportError:
            assert process.poll() is None, process.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
            time.sleep(0.1)
    process.kill()
    raise AssertionError("the proxy did not start")


@pytest.mark.slow
def test_kill_9_under_streaming_load_loses_nothing_that_was_answered(
    tmp_path: Path, tiny_model_dir: Path
):
    script = tmp_path / "script.json"
    script.write_text(json.dumps(SCRIPT))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    admin = {"authorization": f"Bearer {ADMIN}"}
    process = _serve(tmp_path, tiny_model_dir, script, port)
    answered: dict[str, int] = {}
    executions: list[dict] = []
    stop = threading.Event()
    try:
        for _ in range(8):
            response = httpx2.post(url + "/admin/executions", headers=admin, timeout=30)
            executions.append(response.json())

        def drive(ex: dict) -> None:
            client = anthropic.Anthropic(api_key=ex["key"], base_url=url, max_retries=0)
            messages: list[dict] = [{"role": "user", "content": "list the files"}]
            while not stop.is_set():
                try:
                    with client.messages.stream(
                        model="tiny", max_tokens=64, messages=messages, tools=TOOLS_ANTHROPIC
                    ) as stream:
                        reply = stream.get_final_message()
                except Exception:  # the proxy died under it (mid-stream: not an SDK error)
                    return
                answered[ex["id"]] = answered.get(ex["id"], 0) + 1
                messages.append(
                    {"role": "assistant", "content": [b.model_dump() for b in reply.content]}
                )
                uses = [b for b in reply.content if b.type == "tool_use"]
                content: list[dict] | str = [
                    {"type": "tool_result", "tool_use_id": u.id, "content": "a"} for u in uses
                ]
                messages.append({"role": "user", "content": content or "more"})

        threads = [threading.Thread(target=drive, args=(ex,)) for ex in executions]
        for thread in threads:
            thread.start()
        time.sleep(3.0)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(10)
        stop.set()
        for thread in threads:
            thread.join(30)
        process = _serve(tmp_path, tiny_model_dir, script, port)
        for ex in executions:
            response = httpx2.get(url + f"/admin/executions/{ex['id']}/tree", headers=admin)
            assert response.status_code == 200, response.text
            nodes = response.json()["nodes"]
            assert [n["id"] for n in nodes] == list(range(len(nodes)))
            assert all(n["parent"] is None or n["parent"] < n["id"] for n in nodes)
            # Every answer a client received is recorded; at most the one in flight more.
            got = answered.get(ex["id"], 0)
            assert got <= len(nodes) <= got + 1
            assert sum(n["delivered"] for n in nodes) >= got - 1
        assert sum(answered.values()) > 8  # the load really ran
        # The restarted proxy serves the same executions on.
        ex = executions[0]
        client = anthropic.Anthropic(api_key=ex["key"], base_url=url, max_retries=0)
        client.messages.create(
            model="tiny", max_tokens=16, messages=[{"role": "user", "content": "hi"}]
        )
    finally:
        stop.set()
        process.kill()
        process.wait(10)
