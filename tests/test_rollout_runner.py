"""`qwengyre rollout`: tasks through the toy harness, the proxy and the embedded engine."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import sqlite3
from pathlib import Path

import pytest

from qwengyre.apps.rollout import RolloutOptions, rollout, summary
from qwengyre.config import load_config
from qwengyre.records.assessments import read_assessments
from qwengyre.records.trace import read_trace
from qwengyre.rollout.harness import harness_spec
from qwengyre.rollout.tasks import dump_tasks, example_tasks_path, load_tasks
from qwengyre.sim.replay import TraceWorkload

pytestmark = pytest.mark.slow


def test_rollout_records_results_traces_and_trees_and_resumes(tmp_path: Path, tiny_model_dir: Path):
    tasks = tmp_path / "tasks.jsonl"
    dump_tasks(tasks, load_tasks(example_tasks_path())[:2])
    options = _options(tmp_path, tiny_model_dir, tasks)
    run_dir = options.run_dir
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
    # Every assessment is kept with its execution in the run directory.
    logged = read_assessments(run_dir / "assessments.jsonl")
    assert sorted((r.task_id, r.index) for r in logged) == sorted((t, i) for t, i, _, _ in rows)
    assert all(r.assessment.kind == "final" and r.assessment.valid for r in logged)
    assert {r.execution_id for r in logged} == {
        e for (e,) in db.execute("SELECT execution FROM rollout_results")
    }
    with pytest.raises(ValueError, match="pass --resume"):
        asyncio.run(rollout(options))
    # A crash before an execution was committed: it runs again on resume, nothing else.
    db.execute("DELETE FROM rollout_results WHERE task = 'add-02' AND idx = 1")
    db.commit()
    db.close()
    resumed = dataclasses.replace(options, resume=True)
    rows = asyncio.run(rollout(resumed))
    assert len(rows) == 4
    assert len(read_trace(run_dir / "traces.jsonl")) == 5


def test_harness_names_and_templates():
    assert harness_spec("toy", 10).command[-1] == "{instructions}"
    assert dict(harness_spec("toy-critique-assistant", 10).env) == {
        "QWENGYRE_TOY_CRITIQUE": "assistant"
    }
    assert harness_spec("claude-code", 10).deadline_s == 10
    assert harness_spec("my-agent --task {instructions}", 5).command == (
        "my-agent",
        "--task",
        "{instructions}",
    )
    with pytest.raises(ValueError, match="command template"):
        harness_spec("my-agent", 5)


def test_a_runner_killed_with_sigkill_resumes_without_losing_or_double_counting(
    tmp_path: Path, tiny_model_dir: Path
):
    import os
    import signal
    import subprocess
    import sys
    import time

    agent = tmp_path / "agent" / "slow_agent.py"  # shown to the sandbox below
    agent.parent.mkdir()
    agent.write_text("import sys, time\ntime.sleep(1.0)\nopen('answer.txt', 'w').write('82')\n")
    tasks = tmp_path / "tasks.jsonl"
    dump_tasks(tasks, load_tasks(example_tasks_path())[:3])  # add-01 expects 82
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "qwengyre",
        "rollout",
        "--model",
        str(tiny_model_dir),
        "--tasks",
        str(tasks),
        "--harness",
        f"{sys.executable} {agent} {{instructions}}",
        "--run-dir",
        str(run_dir),
        "groups.size=2",
        "cells.capacity=2",
        "harness.deadline_s=60",
        "harness.budget_s=90",
        f"harness.sandbox_expose=[{agent.parent}]",
    ]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    db_path = run_dir / "proxy.sqlite"
    deadline = time.monotonic() + 120
    committed = 0
    while time.monotonic() < deadline and committed < 2:
        time.sleep(0.2)
        if db_path.exists():
            try:
                with sqlite3.connect(db_path) as db:
                    committed = db.execute("SELECT COUNT(*) FROM rollout_results").fetchone()[0]
            except sqlite3.OperationalError:
                committed = 0  # the table is not there yet
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    assert 2 <= committed < 6, "the runner should be killed mid-rollout"
    time.sleep(1.5)  # let orphaned harnesses of the dead runner finish
    done = subprocess.run([*command, "--resume"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    with sqlite3.connect(db_path) as db:
        rows = db.execute("SELECT task, idx, reward FROM rollout_results").fetchall()
    assert sorted((t, i) for t, i, _ in rows) == [
        (t, i) for t in ("add-01", "add-02", "add-03") for i in (0, 1)
    ]
    assert all(reward == (1.0 if t == "add-01" else 0.0) for t, _, reward in rows)
    traced = [(r.query, r.index) for r in read_trace(run_dir / "traces.jsonl")]
    assert len(traced) == len(set(traced))  # nothing counted twice
    assert set(traced) <= {(t, i) for t, i, _ in rows}
    # The store is authoritative; a kill between its commit and the trace write (one
    # synchronous step) could lose at most that one trace line.
    assert len(traced) >= len(rows) - 1


def _options(tmp_path: Path, model: Path, tasks: Path, *overrides: str) -> RolloutOptions:
    """A rollout into ``tmp_path / "run"``: the toy harness, N = 2, two at a time; budgets
    far above a toy episode's seconds, so that a loaded machine times nothing out."""
    config = load_config(
        None,
        [
            "groups.size=2",
            "cells.capacity=2",
            "harness.deadline_s=600",
            "harness.budget_s=900",
            *overrides,
        ],
        values={"model.path": model, "harness.tasks": tasks},
    )
    return RolloutOptions(tmp_path / "run", config)


