"""The real Claude Code CLI through the proxy, offline, with a scripted engine.

The ``claude_bin`` fixture (conftest) installs the pinned ``@anthropic-ai/claude-code``
with npm into a cache folder (about 4 s, 235 MB) and skips, saying why, when node/npm
are missing or the install fails.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.test_proxy_server import Running, start

from qwengyre.engines.scripted import ScriptedEngine
from qwengyre.proxy import server as proxy_server

# Claude Code's compaction instruction and sub-agent header, as its rule set names them
# (qwengyre/presets/classes/claude-code.yaml).
COMPACTION_PREFIX = "CRITICAL: Respond with TEXT ONLY"
SUBAGENT_HEADER = "x-claude-code-agent-id"

pytestmark = pytest.mark.slow  # seconds to minutes; still in the default suite

BASH_CALL = {"name": "Bash", "arguments": {"command": "echo hello > out.txt", "description": "w"}}
TASK_CALL = {
    "name": "Task",
    "arguments": {
        "description": "inspect files",
        "prompt": "List the files and report.",
        "subagent_type": "general-purpose",
    },
}
SCRIPT = {
    "main.task": [f"<tool_call>\n{json.dumps(BASH_CALL)}\n</tool_call>", "Done: wrote out.txt."],
    "main.summary": ["Summary: wrote hello into out.txt."],
    "default": ["ok"],
}
SUBAGENT_SCRIPT = {
    "main.task": [f"<tool_call>\n{json.dumps(TASK_CALL)}\n</tool_call>", "Done: reported."],
    "sub.task": ["Sub-agent report: nothing to fix."],
    "default": ["ok"],
}


def proxy_with(
    script: dict, tmp_path: Path, tiny_model_dir: Path, max_context: int = 1_000_000
) -> Iterator[Running]:
    from transformers import AutoTokenizer

    engine = ScriptedEngine(AutoTokenizer.from_pretrained(tiny_model_dir), script)
    # Claude Code's own prompt is far longer than the tiny model's window; the scripted
    # engine does not care, so the proxy gets a window like a real model's.
    yield from start(tmp_path, tiny_model_dir, engines=[engine], max_context=max_context)


@pytest.fixture
def proxy(tmp_path: Path, tiny_model_dir: Path) -> Iterator[Running]:
    yield from proxy_with(SCRIPT, tmp_path, tiny_model_dir)


def run_claude(
    binary: Path,
    ex: dict,
    home: Path,
    workspace: Path,
    *args: str,
    tools: str = "Bash,Read,Edit,Write",
) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "CLAUDE_CODE_TMPDIR": str(home),
        "ANTHROPIC_BASE_URL": ex["base_url"],  # the path prefix is kept by the SDK
        "ANTHROPIC_API_KEY": ex["key"],
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "IS_SANDBOX": "1",
    }
    common = ["--dangerously-skip-permissions", "--output-format", "stream-json", "--verbose"]
    return subprocess.run(
        [str(binary), "-p", *args, *common, "--tools", tools],
        cwd=workspace,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_claude_code_runs_a_tool_loop_and_a_compaction_through_the_proxy(
    claude_bin: Path, proxy: Running, tmp_path: Path
):
    ex = proxy.new_execution()
    home, workspace = tmp_path / "home", tmp_path / "ws"
    home.mkdir()
    workspace.mkdir()
    done = run_claude(claude_bin, ex, home, workspace, "Write hello to out.txt")
    assert done.returncode == 0, done.stderr[-2000:]
    assert (workspace / "out.txt").read_text() == "hello\n"  # the Bash tool really ran
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["result"] == "Done: wrote out.txt."
    nodes = proxy.tree(ex["id"])
    assert [(n["parent"], n["class"]) for n in nodes] == [(None, "main.task"), (0, "main.task")]
    assert len(nodes[1]["input_ids"]) < 100  # only the tool result and the new turn
    compact = run_claude(claude_bin, ex, home, workspace, "/compact", "--continue")
    assert compact.returncode == 0, compact.stderr[-2000:]
    nodes = proxy.tree(ex["id"])
    summary = [n for n in nodes if n["class"] == "main.summary"]
    assert len(summary) == 1
    # The summary call has its own system prompt: a new branch, not an extension.
    assert summary[0]["parent"] is None
    assert proxy.tokenizer.decode(summary[0]["output_ids"]).startswith("Summary:")


def test_a_claude_code_subagent_gets_its_own_branch_and_class(
    claude_bin: Path, tmp_path: Path, tiny_model_dir: Path
):
    for proxy in proxy_with(SUBAGENT_SCRIPT, tmp_path, tiny_model_dir):
        ex = proxy.new_execution()
        home, workspace = tmp_path / "home", tmp_path / "ws"
        home.mkdir()
        workspace.mkdir()
        done = run_claude(
            claude_bin, ex, home, workspace, "Inspect with a sub-agent", tools="Bash,Read,Task"
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stdout.strip().splitlines()[-1])["result"] == "Done: reported."
        nodes = proxy.tree(ex["id"])
        classes = [(n["parent"], n["class"]) for n in nodes]
        assert classes == [(None, "main.task"), (None, "sub.task"), (0, "main.task")]
        assert nodes[1]["agent_id"] not in ("", "main")  # Claude Code's agent id header
        # The main agent's follow-up only adds the Task tool's result.
        assert "Sub-agent report" in proxy.tokenizer.decode(nodes[2]["input_ids"])


# ------------------------------------------------------------------ compaction shapes
#
# Claude Code keeps its last reply (and anything after it) verbatim and summarises the
# history before it, appending the compaction instruction to the last user message of
# that history. After a tool loop that message holds a tool_result (the proxy splits it
# into a tool message and a user message of its own); after a text-only turn it holds
# the user's text, so the instruction arrives as a *second text block* of a user message
# whose content, joined, starts with the user's words.

TEXT_SCRIPT = {
    "main.task": ["Hi there!", "Bye!", "Again!"],
    "main.summary": ["Summary: said hi and bye."],
    "default": ["ok"],
}
FILLER = "lorem "  # 3 tokens of the tiny model's tokenizer per copy


@pytest.fixture
def requests_seen(monkeypatch: pytest.MonkeyPatch) -> list[tuple[dict, str | None]]:
    """Every ``/v1/messages`` body the proxy parsed (rejected ones too), as JSON, with
    its sub-agent header."""
    seen: list[tuple[dict, str | None]] = []
    read = proxy_server.read_body

    async def spy(http, max_bytes):  # type: ignore[no-untyped-def]
        body = await read(http, max_bytes)
        if http.path.endswith("/v1/messages"):
            seen.append((json.loads(body), http.headers.get(SUBAGENT_HEADER)))
        return body

    monkeypatch.setattr(proxy_server, "read_body", spy)
    return seen


def last_user_blocks(body: dict) -> list[dict]:
    last = next(m for m in reversed(body["messages"]) if m["role"] == "user")
    content = last["content"]
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def compaction_requests(seen: list[tuple[dict, str | None]]) -> list[tuple[dict, str | None]]:
    return [
        (body, agent)
        for body, agent in seen
        if any(
            b["type"] == "text" and b["text"].startswith(COMPACTION_PREFIX)
            for b in last_user_blocks(body)
        )
    ]


def events(done: subprocess.CompletedProcess[str]) -> list[dict]:
    assert done.returncode == 0, done.stderr[-2000:] + done.stdout[-2000:]
    return [json.loads(line) for line in done.stdout.strip().splitlines()]


def compacted(done: subprocess.CompletedProcess[str], trigger: str) -> bool:
    found = events(done)
    boundaries = [e for e in found if e.get("subtype") == "compact_boundary"]
    ok = any(e.get("compact_result") == "success" for e in found)
    return ok and [b["compact_metadata"]["trigger"] for b in boundaries] == [trigger]


def last_user_message(proxy: Running, execution_id: str, node_id: int) -> str:
    """The last user message of what the proxy recorded for a node (request + reply)."""
    conversation = proxy.server.residency.executions[execution_id].recorder.conversation(node_id)
    return next(m.content for m in reversed(conversation) if m.role == "user")


def assert_text_turn_compaction(body: dict, user_text: str) -> None:
    """The raw request: the last message is the user's text turn, then the instruction."""
    assert body["messages"][-1]["role"] == "user"
    blocks = last_user_blocks(body)
    assert [b["type"] for b in blocks] == ["text", "text"]
    assert blocks[0]["text"].strip() == user_text
    assert blocks[1]["text"].startswith(COMPACTION_PREFIX)


