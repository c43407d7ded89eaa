"""The real Codex CLI (OpenAI Responses API only) through the proxy, offline, with a
scripted engine.

The ``codex_bin`` fixture (conftest) installs the pinned ``@openai/codex`` with npm into
a cache folder (about 5 s, 424 MB) and skips, saying why, when node/npm are missing or
the install fails. Codex runs as the ``codex`` harness preset runs it
(:func:`~qwengyre.rollout.harness.codex_spec`): a private HOME whose ``config.toml``
points a model provider at the execution's base URL (``wire_api = "responses"``, the key
in OPENAI_API_KEY), analytics and feedback off; here also every proxy variable aimed at
a closed port, so that nothing but its calls to the proxy (loopback, ``NO_PROXY``) can
leave.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from tests.conftest import proxy_bodies
from tests.test_proxy_server import Running, start

from qwengyre.engines.scripted import ScriptedEngine
from qwengyre.proxy import server as proxy_server
from qwengyre.proxy.body import BodyMemo, SplitBody
from qwengyre.proxy.types import Message, ToolCall
from qwengyre.rollout.harness import codex_spec, prepare_harness, supervise

pytestmark = pytest.mark.slow  # seconds; still in the default suite

SHELL_ARGS = {"cmd": "echo hello > out.txt"}
SCRIPT = {
    "main.task": [
        "Writing the file.\n<tool_call>\n"
        + json.dumps({"name": "exec_command", "arguments": SHELL_ARGS})
        + "\n</tool_call>",
        "Done: wrote out.txt.",
    ],
    "default": ["ok"],
}
NOWHERE = "http://127.0.0.1:9"  # a closed port: any call that is not to the proxy fails


@pytest.fixture
def proxy(tmp_path: Path, tiny_model_dir: Path) -> Iterator[Running]:
    from transformers import AutoTokenizer

    engine = ScriptedEngine(AutoTokenizer.from_pretrained(tiny_model_dir), SCRIPT)
    # Codex's own prompt (~17k tokens with the tiny tokenizer) is far longer than the
    # tiny model's window; the scripted engine does not care.
    yield from start(tmp_path, tiny_model_dir, engines=[engine], max_context=1_000_000)


@pytest.fixture
def splits(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, int]]:
    """For each body the proxy split: whether it repeats a remembered one, and how many
    of its items were decoded."""
    seen: list[tuple[bool, int]] = []
    split = BodyMemo.split

    def spy(self: BodyMemo, body: bytes, key: str = "messages") -> SplitBody | None:
        found = split(self, body, key)
        if found is not None:
            seen.append((found.known is not None, len(found.doc[key])))
        return found

    monkeypatch.setattr(BodyMemo, "split", spy)
    return seen


@pytest.fixture
def requests(monkeypatch: pytest.MonkeyPatch) -> list[tuple[dict, dict]]:
    """Every ``/responses`` request the proxy read: (its headers, its body as JSON)."""
    return proxy_bodies(monkeypatch, "/responses")


def run_codex(
    binary: Path,
    ex: dict,
    home: Path,
    workspace: Path,
    task: str,
    config: str = "",
    resume: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """``codex exec`` of ``task`` against the execution ``ex``, as the ``codex`` harness
    preset runs it (its command, environment and ``config.toml`` in the private home);
    ``config``: more top-level ``config.toml`` lines; ``resume``: run ``codex exec resume
    RESUME...`` instead (a session of that home, ``--last`` or its id). Every proxy
    variable points at a closed port (loopback excepted): nothing but its calls to the
    proxy can leave."""
    offline = {name: NOWHERE for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")}
    spec = codex_spec(
        str(binary),
        "tiny",
        extra_config=config,
        deadline_s=120,
        extra_env={**offline, "NO_PROXY": "127.0.0.1,localhost"},
    )
    if resume:
        at = spec.command.index("exec") + 1
        spec = replace(spec, command=(*spec.command[:at], "resume", *resume, *spec.command[at:]))
    launch = prepare_harness(
        spec,
        workspace=workspace,
        logs_dir=home.parent / "logs",
        execution_id=ex["id"],
        base_url=ex["base_url"],
        api_key=ex["key"],
        instructions=task,
        home_dir=home,
    )
    ran = asyncio.run(supervise(launch))
    assert not ran.timed_out
    return subprocess.CompletedProcess(
        spec.command, ran.exit_code, ran.stdout_path.read_text(), ran.stderr_path.read_text()
    )


def test_codex_runs_a_tool_loop_through_the_proxy(
    codex_bin: Path,
    proxy: Running,
    requests: list[tuple[dict, dict]],
    splits: list[tuple[bool, int]],
    tmp_path: Path,
) -> None:
    ex = proxy.new_execution()
    home, workspace = tmp_path / "home", tmp_path / "ws"
    workspace.mkdir()
    done = run_codex(codex_bin, ex, home, workspace, "Write hello to out.txt")
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    assert (workspace / "out.txt").read_text() == "hello\n"  # the shell tool really ran
    events = [json.loads(line) for line in done.stdout.splitlines()]
    items = [e["item"] for e in events if e["type"] == "item.completed"]
    said = [item["text"] for item in items if item["type"] == "agent_message"]
    assert said == ["Writing the file.", "Done: wrote out.txt."]

    # One main.task chain: the follow-up adds only the tool's output and the new turn.
    nodes = proxy.tree(ex["id"])
    assert [(n["parent"], n["class"]) for n in nodes] == [(None, "main.task"), (0, "main.task")]
    assert len(nodes[1]["input_ids"]) < 150 < len(nodes[0]["input_ids"])
    for node in nodes:  # the engine's tokens and their log-probs, one each
        assert len(node["logprobs"]) == len(node["output_ids"]) > 0
        assert node["delivered"]
    # Codex streams and resends the whole conversation (it asks the server to store none);
    # the proxy decodes the second body only past the first's items.
    bodies = [body for _, body in requests]
    assert [(b["stream"], b["store"]) for b in bodies] == [(True, False), (True, False)]
    new_items = len(bodies[1]["input"]) - len(bodies[0]["input"])
    assert splits == [(False, len(bodies[0]["input"])), (True, new_items)]

    # The call went out as a function_call item and came back with its output, paired
    # by call_id; the payload Codex echoed is the recorded one.
    recorder = proxy.server.residency.executions[ex["id"]].recorder
    assert recorder is not None
    first = recorder.conversation(0)[-1]
    [call] = first.tool_calls
    assert first == Message(
        "assistant", "Writing the file.", (ToolCall(call.id, "exec_command", SHELL_ARGS),)
    )
    echoed = [i for i in bodies[1]["input"] if i.get("type", "").startswith("function_call")]
    assert [(i["type"], i["call_id"]) for i in echoed] == [
        ("function_call", call.id),
        ("function_call_output", call.id),
    ]
    assert json.loads(echoed[0]["arguments"]) == SHELL_ARGS
    conversation = recorder.conversation(1)
    assert conversation[: len(recorder.conversation(0))] == recorder.conversation(0)
    tool = next(m for m in conversation if m.role == "tool")
    assert tool.tool_call_id == call.id and "exited with code 0" in tool.content
    # What Codex was streamed is what was recorded.
    assert conversation[-1] == Message("assistant", "Done: wrote out.txt.")


def tool_call(name: str, arguments: dict) -> str:
    """A scripted reply's tool call (the chat template's format)."""
    return "\n<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


# The main agent spawns a sub-agent, then waits in its shell until the sub-agent's own
# tool has run (so the sub-agent's calls are made whatever the machine's load), then
# finishes; the sub-agent runs one tool and reports.
WAIT_FOR_SUB = "for i in $(seq 300); do [ -f sub.txt ] && break; sleep 0.1; done; cat sub.txt"
SUB_AGENT_SCRIPT = {
    "main.task": [
        "Asking a sub-agent."
        + tool_call("multi_agent_v1__spawn_agent", {"message": "List the files and report."}),
        "Waiting for it." + tool_call("exec_command", {"cmd": WAIT_FOR_SUB}),
        "Done: the sub-agent reported.",
    ],
    "sub.task": [
        "Listing." + tool_call("exec_command", {"cmd": "echo listed > sub.txt"}),
        "Listed the files.",
    ],
    "default": ["ok"],
}


@contextlib.contextmanager
def codex_proxy(tmp_path: Path, model_dir: Path, script: dict) -> Iterator[Running]:
    """The proxy with Codex's request-class rules, its engine scripted with ``script``
    (Codex's own prompt, ~17k tokens with the tiny tokenizer, is far longer than the
    tiny model's window; the scripted engine does not care)."""
    from transformers import AutoTokenizer

    from qwengyre.proxy.classes import load_rule_set

    engine = ScriptedEngine(AutoTokenizer.from_pretrained(model_dir), script)
    rules = load_rule_set("codex")
    serving = contextlib.contextmanager(start)
    with serving(tmp_path, model_dir, engines=[engine], max_context=1_000_000, classes=rules) as p:
        yield p


def test_a_codex_sub_agent_is_recorded_as_its_own_sub_task_chain(
    codex_bin: Path, tiny_model_dir: Path, requests: list[tuple[dict, dict]], tmp_path: Path
) -> None:
    home, workspace = tmp_path / "home", tmp_path / "ws"
    workspace.mkdir()
    with codex_proxy(tmp_path, tiny_model_dir, SUB_AGENT_SCRIPT) as proxy:
        ex = proxy.new_execution()
        done = run_codex(codex_bin, ex, home, workspace, "Inspect with a sub-agent")
        nodes = proxy.tree(ex["id"])
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    assert (workspace / "sub.txt").read_text() == "listed\n"  # the sub-agent's tool ran
    events = [json.loads(line) for line in done.stdout.splitlines()]
    [spawned] = [
        e["item"]
        for e in events
        if e["type"] == "item.completed" and e["item"]["type"] == "collab_tool_call"
    ]
    [sub_id] = spawned["receiver_thread_ids"]  # Codex's id of the sub-agent's thread

    # The namespaced call reached Codex split as it sent it: namespace and name.
    echoed = {
        (i.get("namespace"), i["name"])
        for _, body in requests
        for i in body["input"]
        if i.get("type") == "function_call"
    }
    assert echoed == {("multi_agent_v1", "spawn_agent"), (None, "exec_command")}

    # Two chains: the main agent's calls (three, or four when the sub-agent's report
    # arrives after its last turn), and the sub-agent's two under its own id (Codex names
    # its sub-agent only in x-codex-turn-metadata: thread_source, thread_id).
    chains: dict[tuple[str, str], list[int]] = {}
    for index, node in enumerate(nodes):
        chains.setdefault((node["class"], node["agent_id"]), []).append(index)
    assert set(chains) == {("main.task", "main"), ("sub.task", sub_id)}, chains
    main, sub = chains[("main.task", "main")], chains[("sub.task", sub_id)]
    assert len(main) in (3, 4) and len(sub) == 2
    for chain in (main, sub):  # each its own root, each call extending the one before
        assert [nodes[i]["parent"] for i in chain] == [None, *chain[:-1]]


COMPACTION_SCRIPT = {
    "main.task": ["Saying hi." + tool_call("exec_command", {"cmd": "echo hi"}), "Done: said hi."],
    "main.summary": ["Summary: said hi with the shell."],
    "default": ["ok"],
}


def test_a_codex_auto_compaction_is_recorded_as_a_main_summary_and_a_new_root(
    codex_bin: Path, tmp_path: Path, tiny_model_dir: Path, requests: list[tuple[dict, dict]]
) -> None:
    """Codex compacts mid-turn once the usage it is told passes its limit (its own prompt
    is ~17.3k tokens with the tiny tokenizer: a limit of 17k compacts after the first
    call). The compaction request (``request_kind: compaction``, no tools) is the main
    agent's summary; the turn then goes on from the summary, a new root."""
    home, workspace = tmp_path / "home", tmp_path / "ws"
    workspace.mkdir()
    with codex_proxy(tmp_path, tiny_model_dir, COMPACTION_SCRIPT) as proxy:
        ex = proxy.new_execution()
        limit = "model_auto_compact_token_limit = 17000\n"
        done = run_codex(codex_bin, ex, home, workspace, "Say hi", config=limit)
        nodes = proxy.tree(ex["id"])
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    assert [(n["parent"], n["class"]) for n in nodes] == [
        (None, "main.task"),
        (None, "main.summary"),
        (None, "main.task"),
    ]
    compaction, after = requests[1][1], requests[2][1]
    assert "tools" not in compaction or not compaction["tools"]
    assert "CONTEXT CHECKPOINT COMPACTION" in json.dumps(compaction["input"][-1])
    assert "Summary: said hi with the shell." in json.dumps(after["input"])  # goes on from it


RESUME_SCRIPT = {
    "main.task": [
        "Saying hi." + tool_call("exec_command", {"cmd": "echo hi"}),
        "Done: said hi.",
        "Bye!",
    ],
    "default": ["ok"],
}


def test_a_resumed_codex_session_extends_the_first_sessions_chain(
    codex_bin: Path,
    tiny_model_dir: Path,
    requests: list[tuple[dict, dict]],
    splits: list[tuple[bool, int]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``codex exec resume --last PROMPT``, a new process, resends the stored session
    (read back from ``$CODEX_HOME/sessions``) and the new turn: the proxy extends the first
    session's last call, whose tokens it already has."""
    headers: list[dict] = []
    read = proxy_server.read_body

    async def spy(http, max_bytes):  # type: ignore[no-untyped-def]
        headers.append(json.loads(http.headers["x-codex-turn-metadata"]))
        return await read(http, max_bytes)

    monkeypatch.setattr(proxy_server, "read_body", spy)
    home, workspace = tmp_path / "home", tmp_path / "ws"
    workspace.mkdir()
    with codex_proxy(tmp_path, tiny_model_dir, RESUME_SCRIPT) as proxy:
        ex = proxy.new_execution()
        first = run_codex(codex_bin, ex, home, workspace, "Say hi")
        assert first.returncode == 0, first.stderr[-3000:] + first.stdout[-3000:]
        second = run_codex(codex_bin, ex, home, workspace, "Say bye", resume=("--last",))
        assert second.returncode == 0, second.stderr[-3000:] + second.stdout[-3000:]
        nodes = proxy.tree(ex["id"])
        recorder = proxy.server.residency.executions[ex["id"]].recorder
        assert recorder is not None
        conversations = [recorder.conversation(node["id"]) for node in nodes]

    # The same thread, resumed from disk (Codex says so in its turn metadata).
    started = [json.loads(done.stdout.splitlines()[0]) for done in (first, second)]
    assert started[0]["type"] == started[1]["type"] == "thread.started"
    thread = started[0]["thread_id"]
    assert started[1]["thread_id"] == thread
    assert [(h["thread_id"], h["history_initialization"]) for h in headers] == [
        (thread, "new"),
        (thread, "new"),
        (thread, "cold_resume"),
    ]
    items = [json.loads(line) for line in second.stdout.splitlines()]
    said = [e["item"] for e in items if e["type"] == "item.completed"]
    assert [i["text"] for i in said if i["type"] == "agent_message"] == ["Bye!"]

    # One chain: the resumed call extends the first session's last one, the main agent's.
    assert [(n["parent"], n["class"], n["agent_id"]) for n in nodes] == [
        (None, "main.task", "main"),
        (0, "main.task", "main"),
        (1, "main.task", "main"),
    ]
    assert len(nodes[2]["input_ids"]) < 50  # the reply's end and the new user turn only
    # Codex resent the first session word for word, then the reply it was streamed and
    # the new turn; the proxy decoded only those two items.
    before, resumed = requests[1][1], requests[2][1]
    assert resumed["input"][: len(before["input"])] == before["input"]
    assert resumed["tools"] == before["tools"]
    reply, turn = resumed["input"][len(before["input"]) :]
    assert (reply["role"], reply["content"][0]["text"]) == ("assistant", "Done: said hi.")
    assert (turn["role"], turn["content"]) == ("user", [{"type": "input_text", "text": "Say bye"}])
    assert splits[-1] == (True, 2)
    # What was recorded round-trips: the tool call's payload, by its call_id, and each
    # conversation extends the one before it.
    [call] = conversations[0][-1].tool_calls
    echoed = [i for i in resumed["input"] if i.get("type") == "function_call"]
    assert [(i["call_id"], json.loads(i["arguments"])) for i in echoed] == [
        (call.id, {"cmd": "echo hi"})
    ]
    for shorter, longer in itertools.pairwise(conversations):
        assert longer[: len(shorter)] == shorter
    assert list(conversations[2][-2:]) == [
        Message("user", "Say bye"),
        Message("assistant", "Bye!"),
    ]
