"""Where a live run's metrics go besides ``RUN_DIR/metrics.jsonl``.

:class:`~qwengyre.records.metrics.MetricsWriter` appends every record to the JSONL log
(the source of truth: the report reads it) and hands it to its sinks, each behind
:class:`~qwengyre.records.metrics.MetricsSink` (``name``, ``write(record)``,
``close()``):

- :class:`TensorBoardSink`: event files in ``RUN_DIR/tensorboard/``
  (``torch.utils.tensorboard``); on unless ``metrics.tensorboard=false``.
- :class:`WandbSink`: a Weights & Biases run when ``metrics.wandb_project`` is set
  (the ``wandb`` extra: ``pip install 'qwengyre[wandb]'``). Offline unless
  ``metrics.wandb_mode`` or ``$WANDB_MODE`` says otherwise: it never needs the network
  (``wandb sync RUN_DIR/wandb/offline-run-*`` uploads later).

:func:`open_metrics` builds the writer a live run uses from its config.

Both sinks log the same scalars, derived by :class:`ScalarStream`:

============================  =============================================================
``step/<field>``              every :class:`StepRecord` field but ``step`` (reward_mean,
                              reward_std, rewards, loss, clipped_fraction, grad_norm,
                              tokens, micro_steps, cells, train_s, staleness_mean, ...)
``staleness/measured``        the step's mean staleness
``staleness/predicted``       Eq 2's prediction from the run record, ``phi + (mu - 1)/2``
``staleness/excess``          measured minus predicted
``throughput/tokens_per_s``   tokens trained over the wall time since the previous step
``throughput/train_tokens_per_s``  tokens trained over the step's training seconds
``run/<field>``               the run's shape (mu, phi, cells, predicted_staleness, ...)
``cell/<c>/role``             cell ``c`` entered a role: 0 rollout, 0.5 switching, 1 training
``cells/training``, ``cells/rollout``, ``cells/switching``  cells in each role
``switch/to_training_s``, ``switch/to_rollout_s``  a finished switch's seconds (any cell)
``cell/<c>/switch_to_<to>_s`` the same, per cell
``load/running``, ``load/queued``, ``load/capacity``  executions and rollout capacity
``group/staleness``           a trained group's staleness (one point per group)
``cell/<c>/busy_fraction``    busy seconds over busy + idle seconds so far
============================  =============================================================

The x axis is the training step: a step's own scalars at its index, every other
record at the latest step logged (a resumed run: the step it resumed from). In
TensorBoard every scalar also carries its wall time on the run's clock, so its
"Relative" axis shows roles, switches and load against seconds since the run started;
W&B rows carry ``time_s`` for the same purpose. The standalone pool is cell
``standalone``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from qwengyre.config import Config, ConfigError, MetricsConfig
from qwengyre.records.metrics import (
    METRICS_FILE,
    GroupRecord,
    LoadRecord,
    MetricsSink,
    MetricsWriter,
    PublicationRecord,
    Record,
    RoleRecord,
    RunRecord,
    StepRecord,
    SwitchRecord,
    UsageRecord,
)
from qwengyre.scheduler.events import STANDALONE, Role

__all__ = [
    "ROLE_LEVEL",
    "ScalarStream",
    "TensorBoardSink",
    "WandbSink",
    "check_metrics",
    "import_wandb",
    "open_metrics",
    "wandb_mode",
]

ROLE_LEVEL: Mapping[str, float] = {
    Role.ROLLOUT.value: 0.0,
    Role.TO_TRAINING.value: 0.5,
    Role.TRAINING.value: 1.0,
    Role.TO_ROLLOUT.value: 0.5,
    Role.LOST.value: -1.0,
}
"""A role as one number, so a cell's role plots as a line: 1 training, 0 rollout, -1 lost."""

TENSORBOARD_DIR = "tensorboard"
"""Where a live run's TensorBoard event files go, inside its run directory."""

WANDB_EXTRA = "pip install 'qwengyre[wandb]'"


class _ScalarWriter(Protocol):
    def add_scalar(
        self, tag: str, scalar_value: float, global_step: int, walltime: float | None = None
    ) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


def tensorboard_available() -> bool:
    """Whether TensorBoard event files can be written: ``tensorboard`` and ``torch``."""
    return (
        importlib.util.find_spec("tensorboard") is not None
        and importlib.util.find_spec("torch") is not None
    )


