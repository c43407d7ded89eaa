"""`qwengyre train` with the real Qwen Code, OpenCode and Codex CLIs as harnesses, through
their presets (``harness.name=qwen-code`` / ``opencode`` / ``codex``): one RL step each, as
tests/test_train_claude_code.py runs Claude Code.

The npm fixtures (conftest) install the pinned clients, or skip saying why. Each client's
own prompt is far longer than a tiny model's window (Qwen Code 0.24.4: ~24.6k tokens with
the "demo" model's tokenizer, OpenCode 1.18.33: ~10.5k, Codex 0.171.0: ~13.3k), so the
binary the preset runs (``$QWENGYRE_QWEN_BIN`` / ``$QWENGYRE_OPENCODE_BIN`` /
``$QWENGYRE_CODEX_BIN``) is a wrapper that shortens it with the client's own options: a
one-line system prompt, the shell tool alone and replies of 256 tokens (Qwen Code:
``--system-prompt``, ``--core-tools``/``--exclude-tools`` and a workspace
``.qwen/settings.json`` hiding its bundled skills; OpenCode: its build agent's ``prompt``,
``permission``, the model's output limit and no auto-compaction in
``OPENCODE_CONFIG_CONTENT``; Codex: ``-c`` overrides, ``CODEX_SHORT``, and no reply limit:
it has no option for one). Everything else is the preset's: its settings in the
private home, its flags and environment, the sandbox (bubblewrap where it runs), the
proxy's rule set.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import shutil
from pathlib import Path

import pytest
from tests.test_train_claude_code import alternating_tasks

from qwengyre.config import load_config
from qwengyre.proxy.store import Store
from qwengyre.records.metrics import read_metrics
from qwengyre.rollout.harness import CODEX_BIN_ENV, OPENCODE_BIN_ENV, QWEN_BIN_ENV
from qwengyre.rollout.sandbox import SandboxUnavailable, sandbox
from qwengyre.training.checkpoint import latest_checkpoint

pytestmark = pytest.mark.slow

QWEN_SHORT = [
    "--system-prompt",
    "You are a coding agent. Use run_shell_command to act.",
    "--core-tools",
    "run_shell_command",
    "--exclude-tools",
    *[
        "agent",
        "skill",
        "tool_search",
        "list_agents",
        "get_goal",
        "update_goal",
        "tool_call",
        "enter_worktree",
        "exit_worktree",
        "record_artifact",
        "report_findings",
        "send_message",
        "task_stop",
    ],
]
OPENCODE_SHORT = {
    "agent": {"build": {"prompt": "You are a coding agent. Use bash to act."}},
    "permission": {"*": "deny", "bash": "allow"},
    # a prompt that outgrows the window ends the run (compacting cannot shrink it enough)
    "compaction": {"auto": False},
    # its title request's reply, which max_context leaves long, short too
    "provider": {"qwengyre": {"models": {"qwengyre": {"limit": {"context": 2560, "output": 256}}}}},
}

# Codex's own options (``codex -c KEY=VALUE``, its config.toml keys): a one-line base
# prompt instead of its ~6.4k-token one (``model_instructions_file``), no sub-agent
# (``multi_agent``), goal, image, web-search or ask-the-user tool, no bundled skills'
# list, no permissions or environment-context block. Left: the developer line, the task
# and its shell, ``exec_command`` and ``write_stdin`` (turning ``unified_exec`` off
# changes nothing). Codex has no option for a reply's length: its requests carry no
# ``max_output_tokens``, so a reply may take the rest of ``engine.max_context``.
CODEX_SHORT = [
    "features.multi_agent=false",
    "features.goals=false",
    "features.view_image=false",
    'web_search="disabled"',
    "tools.experimental_request_user_input.enabled=false",
    "skills.bundled.enabled=false",
    "include_permissions_instructions=false",
    "include_environment_context=false",
]


def wrapper(at: Path, name: str, body: str) -> Path:
    """An executable shell script ``at/name`` running ``body``."""
    at.mkdir(exist_ok=True)
    path = at / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def one_step(
    harness: str, max_context: int, exposed: list[Path], model: Path, tmp_path: Path
) -> Path:
    """Train one step through ``harness`` (the model's calls capped at ``max_context``
    tokens, prompt and reply: a few hundred tokens of the untrained model's garbage; the
    sandbox showing ``exposed``); its run directory."""
    from qwengyre.apps.train import TrainOptions, train

    try:  # the harness confined where bubblewrap runs (run unconfined elsewhere)
        sandbox("bwrap").check()
        confine = "bwrap"
    except SandboxUnavailable:
        confine = "none"
    config = load_config(
        None,
        [
            f"harness.name={harness}",
            f"model.path={model}",
            f"harness.tasks={alternating_tasks(tmp_path)}",
            "run.steps=1",
            "warm_start.accuracy=null",
            f"engine.max_context={max_context}",
            "harness.deadline_s=60",
            "harness.budget_s=90",
            "groups.size=4",
            "groups.batch=2",
            "groups.min_valid=2",
            "cells.count=2",
            "cells.capacity=4",
            "cells.standalone_capacity=0",
            "trainer.lr=1e-3",
            "trainer.micro_step_tokens=4096",
            "scheduler.tau_s=0.5",
            f"harness.sandbox={confine}",
            f"harness.sandbox_expose=[{','.join(map(str, exposed))}]",
        ],
    )
    assert config.proxy.classes == harness  # the preset brings its rule set
    run_dir = tmp_path / "run"
    asyncio.run(train(TrainOptions(run_dir=run_dir, config=config, display=False)))
    return run_dir


def recorded_classes(run_dir: Path) -> list[tuple[str, str]]:
    """(class, agent id) of every call the proxy recorded."""
    store = Store(run_dir / "proxy.sqlite")
    try:
        calls = [call for ex in store.executions() for call in store.calls(ex.id)]
    finally:
        store.close()
    return [(node.meta.request_class, node.meta.agent_id) for node, _ in calls]


def check_the_step(run_dir: Path, completed: int = 2 * 2) -> list[dict]:
    """Every execution ran, at least ``completed`` completed (default B x min_valid), the
    completed ones called the model, one optimizer step trained and was checkpointed;
    the traces."""
    traces = [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()]
    assert len(traces) >= 2 * 4
    assert all(t["calls"] for t in traces if t["outcome"] == "completed")
    assert sum(t["outcome"] == "completed" for t in traces) >= completed
    steps = read_metrics(run_dir).steps
    assert [s.version for s in steps] == [1] and steps[0].micro_steps > 0
    assert latest_checkpoint(run_dir / "checkpoints") is not None
    assert (run_dir / "config.yaml").read_text().count("classes: ") == 1
    return traces


def test_one_step_of_rl_through_qwen_code(
    qwen_bin: Path, demo_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if shutil.which("node") is None:
        pytest.skip("node is needed to run the real Qwen Code CLI")
    # a workspace setting: no bundled skill listed, replies of 256 tokens at most
    settings = {
        "skills": {"disabledLevels": ["bundled"]},
        "model": {"generationConfig": {"samplingParams": {"max_tokens": 256}}},
    }
    wrapped = wrapper(
        tmp_path / "bin",
        "qwen",
        f"mkdir -p .qwen && echo {shlex.quote(json.dumps(settings))} > .qwen/settings.json\n"
        f'exec {shlex.join([str(qwen_bin), *QWEN_SHORT])} "$@"',
    )
    monkeypatch.setenv(QWEN_BIN_ENV, str(wrapped))
    # its shortened first prompt: ~3.2k tokens
    run_dir = one_step(
        "qwen-code", 3584, [wrapped.parent, qwen_bin.parents[2]], demo_model_dir, tmp_path
    )
    check_the_step(run_dir)
    logs = sorted((run_dir / "logs").glob("*/stdout.log"))
    events = json.loads(logs[0].read_text())  # -o json: one array of events
    assert events[0]["type"] == "system" and events[0]["qwen_code_version"] == "0.24.4"
    # The preset's settings were in the private home; no background memory agent ran.
    home = logs[0].parent / "home"
    assert json.loads((home / ".qwen" / "settings.json").read_text())["memory"] == {
        "enableManagedAutoMemory": False,
        "enableManagedAutoDream": False,
        "enableAutoSkill": False,
    }
    assert set(recorded_classes(run_dir)) == {("main.task", "main")}


def test_one_step_of_rl_through_opencode(
    opencode_bin: Path, demo_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if shutil.which("node") is None:
        pytest.skip("node is needed to run the real OpenCode CLI")
    wrapped = wrapper(
        tmp_path / "bin",
        "opencode",
        f"export OPENCODE_CONFIG_CONTENT={shlex.quote(json.dumps(OPENCODE_SHORT))}\n"
        f'exec {shlex.quote(str(opencode_bin))} "$@"',
    )
    monkeypatch.setenv(OPENCODE_BIN_ENV, str(wrapped))
    # its shortened first prompt: ~2.2k tokens, the title request's ~0.9k
    run_dir = one_step(
        "opencode", 2560, [wrapped.parent, opencode_bin.parents[2]], demo_model_dir, tmp_path
    )
    check_the_step(run_dir)
    # The title request (the rule set's side marker) and the build agent's turns.
    classes = recorded_classes(run_dir)
    assert set(classes) == {("main.side", "main"), ("main.task", "main")}, classes


# How Codex ends a turn whose reply ran out of tokens (the proxy's ``incomplete``).
OUT_OF_TOKENS = {
    "type": "turn.failed",
    "error": {"message": "Incomplete response returned, reason: max_output_tokens"},
}


def test_one_step_of_rl_through_codex(
    codex_bin: Path, demo_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if shutil.which("node") is None:
        pytest.skip("node is needed to run the real Codex CLI")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "instructions.md").write_text("You are a coding agent. Use exec_command to act.\n")
    overrides = [f'model_instructions_file="{bin_dir / "instructions.md"}"', *CODEX_SHORT]
    options = [arg for override in overrides for arg in ("-c", override)]
    wrapped = wrapper(bin_dir, "codex", f'exec {shlex.join([str(codex_bin), *options])} "$@"')
    monkeypatch.setenv(CODEX_BIN_ENV, str(wrapped))
    # its shortened first prompt: 986 tokens; a reply may take the other 550
    max_context = 1536
    run_dir = one_step(
        "codex", max_context, [bin_dir, codex_bin.parents[2]], demo_model_dir, tmp_path
    )
    # Codex fails a turn whose reply ran out of tokens ("incomplete"): the untrained
    # model's garbage mostly does, so few executions complete (each still gets a reward).
    traces = check_the_step(run_dir, completed=0)
    logs = sorted((run_dir / "logs").glob("*/stdout.log"))
    assert len(logs) == len(traces)
    for log in logs:  # --json: Codex's events, one a line
        events = [json.loads(line) for line in log.read_text().splitlines()]
        assert events[0]["type"] == "thread.started"
        assert events[-1]["type"] == "turn.completed" or events[-1] == OUT_OF_TOKENS, events[-3:]
    # The preset's config.toml was in the private home, the wrapper's overrides on top.
    home = logs[0].parent / "home"
    assert 'wire_api = "responses"' in (home / ".codex" / "config.toml").read_text()
    # The main agent's turns only (no sub-agent tool, no compaction at this size); a
    # call that failed spent the whole budget.
    assert set(recorded_classes(run_dir)) == {("main.task", "main")}
    store = Store(run_dir / "proxy.sqlite")
    try:
        calls = [node for ex in store.executions() for node, _ in store.calls(ex.id)]
    finally:
        store.close()
    assert {len(node.input_ids) for node in calls if node.parent is None} == {986}
    failed = sum(t["outcome"] == "failed" for t in traces)
    spent = sum(len(n.input_ids) + len(n.output_ids) == max_context for n in calls)
    assert spent >= failed, (spent, failed)
