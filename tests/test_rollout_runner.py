"""`qwengyre rollout`: tasks through the toy harness, the proxy and the embedded engine."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from qwengyre.rollout.runner import RolloutOptions, harness_spec, rollout, summary
from qwengyre.rollout.tasks import dump_tasks, example_tasks_path, load_tasks
from qwengyre.sim.trace import TraceWorkload, read_trace

pytestmark = pytest.mark.slow


def test_rollout_records_results_traces_and_trees_and_resumes(tmp_path: Path, tiny_model_dir: Path):
    tasks = tmp_path / "tasks.jsonl"
    dump_tasks(tasks, load_tasks(example_tasks_path())[:2])
    run_dir = tmp_path / "run"
    options = RolloutOptions(
        model=tiny_model_dir,
        tasks=tasks,
        harness="toy",
        run_dir=run_dir,
        executions_per_task=2,
        concurrency=2,
        harness_s=60,
        overall_s=90,
    )
    rows = asyncio.run(rollout(options))
    assert sorted((t, i) for t, i, _, _ in rows) == [
        ("add-01", 0),
        ("add-01", 1),
        ("add-02", 0),
        ("add-02", 1),
    ]
    # The tiny random model never answers the sum: real zeros, every one assessed.
    assert all(outcome == "completed" and reward == 0.0 for _, _, outcome, reward in rows)
    assert "4 executions (completed 4)" in summary(rows)
    trace = read_trace(run_dir / "traces.jsonl")
    assert len(trace) == 4 and all(r.calls for r in trace)
    assert TraceWorkload(trace).execution(0, 0).duration_s > 0  # the simulator replays it
    db = sqlite3.connect(run_dir / "proxy.sqlite")
    assert db.execute("SELECT COUNT(*) FROM nodes").fetchone()[0] >= 4  # TITO records
    with pytest.raises(ValueError, match="pass --resume"):
        asyncio.run(rollout(options))
    # A crash before an execution was committed: it runs again on resume, nothing else.
    db.execute("DELETE FROM rollout_results WHERE task = 'add-02' AND idx = 1")
    db.commit()
    db.close()
    resumed = RolloutOptions(**{**options.__dict__, "resume": True})
    rows = asyncio.run(rollout(resumed))
    assert len(rows) == 4
    assert len(read_trace(run_dir / "traces.jsonl")) == 5


def test_harness_names_and_templates():
    assert harness_spec("toy", 10).command[-1] == "{instructions}"
    assert harness_spec("claude-code", 10).deadline_s == 10
    assert harness_spec("my-agent --task {instructions}", 5).command == (
        "my-agent",
        "--task",
        "{instructions}",
    )
    with pytest.raises(ValueError, match="command template"):
        harness_spec("my-agent", 5)
