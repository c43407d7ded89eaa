"""The execution trace: one JSON object per line, per terminated execution.

The live runtime writes it (with :class:`TraceWriter`) and the simulator replays it
(with :class:`qwengyre.sim.replay.TraceWorkload`).  A line::

    {"query": "repo-17", "group": 3, "index": 5, "start_s": 120.0, "end_s": 7321.5,
     "outcome": "completed", "reward": 0.0, "train_tokens": 81234,
     "calls": [{"start_s": 121.0, "end_s": 130.2, "input_tokens": 5120, "output_tokens": 310}]}

- ``query``: the task id (string or integer; ``"7"`` and ``7`` are different queries);
- ``group``: the rollout group's sequence number; ``index``: the execution's index in it;
- ``start_s`` / ``end_s``: launch and termination, seconds since the run started;
- ``outcome``: an :class:`~qwengyre.types.Outcome` value;
- ``reward``: the valid reward, or ``null`` when there is no valid assessment (always
  ``null`` for ``overall_timeout``; never ``null`` for ``completed``);
- ``train_tokens`` (optional, default 0): target tokens contributed to training after
  trajectory selection; 0 also means "not recorded";
- ``calls`` (optional, default ``[]``): the model calls, each with its own times and
  token counts;
- ``version`` (optional, default ``null``): the policy version published when the
  execution launched (the scheduler's ``Launch.version``); a top-up launched after a
  publication has a newer one than its group;
- ``host`` (optional, default ``null``): the harness host that ran the execution
  (:mod:`qwengyre.rollout.hosts`; ``null`` when none did, e.g. cancelled while waiting).

Unknown fields are rejected, times and counts are non-negative and finite, and an end
never precedes its start.  :func:`read_trace` reports the file, line and field of the
first bad line, e.g. ``trace.jsonl:7: field 'end_s': end_s (3.0) < start_s (5.0)``.
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import Annotated, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
)
from pydantic_core import ErrorDetails

from qwengyre.durable import LineLog
from qwengyre.jsonl import JsonlError, parse_line
from qwengyre.types import Outcome

Seconds = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0)]


def _check_end(end_s: float, info: ValidationInfo) -> float:
    start_s = info.data.get("start_s")
    if start_s is not None and end_s < start_s:
        raise ValueError(f"end_s ({end_s}) < start_s ({start_s})")
    return end_s


class TraceCall(BaseModel):
    """One model call made by an execution."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    start_s: Seconds
    end_s: Seconds
    input_tokens: Count
    output_tokens: Count

    @field_validator("end_s")
    @classmethod
    def _end_not_before_start(cls, end_s: float, info: ValidationInfo) -> float:
        return _check_end(end_s, info)


class TraceRecord(BaseModel):
    """One terminated execution."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    query: StrictStr | StrictInt
    group: Count
    index: Count
    start_s: Seconds
    end_s: Seconds
    outcome: Outcome
    reward: Annotated[float, Field(allow_inf_nan=False)] | None
    train_tokens: Count = 0
    calls: list[TraceCall] = Field(default_factory=list)
    version: Count | None = None
    host: StrictStr | None = None

    @field_validator("end_s")
    @classmethod
    def _end_not_before_start(cls, end_s: float, info: ValidationInfo) -> float:
        return _check_end(end_s, info)

    @field_validator("reward")
    @classmethod
    def _reward_matches_outcome(cls, reward: float | None, info: ValidationInfo) -> float | None:
        outcome = info.data.get("outcome")
        if outcome is Outcome.OVERALL_TIMEOUT and reward is not None:
            raise ValueError("an overall_timeout execution has no valid reward (use null)")
        if outcome is Outcome.COMPLETED and reward is None:
            raise ValueError("a completed execution has a valid reward (not null)")
        return reward

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


class TraceError(JsonlError):
    """A trace file that cannot be read; the message names the file, line and field."""


def _rewrite(
    loc: tuple[int | str, ...], item: ErrorDetails, message: str
) -> tuple[tuple[int | str, ...], str]:
    if loc and loc[0] == "query" and len(loc) > 1:  # one error per union member
        return ("query",), "should be a string or an integer"
    return loc, message


def parse_trace_line(
    text: str, path: Path | str = "<trace>", line: int | None = None
) -> TraceRecord:
    """Parse one trace line; errors are :class:`TraceError` naming ``path:line`` and field."""
    return parse_line(text, Path(path), line, TraceRecord.model_validate, TraceError, _rewrite)


def read_trace(path: Path | str, *, allow_empty: bool = False) -> list[TraceRecord]:
    """Read every record of a JSONL trace; blank lines are skipped.

    Raises :class:`TraceError` for the first bad line, and for a trace without records
    unless ``allow_empty``.
    """
    path = Path(path)
    records: list[TraceRecord] = []
    with path.open(encoding="utf-8") as stream:
        for number, text in enumerate(stream, start=1):
            if text.strip():
                records.append(parse_trace_line(text, path, number))
    if not records and not allow_empty:
        raise TraceError(path, "empty trace: no execution records")
    return records


class TraceWriter:
    """Appends records to a trace, one whole line each (``fsync=True`` also syncs it;
    :class:`~qwengyre.durable.LineLog`: a line cut short is never glued to the next).

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, path: Path | str, *, fsync: bool = False) -> None:
        self.path = Path(path)
        self._log = LineLog(self.path, "the execution traces", fsync=fsync)

    def write(self, record: TraceRecord) -> None:
        self._log.append(record.model_dump_json())

    def close(self) -> None:
        self._log.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
