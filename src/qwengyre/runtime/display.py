"""The live ``rich`` view of a training run: step, reward, each cell's role,
running/queued executions and staleness, redrawn twice a second.

A step with no learning signal (nothing packed: every advantage zero, see
:attr:`~qwengyre.records.metrics.StepRecord.learning_signal`) is marked as such, in the
view and in the one-line-per-step log, with how many steps so far had none."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from rich.console import Console
from rich.live import Live
from rich.table import Table

from qwengyre.records.metrics import StepRecord
from qwengyre.runtime.controller import Controller
from qwengyre.scheduler.events import STANDALONE, Role

ROLE_STYLE = {
    Role.ROLLOUT: "blue",
    Role.TRAINING: "red",
    Role.TO_TRAINING: "yellow",
    Role.TO_ROLLOUT: "green",
    Role.LOST: "bright_black",
}


NO_SIGNAL = "no learning signal"


def signal_text(records: Sequence[StepRecord]) -> str:
    """The view's "learning signal" row: the last step's, and how many steps had none."""
    last = records[-1]
    none = sum(not r.learning_signal for r in records)
    so_far = f"{none} of {len(records)} steps had none so far" if none else "every step so far"
    if last.learning_signal:
        return f"{last.tokens} tokens, {last.micro_steps} micro-steps ({so_far})"
    return f"[bold red]{NO_SIGNAL}[/bold red]: nothing packed, all advantages zero ({so_far})"


def step_line(record: StepRecord) -> str:
    """One step as the log prints it (``NO LEARNING SIGNAL`` when nothing was trained)."""
    line = (
        f"step {record.step}: reward {record.reward_mean:.3f} ± {record.reward_std:.3f}"
        f" over {record.rewards}, staleness {record.staleness_mean:.2f},"
        f" {record.cells} cells, {record.train_s:.1f} s training, t={record.time_s:.0f}s"
    )
    if not record.learning_signal:
        line += (
            f"; {NO_SIGNAL.upper()} ({record.tokens} tokens, {record.micro_steps} micro-steps:"
            " every advantage was zero)"
        )
    return line


def render(controller: Controller) -> Table:
    s = controller.scheduler
    c = s.counters
    last = controller.observer.step_records[-1] if controller.observer.step_records else None
    table = Table(title=f"qwengyre train · {s.params.policy}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("elapsed", f"{controller.now():.0f} s")
    table.add_row("step", f"{s.version} / {controller.config.run.steps}")
    if last is not None:
        table.add_row("reward (last step)", f"{last.reward_mean:.3f} ± {last.reward_std:.3f}")
        table.add_row("staleness (last step)", f"{last.staleness_mean:.2f}")
        table.add_row("learning signal", signal_text(controller.observer.step_records))
    cells = " ".join(
        f"[{ROLE_STYLE[r]}]{i}:{r.value}[/{ROLE_STYLE[r]}]" for i, r in enumerate(s.roles)
    )
    table.add_row("cells", cells)
    if s.params.standalone_capacity:
        on_pool = len(s.running_on(STANDALONE))
        table.add_row("standalone pool", f"{on_pool} / {s.params.standalone_capacity} running")
    reserved = f", {c.reserved} reserved for top-ups" if c.reserved else ""
    table.add_row("executions", f"{c.running} running, {c.queued} queued{reserved}")
    table.add_row("ready groups", str(s.ready_unassigned))
    return table


async def show(controller: Controller, console: Console | None = None) -> None:
    """Redraw until cancelled (a terminal), or print one line per step (a log), each
    whole, the last ones when cancelled included."""
    console = console or Console()
    if console.is_terminal:
        with Live(render(controller), console=console, refresh_per_second=4) as live:
            while True:
                await asyncio.sleep(0.5)
                live.update(render(controller))
    printed = 0

    def print_new() -> None:  # whole lines, however narrow the log's "terminal"
        nonlocal printed
        for record in controller.observer.step_records[printed:]:
            console.print(step_line(record), markup=False, soft_wrap=True)
        printed = len(controller.observer.step_records)

    try:
        while True:
            await asyncio.sleep(1.0)
            print_new()
    finally:  # cancelled at the run's end: the last steps' lines too
        print_new()