def test_claude_code_compact_after_a_text_only_turn_records_a_main_summary(
    claude_bin: Path, tmp_path: Path, tiny_model_dir: Path, requests_seen: list
) -> None:
    for proxy in proxy_with(TEXT_SCRIPT, tmp_path, tiny_model_dir):
        ex = proxy.new_execution()
        home, workspace = tmp_path / "home", tmp_path / "ws"
        home.mkdir()
        workspace.mkdir()
        # Two text-only exchanges: /compact keeps the last reply, so with one exchange
        # Claude Code says "Not enough messages to compact."
        hi = run_claude(claude_bin, ex, home, workspace, "say hi")
        assert events(hi)[-1]["result"] == "Hi there!"
        bye = run_claude(claude_bin, ex, home, workspace, "say bye", "--continue")
        assert events(bye)[-1]["result"] == "Bye!"
        compact = run_claude(claude_bin, ex, home, workspace, "/compact", "--continue")
        assert compacted(compact, "manual"), compact.stdout[-3000:]

        nodes = proxy.tree(ex["id"])
        assert [n["class"] for n in nodes] == ["main.task", "main.task", "main.summary"]
        summary = nodes[2]
        assert proxy.tokenizer.decode(summary["output_ids"]).startswith("Summary:")
        # What the proxy recorded for that node: the user's text and the instruction in
        # one user message (the old rule looked only at how that message starts).
        last = last_user_message(proxy, ex["id"], summary["id"])
        assert last.startswith("say bye") and f"\n{COMPACTION_PREFIX}" in last
        # What Claude Code sent: exactly one compaction request, of the text-turn shape.
        [(body, agent)] = compaction_requests(requests_seen)
        assert agent is None
        assert_text_turn_compaction(body, "say bye")