def test_oversampled_surplus_is_not_launched_once_n_rewards_are_valid(
    tmp_path: Path, tiny_model_dir: Path
):
    from qwengyre.apps.rollout import ResultStore

    tasks = tmp_path / "tasks.jsonl"
    dump_tasks(tasks, load_tasks(example_tasks_path())[:1])
    options = _options(tmp_path, tiny_model_dir, tasks, "groups.oversample=2")
    rows = asyncio.run(rollout(options))
    # Two run at a time: the first to finish frees a slot for index 2, which launches
    # unless the second finished valid before it started (a race either way); once two
    # are valid the rest is cancelled, so index 3 (a slot after two ended) never runs.
    assert sorted(i for _, i, _, _ in rows) in ([0, 1], [0, 1, 2])
    store = ResultStore(options.run_dir / "proxy.sqlite")
    ((status, advantages),) = store.groups().values()
    assert status == "ready" and len(advantages) == 2 and set(advantages) <= {0, 1, 2}
    store.close()


def test_a_group_without_valid_rewards_is_dropped_not_zeroed(tmp_path: Path, tiny_model_dir: Path):
    from qwengyre.apps.rollout import ResultStore
    from qwengyre.rollout.tasks import CommandEvaluator, Task

    broken = CommandEvaluator(type="command", command="exit 1", timeout_s=5)
    tasks = tmp_path / "tasks.jsonl"
    dump_tasks(tasks, [Task(id="t", instructions="x", evaluator=broken)])
    # Retries go on until the overall budget (62 s) unless capped: cap them to stay fast.
    quick = ["evaluation.retry_delay_s=0.05", "evaluation.max_attempts=3"]
    budget = ["harness.deadline_s=60", "harness.budget_s=62"]
    options = _options(tmp_path, tiny_model_dir, tasks, *budget, *quick)
    rows = asyncio.run(rollout(options))
    assert all(reward is None for *_, reward in rows) and len(rows) == 2
    logged = read_assessments(options.run_dir / "assessments.jsonl")
    assert len(logged) == 6 and all(not r.assessment.valid for r in logged)
    store = ResultStore(options.run_dir / "proxy.sqlite")
    assert store.groups() == {"t": ("dropped", {})}
    store.close()


