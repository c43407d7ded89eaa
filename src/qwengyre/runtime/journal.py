"""The launch journal: every execution launched, durably, before its harness starts,
and how each ended once it counted; what a resumed run needs to re-adopt the
executions a dead controller left running.

One JSON object per line, appended and fsynced::

    {"launch": {execution, group, index, version, v_d, proxy_id, task, time}}
    {"finish": {execution, outcome, reward}}
    {"drop": group}

A line a crash cut short is skipped (the next append starts on a line of its own):
a launch cut short never started its harness (the line is durable first), a finish
cut short never counted (the controller emits it after the line is durable).

On resume (:func:`adoption`), the groups the journal launched that are neither in the
ledger nor trained nor dropped were in rollout: each execution of theirs that counted
keeps its reward, each whose harness a host still has (running, or ended with its exit
status kept: :meth:`~qwengyre.rollout.hosts.HarnessHost.survivors`) is adopted and
evaluated when it ends, and each other one is lost and replaced, as is one the stopping
run cancelled (a group in rollout has none cancelled otherwise)
(:meth:`~qwengyre.scheduler.core.Scheduler.resume`). No execution is started twice.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from qwengyre.scheduler.core import InFlightExecution, InFlightGroup
from qwengyre.types import Outcome

__all__ = ["JOURNAL_FILE", "Adoption", "JournalState", "LaunchJournal", "LaunchRecord", "adoption"]

JOURNAL_FILE = "launches.jsonl"


@dataclass(frozen=True, kw_only=True)
class LaunchRecord:
    """One launched execution: the scheduler's ids, the versions, the proxy's execution
    id, the task, and the wall-clock time of its launch."""

    execution: int
    group: int
    index: int
    version: int
    v_d: int
    proxy_id: str
    task: str
    time: float


@dataclass(frozen=True, kw_only=True)
class FinishRecord:
    execution: int
    outcome: str
    reward: float | None


@dataclass(kw_only=True)
class JournalState:
    """What the journal holds: launches and finishes by execution id, dropped groups."""

    launches: dict[int, LaunchRecord] = field(default_factory=dict)
    finishes: dict[int, FinishRecord] = field(default_factory=dict)
    dropped: set[int] = field(default_factory=set)

    @property
    def next_group(self) -> int:
        return max((r.group + 1 for r in self.launches.values()), default=0)

    @property
    def next_execution(self) -> int:
        return max((e + 1 for e in self.launches), default=0)


class LaunchJournal:
    """The append-only journal at ``path`` (module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def launch(self, record: LaunchRecord) -> None:
        self._append({"launch": asdict(record)})

    def finish(self, execution: int, outcome: str, reward: float | None) -> None:
        self._append(
            {"finish": asdict(FinishRecord(execution=execution, outcome=outcome, reward=reward))}
        )

    def drop(self, group: int) -> None:
        self._append({"drop": group})

    def _append(self, entry: dict[str, Any]) -> None:
        line = json.dumps(entry, separators=(",", ":")) + "\n"
        with self.path.open("ab") as f:
            if f.tell() and not _ends_with_newline(self.path):
                line = "\n" + line  # a line cut short stays a line of its own
            f.write(line.encode())
            f.flush()
            os.fsync(f.fileno())

    def read(self) -> JournalState:
        """Everything recorded; lines cut short by a crash are skipped."""
        state = JournalState()
        if not self.path.exists():
            return state
        for text in self.path.read_text(encoding="utf-8").splitlines():
            try:
                entry = json.loads(text)
                if "launch" in entry:
                    record = LaunchRecord(**entry["launch"])
                    state.launches[record.execution] = record
                elif "finish" in entry:
                    finish = FinishRecord(**entry["finish"])
                    state.finishes[finish.execution] = finish
                elif "drop" in entry:
                    state.dropped.add(int(entry["drop"]))
            except (ValueError, TypeError, AttributeError):
                continue
        return state


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


@dataclass(frozen=True, kw_only=True)
class Adoption:
    """What a resumed run takes over: the scheduler's in-flight groups, the launch
    records of their executions, the harness host of each one still running, and the
    launch version of every execution the journal holds (a resumed ready group's
    executions are reported with them when it is trained)."""

    groups: tuple[InFlightGroup, ...] = ()
    launches: tuple[LaunchRecord, ...] = ()
    hosts: Mapping[str, str] = field(default_factory=dict)  # proxy id -> host name
    versions: Mapping[int, int] = field(default_factory=dict)  # execution id -> version

    @property
    def lost(self) -> int:
        """Executions lost with the dead controller (replaced)."""
        return sum(1 for g in self.groups for e in g.executions if not (e.running or e.finished))


def adoption(
    journal: JournalState, settled: Collection[int], survivors: Mapping[str, str]
) -> Adoption:
    """The in-flight groups of ``journal``: launched, not ``settled`` (in the ledger or
    trained) and not dropped; ``survivors``: the host of each harness a host still has,
    by proxy execution id (module docstring)."""
    by_group: dict[int, list[LaunchRecord]] = {}
    for record in journal.launches.values():
        if record.group not in settled and record.group not in journal.dropped:
            by_group.setdefault(record.group, []).append(record)
    groups, launches, hosts = [], [], {}
    for gid, records in sorted(by_group.items()):
        executions = []
        for record in records:
            finish = journal.finishes.get(record.execution)
            if finish is not None and finish.outcome == Outcome.CANCELLED:
                finish = None  # a group in rollout cancels none: a stopping run did (lost)
            running = finish is None and record.proxy_id in survivors
            if running:
                hosts[record.proxy_id] = survivors[record.proxy_id]
            executions.append(
                InFlightExecution(
                    id=record.execution,
                    index=record.index,
                    version=record.version,
                    running=running,
                    finished=finish is not None,
                    reward=finish.reward if finish is not None else None,
                )
            )
        groups.append(InFlightGroup(id=gid, v_d=records[0].v_d, executions=tuple(executions)))
        launches += records
    versions = {r.execution: r.version for r in journal.launches.values()}
    return Adoption(groups=tuple(groups), launches=tuple(launches), hosts=hosts, versions=versions)