def test_claude_code_auto_compaction_after_a_text_only_turn_records_a_main_summary(
    claude_bin: Path, tmp_path: Path, tiny_model_dir: Path, requests_seen: list
) -> None:
    # Token counts with the tiny model's tokenizer (Claude Code 2.1.197, tools
    # Bash,Read,Edit,Write): its own prompt P ~ 6_000; the compaction instruction
    # C ~ 2_800. The first message carries 8_100 filler tokens, the third 6_000, so:
    #   calls 1-2          P + 8_100          ~ 14_100  fit
    #   call 3             P + 8_100 + 6_000  ~ 20_150  400 "prompt is too long"
    #   compaction         P + 8_100 + C      ~ 16_900  fits
    #   retry              P + summary + 6_000 ~ 12_400  fits
    # max_context sits halfway between the compaction and call 3 (margins ~1_600).
    max_context = 18_450
    for proxy in proxy_with(TEXT_SCRIPT, tmp_path, tiny_model_dir, max_context=max_context):
        ex = proxy.new_execution()
        home, workspace = tmp_path / "home", tmp_path / "ws"
        home.mkdir()
        workspace.mkdir()
        hi = run_claude(claude_bin, ex, home, workspace, "say hi " + FILLER * 2_700)
        assert events(hi)[-1]["result"] == "Hi there!"
        bye = run_claude(claude_bin, ex, home, workspace, "say bye", "--continue")
        assert events(bye)[-1]["result"] == "Bye!"
        again = run_claude(
            claude_bin, ex, home, workspace, "say again " + FILLER * 2_000, "--continue"
        )
        assert compacted(again, "auto"), again.stdout[-3000:]
        assert events(again)[-1]["result"] == "Again!"  # the retry after compaction

        nodes = proxy.tree(ex["id"])
        sizes = [n["usage"]["input_tokens"] for n in nodes]
        assert [n["class"] for n in nodes] == [
            "main.task",
            "main.task",
            "main.summary",
            "main.task",
        ], sizes
        assert all(size < max_context for size in sizes)
        summary = nodes[2]
        last = last_user_message(proxy, ex["id"], summary["id"])
        assert last.startswith("say bye") and f"\n{COMPACTION_PREFIX}" in last
        retry = last_user_message(proxy, ex["id"], nodes[3]["id"])
        assert retry.startswith("say again")
        # Claude Code sent call 3 (refused, not recorded), the compaction, the retry.
        bodies = [body for body, _ in requests_seen]
        assert len(bodies) == 5
        assert last_user_blocks(bodies[2])[-1]["text"].startswith("say again")
        [(body, agent)] = compaction_requests(requests_seen)
        assert agent is None and body is bodies[3]
        assert_text_turn_compaction(body, "say bye")


