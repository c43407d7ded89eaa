"""The live training run's metrics log, ``RUN_DIR/metrics.jsonl``.

One JSON object per line, each with a ``kind`` naming its record type:

- ``run``: the run's shape, written once at the start (policy, mu, phi, K cells,
  Eq 2's predicted staleness, group size, batch).
- ``step``: one optimizer step done (the policy version after the update, rewards,
  loss, clipping, gradient norm, tokens, micro-steps, cells, seconds, staleness).
- ``role``: a cell entered a role (:class:`~qwengyre.scheduler.events.Role` values).
- ``switch``: a cell finished switching to ``training`` or ``rollout`` in ``seconds``.
- ``load``: running, queued and reserved executions and rollout capacity from ``time_s``
  on (written whenever they change).
- ``group``: a group trained in ``step`` that was dispatched at ``dispatch_version``.
- ``publication``: a version reached every rollout engine (a burst boundary).

Times (``time_s``) are seconds since the run's start. :class:`MetricsWriter` appends
records (one flushed line each, so a crash loses at most the line being written) and
hands each record to its sinks (TensorBoard event files in ``RUN_DIR/tensorboard/``,
Weights & Biases when configured: :mod:`qwengyre.report.sinks`).
:func:`read_metrics` reads a log back, ignoring a truncated last line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, Protocol, Self, TypeAlias

from qwengyre.durable import LineLog
from qwengyre.jsonl import JsonlError
from qwengyre.scheduler.events import Role

METRICS_FILE = "metrics.jsonl"
"""The metrics log's name inside a run directory."""

"""Where the TensorBoard mirror is written inside a run directory."""

SWITCH_DIRECTIONS = ("training", "rollout")
"""The two ways a cell can switch: to ``training`` or back to ``rollout``."""


class MetricsError(JsonlError):
    """A metrics log line that cannot be read; the message names the file and line."""


# ---------------------------------------------------------------- records


def _check_fields(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """The dataclass fields of ``cls`` from ``data``, type-checked; extra keys are ignored
    and fields with a default may be absent (logs written before they existed).

    ``int`` fields take JSON integers, ``float`` fields any JSON number (NaN allowed,
    as Python's ``json`` writes it), ``str`` fields strings, ``bool`` fields booleans;
    bools are never numbers.
    """
    values: dict[str, Any] = {}
    fields = dataclasses.fields(cls)
    required = [f for f in fields if f.default is dataclasses.MISSING]
    missing = [f.name for f in required if f.name not in data]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(map(repr, missing))}")
    for f in fields:
        if f.name not in data:
            continue  # a field added later, with its default, absent from older logs
        value = data[f.name]
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        if kind == "int":
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind == "float":
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            value = float(value) if ok else value
        elif kind == "str":
            ok = isinstance(value, str)
        elif kind == "bool":
            ok = isinstance(value, bool)
        else:  # pragma: no cover - every record field is one of the above
            raise TypeError(f"{cls.__name__}.{f.name}: unsupported field type {kind}")
        if not ok:
            raise ValueError(f"field {f.name!r}: expected {kind}, got {json.dumps(value)}")
        values[f.name] = value
    return values


class _Record:
    """Shared JSON round trip of the record dataclasses below."""

    KIND: ClassVar[str]

    def to_json(self) -> str:
        """One JSON line (no newline), ``kind`` first."""
        assert dataclasses.is_dataclass(self)
        return json.dumps({"kind": self.KIND, **dataclasses.asdict(self)})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        """The record from a decoded JSON object (its ``kind`` is not checked here)."""
        record = cls(**_check_fields(cls, data))
        record.validate()
        return record

    @classmethod
    def from_json(cls, text: str) -> Self:
        """The record from one JSON line; ``ValueError`` when it is not one of ``cls``."""
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("kind") != cls.KIND:
            raise ValueError(f"not a {cls.KIND!r} record: {text[:80]}")
        return cls.from_dict(data)

    def validate(self) -> None:
        """Raise ``ValueError`` when a field holds an impossible value."""


