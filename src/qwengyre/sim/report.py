"""The simulator's table on the terminal."""

from __future__ import annotations

import math
from collections.abc import Mapping

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from qwengyre.sim.simulator import SimResult

#: Short names of the bound's terms (:class:`qwengyre.sim.bound.RunBound`) for the table.
BINDING_LABELS = {"resource": "work", "littles_law": "slots", "critical_chain": "chain"}


def print_table(
    results: Mapping[str, SimResult], title: str, console: Console | None = None
) -> None:
    """One row per policy: time, its run's lower bound (time over it, the binding term),
    staleness measured vs Eq 2, usage, and the publications after which Eq 6 kept the
    core in training (of all publications in the run).

    With an ``elastic`` row and others, a last column gives each baseline's time over
    elastic's (the speedup of elastic).
    """
    table = Table(title=title)
    columns = ["policy", "mu", "phi", "hours", "bound h", "/bound", "binds", "E[d]", "Eq 2"]
    columns += ["training", "rollout use", "dropped", "Eq 6 kept", "speedup"]
    for column in columns:
        table.add_column(escape(column), justify="left" if column == "policy" else "right")
    elastic = results.get("elastic")
    for name, r in results.items():
        speedup = (
            ""
            if elastic is None or name == "elastic"
            else (f"{r.end_to_end_s / elastic.end_to_end_s:.2f}x")
        )
        share = sum(r.cell_training_share) / len(r.cell_training_share)
        table.add_row(
            name,
            str(r.mu),
            f"{r.phi:g}",
            f"{r.end_to_end_s / 3600:.2f}",
            f"{r.bound.seconds / 3600:.2f}",
            f"{r.end_to_end_s / r.bound.seconds:.2f}",
            BINDING_LABELS[r.bound.binding],
            _number(r.mean_staleness),
            _number(r.predicted_staleness),
            f"{share:.0%}",
            f"{r.rollout_utilisation:.0%}",
            str(r.groups_dropped),
            "—" if r.policy == "async" else f"{r.core_kept}/{r.publications}",
            speedup,
        )
    (console or table_console(width=132)).print(table)


def _number(value: float) -> str:
    """Two decimals; a dash where there is no value (no steady-state step yet, or no
    Eq 2 prediction for continuous dispatch)."""
    return "—" if math.isnan(value) else f"{value:.2f}"


def table_console(width: int) -> Console:
    """The terminal's console, or one ``width`` columns wide when output is not a
    terminal (a log or a pipe), so that wide tables are not squeezed."""
    console = Console()
    return console if console.is_terminal else Console(width=width)
