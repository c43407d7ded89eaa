"""The run-directory lock: a second train/rollout on a directory in use is
refused with one line naming the holder; a holder killed with -9 leaves no stale lock;
train() keeps it across its in-process restarts."""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from qwengyre.apps import train as train_module
from qwengyre.apps.train import CONFIG_FILE, TrainOptions, prepare_run_dir, train
from qwengyre.cli import main
from qwengyre.cluster.local import ActorDied
from qwengyre.config import config_to_yaml, load_config
from qwengyre.runtime.lock import LOCK_FILE, RunDirLocked, lock_holder, lock_run_dir

HOLDER = """
import sys, time
from pathlib import Path
from qwengyre.runtime.lock import lock_run_dir
with lock_run_dir(Path(sys.argv[1]), command="qwengyre train --run-dir held"):
    print("locked", flush=True)
    time.sleep(120)
"""


PROBE = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except BlockingIOError:
    sys.exit(3)
"""


def _locked_by_another_process(run_dir: Path) -> bool:
    probe = subprocess.run([sys.executable, "-c", PROBE, str(run_dir / LOCK_FILE)], timeout=30)
    assert probe.returncode in (0, 3), probe
    return probe.returncode == 3


def _locked_by_anyone(run_dir: Path) -> bool:
    """Probe with a fresh open file (flock conflicts even within one process)."""
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """Another process holding the lock of tmp_path/run."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        yield proc, run_dir
    finally:
        proc.kill()
        proc.wait()


def _kill_9(proc: subprocess.Popen[str]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=10) == -signal.SIGKILL


def test_refused_naming_the_holder_and_free_once_it_is_killed(
    holder: tuple[subprocess.Popen[str], Path],
):
    proc, run_dir = holder
    with pytest.raises(RunDirLocked) as err, lock_run_dir(run_dir):
        pass
    message = str(err.value)
    assert "\n" not in message
    assert f"in use by pid {proc.pid} on {socket.gethostname()}" in message
    assert "(qwengyre train --run-dir held)" in message and " since 20" in message
    _kill_9(proc)  # no cleanup runs: the OS drops the lock with the process
    assert lock_holder(run_dir) is not None  # the dead holder's details are still there...
    with lock_run_dir(run_dir, command="second") as path:  # ...but the lock is free
        assert path == run_dir / LOCK_FILE
        info = lock_holder(run_dir)
        assert info is not None and info["command"] == "second" and info["pid"] == os.getpid()
        assert _locked_by_anyone(run_dir)
    assert not _locked_by_anyone(run_dir)
    assert path.read_text() == ""  # no stale details once released


FORKING_HOLDER = """
import os, sys, time
from pathlib import Path
from qwengyre.runtime.lock import lock_run_dir
with lock_run_dir(Path(sys.argv[1]), command="parent"):
    child = os.fork()
    if child == 0:
        time.sleep(120)
        os._exit(0)
    print(child, flush=True)
    os._exit(0)  # the parent dies without unlocking; its forked child keeps the open file
"""


def test_a_lock_kept_by_a_dead_holders_child_names_that_child(tmp_path: Path):
    run_dir = tmp_path / "run"
    parent = subprocess.Popen(
        [sys.executable, "-c", FORKING_HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        assert parent.wait(timeout=30) == 0
        with pytest.raises(RunDirLocked) as err, lock_run_dir(run_dir):
            pass
        message = str(err.value)
        assert "\n" not in message and f"in use by pid {parent.pid} on " in message
        assert f"pid {parent.pid} has exited; still holding the lock: pid {child} (" in message
    finally:
        os.kill(child, signal.SIGKILL)


def test_train_keeps_the_lock_across_its_restart(tmp_path: Path):
    run_dir = tmp_path / "run"
    config = load_config(overrides=["warm_start.accuracy=null", "run.restarts=1"])
    calls: list[bool] = []
    between: list[bool] = []

    async def train_once(options: TrainOptions, restarts: int) -> str:
        assert options.resume == bool(calls)  # the restart resumes the run
        prepare_run_dir(options)
        calls.append(_locked_by_anyone(run_dir))
        if len(calls) == 1:
            raise ActorDied("cell 0 died")
        return "done"

    def log(line: str) -> None:  # train() logs the restart between the two calls
        between.append(_locked_by_another_process(run_dir))

    options = TrainOptions(run_dir=run_dir, config=config, log=log)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train_module, "_train_once", train_once)
        assert asyncio.run(train(options)) == "done"  # type: ignore[comparison-overlap]
    assert calls == [True, True] and between == [True]
    assert not _locked_by_anyone(run_dir)
    # Resuming a directory that is no run leaves it as it was (no lock file).
    resume = dataclasses.replace(options, run_dir=tmp_path / "none", config=None, resume=True)
    with pytest.raises(ValueError, match="is not a training run"):
        asyncio.run(train(resume))
    assert not (tmp_path / "none").exists()


def test_a_new_run_needs_an_empty_directory_bar_the_lock_file(tmp_path: Path):
    with lock_run_dir(tmp_path, new=True):  # empty: fine, the lock file is not content
        pass
    with lock_run_dir(tmp_path, new=True):  # the lock file alone is no earlier run
        (tmp_path / "data").write_text("x")
    message = "is not empty; pick a new --run-dir or pass --resume"
    with pytest.raises(ValueError, match=message), lock_run_dir(tmp_path, new=True):
        pass
    assert not _locked_by_anyone(tmp_path)
    with lock_run_dir(tmp_path):  # resuming it is fine
        pass


def test_a_foreign_non_empty_directory_is_refused_without_a_lock_file(tmp_path: Path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not empty"), lock_run_dir(tmp_path, new=True):
        pass
    with pytest.raises(ValueError, match="is not empty"):
        asyncio.run(train(TrainOptions(run_dir=tmp_path, config=load_config())))
    assert not (tmp_path / LOCK_FILE).exists()


def test_second_train_resume_and_rollout_are_refused_in_one_line(
    holder: tuple[subprocess.Popen[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    proc, run_dir = holder
    (run_dir / CONFIG_FILE).write_text(config_to_yaml(load_config()))
    for argv in (
        ["train", "--resume", str(run_dir)],
        ["train", "--run-dir", str(run_dir)],
        ["rollout", "--model", str(tmp_path), "--tasks", "example", "--run-dir", str(run_dir)],
        ["rollout", "--model", str(tmp_path), "--tasks", "example", "--run-dir", str(run_dir),
         "--resume"],
    ):  # fmt: skip
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert "\n" not in err, err
        assert err.startswith(f"qwengyre: error: run directory {run_dir} is in use by pid ")
        assert f"pid {proc.pid} on " in err and "qwengyre train --run-dir held" in err
    _kill_9(proc)
    with lock_run_dir(run_dir):
        pass
