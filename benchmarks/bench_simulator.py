"""How fast the simulator runs paper-122b (48 steps, ~25k executions) at K = 8 and 80 cells.

Prints, per cell count and policy, the executions simulated per second of wall time,
the µs of CPU per execution, how much faster than real time the run is, and where the
time goes: inside the scheduler (``Scheduler.handle`` and the views the simulator
reads), inside the workload (``execution``: the random draws), and the rest (the
simulator's own event loop). Each run gets a fresh workload, so it pays its draws. The
shares come from a second, instrumented run of the same configuration, so the timing
wrappers cost nothing in the speeds.

K = 80 is the same cluster cut into ten times as many cells: total rollout capacity
(cells x capacity, 1152 at K = 8), total training throughput (cells x
``sim.train_tokens_per_cell_s``) and the async training share (2 cells in 8) are held
fixed; per-cell capacity 144 becomes 14 (1120 in all, 2.8% less).

    python benchmarks/bench_simulator.py [--steps 48] [--cells 8 80]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from _smoke import parse
from qwengyre.config import Config, load_config, retarget
from qwengyre.presets import preset_path
from qwengyre.scheduler.core import Scheduler
from qwengyre.sim.plan import POLICIES
from qwengyre.sim.simulator import SimResult, simulate
from qwengyre.sim.workload import ExecutionSpec, Workload, workload_from_name

PAPER_CELLS = 8
SCHEDULER_METHODS = ("handle", "wants_groups")
SCHEDULER_VIEWS = ("counters", "capacity", "training_cells")


class Stopwatch:
    """Wall time spent inside the wrapped callables; nested calls count once."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self._depth -= 1

        return timed


class TimedWorkload:
    """A workload whose ``execution`` calls are timed."""

    def __init__(self, workload: Workload, stopwatch: Stopwatch) -> None:
        self.name = workload.name
        self._execution = stopwatch.wrap(workload.execution)

    def execution(self, query_id: int, index: int) -> ExecutionSpec:
        spec: ExecutionSpec = self._execution(query_id, index)
        return spec


@contextmanager
def scheduler_timed(stopwatch: Stopwatch) -> Iterator[None]:
    """Within: the scheduler's entry point and the views the simulator reads are timed."""
    saved = {name: Scheduler.__dict__[name] for name in SCHEDULER_METHODS + SCHEDULER_VIEWS}
    for name in SCHEDULER_METHODS:
        setattr(Scheduler, name, stopwatch.wrap(saved[name]))
    for name in SCHEDULER_VIEWS:
        setattr(Scheduler, name, property(stopwatch.wrap(saved[name].fget)))
    try:
        yield
    finally:
        for name, attribute in saved.items():
            setattr(Scheduler, name, attribute)


def scaled(base: Config, cells: int) -> Config:
    """``base`` cut into ``cells`` cells of the same cluster (see the module docstring)."""
    c, s = base.cells, base.sim
    scale = PAPER_CELLS / cells
    data = base.model_dump()
    data["cells"].update(count=cells, capacity=max(1, round(c.capacity * scale)))
    data["sim"]["train_tokens_per_cell_s"] = s.train_tokens_per_cell_s * scale
    split = base.scheduler.async_training_cells * cells // PAPER_CELLS
    data["scheduler"]["async_training_cells"] = max(1, split)
    return Config.model_validate(data)


def timed_run(config: Config, workload: Workload) -> tuple[SimResult, float, float]:
    """Simulate; answer the result, its CPU seconds and its wall seconds."""
    cpu, wall = time.process_time(), time.perf_counter()
    result = simulate(config, workload)
    return result, time.process_time() - cpu, time.perf_counter() - wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--target-staleness", type=float, default=1.5)
    parser.add_argument("--cells", type=int, nargs="+", default=[8, 80])
    args = parse(parser, steps=3, cells=[8])
    base = load_config(preset_path("paper-122b"), [f"sim.steps={args.steps}"])

    def fresh_workload() -> Workload:
        return workload_from_name(base.sim.workload, base.seed)

    print(
        f"{'K':>3} {'policy':9} {'executions':>10} {'exec/s':>8} {'CPU µs/exec':>11}"
        f" {'x real time':>11} {'scheduler':>9} {'simulator':>9} {'draws':>6}"
    )
    total = 0.0
    for cells in args.cells:
        for policy in POLICIES:
            config = retarget(scaled(base, cells), args.target_staleness, policy)
            result, cpu, wall = timed_run(config, fresh_workload())
            in_scheduler, in_workload = Stopwatch(), Stopwatch()
            with scheduler_timed(in_scheduler):
                *_, instrumented = timed_run(config, TimedWorkload(fresh_workload(), in_workload))
            total += wall + instrumented
            scheduler = in_scheduler.seconds / instrumented
            draws = in_workload.seconds / instrumented
            print(
                f"{cells:3d} {policy:9} {result.launched:10d} {result.launched / wall:8.0f}"
                f" {cpu / result.launched * 1e6:11.1f} {result.end_to_end_s / wall:11.0f}"
                f" {scheduler:9.0%} {1 - scheduler - draws:9.0%} {draws:6.0%}"
            )
    print(f"all runs: {total:.1f} s wall")


if __name__ == "__main__":
    main()