def open_tensorboard(log_dir: Path, purge_step: int | None = None) -> _ScalarWriter | None:
    """A TensorBoard ``SummaryWriter`` on ``log_dir``, or None when it is not installed.

    ``purge_step``: a resumed run's first step; TensorBoard hides what an earlier
    process logged at or after it (those steps are trained again).
    """
    if not tensorboard_available():
        return None
    from torch.utils.tensorboard import SummaryWriter

    writer: _ScalarWriter = SummaryWriter(
        log_dir=str(log_dir), purge_step=purge_step or None, flush_secs=10
    )
    return writer


#: Step fields written to TensorBoard (as ``step/<name>``), all but the step index.
STEP_SCALARS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(StepRecord) if f.name != "step"
)


def _cell(cell: int) -> str:
    return "standalone" if cell == STANDALONE else str(cell)


class ScalarStream:
    """Turns records into named scalars and the step to log them at.

    Stateful: Eq 2's prediction comes from the last run record, tokens/s from the
    previous step's time, the role counts from every cell's last role.
    """

    def __init__(self, step: int = 0) -> None:
        self.step = step
        """The step the latest scalars belong to."""
        self.predicted_staleness: float | None = None
        self._last_step_s: float | None = None
        self._roles: dict[int, str] = {}

    def scalars(self, record: Record) -> dict[str, float]:
        """The scalars of ``record`` (non-finite values left out); updates :attr:`step`."""
        values: dict[str, float] = {}
        match record:
            case RunRecord():
                self.predicted_staleness = record.predicted_staleness
                self._last_step_s = record.time_s  # a new process: its clock starts again
                self._roles.clear()
                for f in dataclasses.fields(record):
                    value = getattr(record, f.name)
                    if f.name != "time_s" and isinstance(value, int | float):
                        values[f"run/{f.name}"] = float(value)
            case StepRecord():
                self.step = max(self.step, record.step)
                for name in STEP_SCALARS:
                    values[f"step/{name}"] = float(getattr(record, name))
                values["staleness/measured"] = record.staleness_mean
                if self.predicted_staleness is not None:
                    values["staleness/predicted"] = self.predicted_staleness
                    values["staleness/excess"] = record.staleness_mean - self.predicted_staleness
                if self._last_step_s is not None and record.time_s > self._last_step_s:
                    values["throughput/tokens_per_s"] = record.tokens / (
                        record.time_s - self._last_step_s
                    )
                if record.train_s > 0:
                    values["throughput/train_tokens_per_s"] = record.tokens / record.train_s
                self._last_step_s = record.time_s
            case RoleRecord():
                self._roles[record.cell] = record.role
                values[f"cell/{_cell(record.cell)}/role"] = ROLE_LEVEL[record.role]
                roles = list(self._roles.values())
                values["cells/training"] = roles.count(Role.TRAINING.value)
                values["cells/rollout"] = roles.count(Role.ROLLOUT.value)
                values["cells/switching"] = (
                    len(roles) - values["cells/training"] - values["cells/rollout"]
                )
            case SwitchRecord():
                values[f"switch/to_{record.to}_s"] = record.seconds
                values[f"cell/{_cell(record.cell)}/switch_to_{record.to}_s"] = record.seconds
            case LoadRecord():
                values["load/running"] = record.running
                values["load/queued"] = record.queued
                values["load/capacity"] = record.capacity
                values["load/waterlevel"] = record.waterlevel
                values["load/stalls"] = record.stalls
            case PublicationRecord():
                values["publication/seconds"] = record.seconds
            case GroupRecord():
                values["group/staleness"] = record.staleness
            case UsageRecord():
                total = record.busy_s + record.idle_s
                if total > 0:
                    values[f"cell/{_cell(record.cell)}/busy_fraction"] = record.busy_s / total
        return {tag: float(v) for tag, v in values.items() if math.isfinite(v)}

    def step_of(self, record: Record) -> int:
        """The step ``record``'s scalars are logged at (call after :meth:`scalars`)."""
        return record.step if isinstance(record, StepRecord) else self.step


