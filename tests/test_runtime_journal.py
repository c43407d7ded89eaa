"""The launch journal (qwengyre.runtime.journal): durable launches, finishes and drops,
and what a resumed run takes over from them."""

from __future__ import annotations

from pathlib import Path

from qwengyre.runtime.journal import LaunchJournal, LaunchRecord, adoption
from qwengyre.scheduler.core import InFlightExecution


def launch(execution: int, group: int, index: int) -> LaunchRecord:
    return LaunchRecord(
        execution=execution,
        group=group,
        index=index,
        version=1,
        v_d=1,
        proxy_id=f"ex_{execution}",
        task="t0",
        time=0.0,
    )


def test_a_line_cut_short_is_skipped_and_the_next_append_stands_alone(tmp_path: Path):
    journal = LaunchJournal(tmp_path / "launches.jsonl")
    journal.launch(launch(0, 0, 0))
    with journal.path.open("a") as f:
        f.write('{"launch": {"execution": 1, "gro')  # a crash mid-append
    journal.finish(0, "completed", 1.0)
    state = journal.read()
    assert list(state.launches) == [0] and state.finishes[0].reward == 1.0
    assert state.next_execution == 1 and state.next_group == 1


def test_adoption_takes_over_the_groups_in_rollout_only(tmp_path: Path):
    journal = LaunchJournal(tmp_path / "launches.jsonl")
    for execution, group, index in [(0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 0, 3)]:
        journal.launch(launch(execution, group, index))
    for execution, group in [(4, 1), (5, 2), (6, 3)]:  # ledgered, trained, dropped
        journal.launch(launch(execution, group, 0))
    journal.finish(0, "completed", 0.5)  # counted
    journal.finish(3, "cancelled", None)  # cancelled by the stopping run: lost
    journal.drop(3)
    survivors = {"ex_1": "local", "ex_4": "local"}  # ex_2's harness died
    taken = adoption(journal.read(), settled={1, 2}, survivors=survivors)
    (group,) = taken.groups
    assert group.id == 0 and group.v_d == 1
    assert list(group.executions) == [
        InFlightExecution(id=0, index=0, version=1, finished=True, reward=0.5),
        InFlightExecution(id=1, index=1, version=1, running=True),
        InFlightExecution(id=2, index=2, version=1),
        InFlightExecution(id=3, index=3, version=1),
    ]
    assert dict(taken.hosts) == {"ex_1": "local"} and taken.lost == 2
    assert [r.execution for r in taken.launches] == [0, 1, 2, 3]
