"""Durable writes: whole lines and whole files only, and a full disk (the ledger, a
checkpoint, the metrics log, the proxy's store) as one error naming the path that loses
nothing recorded before. Portable: a full disk is simulated (``ENOSPC`` from a patched
write, ``/dev/full``, SQLite's page limit); one root-only test fills a real tiny tmpfs."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from qwengyre import durable
from qwengyre.cluster.local import ProcessActor
from qwengyre.durable import DiskFullError, LineLog, write_atomic
from qwengyre.proxy.store import Store
from qwengyre.proxy.tito import Turn
from qwengyre.proxy.types import Message
from qwengyre.records.metrics import MetricsWriter, StepRecord, read_metrics
from qwengyre.runtime.ledger import Ledger
from qwengyre.training.checkpoint import latest_checkpoint, read_checkpoint, save_checkpoint
from qwengyre.trajectories.tree import Node
from test_runtime_ledger import sample
from test_trajectory_tree import META


def test_a_torn_last_line_is_cut_before_the_next_append(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    log = LineLog(path, "the test log")
    log.append('{"a": 1}')
    log.close()
    with path.open("ab") as f:  # a crash mid-line
        f.write(b'{"b": 2, "c"')
    log = LineLog(path, "the test log")
    log.append('{"d": 4}')
    log.close()
    assert path.read_text() == '{"a": 1}\n{"d": 4}\n'
    path.write_bytes(b"no newline at all")
    LineLog(path, "the test log").close()
    assert path.read_bytes() == b""


def enospc_after(monkeypatch: pytest.MonkeyPatch, nbytes: int) -> None:
    """The disk fills after ``nbytes`` more bytes written through ``os.write``."""
    left = [nbytes]
    real = os.write

    def write(fd: int, data: bytes | memoryview) -> int:
        if left[0] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = real(fd, bytes(data[: left[0]]))
        left[0] -= n
        return n

    monkeypatch.setattr(durable.os, "write", write)


def step(version: int) -> StepRecord:
    return StepRecord(
        time_s=float(version),
        step=version - 1,
        version=version,
        reward_mean=0.5,
        reward_std=0.1,
        rewards=8,
        loss=0.0,
        clipped_fraction=0.0,
        grad_norm=1.0,
        tokens=100,
        micro_steps=1,
        cells=1,
        train_s=1.0,
        staleness_mean=0.0,
    )


def test_a_full_disk_under_the_metrics_log_is_one_error_and_loses_no_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    writer.write(step(1))
    enospc_after(monkeypatch, 10)  # the next line gets 10 bytes in, then the disk is full
    with pytest.raises(DiskFullError, match=r"metrics\.jsonl: the disk is full") as caught:
        writer.write(step(2))
    assert "writing the metrics log" in str(caught.value)
    assert [s.version for s in read_metrics(path).steps] == [1]  # the partial line is gone
    monkeypatch.undo()  # space freed: the run resumes and appends
    writer.close()
    with MetricsWriter(path) as writer:
        writer.write(step(2))
    assert [s.version for s in read_metrics(path).steps] == [1, 2]


def test_dev_full_is_a_full_disk(tmp_path: Path) -> None:
    log = LineLog(Path("/dev/full"), "the test log")
    with pytest.raises(DiskFullError, match="/dev/full: the disk is full"):
        log.append("x")
    log.close()


def test_an_atomic_write_that_finds_the_disk_full_leaves_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "state"
    write_atomic(path, lambda f: f.write(b"old"), "the state")

    def full(f: IO[bytes]) -> None:
        f.write(b"new, half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(DiskFullError, match=r"state: the disk is full .* writing the state"):
        write_atomic(path, full, "the state")
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["state"]


def torch_write_failure(directory: Path) -> None:
    """What torch's checkpoint writer raises when the disk fills: no errno anywhere, and
    a BaseException."""
    (directory / "weights").mkdir()
    (directory / "weights" / "__0_0.distcp").write_bytes(b"\0" * 100)
    failure = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    raise CheckpointException("CheckpointException ranks:dict_keys([0])", {0: (failure, None)})


def test_a_full_disk_under_a_checkpoint_is_one_error_and_keeps_the_previous_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "checkpoints"
    save_checkpoint(root, step=1, write=lambda d: None, state={"version": 1})
    # With room on the disk, a failed write is what it is.
    with pytest.raises(CheckpointException, match="ranks"):
        save_checkpoint(root, step=2, write=torch_write_failure, state={"version": 2})
    # With the disk (nearly) full, it is a full disk, named.
    usage = durable.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(durable.shutil, "disk_usage", lambda p: usage._replace(free=4096))
    with pytest.raises(DiskFullError, match=r"step-000002: the disk is full") as caught:
        save_checkpoint(root, step=2, write=torch_write_failure, state={"version": 2})
    assert "checkpoint of step 2" in str(caught.value)
    latest = latest_checkpoint(root)
    assert latest is not None and read_checkpoint(latest).state == {"version": 1}
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]


def call(i: int) -> tuple[Node, Turn]:
    node = Node(
        id=i,
        parent=i - 1 if i else None,
        input_ids=list(range(400)),
        output_ids=list(range(100)),
        logprobs=[-0.5] * 100,
        versions=[0] * 100,
        meta=META,
    )
    messages = (Message(role="user", content="q" * 200), Message(role="assistant", content="a"))
    return node, Turn(
        node_id=i, parent=node.parent, new_messages=messages, tools=(), toolset="t", length=2
    )


def test_a_full_disk_under_the_proxy_store_is_one_error_and_loses_no_call(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "proxy.sqlite")
    store.add_execution("ex", "hash", 0.0)
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count = {pages + 4}")  # SQLite's own "disk full"
    recorded = 0
    with pytest.raises(DiskFullError, match=r"proxy\.sqlite: the disk is full") as caught:
        for i in range(100):
            store.add_call("ex", *call(i))
            recorded += 1
    assert f"call {recorded} of execution ex" in str(caught.value) and recorded > 0
    assert [node for node, _ in store.calls("ex")] == [call(i)[0] for i in range(recorded)]


def test_a_cell_s_full_disk_reaches_the_caller_as_itself(tmp_path: Path) -> None:
    actor = ProcessActor(LineLog, Path("/dev/full"), "the test log", name="writer")
    try:
        with pytest.raises(DiskFullError, match="/dev/full: the disk is full"):
            actor.call_sync("append", "x")
    finally:
        actor.close()


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs: a real disk that fills (root only)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"mounting a tiny tmpfs needs root: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_real_full_disk_is_one_clear_error_everywhere(tiny_disk: Path) -> None:
    ledger = Ledger(tiny_disk / "ledger")
    written = []
    with pytest.raises(DiskFullError, match=r"ledger/group-\d+\.npz: the disk is full"):
        for gid in range(100):
            ledger.append(sample(gid), {})
            written.append(gid)
    assert written and [g.group_id for g in ledger.groups()] == written
    for stored in ledger.groups():
        stored.load()
    with pytest.raises(DiskFullError, match=r"checkpoints/step-000001: the disk is full"):
        save_checkpoint(
            tiny_disk / "checkpoints",
            step=1,
            write=lambda d: dcp.save({"w": torch.zeros(1 << 16)}, checkpoint_id=d / "weights"),
            state={"version": 1},
        )
    log = LineLog(tiny_disk / "metrics.jsonl", "the metrics log")
    with pytest.raises(DiskFullError, match=r"metrics\.jsonl: the disk is full"):
        for _ in range(10_000):
            log.append("x" * 100)
    log.close()
    assert set((tiny_disk / "metrics.jsonl").read_text().split("\n")) <= {"x" * 100, ""}