class TensorBoardSink:
    """Scalars into a TensorBoard ``SummaryWriter`` (see the module docstring).

    ``step``: the step a resumed run continues from. Each scalar's wall time is the
    run's clock (``time_s`` after the latest run record's wall time).
    """

    name = "tensorboard"

    def __init__(self, writer: _ScalarWriter, *, step: int = 0) -> None:
        self.writer = writer
        self._stream = ScalarStream(step)
        self._start_wall = time.time()

    def write(self, record: Record) -> None:
        if isinstance(record, RunRecord):
            self._start_wall = time.time() - record.time_s
        values = self._stream.scalars(record)
        step, walltime = self._stream.step_of(record), self._start_wall + record.time_s
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step, walltime=walltime)
        if isinstance(record, StepRecord):
            self.writer.flush()  # a live `tensorboard --logdir` sees every step at once

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Scalars into a Weights & Biases run (``run.log(values, step=...)``); the run
    record also goes into the run's config (``run.config["run"]``). ``run`` is what
    ``wandb.init`` returned (:meth:`open` calls it)."""

    name = "wandb"

    def __init__(self, run: Any, *, step: int = 0) -> None:
        self.run = run
        self._stream = ScalarStream(step)

    @classmethod
    def open(cls, run_dir: Path, config: Config, *, step: int = 0) -> WandbSink:
        """``wandb.init`` for the run in ``run_dir``: the project, entity, name and mode
        from ``config.metrics`` (:func:`wandb_mode`), the whole config as W&B's config,
        its files under ``run_dir/wandb/``, no console capture."""
        wandb = import_wandb()
        settings = config.metrics
        run = wandb.init(
            project=settings.wandb_project,
            entity=settings.wandb_entity,
            name=settings.wandb_name or Path(run_dir).resolve().name,
            dir=str(run_dir),
            mode=wandb_mode(settings),
            config=config.model_dump(mode="json"),
            settings=wandb.Settings(console="off", quiet=True),
        )
        return cls(run, step=step)

    def write(self, record: Record) -> None:
        if isinstance(record, RunRecord):
            self.run.config.update({"run": dataclasses.asdict(record)}, allow_val_change=True)
        values = self._stream.scalars(record)
        if values:
            self.run.log({**values, "time_s": record.time_s}, step=self._stream.step_of(record))

    def close(self) -> None:
        self.run.finish()


def import_wandb() -> ModuleType:
    """The ``wandb`` module; :class:`ConfigError` naming the extra when it is missing."""
    try:
        import wandb
    except ImportError:
        raise ConfigError(
            f"metrics.wandb_project is set but wandb is not installed: {WANDB_EXTRA}"
            " (or unset metrics.wandb_project)"
        ) from None
    return wandb


def wandb_mode(settings: MetricsConfig, environ: Mapping[str, str] = os.environ) -> str:
    """``metrics.wandb_mode`` if set, else ``$WANDB_MODE`` if set, else ``offline``."""
    return settings.wandb_mode or environ.get("WANDB_MODE") or "offline"


def check_metrics(config: Config) -> None:
    """Refuse, before anything starts, sinks that cannot work: TensorBoard without the
    ``tensorboard`` package, W&B without ``wandb``. Opens nothing."""
    if config.metrics.tensorboard and not tensorboard_available():
        raise ConfigError(
            "metrics.tensorboard is on but tensorboard is not installed (a dependency of "
            "qwengyre): pip install tensorboard, or set metrics.tensorboard=false"
        )
    if config.metrics.wandb_project is not None:
        import_wandb()


def open_metrics(
    run_dir: Path, config: Config, *, step: int = 0, fsync: bool = False
) -> MetricsWriter:
    """The metrics writer of a live run in ``run_dir``: ``metrics.jsonl`` plus the sinks
    ``config.metrics`` asks for (:func:`check_metrics` first). ``step``: the step a
    resumed run continues from (0 for a new run)."""
    check_metrics(config)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    sinks: list[MetricsSink] = []
    if config.metrics.wandb_project is not None:
        sinks.append(WandbSink.open(run_dir, config, step=step))
    try:
        if config.metrics.tensorboard:
            writer = open_tensorboard(run_dir / TENSORBOARD_DIR, step)
            if writer is not None:
                sinks.insert(0, TensorBoardSink(writer, step=step))
        return MetricsWriter(run_dir / METRICS_FILE, fsync=fsync, sinks=sinks)
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
