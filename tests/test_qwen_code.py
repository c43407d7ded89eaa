"""Qwen Code through the proxy under its rule set (``proxy.classes=qwen-code``): an
execution shaped like its requests (its prompts and tool sets, its compression
directive), then the real CLI, offline, with a scripted engine.

The ``qwen_bin`` fixture (conftest) installs the pinned ``@qwen-code/qwen-code`` with npm
into a cache folder (about 6 s, 125 MB) and skips, saying why, when node/npm are missing
or the install fails.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.test_proxy_server import Running, gpt, start
from tests.test_request_classes import QWEN
from transformers import AutoTokenizer

from qwengyre.engines.scripted import ScriptedEngine
from qwengyre.proxy import server as proxy_server
from qwengyre.proxy.classes import load_rule_set
from qwengyre.proxy.types import Message, ToolCall

AGENT_CALL = {
    "name": "agent",
    "arguments": {
        "description": "inspect files",
        "prompt": "List the files and report.",
        "subagent_type": "general-purpose",
    },
}
SNAPSHOT = (
    "<analysis>Nothing to fix.</analysis>\n<state_snapshot>\n<primary_request_and_intent>"
    "Inspect with a sub-agent.</primary_request_and_intent>\n</state_snapshot>"
)
SCRIPT = {
    "main.task": [
        f"<tool_call>\n{json.dumps(AGENT_CALL)}\n</tool_call>",
        "Waiting for the report.",
        "Done: reported.",
    ],
    "sub.task": ["Sub-agent report: nothing to fix."],
    "main.summary": [SNAPSHOT],
    "default": ["ok"],
}


def qwen_proxy(tmp_path: Path, tiny_model_dir: Path, script: dict = SCRIPT) -> Iterator[Running]:
    engine = ScriptedEngine(AutoTokenizer.from_pretrained(tiny_model_dir), script)
    yield from start(
        tmp_path,
        tiny_model_dir,
        engines=[engine],
        max_context=1_000_000,
        classes=load_rule_set("qwen-code"),
    )


@pytest.fixture
def proxy(tmp_path: Path, tiny_model_dir: Path) -> Iterator[Running]:
    yield from qwen_proxy(tmp_path, tiny_model_dir)


def body(what: str) -> dict:
    """A captured Qwen Code request's body (tests/harness_requests.json)."""
    return QWEN[what]["body"]


def test_a_qwen_code_execution_records_its_sub_agent_and_its_compression(proxy: Running):
    ex = proxy.new_execution()
    client = gpt(proxy, ex)
    main = body("main agent, first call")
    sub = body("sub-agent (general-purpose), first call")
    cold = body("/compress --continue: the summariser's request (its fallback)")
    shared = body("/compress --continue: the main agent's own request (prompt cache shared)")

    def ask(messages: list, tools: list | None) -> dict:
        kw = {"tools": tools} if tools else {}
        answer = client.chat.completions.create(model="tiny", messages=messages, **kw)
        return answer.choices[0].message.model_dump(exclude_none=True)

    history = list(main["messages"])
    call = ask(history, main["tools"])
    assert call["tool_calls"][0]["function"]["name"] == "agent"
    report = ask(sub["messages"], sub["tools"])["content"]
    history += [
        call,
        {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "content": report},
    ]
    history.append(ask(history, main["tools"]))
    directive = shared["messages"][-1]  # the summariser's prompt and the directive, as a user turn
    ask([*history, directive], main["tools"])
    ask([cold["messages"][0], *history[1:], cold["messages"][-1]], None)

    nodes = proxy.tree(ex["id"])
    sub_id = nodes[1]["agent_id"]
    assert sub_id.startswith("sub-")
    assert [(n["parent"], n["class"], n["agent_id"]) for n in nodes] == [
        (None, "main.task", "main"),
        (None, "sub.task", sub_id),
        (0, "main.task", "main"),
        (2, "main.summary", "main"),  # extends the main agent's chain
        (None, "main.summary", "main"),  # the summariser's own system prompt: a root
    ]


# ------------------------------------------------------------------ the real CLI

SETTINGS = {
    "security": {"auth": {"selectedType": "openai"}},
    "privacy": {"usageStatisticsEnabled": False},
    "general": {"enableAutoUpdate": False},
    "telemetry": {"enabled": False},
}


def run_qwen(
    binary: Path, ex: dict, home: Path, workspace: Path, *args: str, settings: dict = SETTINGS
) -> subprocess.CompletedProcess[str]:
    """``qwen ARGS --yolo -o json`` offline against the execution's proxy URL, with
    ``settings`` as its ``$HOME/.qwen/settings.json``."""
    (home / ".qwen").mkdir(parents=True, exist_ok=True)
    (home / ".qwen" / "settings.json").write_text(json.dumps(settings))
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "OPENAI_API_KEY": ex["key"],
        "OPENAI_BASE_URL": ex["openai_base_url"],
        "OPENAI_MODEL": "tiny",
        "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1",
    }
    return subprocess.run(
        [str(binary), *args, "--yolo", "-o", "json"],
        cwd=workspace,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )


