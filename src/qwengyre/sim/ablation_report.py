"""The ablation tables of ``qwengyre simulate --ablations`` on the terminal."""

from __future__ import annotations

import math

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from qwengyre.sim.ablations import MEASURED, PAPER_HOURS, AblationResult, settings
from qwengyre.sim.report import table_console

WIDTH = 150
"""Columns of the tables when output is not a terminal."""


def print_ablations(result: AblationResult, console: Console | None = None) -> None:
    """Two tables: the rows (mean hours and their range over the seeds, the paper's
    hours where stated, exposed training, time over bound, staleness, rollout use), then
    the paper's figures against ours; under them, why each disagreeing figure does."""
    console = console or table_console(width=WIDTH)
    rows = Table(
        title=escape(f"Paper ablations at E[d] = 1.5: {result.workload}, {result.steps} steps, ")
        + _seeds(result.seeds)
    )
    columns = ["row", "what (and the settings it ran)", "hours", "min-max", "paper h"]
    columns += ["exposed train h", "/bound", escape("E[d]"), "rollout use"]
    for column in columns:
        rows.add_column(column, justify="left" if column in columns[:2] else "right")
    for name, r in result.rows.items():
        hours = r.hours()
        paper = PAPER_HOURS.get(name)
        rows.add_row(
            name,
            f"{escape(r.row.description)}\n[dim]{escape(settings(r.config))}[/dim]",
            f"{r.mean_hours:.2f}",
            f"{min(hours):.2f}-{max(hours):.2f}",
            "" if paper is None else f"{paper:.2f}",
            f"{r.exposed_training_hours:.2f}",
            f"{r.time_over_bound:.2f}",
            "—" if math.isnan(r.staleness) else f"{r.staleness:.2f}",
            f"{r.rollout_use:.0%}",
        )
    console.print(rows)

    figures = Table(title="The paper's figures: row against reference")
    columns = ["figure", "paper", "ours", "seeds min-max", "single runs", "agrees"]
    for column in columns:
        figures.add_column(column, justify="left" if column == "figure" else "right")
    for measured in result.figures:
        f = measured.figure
        figures.add_row(
            f.label(),
            f.format(f.paper),
            f.format(measured.ours),
            f"{f.format(measured.low)} .. {f.format(measured.high)}",
            f"{f.format(measured.single_low)} .. {f.format(measured.single_high)}",
            "yes" if measured.agrees else "no",
        )
    console.print(figures)
    console.print(
        "exposed train h: what training adds to the row's time (the row run again with "
        "training free). percent: the row's time against the reference's; x: the "
        "reference's time over the row's. single runs: one run of each row on any two "
        "seeds, as two live runs would be.",
        markup=False,
    )
    disagreeing = [m.figure for m in result.figures if not m.agrees]
    if disagreeing:
        console.print(
            f"Why these figures disagree ({MEASURED}; qwengyre.sim.ablations has the details):",
            markup=False,
        )
    for figure in disagreeing:
        why = figure.reason or "no explanation recorded for this figure"
        console.print(f"- {figure.label()}: {why}", markup=False)


def _seeds(seeds: tuple[int, ...]) -> str:
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    if seeds == tuple(range(seeds[0], seeds[0] + len(seeds))):
        return f"seeds {seeds[0]}-{seeds[-1]}"
    return "seeds " + ", ".join(map(str, seeds))
