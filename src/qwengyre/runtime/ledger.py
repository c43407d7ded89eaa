"""The ready-group ledger: every rollout group that finished its rollout, durably.

A group is written (and fsynced) the moment it becomes ready, with its admitted
trajectories and advantages, before it can be assigned to training. A checkpoint
records which groups its version has trained; on resume, the ledger's groups minus
those are the ready groups the scheduler gets back. So a crash loses no finished
group and a resumed run trains none twice (docs/design.md §4: nothing recorded is lost).

Layout: a directory with one file per group, ``group-000042.npz`` (numpy's uncompressed
zip of arrays), written atomically (:func:`qwengyre.durable.write_atomic`): a crash
leaves the whole group or none of it, never a file that later reads fail on. A file holds

- ``group``: int64 ``[group_id, version, ready]``: the version at dispatch (v_d) and the
  group's place in the order groups became ready, which a resumed run keeps (the scheduler
  takes ready groups by v_d, then in that order: a step redone after a crash trains the
  same groups);
- ``valid_ids``, ``valid_rewards``: int64 and float64, the group's valid rewards by the
  scheduler's execution id (a resumed run reports them with the step that trains it);
- ``meta``: UTF-8 JSON of the executions (id, advantage) and their trajectories (leaf,
  request class, tree nodes, execution id, advantage, token count), in order;
- the trajectories' tokens, concatenated in that order: ``input_ids`` (int32),
  ``behaviour_logprobs`` (float32: the trainer computes in fp32, so it trains on the same
  numbers), ``target_mask`` (bits, :func:`numpy.packbits`), ``versions`` (run-length:
  ``version_values`` and ``version_runs``) and, where any trajectory has an MoE's routed
  experts, ``routing`` (:mod:`qwengyre.trajectories.routed_experts`: ``[tokens, layers,
  k]``, -1 rows for a trajectory without).

About 8 bytes a token. :meth:`Ledger.groups` lists the groups from their ``group`` arrays
only; a group's tokens are read when it is taken for training (``StoredGroup.load``), so a
resumed run holds one group's tokens at a time, whatever the ledger's size.
"""

from __future__ import annotations

import json
import re
import zipfile
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import IO, NamedTuple

import numpy as np

from qwengyre.durable import write_atomic
from qwengyre.scheduler.core import ReadyGroup
from qwengyre.training.buffers import ExecutionSample, GroupSample, StoredGroup
from qwengyre.trajectories import routed_experts
from qwengyre.trajectories.selection import AdmittedTrajectory

__all__ = ["LEDGER_DIR", "Ledger", "LedgerError"]

LEDGER_DIR = "ledger"
_NAME = re.compile(r"group-(\d+)\.npz")
_ARRAYS = (
    "group",
    "valid_ids",
    "valid_rewards",
    "meta",
    "input_ids",
    "behaviour_logprobs",
    "target_mask",
    "version_values",
    "version_runs",
)
_OPTIONAL = ("routing",)


class LedgerError(ValueError):
    """A group file of the ledger that cannot be read (damaged after it was written)."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(
            f"{path}: unreadable ready group ({reason}); the ledger writes a group whole "
            "or not at all, so this file was damaged afterwards: move it out of the "
            "ledger directory to resume without that group"
        )
        self.path = path


class Ledger:
    """A directory of ready groups, one file each (see the module docstring)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._next_ready: int | None = None  # read from the directory at the first append

    def path(self, group_id: int) -> Path:
        return self.directory / f"group-{group_id:06d}.npz"

    def append(self, group: GroupSample, valid: Mapping[int, float]) -> None:
        """Write ``group`` whole with its ``valid`` rewards (execution id -> reward),
        durably; a full disk raises
        :class:`~qwengyre.durable.DiskFullError` and leaves the ledger as it was."""
        self.directory.mkdir(parents=True, exist_ok=True)
        if self._next_ready is None:
            self._next_ready = max((g.ready for g in self._stored()), default=-1) + 1
        arrays = _encode(group, self._next_ready, valid)
        write_atomic(
            self.path(group.group_id),
            partial(_save, arrays),
            f"ready group {group.group_id} of the ledger",
        )
        self._next_ready += 1

    def discard_partial(self) -> None:
        """Remove what a crash cut off (``.group-*.npz.tmp``: groups never completed).
        Only while nothing writes to the ledger (the run directory's lock is held)."""
        for path in self.directory.glob(".group-*.npz.tmp"):
            path.unlink()

    def groups(self) -> list[StoredGroup]:
        """Every recorded group in the order they became ready, its tokens left on disk
        until ``load()``; a group file that cannot be opened raises :class:`LedgerError`
        naming it."""
        return [self.stored(g) for g in self.ready_groups()]

    def ready_groups(self) -> list[ReadyGroup]:
        """Every recorded group as the scheduler resumes it (with its valid rewards), in
        the order they became ready; no tokens are read."""
        return [
            ReadyGroup(id=g.group_id, v_d=g.version, valid=g.valid)
            for g in sorted(self._stored(), key=lambda g: g.ready)
        ]

    def stored(self, group: ReadyGroup) -> StoredGroup:
        """``group``, its tokens left on disk until ``load()``."""
        return StoredGroup(group.id, group.v_d, partial(self.load, group.id))

    def _stored(self) -> list[_Header]:
        if not self.directory.exists():
            return []
        found = []
        for path in self.directory.iterdir():
            match = _NAME.fullmatch(path.name)
            if match is None:
                continue
            arrays = _read(path, ["group", "valid_ids", "valid_rewards"])
            header = arrays["group"]
            if header.shape != (3,):
                raise LedgerError(path, f"its group header has shape {header.shape}, not (3,)")
            group_id, version, ready = (int(x) for x in header)
            if group_id != int(match.group(1)):
                raise LedgerError(path, f"it holds group {group_id}")
            valid = dict(
                zip(arrays["valid_ids"].tolist(), arrays["valid_rewards"].tolist(), strict=True)
            )
            found.append(_Header(group_id, version, ready, valid))
        return found

    def load(self, group_id: int) -> GroupSample:
        """Group ``group_id`` with its tokens (a damaged file: :class:`LedgerError`)."""
        path = self.path(group_id)
        arrays = _read(path, _ARRAYS, optional=_OPTIONAL)
        try:
            return _decode(arrays)
        except (ValueError, KeyError, TypeError) as exc:
            raise LedgerError(path, str(exc)) from None