@dataclass(kw_only=True, frozen=True)
class RunRecord(_Record):
    """The run's shape, written once when it starts."""

    KIND: ClassVar[str] = "run"

    time_s: float
    policy: str
    mu: int
    phi: float
    cells: int
    """K, the number of elastic cells."""
    predicted_staleness: float
    """Eq 2: ``phi + (mu - 1) / 2``."""
    group_size: int
    batch: int
    standalone_capacity: int = 0
    """C_s, the standalone rollout pool's capacity (0: no pool)."""
    dispatch: str = "boundary"
    """``boundary`` or ``continuous`` (``scheduler.dispatch``)."""
    streaming: bool = True
    """Whether training streams on ready groups (``scheduler.streaming``)."""
    engine_backend: str = "embedded"
    """What serves rollout (``engine.backend``): the publications' and switches' cost
    depends on it."""


@dataclass(kw_only=True, frozen=True)
class StepRecord(_Record):
    """One optimizer step done."""

    KIND: ClassVar[str] = "step"

    time_s: float
    step: int
    version: int
    """The policy version after the update."""
    reward_mean: float
    reward_std: float
    rewards: int
    """How many valid rewards the step trained on."""
    loss: float
    clipped_fraction: float
    grad_norm: float
    tokens: int
    micro_steps: int
    cells: int
    """How many cells trained this step."""
    train_s: float
    """From the step's first assignment to its update done: waits for streamed groups
    included."""
    staleness_mean: float
    ratio_mean: float = math.nan
    """The mean execution ratio s_i = exp(mean(l_t - b_t)) over the trained executions:
    1 when the trained policy is the behaviour policy."""
    kl: float = math.nan
    """KL(behaviour || current) per target token, the k3 estimate (objective.py)."""
    routing_drift: float = math.nan
    """An MoE trained with routing replay: the share of the replayed (position, layer)
    routings where the current router would have chosen other experts than the engine
    did (the train-inference routing mismatch replay removes); NaN otherwise."""
    micro_step_s: float = math.nan
    """Seconds the cells spent in this step's micro-steps, summed over cells (what
    ``sim.train_tokens_per_cell_s`` models); NaN in logs written before it existed."""
    update_s: float = math.nan
    """Seconds from the last micro-step's end to the update done on every cell (what
    ``sim.train_step_overhead_s`` models); NaN in older logs."""

    @property
    def learning_signal(self) -> bool:
        """Did the step learn from anything? False ("no learning signal") when nothing was
        packed -- no tokens, no micro-steps: every execution's advantage was zero (each
        group's rewards all equal, e.g. all 0) -- so the update changed nothing."""
        return self.tokens > 0 and self.micro_steps > 0


@dataclass(frozen=True)
class RoleRecord(_Record):
    """Cell ``cell`` entered ``role`` at ``time_s``."""

    KIND: ClassVar[str] = "role"

    time_s: float
    cell: int
    role: str
    """A :class:`~qwengyre.scheduler.events.Role` value."""

    def validate(self) -> None:
        if self.role not in {r.value for r in Role}:
            raise ValueError(
                f"field 'role': {self.role!r} is not one of {', '.join(r.value for r in Role)}"
            )


@dataclass(kw_only=True, frozen=True)
class SwitchRecord(_Record):
    """Cell ``cell`` finished switching ``to`` training or rollout, in ``seconds``."""

    KIND: ClassVar[str] = "switch"

    time_s: float
    cell: int
    to: str
    """``"training"`` or ``"rollout"``."""
    seconds: float
    engine: str = ""
    """How the cell's rollout engine gave its device memory up for this stint in
    training: ``released`` (embedded), ``asleep`` (vLLM sleep, SGLang memory release),
    ``stopped`` (a vLLM server on the CPU, whose sleep frees nothing, is stopped and
    restarted); empty in logs written before this field existed."""

    def validate(self) -> None:
        if self.to not in SWITCH_DIRECTIONS:
            raise ValueError(f"field 'to': {self.to!r} is not 'training' or 'rollout'")