def test_a_claude_code_subagent_auto_compaction_records_a_sub_summary(
    claude_bin: Path, tmp_path: Path, tiny_model_dir: Path, requests_seen: list
) -> None:
    # A sub-agent's only user text is its prompt, so it compacts after a tool result:
    # the instruction is a text block after the tool_result of the last user message.
    # Sub-agent prompt P ~ 4_850 tokens, C ~ 2_800; its first command prints 1_500
    # lines (~6_750 tokens), its second 1_250 (~5_650):
    #   sub call 2   P + 6_750          ~ 11_600  fits
    #   sub call 3   P + 12_400         ~ 17_300  400
    #   compaction   P + 6_750 + C      ~ 14_400  fits
    #   retry        P + summary + 5_650 ~ 11_000  fits
    # (the main agent's calls are ~7_300). max_context sits halfway (margins ~1_450).
    def bash(command: str) -> str:
        call = {"name": "Bash", "arguments": {"command": command, "description": "d"}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"

    script = {
        **SUBAGENT_SCRIPT,
        "sub.task": [
            bash("yes lorem | head -n 1500"),
            bash("yes lorem | head -n 1250"),
            "Sub-agent report: nothing to fix.",
        ],
        "sub.summary": ["Summary: printed lorem twice."],
    }
    max_context = 15_850
    for proxy in proxy_with(script, tmp_path, tiny_model_dir, max_context=max_context):
        ex = proxy.new_execution()
        home, workspace = tmp_path / "home", tmp_path / "ws"
        home.mkdir()
        workspace.mkdir()
        done = run_claude(
            claude_bin, ex, home, workspace, "Inspect with a sub-agent", tools="Bash,Read,Task"
        )
        assert events(done)[-1]["result"] == "Done: reported."
        nodes = proxy.tree(ex["id"])
        sizes = [n["usage"]["input_tokens"] for n in nodes]
        classes = [n["class"] for n in nodes]
        assert classes == [
            "main.task",
            "sub.task",
            "sub.task",
            "sub.summary",
            "sub.task",
            "main.task",
        ], sizes
        agent_id = nodes[1]["agent_id"]
        assert agent_id not in ("", "main")
        assert [n["agent_id"] for n in nodes[1:5]] == [agent_id] * 4
        # The sub-agent's retry after compaction is what the main agent got back.
        assert "Sub-agent report" in proxy.tokenizer.decode(nodes[5]["input_ids"])
        [(body, agent)] = compaction_requests(requests_seen)
        assert agent == agent_id
        assert [b["type"] for b in last_user_blocks(body)] == ["tool_result", "text"]
        assert last_user_message(proxy, ex["id"], nodes[3]["id"]).startswith(COMPACTION_PREFIX)
