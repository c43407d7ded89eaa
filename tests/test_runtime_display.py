"""The run's live view in a log (not a terminal): one whole line per step, the last
steps' included when the view stops with the run."""

from __future__ import annotations

import asyncio
import io
from types import SimpleNamespace
from typing import Any

from rich.console import Console
from tests.test_report import _step

from qwengyre.records.metrics import StepRecord
from qwengyre.runtime.display import show, step_line


def test_a_log_gets_each_step_on_one_whole_line_the_last_ones_included() -> None:
    out = io.StringIO()
    console = Console(file=out, width=40, force_terminal=False)  # a narrow file
    records: list[StepRecord] = []
    controller: Any = SimpleNamespace(observer=SimpleNamespace(step_records=records))

    async def main() -> None:
        view = asyncio.create_task(show(controller, console))
        records.append(_step(0, 0.0))
        await asyncio.sleep(1.2)  # the view prints what it has every second
        records.extend([_step(1, 10.0), _step(2, 20.0)])  # the run ends before a print
        view.cancel()
        await asyncio.gather(view, return_exceptions=True)

    asyncio.run(main())
    lines = out.getvalue().splitlines()
    assert lines == [step_line(_step(s, 10.0 * s)) for s in range(3)]
    assert len(lines[0]) > 40  # not wrapped at the console's width