def test_claude_code_as_the_rollout_harness_with_the_embedded_engine(
    tmp_path: Path, claude_bin: Path, monkeypatch: pytest.MonkeyPatch
):
    """Claude Code's own prompt needs the demo model's 8k window (the test model has 4k)."""
    import os

    from qwengyre.models import cached_tiny_model

    monkeypatch.setenv("PATH", f"{claude_bin.parent}{os.pathsep}{os.environ['PATH']}")
    tasks = tmp_path / "tasks.jsonl"
    dump_tasks(tasks, load_tasks(example_tasks_path())[:1])
    demo = cached_tiny_model("demo", cache_dir=tmp_path.parent / "qwengyre-models")
    options = _options(
        tmp_path,
        demo,
        tasks,
        "harness.name=claude-code",
        "harness.deadline_s=120",
        "harness.budget_s=180",
        "engine.max_context=8192",
        f"harness.sandbox_expose=[{claude_bin.parents[2]}]",  # npm's, under /tmp
    )
    rows = asyncio.run(rollout(options))
    assert [(outcome, reward) for _, _, outcome, reward in rows] == [("completed", 0.0)] * 2
    trace = read_trace(options.run_dir / "traces.jsonl")
    assert all(r.calls and r.calls[0].input_tokens > 1000 for r in trace)  # its real prompt


def test_a_call_the_harness_never_received_is_not_one_of_its_calls_in_the_trace():
    from qwengyre.rollout.execution import ExecutionResult, trace_record
    from qwengyre.trajectories.tree import NodeMeta, TrajectoryTree
    from qwengyre.types import Outcome

    tree = TrajectoryTree()
    usage = {"input_tokens": 10, "output_tokens": 3}
    cut = NodeMeta(
        request_class="main.task",
        agent_id="main",
        engine="e",
        policy_version=0,
        started_s=1.0,
        finished_s=2.0,
        finish_reason="abort",
        usage=usage,
        delivered=False,
    )
    tree.add(None, (1, 2), (3, 4, 5), (-0.1,) * 3, (0,) * 3, cut)
    retry = NodeMeta(
        request_class="main.task",
        agent_id="main",
        engine="e",
        policy_version=0,
        started_s=2.0,
        finished_s=3.0,
        finish_reason="stop",
        usage=usage,
    )
    tree.add(None, (1, 2), (6, 7, 8), (-0.1,) * 3, (0,) * 3, retry)
    task = load_tasks(example_tasks_path())[0]
    result = ExecutionResult(
        execution_id="ex",
        task_id=task.id,
        outcome=Outcome.COMPLETED,
        reward=1.0,
        started_s=0.0,
        ended_s=5.0,
        harness=None,
    )
    record = trace_record(task, 0, 0, result, 0.0, tree.to_json()["nodes"], 0.0)
    assert [(c.start_s, c.end_s) for c in record.calls] == [(2.0, 3.0)]
    assert record.train_tokens == 3


def test_a_rollout_says_each_execution_as_it_ends(tmp_path: Path, tiny_model_dir: Path):
    tasks = tmp_path / "tasks.jsonl"
    dump_tasks(tasks, load_tasks(example_tasks_path())[:1])
    options = _options(tmp_path, tiny_model_dir, tasks)
    said: list[str] = []
    rows = asyncio.run(rollout(dataclasses.replace(options, log=said.append)))
    assert len(said) == len(rows) == 2
    task = rows[0][0]
    assert [line.split(f" {task} #")[0] for line in said] == ["[1/2]", "[2/2]"]
    assert all(re.search(r": (completed|failed|harness_timeout), ", line) for line in said)


def test_a_rollout_s_mistakes_are_found_before_its_model_loads(tmp_path: Path):
    tasks = tmp_path / "tasks.jsonl"
    dump_tasks(tasks, load_tasks(example_tasks_path())[:1])
    missing_model = tmp_path / "no-model"  # it would fail there, later
    options = _options(tmp_path, missing_model, tasks, "harness.name=no-such-agent {instructions}")
    with pytest.raises(ValueError, match=re.escape("harness 'no-such-agent {instructions}' needs")):
        asyncio.run(rollout(options))
    assert not (tmp_path / "run").exists()  # nothing started, nothing written
