"""A controller restart re-adopts the harnesses that still run: `qwengyre train` is
SIGKILLed (its whole process group, cells included) while executions are in flight,
and `--resume` takes them over from the harness daemon, which outlived it."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from tests.test_runtime_train import kill_group, start_train, wait_for_checkpoint

from qwengyre.apps.train import TrainOptions, train
from qwengyre.proxy.store import Store
from qwengyre.records.metrics import read_metrics
from qwengyre.rollout import paced_harness
from qwengyre.rollout.harnessd import DAEMON_DIR
from qwengyre.runtime.journal import JOURNAL_FILE, LaunchJournal
from qwengyre.runtime.ledger import LEDGER_DIR, Ledger
from qwengyre.training.checkpoint import latest_checkpoint, read_checkpoint

pytestmark = pytest.mark.slow

CALLS = 4  # the paced harness's default: 4 calls, a second apart


def harness_states(run_dir: Path) -> dict[str, dict]:  # type: ignore[type-arg]
    states = {}
    for path in (run_dir / DAEMON_DIR / "state").glob("*.json"):
        try:
            states[path.stem] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being replaced
    return states


def calls_made(run_dir: Path, execution_id: str) -> int:
    path = run_dir / "workspaces" / execution_id / "calls"
    return len(path.read_text()) if path.exists() else 0


def test_a_killed_controller_s_running_executions_are_adopted_on_resume(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    script = paced_harness.__file__
    run_dir = tmp_path / "run"
    process = start_train(
        tmp_path,
        tiny_model_dir,
        3,
        f"harness.name={sys.executable} {script} {{instructions}}",
        "harness.deadline_s=400",
        "harness.budget_s=500",
        "cells.capacity=4",
    )
    wait_for_checkpoint(process, run_dir, version=1)
    # Mid-run: executions that have made some of their calls and not all.
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        running = {
            eid: state["pid"]
            for eid, state in harness_states(run_dir).items()
            if state["ended"] is None and 0 < calls_made(run_dir, eid) < CALLS
        }
        if len(running) >= 2:
            break
        assert process.poll() is None, process.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
        time.sleep(0.05)
    else:
        pytest.fail("no two executions in flight within 240 s")
    kill_group(process)
    before = read_checkpoint(latest_checkpoint(run_dir / "checkpoints")).state  # type: ignore[arg-type]

    lines: list[str] = []
    asyncio.run(train(TrainOptions(run_dir=run_dir, resume=True, display=False, log=lines.append)))

    after = read_checkpoint(latest_checkpoint(run_dir / "checkpoints")).state  # type: ignore[arg-type]
    assert after["version"] == 3  # the run finished
    (taken_over,) = [line for line in lines if "re-adopted" in line]
    print(taken_over, f"(in flight with calls made: {len(running)})")
    assert int(re.search(r"(\d+) running executions re-adopted", taken_over)[1]) >= len(running)  # type: ignore[index]
    states = harness_states(run_dir)
    journal = LaunchJournal(run_dir / JOURNAL_FILE).read()
    by_proxy = {record.proxy_id: record for record in journal.launches.values()}
    store = Store(run_dir / "proxy.sqlite")
    try:
        for eid, pid in running.items():
            # The same harness process went on (same pid, started once) and finished:
            # every call it made is in its one tree, and it counted once.
            assert states[eid]["pid"] == pid and states[eid]["ended"] is not None
            assert states[eid]["exit_code"] == 0, run_dir / "logs" / eid / "stderr.log"
            # one start (a sandboxed harness sees its own PID namespace's pid there)
            assert len((run_dir / "workspaces" / eid / "starts").read_text().split()) == 1
            assert calls_made(run_dir, eid) == CALLS
            delivered = [node for node, _ in store.calls(eid) if node.meta.delivered]
            assert len(delivered) == CALLS
            assert by_proxy[eid].execution in journal.finishes
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
    counts = Counter(g.group_id for g in read_metrics(run_dir).groups)
    assert set(counts) == set(trained) and set(counts.values()) == {1}
    # The run's end stopped its harness daemon.
    assert not (run_dir / DAEMON_DIR / "sock").exists()