@dataclass(kw_only=True, frozen=True)
class LoadRecord(_Record):
    """Running and queued executions and rollout capacity from ``time_s`` on."""

    KIND: ClassVar[str] = "load"

    time_s: float
    running: int
    queued: int
    capacity: int
    reserved: int = 0
    """Quota held for top-ups (``groups.reserve``), counted in the waterlevel."""
    stalls: int = 0
    """Stalled bursts' dispatches so far (the scheduler's ``stalls``): a burst whose groups
    could no longer fill its step dispatched owed top-ups and dropped groups' slots at
    once, the only way the waterlevel rises within a burst. Many of them say that
    ``scheduler.phi`` or ``groups.reserve`` is too small for the invalid results."""

    @property
    def waterlevel(self) -> int:
        """w = d - f (+ the held reserve): never rises within a burst (docs/design.md §4)."""
        return self.running + self.queued + self.reserved


@dataclass(frozen=True)
class PublicationRecord(_Record):
    """The core's weights ``version`` reached every rollout engine, in ``seconds``; the
    next burst's dispatch follows (a burst boundary)."""

    KIND: ClassVar[str] = "publication"

    time_s: float
    version: int
    seconds: float


@dataclass(kw_only=True, frozen=True)
class GroupRecord(_Record):
    """A group dispatched at ``dispatch_version`` and trained in ``step``."""

    KIND: ClassVar[str] = "group"

    time_s: float
    group_id: int
    dispatch_version: int
    step: int
    staleness: int
    """``step - dispatch_version``: the group's scheduling staleness (Eq 2's quantity)."""
    execution_staleness: float = math.nan
    """The mean of ``step - v`` over the group's trained executions, ``v`` the version
    each launched with: a top-up launched after a publication samples newer weights."""


@dataclass(frozen=True)
class UsageRecord(_Record):
    """Cell ``cell``'s busy and idle seconds since the run started, as of ``time_s``.

    Busy: serving rollout with at least one execution routed to it, or training (a
    micro-step or an update in progress). Idle: everything else, transitions included.
    """

    KIND: ClassVar[str] = "usage"

    time_s: float
    cell: int
    busy_s: float
    idle_s: float


Record: TypeAlias = (
    RunRecord
    | StepRecord
    | RoleRecord
    | SwitchRecord
    | LoadRecord
    | GroupRecord
    | UsageRecord
    | PublicationRecord
)
RECORD_TYPES: dict[str, type[Record]] = {
    cls.KIND: cls
    for cls in (
        RunRecord,
        StepRecord,
        RoleRecord,
        SwitchRecord,
        LoadRecord,
        GroupRecord,
        UsageRecord,
        PublicationRecord,
    )
}
"""Record class by ``kind``."""


def parse_record(text: str) -> Record:
    """One metrics line as its record; ``ValueError`` says what is wrong."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    kind = data.get("kind")
    cls = RECORD_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"unknown kind {kind!r} (expected one of {', '.join(RECORD_TYPES)})")
    return cls.from_dict(data)


# ---------------------------------------------------------------- reading


@dataclass(kw_only=True)
class RunMetrics:
    """A metrics log read back: the records of each kind, in file order."""

    runs: list[RunRecord] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    roles: list[RoleRecord] = field(default_factory=list)
    switches: list[SwitchRecord] = field(default_factory=list)
    loads: list[LoadRecord] = field(default_factory=list)
    groups: list[GroupRecord] = field(default_factory=list)
    usage: list[UsageRecord] = field(default_factory=list)
    publications: list[PublicationRecord] = field(default_factory=list)

    def add(self, record: Record) -> None:
        match record:
            case RunRecord():
                self.runs.append(record)
            case StepRecord():
                self.steps.append(record)
            case RoleRecord():
                self.roles.append(record)
            case SwitchRecord():
                self.switches.append(record)
            case LoadRecord():
                self.loads.append(record)
            case GroupRecord():
                self.groups.append(record)
            case UsageRecord():
                self.usage.append(record)
            case PublicationRecord():
                self.publications.append(record)

    @property
    def run(self) -> RunRecord | None:
        """The run's shape: the last ``run`` record (a resumed run writes another)."""
        return self.runs[-1] if self.runs else None

    def _kinds(self) -> tuple[Sequence[Record], ...]:
        return (
            self.runs,
            self.steps,
            self.roles,
            self.switches,
            self.loads,
            self.groups,
            self.usage,
            self.publications,
        )

    @property
    def end_s(self) -> float:
        """The latest time any record carries (0 for an empty log)."""
        times = [t for rs in self._kinds() for r in rs if math.isfinite(t := r.time_s)]
        return max(times, default=0.0)

    def __len__(self) -> int:
        return sum(len(rs) for rs in self._kinds())