class _Header(NamedTuple):
    group_id: int
    version: int
    ready: int
    valid: dict[int, float]


def _read(path: Path, names: Sequence[str], optional: Sequence[str] = ()) -> dict[str, np.ndarray]:
    """The arrays ``names`` of a group file, and those of ``optional`` it has (each
    checked against the zip's CRC-32)."""
    try:
        with np.load(path, allow_pickle=False) as data:
            present = [name for name in optional if name in data.files]
            return {name: data[name] for name in [*names, *present]}
    except (ValueError, KeyError, EOFError, OSError, zipfile.BadZipFile) as exc:
        raise LedgerError(path, f"{type(exc).__name__}: {exc}") from None


def _save(arrays: dict[str, np.ndarray], f: IO[bytes]) -> None:
    np.savez(f, allow_pickle=False, **arrays)


def _encode(group: GroupSample, ready: int, valid: Mapping[int, float]) -> dict[str, np.ndarray]:
    trajectories = [t for e in group.executions for t in e.trajectories]
    meta = [
        {
            "execution_id": e.execution_id,
            "advantage": e.advantage,
            "trajectories": [
                {
                    "leaf": t.leaf,
                    "request_class": t.request_class,
                    "nodes": list(t.nodes),
                    "execution_id": t.execution_id,
                    "advantage": t.advantage,
                    "length": len(t.input_ids),
                }
                for t in e.trajectories
            ],
        }
        for e in group.executions
    ]
    values, runs = _run_lengths(
        np.array([v for t in trajectories for v in t.versions], dtype=np.int32)
    )
    routing = routed_experts.join(
        [t.routing for t in trajectories], [len(t.input_ids) for t in trajectories]
    )
    return {
        **({} if routing is None else {"routing": routing}),
        "group": np.array([group.group_id, group.version, ready], dtype=np.int64),
        "valid_ids": np.array(list(valid), dtype=np.int64),
        "valid_rewards": np.array(list(valid.values()), dtype=np.float64),
        "meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
        "input_ids": np.array([x for t in trajectories for x in t.input_ids], dtype=np.int32),
        "behaviour_logprobs": np.array(
            [x for t in trajectories for x in t.behaviour_logprobs], dtype=np.float32
        ),
        "target_mask": np.packbits(
            np.array([x for t in trajectories for x in t.target_mask], dtype=bool)
        ),
        "version_values": values,
        "version_runs": runs,
    }


def _run_lengths(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``values`` as runs of equal values: each run's value and its length."""
    if not len(values):
        return values, np.zeros(0, dtype=np.int64)
    starts = np.concatenate(([0], np.flatnonzero(np.diff(values)) + 1))
    return values[starts], np.diff(np.append(starts, len(values)))


def _decode(arrays: dict[str, np.ndarray]) -> GroupSample:
    group_id, version, _ = (int(x) for x in arrays["group"])
    meta = json.loads(arrays["meta"].tobytes())
    ids = arrays["input_ids"].tolist()
    logprobs = arrays["behaviour_logprobs"].tolist()
    mask = np.unpackbits(arrays["target_mask"], count=len(ids)).astype(bool).tolist()
    versions = np.repeat(arrays["version_values"], arrays["version_runs"]).tolist()
    routing = arrays.get("routing")
    if not len(ids) == len(logprobs) == len(versions) == len(ids if routing is None else routing):
        raise ValueError(
            f"{len(ids)} token ids, {len(logprobs)} log-probs, {len(versions)} versions"
            + ("" if routing is None else f", {len(routing)} routed positions")
        )
    executions, at = [], 0
    for e in meta:
        trajectories = []
        for t in e["trajectories"]:
            end = at + int(t["length"])
            trajectories.append(
                AdmittedTrajectory(
                    leaf=int(t["leaf"]),
                    request_class=str(t["request_class"]),
                    nodes=tuple(int(x) for x in t["nodes"]),
                    input_ids=tuple(ids[at:end]),
                    target_mask=tuple(mask[at:end]),
                    behaviour_logprobs=tuple(logprobs[at:end]),
                    versions=tuple(versions[at:end]),
                    execution_id=str(t["execution_id"]),
                    advantage=float(t["advantage"]),
                    routing=None if routing is None else routing[at:end],
                )
            )
            at = end
        executions.append(
            ExecutionSample(
                execution_id=str(e["execution_id"]),
                advantage=float(e["advantage"]),
                trajectories=tuple(trajectories),
            )
        )
    if at != len(ids):
        raise ValueError(f"its trajectories cover {at} of {len(ids)} tokens")
    return GroupSample(group_id=group_id, version=version, executions=tuple(executions))
