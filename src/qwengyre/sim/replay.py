"""A workload that replays a live run's execution trace (``traces.jsonl``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from qwengyre.records.trace import TraceError, TraceRecord, read_trace
from qwengyre.sim.workload import ExecutionSpec
from qwengyre.types import Outcome


class TraceWorkload:
    """A :class:`~qwengyre.sim.workload.Workload` replaying a recorded trace.

    Records are grouped by ``query`` in order of first appearance; within a query they
    are ordered by ``(group, index)`` (then file order), so a recorded execution keeps
    its index when ``index`` < the query's record count.  ``query_id`` k replays the
    (k mod Q)-th recorded query and ``index`` i its (i mod n)-th execution, so any number
    of queries and oversampled indices can be asked for.

    ``cancelled`` records are skipped: cancellation is the simulated scheduler's
    decision, and a cancelled run says nothing about how the execution would have ended.

    Duration is ``end_s - start_s``; outcome and reward are copied.  ``train_tokens`` is
    copied when positive; when 0 (absent) it is estimated as the sum of the calls'
    ``output_tokens`` -- the engine-sampled tokens, which are the only possible training
    targets, so this is an upper bound that assumes trajectory selection admitted all of
    them -- and it is 0 for ``overall_timeout`` executions, whose trajectories are
    discarded from training.
    """

    def __init__(self, records: Sequence[TraceRecord], name: str = "trace") -> None:
        by_query: dict[str | int, list[TraceRecord]] = {}
        for record in records:
            if record.outcome is not Outcome.CANCELLED:
                by_query.setdefault(record.query, []).append(record)
        if not by_query:
            raise ValueError("trace has no replayable records (all are cancelled, or none)")
        self._name = name
        self._queries: list[list[TraceRecord]] = [
            sorted(group, key=lambda r: (r.group, r.index)) for group in by_query.values()
        ]

    @classmethod
    def from_path(cls, path: Path | str) -> TraceWorkload:
        path = Path(path)
        records = read_trace(path)
        try:
            return cls(records, name="trace")
        except ValueError as error:
            raise TraceError(path, str(error)) from None

    @property
    def name(self) -> str:
        return self._name

    @property
    def n_queries(self) -> int:
        """The number of distinct recorded queries with replayable records."""
        return len(self._queries)

    def execution(self, query_id: int, index: int) -> ExecutionSpec:
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        executions = self._queries[query_id % len(self._queries)]
        record = executions[index % len(executions)]
        if record.outcome is Outcome.OVERALL_TIMEOUT:
            train_tokens = 0
        elif record.train_tokens > 0:
            train_tokens = record.train_tokens
        else:
            train_tokens = sum(call.output_tokens for call in record.calls)
        return ExecutionSpec(
            query_id=query_id,
            index=index,
            duration_s=record.duration_s,
            outcome=record.outcome,
            reward=record.reward,
            train_tokens=train_tokens,
        )