def read_metrics(path: Path) -> RunMetrics:
    """Read ``metrics.jsonl`` (or a run directory holding one).

    Blank lines are skipped. A last line without its newline that does not parse was
    cut short by a crash mid-write and is ignored; any other bad line raises
    :class:`MetricsError` naming the file and line number.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    # After the last newline: "" for a complete file, else a line the writer never finished.
    metrics = RunMetrics()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = parse_record(line)
        except ValueError as exc:
            if number == len(lines):  # no newline after it: truncated by a crash
                continue
            raise MetricsError(path, str(exc), number) from None
        metrics.add(record)
    return metrics


# ---------------------------------------------------------------- writing


class MetricsSink(Protocol):
    """Somewhere records go besides ``metrics.jsonl``: TensorBoard, Weights & Biases
    (:mod:`qwengyre.report.sinks`). ``write`` gets every record, in log order."""

    name: str

    def write(self, record: Record) -> None: ...
    def close(self) -> None: ...


class MetricsWriter:
    """Appends records to a metrics log, one whole line each
    (:class:`~qwengyre.durable.LineLog`: a line a crash or a full disk cut short never
    has the next one glued on; a full disk raises
    :class:`~qwengyre.durable.DiskFullError` naming the log), and hands every record to
    its ``sinks`` (TensorBoard, W&B: :mod:`qwengyre.report.sinks`, whose
    :func:`~qwengyre.report.sinks.open_metrics` opens a live run's). ``fsync``: also
    fsync after every line (durable across power loss). A sink that raises is reported
    once on stderr and dropped; the log itself stays complete.
    """

    def __init__(
        self, path: Path, *, fsync: bool = False, sinks: Sequence[MetricsSink] = ()
    ) -> None:
        self.path = Path(path)
        self._file = LineLog(self.path, "the metrics log", fsync=fsync)
        self._sinks: list[MetricsSink] = list(sinks)

    @property
    def sinks(self) -> tuple[MetricsSink, ...]:
        """The sinks still receiving records (a failed one is dropped)."""
        return tuple(self._sinks)

    @property
    def closed(self) -> bool:
        return self._file.closed

    def write(self, record: Record) -> None:
        """Append ``record`` as one line and flush it (and fsync when asked), then hand
        it to every sink."""
        self._file.append(record.to_json())
        for sink in list(self._sinks):
            try:
                sink.write(record)
            except Exception as exc:
                self._drop(sink, exc)

    def _drop(self, sink: MetricsSink, exc: BaseException) -> None:
        self._sinks.remove(sink)
        print(
            f"qwengyre: metrics sink {sink.name} failed ({type(exc).__name__}: {exc}); "
            f"it gets no more records ({self.path} still does)",
            file=sys.stderr,
            flush=True,
        )
        with contextlib.suppress(Exception):
            sink.close()

    def close(self) -> None:
        self._file.close()
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            try:
                sink.close()
            except Exception as exc:
                print(f"qwengyre: closing metrics sink {sink.name} failed: {exc}", file=sys.stderr)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
