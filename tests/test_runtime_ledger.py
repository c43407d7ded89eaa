"""The ready-group ledger: groups written whole or not at all, read back exactly and
lazily, a crash mid-write never making a later resume fail, a full disk one clear error."""

from __future__ import annotations

import errno
from dataclasses import replace
from pathlib import Path
from typing import IO

import numpy as np
import pytest
import torch

from qwengyre.apps.train import resume_state
from qwengyre.durable import DiskFullError
from qwengyre.runtime import ledger as ledger_module
from qwengyre.runtime.ledger import LEDGER_DIR, Ledger, LedgerError
from qwengyre.training.buffers import (
    ExecutionSample,
    GroupSample,
    PackingBuffer,
    StoredGroup,
    TrajectoryBuffer,
)
from qwengyre.training.checkpoint import save_checkpoint
from qwengyre.trajectories import routed_experts
from test_training_buffers import execution, group


def sample(gid: int, version: int = 0) -> GroupSample:
    """A group of three executions, one of them zero-advantage."""
    return group(
        gid,
        version,
        [
            execution(f"{gid}-a", [40, 25], advantage=0.75),
            execution(f"{gid}-b", [60], advantage=-0.5),
            execution(f"{gid}-c", [30], advantage=0.0),
        ],
    )


def fp32(g: GroupSample) -> GroupSample:
    """``g`` with its log-probs rounded to float32, as the ledger keeps them."""

    def rounded(e: ExecutionSample) -> ExecutionSample:
        trajectories = tuple(
            replace(t, behaviour_logprobs=tuple(np.float32(t.behaviour_logprobs).tolist()))
            for t in e.trajectories
        )
        return replace(e, trajectories=trajectories)

    return replace(g, executions=tuple(rounded(e) for e in g.executions))