def result(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stderr[-2000:] + done.stdout[-2000:]
    return json.loads(done.stdout)[-1]["result"]


@pytest.mark.slow
def test_the_real_qwen_code_records_sub_task_and_main_summary(
    qwen_bin: Path, proxy: Running, tmp_path: Path
):
    ex = proxy.new_execution()
    home, workspace = tmp_path / "home", tmp_path / "ws"
    workspace.mkdir()
    assert result(run_qwen(qwen_bin, ex, home, workspace, "Inspect with a sub-agent")) == (
        "Done: reported."
    )
    compress = result(run_qwen(qwen_bin, ex, home, workspace, "/compress", "--continue"))
    assert compress.startswith("Context compressed")

    nodes = proxy.tree(ex["id"])
    found = [(n["parent"], n["class"]) for n in nodes]
    roots = [n for n in nodes if n["parent"] is None]
    # One main chain: no helper (auto-memory, default settings) is a main.task root.
    assert [n["class"] for n in roots if n["class"] == "main.task"] == ["main.task"], found
    subs = [n for n in nodes if n["class"] == "sub.task"]
    assert len(subs) == 1 and subs[0]["agent_id"].startswith("sub-"), found
    assert [n["class"] for n in nodes if "summary" in n["class"]] == ["main.summary"], found
    assert {n["class"] for n in nodes} <= {"main.task", "sub.task", "main.summary", "main.side"}
    assert all(n["agent_id"] == "main" for n in nodes if n["class"] != "sub.task")


SHELL = {"name": "run_shell_command", "arguments": {"command": "echo hi"}}
RESUME_SCRIPT = {
    "main.task": [
        f"Saying hi.\n<tool_call>\n{json.dumps(SHELL)}\n</tool_call>",
        "Done: said hi.",
        "Bye!",
    ],
    "default": ["ok"],
}
# The preset's: no background memory agents (their calls would be roots of their own).
NO_MEMORY = {
    **SETTINGS,
    "memory": {
        "enableManagedAutoMemory": False,
        "enableManagedAutoDream": False,
        "enableAutoSkill": False,
    },
}


@pytest.mark.slow
def test_a_resumed_qwen_code_session_is_a_main_task_root_of_its_rewritten_history(
    qwen_bin: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``qwen --continue`` (``--resume ID`` sends the same) reloads the session, but not
    as it sent it: the first user message loses the part that said the date (a
    ``<system-reminder>`` Qwen Code does not store), and the new turn carries a fresh
    one. The resumed request extends no recorded call message for message, so the proxy
    renders it whole, a new root: the main agent's (same prompt and tools), a task call,
    its earlier turns restored as recorded (the tool call by its id)."""
    bodies: list[dict] = []
    read = proxy_server.read_body

    async def spy(http, max_bytes):  # type: ignore[no-untyped-def]
        body = await read(http, max_bytes)
        bodies.append(json.loads(body))
        return body

    monkeypatch.setattr(proxy_server, "read_body", spy)
    home, workspace = tmp_path / "home", tmp_path / "ws"
    workspace.mkdir()
    for proxy in qwen_proxy(tmp_path, tiny_model_dir, RESUME_SCRIPT):
        ex = proxy.new_execution()
        first = run_qwen(qwen_bin, ex, home, workspace, "Say hi", settings=NO_MEMORY)
        assert result(first) == "Done: said hi."
        second = run_qwen(
            qwen_bin, ex, home, workspace, "Say bye", "--continue", settings=NO_MEMORY
        )
        assert result(second) == "Bye!"
        nodes = proxy.tree(ex["id"])
        recorder = proxy.server.residency.executions[ex["id"]].recorder
        assert recorder is not None
        before, resumed = recorder.conversation(1), recorder.conversation(2)
    sessions = [json.loads(done.stdout)[0]["session_id"] for done in (first, second)]
    assert sessions[0] == sessions[1]  # the same session, resumed

    assert [(n["parent"], n["class"], n["agent_id"]) for n in nodes] == [
        (None, "main.task", "main"),
        (0, "main.task", "main"),
        (None, "main.task", "main"),  # rendered whole: it extends nothing recorded
    ]
    assert len(nodes[2]["input_ids"]) > len(nodes[0]["input_ids"])
    # Why: what Qwen Code sent for the first user message, then and on resuming.
    assert len(bodies) == 3 and bodies[2]["tools"] == bodies[0]["tools"]
    sent, resent = bodies[0]["messages"][1]["content"], bodies[2]["messages"][1]["content"]
    [dated] = [p for p in sent if "The current date is" in p["text"]]
    assert resent == [p for p in sent if p is not dated]
    assert bodies[2]["messages"][-1]["content"] == [dated, {"type": "text", "text": "Say bye"}]
    # Everything else of the first session came back as recorded: the system prompt,
    # the tool call (its id and arguments), its result, the last reply.
    assert resumed[0] == before[0] and resumed[1] != before[1]
    assert resumed[2 : len(before)] == before[2:]
    [call] = before[2].tool_calls
    assert call == ToolCall(call.id, "run_shell_command", SHELL["arguments"])
    turn, reply = resumed[len(before) :]
    assert turn.role == "user" and turn.content.endswith("\nSay bye")
    assert reply == Message("assistant", "Bye!")
