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


def proxy_with(script: dict, tmp_path: Path, tiny_model_dir: Path) -> Iterator[Running]:
    from transformers import AutoTokenizer

    engine = ScriptedEngine(AutoTokenizer.from_pretrained(tiny_model_dir), script)
    # Claude Code's own prompt is far longer than the tiny model's window; the scripted
    # engine does not care, so the proxy gets a window like a real model's.
    yield from start(tmp_path, tiny_model_dir, engines=[engine], max_context=1_000_000)


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
