"""A controller restart re-adopts the harnesses that still run: `qwengyre train` is
SIGKILLed (its whole process group, cells included) while executions are in flight,
and `--resume` takes them over from the harness daemon, which outlived it. The core's
death does the same within the run (``run.restarts=1``): the run resumes itself and
re-adopts its harnesses, which kept running through the restart."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.test_runtime_train import kill_group, redone_steps, start_train, wait_for_checkpoint

from qwengyre.apps.train import TrainOptions, train
from qwengyre.cluster.local import actor_processes
from qwengyre.proxy.store import Store
from qwengyre.records.metrics import read_metrics
from qwengyre.rollout import paced_harness
from qwengyre.rollout.harnessd import DAEMON_DIR, recorded_states
from qwengyre.runtime.journal import JOURNAL_FILE, LaunchJournal
from qwengyre.runtime.ledger import LEDGER_DIR, Ledger
from qwengyre.training.checkpoint import latest_checkpoint, read_checkpoint

pytestmark = pytest.mark.slow

CALLS = 4  # the paced harness's default: 4 calls, a second apart
STEPS = 4  # two or more steps after the death: the adopted executions have time to end


def calls_made(run_dir: Path, execution_id: str) -> int:
    path = run_dir / "workspaces" / execution_id / "calls"
    return len(path.read_text()) if path.exists() else 0


def core_of(process: subprocess.Popen[bytes]) -> int:
    """The pid of the run's core."""
    return actor_processes(process.pid)["cell-0"]


@pytest.mark.parametrize("death", ["controller", "core"])
def test_running_executions_are_adopted_after_a_controller_or_core_death(
    death: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    script = paced_harness.__file__
    run_dir = tmp_path / "run"
    process = start_train(
        tmp_path,
        tiny_model_dir,
        STEPS,
        f"harness.name={sys.executable} {script} {{instructions}}",
        "harness.deadline_s=400",
        "harness.budget_s=500",
        "cells.capacity=4",
        "run.restarts=1",
    )
    wait_for_checkpoint(process, run_dir, version=1)
    # Mid-run: executions that have made some of their calls and not all.
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        running = {
            eid: state.pid
            for eid, state in recorded_states(run_dir).items()
            if state.running and 0 < calls_made(run_dir, eid) < CALLS
        }
        if len(running) >= 2:
            break
        assert process.poll() is None, process.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
        time.sleep(0.05)
    else:
        pytest.fail("no two executions in flight within 240 s")
    lines: list[str] = []
    if death == "controller":
        kill_group(process)
        before = read_checkpoint(latest_checkpoint(run_dir / "checkpoints")).state  # type: ignore[arg-type]
        options = TrainOptions(run_dir=run_dir, resume=True, display=False, log=lines.append)
        asyncio.run(train(options))
    else:  # the run resumes itself
        os.kill(core_of(process), signal.SIGKILL)
        before = read_checkpoint(latest_checkpoint(run_dir / "checkpoints")).state  # type: ignore[arg-type]
        out, err = process.communicate(timeout=600)
        lines = (out + err).decode().splitlines()
        assert process.returncode == 0, lines[-30:]
        assert any("died (exit code -9); restart 1 of 1" in line for line in lines), lines

    after = read_checkpoint(latest_checkpoint(run_dir / "checkpoints")).state  # type: ignore[arg-type]
    assert after["version"] == STEPS  # the run finished
    (taken_over,) = [line for line in lines if "re-adopted" in line]
    print(taken_over, f"(in flight with calls made: {len(running)})")
    assert int(re.search(r"(\d+) running executions re-adopted", taken_over)[1]) >= len(running)  # type: ignore[index]
    states = recorded_states(run_dir)
    journal = LaunchJournal(run_dir / JOURNAL_FILE).read()
    by_proxy = {record.proxy_id: record for record in journal.launches.values()}
    store = Store(run_dir / "proxy.sqlite")
    try:
        completed = set()
        for eid, pid in running.items():
            # The same harness process went on (same pid, started once) ...
            assert states[eid].pid == pid and not states[eid].running
            # one start (a sandboxed harness sees its own PID namespace's pid there)
            assert len((run_dir / "workspaces" / eid / "starts").read_text().split()) == 1
            finish = journal.finishes.get(by_proxy[eid].execution)
            assert finish is not None  # it counted, once
            if finish.outcome != "completed":
                continue  # still running when the run had trained its last step
            # ... and finished: every call it made is in its one tree.
            completed.add(eid)
            assert states[eid].exit_code == 0, run_dir / "logs" / eid / "stderr.log"
            assert calls_made(run_dir, eid) == CALLS
            delivered = [node for node, _ in store.calls(eid) if node.meta.delivered]
            assert len(delivered) == CALLS
        assert len(completed) * 2 >= len(running), (completed, running)
    finally:
        store.close()
    # No harness was started twice, no execution launched twice.
    for workspace in (run_dir / "workspaces").iterdir():
        starts = workspace / "starts"
        assert not starts.exists() or len(starts.read_text().split()) == 1, workspace
    assert len(by_proxy) == len(journal.launches)
    # Every ready group trained once, those finished before the kill included.
    trained = after["trained_groups"]
    assert trained[: len(before["trained_groups"])] == before["trained_groups"]
    assert len(set(trained)) == len(trained)
    finished = {g.group_id for g in Ledger(run_dir / LEDGER_DIR).groups()}
    assert set(trained) <= finished
    metrics = read_metrics(run_dir)
    # ... but those of a step the core trained and had not checkpointed when it died
    redone = redone_steps(metrics, trained)
    assert death == "core" or not redone
    # Every step reports the rewards of the groups it trained, resumed ones included.
    assert all(step.rewards > 0 for step in metrics.steps), metrics.steps
    # The run's end stopped its harness daemon.
    assert not (run_dir / DAEMON_DIR / "sock").exists()
