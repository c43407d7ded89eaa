"""Hostile harnesses under ``harness.sandbox=bwrap`` (:mod:`qwengyre.rollout.sandbox`): a
rollout whose harness (tests/hostile_harness.py) tries to read the proxy's store, other
executions' workspaces and logs, another run's checkpoints and store, the operator's
credentials, other processes' keys and the weight boards; to remount the machine writable
and write to it, unmount what hides the run directory, signal a process outside, fork
without bound, allocate past its memory limit, and reach a listener on the machine's
loopback or any other address. Every attempt fails, while its model call through its
base URL succeeds and is recorded as its own execution's."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from qwengyre.apps.rollout import RolloutOptions, rollout
from qwengyre.config import load_config
from qwengyre.records.trace import read_trace
from qwengyre.rollout.tasks import dump_tasks, example_tasks_path, load_tasks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("bwrap") is None,
        reason="bubblewrap is not installed (apt-get install bubblewrap)",
    ),
]

HOSTILE = Path(__file__).with_name("hostile_harness.py")
MAX_PROCESSES, MAX_MEMORY_MB = 48, 256


@pytest.fixture
def victim() -> Iterator[subprocess.Popen[bytes]]:
    """A process outside the sandbox for the harness to signal."""
    sleeper = subprocess.Popen(["sleep", "600"])
    yield sleeper
    sleeper.kill()
    sleeper.wait()


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A service on the machine's loopback, as the Ray GCS or a dashboard would be."""
    server = socket.create_server(("0.0.0.0", 0))
    server.settimeout(0)
    yield server
    server.close()


@pytest.fixture
def credentials() -> Iterator[Path]:
    """An agent's credentials in the operator's home, as ``~/.claude`` holds them."""
    directory = Path.home() / f".qwengyre-test-{uuid.uuid4().hex}"
    directory.mkdir()
    (directory / ".credentials.json").write_text('{"token": "operator secret"}')
    yield directory / ".credentials.json"
    shutil.rmtree(directory)


@pytest.fixture
def board() -> Iterator[Path]:
    """A weights board's shared memory."""
    path = Path("/dev/shm") / f"qwengyre-test-board-{uuid.uuid4().hex}"
    path.write_bytes(b"weights")
    yield path
    path.unlink()


def hostile_rollout(
    tmp_path: Path, model: Path, sandbox: str, skip: tuple[str, ...] = ()
) -> dict[str, dict[str, list[str]]]:
    """A rollout of two hostile harnesses at once under ``sandbox``, with another run's
    store and checkpoints next to its run directory; what each got, by execution id."""
    run_dir, other = tmp_path / "run", tmp_path / "other-run"
    (other / "checkpoints" / "step_1").mkdir(parents=True)
    (other / "checkpoints" / "step_1" / "model.safetensors").write_bytes(b"weights")
    (other / "proxy.sqlite").write_bytes(b"SQLite format 3\0")
    targets = json.loads((tmp_path / "tools" / "targets.json").read_text())
    targets |= {
        "store": str(run_dir / "proxy.sqlite"),
        "workspaces": str(run_dir / "workspaces"),
        "logs": str(run_dir / "logs"),
        "checkpoint": str(other / "checkpoints" / "step_1" / "model.safetensors"),
        "other_store": str(other / "proxy.sqlite"),
        "hidden": [str(run_dir), str(tmp_path), "/tmp"],
        "memory_mb": MAX_MEMORY_MB,
        "processes": MAX_PROCESSES,
        "skip": list(skip),
    }
    (tmp_path / "tools" / "targets.json").write_text(json.dumps(targets))
    tasks = tmp_path / "tasks.jsonl"
    dump_tasks(tasks, load_tasks(example_tasks_path())[:1])
    harness = f"{sys.executable} {HOSTILE} {tmp_path / 'tools' / 'targets.json'} {{instructions}}"
    config = load_config(
        None,
        [
            "groups.size=2",
            "cells.capacity=2",  # both at once: each has another's workspace to go after
            "harness.deadline_s=600",
            "harness.budget_s=900",
            f"harness.sandbox={sandbox}",
            f"harness.limits.max_processes={MAX_PROCESSES}",
            f"harness.limits.max_memory_mb={MAX_MEMORY_MB}",
        ],
        values={
            "model.path": model,
            "harness.tasks": tasks,
            "harness.name": harness,
            # shows the targets file to a sandboxed harness
            "harness.sandbox_expose": [tmp_path / "tools"] if sandbox != "none" else [],
        },
    )
    rows = asyncio.run(rollout(RolloutOptions(run_dir, config)))
    assert [outcome for _, _, outcome, _ in rows] == ["completed", "completed"]
    reports = {}
    for log in sorted((run_dir / "logs").glob("*/stdout.log")):
        lines = log.read_text().splitlines()
        assert lines[0] == f"execution {log.parent.name}"
        reports[log.parent.name] = {
            line.split(" ", 2)[0]: line.split(" ", 2)[1:] for line in lines[1:]
        }
    assert len(reports) == 2
    assert all(len(report) == 18 for report in reports.values()), reports  # all ran
    return reports