def test_a_group_reads_back_exactly_and_trains_on_the_same_numbers(tmp_path: Path) -> None:
    original = sample(7, version=3)  # log-probs like -0.01 that float32 cannot hold exactly
    ledger = Ledger(tmp_path)
    ledger.append(original, {})

    [stored] = ledger.groups()
    assert (stored.group_id, stored.version) == (7, 3)
    loaded = stored.load()
    assert loaded != original and loaded == fp32(original)

    def packed(g: GroupSample) -> list[torch.Tensor]:
        buffer = TrajectoryBuffer()
        buffer.add(g)
        [ms] = PackingBuffer(buffer, 10_000).assign(0, [g.group_id], closes_batch=True)
        return [ms.input_ids, ms.target_mask, ms.behaviour_logprobs, ms.advantages]

    # The trainer's tensors are float32: bit for bit the same from the ledger.
    for a, b in zip(packed(loaded), packed(original), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_the_ledger_takes_about_eight_bytes_a_token(tmp_path: Path) -> None:
    big = group(1, 0, [execution(f"e{i}", [3000, 2000]) for i in range(8)])
    tokens = sum(e.num_tokens for e in big.executions)
    Ledger(tmp_path).append(big, {})
    size = Ledger(tmp_path).path(1).stat().st_size
    assert size / tokens < 8.5, size / tokens  # int32 ids, fp32 log-probs, bits, runs


def test_a_stored_group_is_read_only_when_it_is_taken(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    second = sample(2, version=1)
    ledger.append(sample(1, version=2), {})
    ledger.append(second, {})
    reads: list[int] = []

    def counted(gid: int) -> GroupSample:
        reads.append(gid)
        return ledger.load(gid)

    buffer = TrajectoryBuffer()
    for stored in ledger.groups():
        buffer.add(
            StoredGroup(stored.group_id, stored.version, lambda g=stored.group_id: counted(g))
        )
    assert buffer.ready_ids() == [2, 1] and reads == []  # ordered by version, nothing read
    assert buffer.take(2) == fp32(second)
    assert reads == [2]
    with pytest.raises(ValueError, match="already taken"):
        buffer.take(2)


def test_a_resumed_run_gets_the_ready_groups_in_the_order_they_became_ready(
    tmp_path: Path,
) -> None:
    """Groups finish out of id order; a step redone after a crash must take the groups the
    dead run took (the scheduler orders by v_d, then by readiness), so the ledger keeps
    the order across runs, not the ids'."""
    first = Ledger(tmp_path / LEDGER_DIR)
    for gid in (3, 1, 2):
        first.append(sample(gid), {})
    assert [g.group_id for g in first.groups()] == [3, 1, 2]
    again = Ledger(tmp_path / LEDGER_DIR)  # the resumed run's ledger continues the order
    for gid in (5, 0, 4):
        again.append(sample(gid), {})
    assert [g.group_id for g in again.groups()] == [3, 1, 2, 5, 0, 4]
    assert [g.id for g in resume_state(tmp_path, tmp_path).ready] == [3, 1, 2, 5, 0, 4]


def test_a_resumed_group_comes_back_with_its_valid_rewards(tmp_path: Path) -> None:
    """The step that trains a resumed group reports the rewards it was admitted with."""
    ledger = Ledger(tmp_path / LEDGER_DIR)
    ledger.append(sample(4, version=2), {40: 1.0, 41: 0.0, 43: 0.25})
    ledger.append(sample(5, version=2), {})
    [four, five] = resume_state(tmp_path, tmp_path).ready
    assert (four.id, four.v_d, dict(four.valid)) == (4, 2, {40: 1.0, 41: 0.0, 43: 0.25})
    assert (five.id, dict(five.valid)) == (5, {})


def test_a_stored_group_that_loads_as_another_is_refused(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    ledger.append(sample(1), {})
    buffer = TrajectoryBuffer()
    buffer.add(StoredGroup(5, 0, lambda: ledger.load(1)))
    with pytest.raises(ValueError, match=r"stored group 5 .* loaded as group 1"):
        buffer.take(5)
    assert buffer.ready_ids() == [5]  # not taken: nothing was trained


def crash_mid_write(ledger: Ledger, group: GroupSample, monkeypatch: pytest.MonkeyPatch) -> None:
    """The process dies (here: an exception the writer does not catch) half-way through
    writing ``group``'s file; what it wrote stays as a crash would leave it."""

    class Killed(BaseException):
        pass

    def half(arrays: dict[str, np.ndarray], f: IO[bytes]) -> None:
        f.write(b"PK\x03\x04" + bytes(100))
        f.flush()
        raise Killed

    with monkeypatch.context() as m:
        m.setattr(ledger_module, "_save", half)
        # a real crash would not get to remove the temporary file: keep it
        m.setattr(Path, "unlink", lambda self, missing_ok=False: None)
        with pytest.raises(Killed):
            ledger.append(group, {})


def train(run_dir: Path, step: int, count: int) -> list[int]:
    """Resume, train the ``count`` oldest ready groups, checkpoint ``step``; returns
    every group trained so far."""
    resumed = resume_state(run_dir, run_dir)
    ids = resumed.trajectories.ready_ids()[:count]
    PackingBuffer(resumed.trajectories, 100_000).assign(step, ids, closes_batch=True)
    trained = [*resumed.trained, *ids]
    save_checkpoint(
        run_dir / "checkpoints",
        step=step,
        write=lambda directory: None,
        state={"version": step, "trained_groups": trained},
    )
    return trained


def test_crashes_mid_write_never_make_a_later_resume_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = Ledger(tmp_path / LEDGER_DIR)
    for gid in range(4):
        ledger.append(sample(gid), {})
    crash_mid_write(ledger, sample(4), monkeypatch)  # a partial temporary file
    assert (tmp_path / LEDGER_DIR / ".group-000004.npz.tmp").exists()
    with (ledger.path(1)).open("ab") as f:  # bytes after a complete group: still complete
        f.write(b"\x00garbage" * 50)

    trained = train(tmp_path, 1, 2)  # first resume: the partial group is gone
    assert not (tmp_path / LEDGER_DIR / ".group-000004.npz.tmp").exists()
    assert trained == [0, 1]
    for gid in range(5, 8):  # the resumed run appends more groups
        ledger.append(sample(gid), {})
    crash_mid_write(ledger, sample(8), monkeypatch)

    trained = train(tmp_path, 2, 10)  # second resume: every complete group, once
    assert trained == [0, 1, 2, 3, 5, 6, 7]
    resumed = resume_state(tmp_path, tmp_path)  # and a third finds nothing left to train
    assert resumed.ready == [] and resumed.next_group == 8


def test_a_group_file_damaged_after_writing_is_named(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    first, second = sample(1), sample(2)
    ledger.append(first, {})
    ledger.append(second, {})
    data = ledger.path(2).read_bytes()
    ledger.path(2).write_bytes(data[: len(data) // 2])
    with pytest.raises(LedgerError, match=r"group-000002\.npz: unreadable ready group"):
        ledger.groups()
    # Bytes flipped inside the tokens: the zip's checksum finds them when the group loads.
    ledger.path(2).write_bytes(data)
    ids = np.array(second.executions[0].trajectories[0].input_ids[:4], dtype=np.int32)
    at = data.find(ids.tobytes())
    assert at > 0
    ledger.path(2).write_bytes(data[:at] + b"\xff\xff" + data[at + 2 :])
    [_, stored] = ledger.groups()
    with pytest.raises(LedgerError, match=r"group-000002\.npz: .*CRC"):
        stored.load()
    assert ledger.load(1) == fp32(first)


def test_a_full_disk_is_one_error_naming_the_group_file_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = Ledger(tmp_path)
    first = sample(1)
    ledger.append(first, {})

    def full(arrays: dict[str, np.ndarray], f: IO[bytes]) -> None:
        f.write(b"PK" + bytes(64))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ledger_module, "_save", full)
    with pytest.raises(DiskFullError, match=r"group-000002\.npz: the disk is full") as caught:
        ledger.append(sample(2), {})
    assert str(tmp_path) in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["group-000001.npz"]
    assert [g.group_id for g in ledger.groups()] == [1]
    assert ledger.load(1) == fp32(first)


def test_an_moe_group_keeps_its_routing_in_the_ledger_and_a_checkpoint(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    original = sample(4)
    executions = []
    for i, e in enumerate(original.executions):
        routed = []
        for j, t in enumerate(e.trajectories):
            # One trajectory served without routing: its rows come back unknown (-1).
            rows = None
            if (i, j) != (1, 0):
                rows = routed_experts.compact(rng.integers(-1, 4, (len(t.input_ids), 2, 2)))
            routed.append(replace(t, routing=rows))
        executions.append(replace(e, trajectories=tuple(routed)))
    moe = replace(original, executions=tuple(executions))
    trajectories = [t for e in moe.executions for t in e.trajectories]

    ledger = Ledger(tmp_path)
    ledger.append(moe, {})
    loaded = [t for e in ledger.load(4).executions for t in e.trajectories]
    from_json = [
        t for e in GroupSample.from_json(moe.to_json()).executions for t in e.trajectories
    ]  # a checkpoint's buffers
    for t, back, again in zip(trajectories, loaded, from_json, strict=True):
        assert back.routing is not None
        expected = t.routing if t.routing is not None else -np.ones_like(back.routing)
        np.testing.assert_array_equal(back.routing, expected)
        if t.routing is None:
            assert again.routing is None
        else:
            np.testing.assert_array_equal(again.routing, t.routing)  # type: ignore[arg-type]
