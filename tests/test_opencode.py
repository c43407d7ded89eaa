"""The real OpenCode CLI (``opencode run``, Chat Completions through
``@ai-sdk/openai-compatible``) through the proxy under its rule set
(``proxy.classes=opencode``), offline, with a scripted engine.

The ``opencode_bin`` fixture (conftest) installs the pinned ``opencode-ai`` with npm into
a cache folder (about 6 s, 354 MB) and skips, saying why, when node/npm are missing or
the install fails. OpenCode runs as the ``opencode`` harness preset runs it
(:func:`~qwengyre.rollout.harness.opencode_spec`): a private HOME holding its global
``opencode.json`` (one provider at the execution's URL, the key in the environment, no
update check, models.dev fetch, sharing, LSP download or default plugins); here also
every proxy variable aimed at a closed port, so that nothing but its calls to the proxy
(loopback, ``NO_PROXY``) can leave. Each ``opencode run`` takes 3 to 6 s here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from tests.conftest import proxy_bodies
from tests.test_proxy_server import Running, start

from qwengyre.engines.scripted import ScriptedEngine
from qwengyre.proxy.classes import load_rule_set
from qwengyre.proxy.openai_api import parse_chat_request_with_ignored
from qwengyre.proxy.types import Message, ToolCall
from qwengyre.rollout.harness import opencode_spec, prepare_harness, supervise

pytestmark = pytest.mark.slow  # seconds; still in the default suite

NOWHERE = "http://127.0.0.1:9"  # a closed port: any call that is not to the proxy fails
SYSTEM = (
    "You are opencode, an interactive CLI tool"  # the main agent's (and the general sub-agent's)
)


def tool_call(name: str, arguments: dict) -> str:
    """A scripted reply's tool call (the chat template's format)."""
    return "\n<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@contextlib.contextmanager
def opencode_proxy(tmp_path: Path, model_dir: Path, script: dict) -> Iterator[Running]:
    """The proxy with OpenCode's request-class rules, its engine scripted with ``script``
    (OpenCode's own prompt, ~13.8k tokens with the tiny tokenizer, is far longer than
    the tiny model's window; the scripted engine does not care)."""
    from transformers import AutoTokenizer

    engine = ScriptedEngine(AutoTokenizer.from_pretrained(model_dir), script)
    rules = load_rule_set("opencode")
    serving = contextlib.contextmanager(start)
    with serving(tmp_path, model_dir, engines=[engine], max_context=1_000_000, classes=rules) as p:
        yield p


@pytest.fixture
def requests(monkeypatch: pytest.MonkeyPatch) -> list[tuple[dict, dict]]:
    """Every Chat Completions request the proxy read: (its headers, its body as JSON)."""
    return proxy_bodies(monkeypatch, "/chat/completions")


def run_opencode(
    binary: Path,
    ex: dict,
    home: Path,
    workspace: Path,
    task: str,
    *args: str,
    config: dict | None = None,
) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    """``opencode run ARGS`` of ``task`` against the execution ``ex``, as the
    ``opencode`` harness preset runs it (its command, environment and global config in
    the private home); ``config``: more config, merged over it by OpenCode
    (OPENCODE_CONFIG_CONTENT). Every proxy variable points at a closed port (loopback
    excepted). The finished process and its JSON events."""
    env = {name: NOWHERE for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")}
    env["NO_PROXY"] = "127.0.0.1,localhost"
    if config is not None:  # a literal, not a template
        env["OPENCODE_CONFIG_CONTENT"] = json.dumps(config).replace("{", "{{").replace("}", "}}")
    spec = opencode_spec(str(binary), "tiny", deadline_s=120, extra_env=env)
    spec = replace(spec, command=(*spec.command[:2], *args, *spec.command[2:]))
    launch = prepare_harness(
        spec,
        workspace=workspace,
        logs_dir=home.parent / f"logs-{len(list(home.parent.glob('logs-*')))}",
        execution_id=ex["id"],
        base_url=ex["base_url"],
        api_key=ex["key"],
        instructions=task,
        home_dir=home,
    )
    ran = asyncio.run(supervise(launch))
    assert not ran.timed_out
    assert ran.stdout_path is not None and ran.stderr_path is not None
    done = subprocess.CompletedProcess(
        spec.command, ran.exit_code, ran.stdout_path.read_text(), ran.stderr_path.read_text()
    )
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    return done, [json.loads(line) for line in done.stdout.splitlines()]


def said(events: list[dict]) -> list[str]:
    return [e["part"]["text"] for e in events if e["type"] == "text"]


def tools_used(events: list[dict]) -> list[dict]:
    return [e["part"] for e in events if e["type"] == "tool_use"]


def chains(nodes: list[dict]) -> dict[tuple[str, str], list[int]]:
    """The recorded nodes' indices by (class, agent id), in recording order."""
    found: dict[tuple[str, str], list[int]] = {}
    for index, node in enumerate(nodes):
        found.setdefault((node["class"], node["agent_id"]), []).append(index)
    return found


def is_chain(nodes: list[dict], chain: list[int]) -> bool:
    """Whether each call of ``chain`` extends the one before, the first a root."""
    return [nodes[i]["parent"] for i in chain] == [None, *chain[:-1]]


# ------------------------------------------------------------------ a tool loop

# A payload that must survive the round trip byte for byte: quotes, a backslash, non-ASCII.
COMMAND = "printf '%s\\n' 'h\u00e9llo \"w\u00f6rld\" \\ \u2713' > out.txt"
BASH = {"command": COMMAND, "description": "Write the file"}
LOOP_SCRIPT = {
    "main.task": ["Writing the file." + tool_call("bash", BASH), "Done: wrote out.txt."],
    "main.side": ["Writing a file"],
    "default": ["ok"],
}


def test_opencode_runs_a_bash_tool_loop_through_the_proxy(
    opencode_bin: Path, tiny_model_dir: Path, requests: list[tuple[dict, dict]], tmp_path: Path
) -> None:
    home, workspace = tmp_path / "home", tmp_path / "ws"
    workspace.mkdir()
    with opencode_proxy(tmp_path, tiny_model_dir, LOOP_SCRIPT) as proxy:
        ex = proxy.new_execution()
        _, events = run_opencode(opencode_bin, ex, home, workspace, "Write the file")
        nodes = proxy.tree(ex["id"])
        recorder = proxy.server.residency.executions[ex["id"]].recorder
    assert (workspace / "out.txt").read_text() == 'h\u00e9llo "w\u00f6rld" \\ \u2713\n'  # it ran
    assert said(events) == ["Writing the file.", "Done: wrote out.txt."]
    [used] = tools_used(events)
    assert (used["tool"], used["state"]["input"], used["state"]["status"]) == (
        "bash",
        BASH,
        "completed",
    )

    # The title request (its own prompt, no tools) is a side call; the main agent's two
    # calls are one chain, the second adding only the tool's output and the new turn.
    found = chains(nodes)
    assert set(found) == {("main.side", "main"), ("main.task", "main")}, found
    [title], main = found[("main.side", "main")], found[("main.task", "main")]
    assert nodes[title]["parent"] is None and len(main) == 2 and is_chain(nodes, main)
    assert len(nodes[main[1]]["input_ids"]) < 150 < len(nodes[main[0]]["input_ids"])
    for node in nodes:  # the engine's tokens and their log-probs, one each
        assert len(node["logprobs"]) == len(node["output_ids"]) > 0
        assert node["delivered"]

    # The call went out as a tool call and came back with its output, paired by id; the
    # arguments OpenCode echoed are the recorded ones.
    assert recorder is not None
    first = recorder.conversation(main[0])[-1]
    [call] = first.tool_calls
    assert first == Message("assistant", "Writing the file.", (ToolCall(call.id, "bash", BASH),))
    assert used["callID"] == call.id
    bodies = [body for _, body in requests]
    [follow_up] = [b for b in bodies if any(m["role"] == "tool" for m in b["messages"])]
    assistant, tool = follow_up["messages"][-2:]
    [echoed] = assistant["tool_calls"]
    assert (echoed["id"], echoed["function"]["name"]) == (call.id, "bash")
    assert json.loads(echoed["function"]["arguments"]) == BASH
    assert (tool["role"], tool["tool_call_id"]) == ("tool", call.id)
    conversation = recorder.conversation(main[1])
    assert conversation[: len(recorder.conversation(main[0]))] == recorder.conversation(main[0])
    assert conversation[-1] == Message("assistant", "Done: wrote out.txt.")

    # What the proxy does not act on: only tool_choice ("auto", its own behaviour).
    for headers, body in requests:
        ignored = parse_chat_request_with_ignored(json.dumps(body).encode(), headers)[1]
        assert ignored == (("tool_choice",) if body.get("tools") else ()), ignored
        assert body.get("tool_choice", "auto") == "auto"


# ------------------------------------------------------------------ a sub-agent, a resume

TASK = {
    "description": "List files",
    "prompt": "List the files and report.",
    "subagent_type": "general",
}
SUB_SCRIPT = {
    "main.task": [
        "Asking a sub-agent." + tool_call("task", TASK),
        "Done: the sub-agent reported.",
        "Resumed: nothing left to do.",
    ],
    "sub.task": [
        "Listing." + tool_call("bash", {"command": "echo listed > sub.txt", "description": "List"}),
        "Sub-agent report: listed.",
    ],
    "main.side": ["Inspecting with a sub-agent"],
    "default": ["ok"],
}


def test_an_opencode_sub_agent_is_its_own_sub_task_chain_and_a_resume_goes_on_the_main_one(
    opencode_bin: Path, tiny_model_dir: Path, requests: list[tuple[dict, dict]], tmp_path: Path
) -> None:
    """The ``task`` tool runs the ``general`` sub-agent in a session of its own (its
    requests name it in x-session-id and the main session in x-parent-session-id); then
    ``opencode run --continue`` resumes the main session (not the sub-agent's, the most
    recent one) in a second process."""
    home, workspace = tmp_path / "home", tmp_path / "ws"
    workspace.mkdir()
    with opencode_proxy(tmp_path, tiny_model_dir, SUB_SCRIPT) as proxy:
        ex = proxy.new_execution()
        _, first = run_opencode(opencode_bin, ex, home, workspace, "Inspect with a sub-agent")
        before = len(proxy.tree(ex["id"]))
        _, resumed = run_opencode(opencode_bin, ex, home, workspace, "Anything left?", "--continue")
        nodes = proxy.tree(ex["id"])
    assert (workspace / "sub.txt").read_text() == "listed\n"  # the sub-agent's tool ran
    assert said(first) == ["Asking a sub-agent.", "Done: the sub-agent reported."]
    [used] = tools_used(first)
    assert (used["tool"], used["state"]["input"]) == ("task", TASK)
    sub_id = used["state"]["metadata"]["sessionId"]  # OpenCode's id of the sub-agent's session
    assert "Sub-agent report: listed." in used["state"]["output"]
    session = {e["sessionID"] for e in first}
    assert session == {e["sessionID"] for e in resumed} and sub_id not in session
    assert said(resumed) == ["Resumed: nothing left to do."]

    # Three chains: the title (a side call), the main agent's, and the sub-agent's under
    # its own session id; the resumed call extends the main chain of the first process.
    found = chains(nodes)
    assert set(found) == {("main.side", "main"), ("main.task", "main"), ("sub.task", sub_id)}
    [title], main, sub = (
        found[("main.side", "main")],
        found[("main.task", "main")],
        found[("sub.task", sub_id)],
    )
    assert nodes[title]["parent"] is None
    assert len(main) == 3 and len(sub) == 2 and is_chain(nodes, main) and is_chain(nodes, sub)
    assert main[-1] == before and len(nodes) == before + 1  # the resume: one call, no title
    assert len(nodes[main[-1]]["input_ids"]) < 100  # only the new turn was prefilled anew
    # The sub-agent keeps the main agent's system prompt; its headers tell it apart.
    by_session = {(h["x-session-id"], h.get("x-parent-session-id")) for h, _ in requests}
    assert by_session == {(*session, None), (sub_id, *session)}
    assert all(
        b["messages"][0]["content"].startswith(SYSTEM) for _, b in requests if b.get("tools")
    )


# ------------------------------------------------------------------ auto-compaction

# The model's window (limit.context) less its output budget (limit.output) is where
# OpenCode compacts: 14.5k tokens, above its own prompt (~13.8k with the tiny tokenizer)
# but below it with the 1000 numbers of seq (~1.2k tokens). tail_turns 0: no recent
# turn is kept verbatim after the summary (else the long tool output would stay).
COMPACTING = {
    "provider": {"qwengyre": {"models": {"tiny": {"limit": {"context": 15500, "output": 1000}}}}},
    "compaction": {"tail_turns": 0},
}
SUMMARY = "## Objective\n- Count to 1999.\n## Progress\n- Counted with seq."
COMPACTION_SCRIPT = {
    "main.task": [
        "Counting." + tool_call("bash", {"command": "seq 1000 1999", "description": "Count"}),
        "Done: counted.",
        "Nothing left to do.",
    ],
    "main.summary": [SUMMARY],
    "main.side": ["Counting"],
    "default": ["ok"],
}


def test_an_opencode_auto_compaction_is_a_main_summary_and_a_new_root(
    opencode_bin: Path, tiny_model_dir: Path, requests: list[tuple[dict, dict]], tmp_path: Path
) -> None:
    """Once a step's usage passes the model's limit, OpenCode's hidden compaction agent
    summarises the session (its own system prompt, no tools, the conversation as text),
    then the main agent goes on from the summary: a new root."""
    home, workspace = tmp_path / "home", tmp_path / "ws"
    workspace.mkdir()
    with opencode_proxy(tmp_path, tiny_model_dir, COMPACTION_SCRIPT) as proxy:
        ex = proxy.new_execution()
        _, events = run_opencode(
            opencode_bin, ex, home, workspace, "Count to 1999", config=COMPACTING
        )
        nodes = proxy.tree(ex["id"])
    assert said(events)[-1] == "Nothing left to do."
    found = chains(nodes)
    assert set(found) == {("main.side", "main"), ("main.task", "main"), ("main.summary", "main")}
    [summary], main = found[("main.summary", "main")], found[("main.task", "main")]
    assert len(main) == 3 and main[0] < main[1] < summary < main[2]
    assert [nodes[i]["parent"] for i in (*main, summary)] == [None, main[0], None, None]

    bodies = [body for _, body in requests]
    [compaction] = [
        b for b in bodies if b["messages"][0]["content"].startswith("You are a context")
    ]
    assert "tools" not in compaction
    assert "seq 1000 1999" in compaction["messages"][-1]["content"]  # the session, as text
    after = bodies[-1]
    assert after["messages"][0]["content"].startswith(SYSTEM)
    assert [m["content"] for m in after["messages"][1:3]] == ["What did we do so far?", SUMMARY]