@pytest.fixture
def targets(
    tmp_path: Path,
    victim: subprocess.Popen[bytes],
    listener: socket.socket,
    credentials: Path,
    board: Path,
) -> Path:
    """The processes, services and files outside for the harness to go after."""
    tools = tmp_path / "tools"
    tools.mkdir()
    found = {
        "plant": str(tools / "planted.txt"),
        "credentials": str(credentials),
        "victim": victim.pid,
        "board": str(board),
        "port": listener.getsockname()[1],
    }
    (tools / "targets.json").write_text(json.dumps(found))
    return tools / "targets.json"


def test_every_way_out_fails_and_the_model_call_is_the_executions_own(
    tmp_path: Path,
    tiny_model_dir: Path,
    targets: Path,
    victim: subprocess.Popen[bytes],
    listener: socket.socket,
    board: Path,
) -> None:
    reports = hostile_rollout(tmp_path, tiny_model_dir, "bwrap")
    for execution, report in reports.items():
        assert report.pop("model_call")[0] == "yes", report
        got_out = {name: detail for name, (answer, *detail) in report.items() if answer != "no"}
        assert got_out == {}, f"{execution} got out: {got_out}"
    # ... and nothing happened outside
    assert victim.poll() is None
    assert board.read_bytes() == b"weights"
    assert not (targets.parent / "planted.txt").exists()
    with pytest.raises(BlockingIOError):
        listener.accept()  # nobody connected
    # each call was recorded for the execution that made it, whatever key it sent
    run_dir = tmp_path / "run"
    db = sqlite3.connect(run_dir / "proxy.sqlite")
    calls = dict(db.execute("SELECT execution, COUNT(*) FROM nodes GROUP BY execution"))
    db.close()
    assert calls == dict.fromkeys(reports, 1)
    assert all(len(trace.calls) == 1 for trace in read_trace(run_dir / "traces.jsonl"))


def test_unconfined_the_same_harness_gets_out(
    tmp_path: Path, tiny_model_dir: Path, targets: Path, victim: subprocess.Popen[bytes]
) -> None:
    """The control: without a sandbox (only the kernel limits) the attempts succeed, so
    the test above fails if a sandbox stops confining. Remounting and unmounting are
    skipped: unconfined as root they would act on the machine itself."""
    reports = hostile_rollout(
        tmp_path, tiny_model_dir, "none", skip=("remount_write", "unmount_read")
    )
    escaped = {
        "read_store",
        "read_checkpoint",
        "other_run_store",
        "operator_credentials",
        "environ_keys",
        "signal_outside",
        "weight_board",
        "loopback_listener",
    }
    for report in reports.values():
        assert {name for name, (answer, *_) in report.items() if answer == "yes"} >= escaped
        assert report["model_call"][0] == "no"  # its made-up key, unrelayed, is refused
        assert report["fork_bomb"][0] == report["memory"][0] == "no"  # the limits hold
    assert victim.wait() == -signal.SIGTERM
