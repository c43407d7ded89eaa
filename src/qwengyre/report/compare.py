"""Training runs side by side on the terminal: ``qwengyre report RUN_DIR RUN_DIR ...``.

One row per run, from its ``metrics.jsonl`` alone (:func:`~qwengyre.report.html.summarize`):
the policy and its (mu, phi), steps, RL time per step and, when an ``elastic`` run is
among them, each run's time per step over the first elastic run's (how much faster
elastic was), each cell's idle fraction and their mean, the measured staleness against
Eq 2, how many steps were trained by how many cells, and the mean reward over the first
and last fifth of the steps. It is the live counterpart of the simulator's table
(:mod:`qwengyre.sim.report`); compare runs of the same workload.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from qwengyre.records.metrics import RunMetrics
from qwengyre.report.html import Summary, describe_policy, read_run, summarize
from qwengyre.sim.report import table_console

COLUMNS = (
    "run",
    "policy",
    "steps",
    "s/step",
    "vs elastic",
    "idle per cell",
    "mean idle",
    "staleness (Eq 2)",
    "steps by cells",
    "reward first → last fifth",
)


@dataclass(kw_only=True, frozen=True)
class RunRow:
    """One run of the comparison: its directory's ``name``, policy and summary."""

    run_dir: Path
    metrics: RunMetrics
    name: str
    policy: str
    """``elastic``, ``async`` or ``colocate`` (``?`` when the run's shape was not recorded)."""
    label: str
    """The policy with its (mu, phi), as the table shows it."""
    summary: Summary

    @property
    def mean_idle(self) -> float:
        idle = self.summary.idle_fraction
        return statistics.fmean(idle) if idle else math.nan


def comparison_rows(run_dirs: Sequence[Path]) -> list[RunRow]:
    """The rows of ``run_dirs`` in the order given; raises as :func:`read_run` does."""
    rows = []
    for run_dir in run_dirs:
        run_dir = Path(run_dir)
        metrics = read_run(run_dir)
        policy = metrics.run.policy if metrics.run is not None else "?"
        name = run_dir.resolve().name
        rows.append(
            RunRow(
                run_dir=run_dir,
                metrics=metrics,
                name=name,
                policy=policy,
                label=describe_policy(metrics),
                summary=summarize(metrics),
            )
        )
    return rows


def _fmt(value: float, spec: str) -> str:
    return format(value, spec) if math.isfinite(value) else "–"


def comparison_table(rows: Sequence[RunRow]) -> Table:
    """The rich table of ``rows`` (see the module docstring for the columns)."""
    table = Table(title="qwengyre runs compared")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("run", "policy") else "right")
    elastic = next((r for r in rows if r.policy == "elastic"), None)
    for row in rows:
        s = row.summary
        versus = ""
        if elastic is not None and row is not elastic:
            versus = _fmt(s.seconds_per_step / elastic.summary.seconds_per_step, ".2f") + "x"
        table.add_row(
            row.name,
            row.label,
            str(s.steps),
            _fmt(s.seconds_per_step, ".1f"),
            versus,
            " / ".join(f"{x:.0%}" for x in s.idle_fraction) or "–",
            _fmt(row.mean_idle, ".0%"),
            f"{_fmt(s.mean_staleness, '.2f')} ({_fmt(s.predicted_staleness, '.2f')})",
            " ".join(f"{k}:{n}" for k, n in s.steps_by_cells.items()) or "–",
            f"{_fmt(s.reward_first_fifth, '.3f')} → {_fmt(s.reward_last_fifth, '.3f')}",
        )
    return table


def comparison_caveats(rows: Sequence[RunRow]) -> list[str]:
    """What differs between the runs besides their policy, which the table's ratios
    do not account for (one line each; none for runs of the same shape)."""
    caveats = []
    steps = {row.name: row.summary.steps for row in rows}
    if len(set(steps.values())) > 1:
        caveats.append(
            "the runs trained different numbers of steps ("
            + ", ".join(f"{name}: {n}" for name, n in steps.items())
            + "): times per step and reward fifths cover different stretches of training"
        )
    shapes = {
        "cells": lambda m: m.run.cells,
        "groups.size": lambda m: m.run.group_size,
        "groups.batch": lambda m: m.run.batch,
        "engine.backend": lambda m: m.run.engine_backend,
    }
    for key, of in shapes.items():
        values = {row.name: of(row.metrics) for row in rows if row.metrics.run is not None}
        if len(set(values.values())) > 1:
            listed = ", ".join(f"{name}: {value}" for name, value in values.items())
            caveats.append(f"{key} differs ({listed}): not the same workload")
    return caveats


def print_comparison(rows: Sequence[RunRow], console: Console | None = None) -> None:
    """Print :func:`comparison_table` (160 columns wide when not on a terminal), then
    :func:`comparison_caveats`."""
    console = console or table_console(width=160)
    console.print(comparison_table(rows))
    for caveat in comparison_caveats(rows):
        console.print(f"caveat: {caveat}", markup=False, soft_wrap=True)
