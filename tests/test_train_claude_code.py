"""`qwengyre train` with the real Claude Code CLI as the harness (examples/claude-code.yaml).

One short run, in-process: real cell processes, the proxy, `claude -p ... --bare` per
execution (the ``claude_bin`` fixture installs the pinned CLI with npm, or skips saying
why), one optimizer step and its checkpoint. The tiny test model cannot solve a task, so
rewards come from a grader that alternates 0/1 per task: each group gets both, its
advantages are non-zero and the trainer really trains.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import time
from pathlib import Path

import pytest

from qwengyre.config import load_config
from qwengyre.proxy.store import Store
from qwengyre.records.metrics import read_metrics
from qwengyre.rollout.harness import CLAUDE_BIN_ENV
from qwengyre.rollout.tasks import CommandEvaluator, Task, dump_tasks
from qwengyre.training.checkpoint import latest_checkpoint, read_checkpoint

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "claude-code.yaml"

# Score = how many times this task was graded before, mod 2 (a file lock keeps the
# count exact across concurrent graders): a group of one task gets 0s and 1s.
ALTERNATE = """
import fcntl, json, sys
from pathlib import Path
with open(Path(sys.argv[1]) / sys.argv[2], "a+") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    f.seek(0)
    n = len(f.read())
    f.write("x")
print(json.dumps({"score": float(n % 2), "valid": True}))
"""


def alternating_tasks(tmp_path: Path) -> Path:
    counts = tmp_path / "grades"
    counts.mkdir()
    tasks = [
        Task(
            id=f"t{i}",
            instructions=f"Write {i} into answer.txt.",
            evaluator=CommandEvaluator(
                command=[sys.executable, "-c", ALTERNATE, str(counts), f"t{i}"], timeout_s=30
            ),
        )
        for i in range(4)
    ]
    path = tmp_path / "tasks.jsonl"
    dump_tasks(path, tasks)
    return path


def test_one_step_of_rl_through_claude_code(
    claude_bin: Path,
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if shutil.which("node") is None:
        pytest.skip("node is needed to run the real Claude Code CLI")
    from qwengyre.apps.train import TrainOptions, train

    # The harness child inherits PATH only; the binary is named by $QWENGYRE_CLAUDE_BIN.
    monkeypatch.setenv(CLAUDE_BIN_ENV, str(claude_bin))
    config = load_config(
        EXAMPLE,
        [
            f"model.path={tiny_model_dir}",  # the "test" tiny model: 4096 positions
            f"harness.tasks={alternating_tasks(tmp_path)}",
            "run.steps=1",
            # --bare renders to ~1.8k tokens with the test tokenizer; the rest is room
            # for the (untrained, so garbage) reply.
            "engine.max_context=2304",
            "harness.deadline_s=60",
            "harness.budget_s=90",
            "groups.size=4",
            "groups.batch=2",
            "cells.count=2",
            "cells.capacity=4",
            "trainer.lr=1e-3",
            "trainer.micro_step_tokens=2304",
            "scheduler.tau_s=0.5",
            # where npm installed it, under /tmp, which a sandboxed harness gets empty
            f"harness.sandbox_expose=[{claude_bin.parents[2]}]",
        ],
    )
    assert config.harness.name == "claude-code-bare"
    run_dir = tmp_path / "run"
    began = time.monotonic()
    asyncio.run(train(TrainOptions(run_dir=run_dir, config=config, display=False)))
    seconds = time.monotonic() - began

    # Every execution ran through Claude Code; those that completed made model calls
    # (ones cancelled when the run ended may not have called the model yet).
    traces = [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()]
    assert len(traces) >= 2 * 4
    assert all(t["calls"] for t in traces if t["outcome"] == "completed")
    assert sum(t["outcome"] == "completed" for t in traces) >= 2 * 2  # B x min_valid
    logs = sorted((run_dir / "logs").glob("*/stdout.log"))
    assert logs
    init = json.loads(logs[0].read_text().splitlines()[0])  # stream-json's first event
    assert init["type"] == "system" and init["claude_code_version"] == "2.1.197"

    # The proxy recorded Claude Code's /v1/messages calls as main-agent task calls.
    store = Store(run_dir / "proxy.sqlite")
    try:
        calls = [call for ex in store.executions() for call in store.calls(ex.id)]
    finally:
        store.close()
    assert calls and {node.meta.request_class for node, _ in calls} == {"main.task"}
    node, turn = calls[0]
    system = turn.new_messages[0]  # a first call's increment is its whole conversation
    assert system.role == "system" and "cc_version=2.1.197" in system.content
    assert {t.name for t in turn.tools} >= {"Bash", "Read", "Edit"}  # --bare's tools
    assert len(node.input_ids) < config.engine.max_context

    # One optimizer step trained on real gradients, and its checkpoint exists.
    steps = read_metrics(run_dir).steps
    assert [s.version for s in steps] == [1] and steps[0].micro_steps > 0
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    assert checkpoint is not None and read_checkpoint(checkpoint).state["version"] == 1
    assert seconds < 90, f"the run took {seconds:.0f} s"


def test_claude_code_harness_names_and_binary(monkeypatch: pytest.MonkeyPatch) -> None:
    from qwengyre.rollout.harness import harness_spec

    monkeypatch.delenv(CLAUDE_BIN_ENV, raising=False)
    tools = harness_spec("claude-code", 10).command
    assert tools[0] == "claude" and "--tools" in tools and "--bare" not in tools
    monkeypatch.setenv(CLAUDE_BIN_ENV, "/opt/cc/claude")
    bare = harness_spec("claude-code-bare", 10).command
    assert bare[0] == "/opt/cc/claude" and "--bare" in bare and "--tools" not in bare
