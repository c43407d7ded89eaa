"""How fast the simulator runs the paper-122b preset (48 steps, ~25k executions) per policy.

Prints, per policy, the wall time, executions simulated per second, how much faster
than real time the run is, and the share of the time spent inside the scheduler's
``handle`` (the rest is the simulator's own event loop) - ratios measured in this run.

    python benchmarks/bench_simulator.py [--steps 48]
"""

from __future__ import annotations

import argparse
import time

from qwengyre.config import load_config, retarget
from qwengyre.presets import preset_path
from qwengyre.scheduler.core import Scheduler
from qwengyre.sim.compare import POLICIES
from qwengyre.sim.simulator import simulate
from qwengyre.sim.workload import workload_from_name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--target-staleness", type=float, default=1.5)
    args = parser.parse_args()
    base = load_config(preset_path("paper-122b"), [f"sim.steps={args.steps}"])
    workload = workload_from_name(base.sim.workload, base.seed)

    inside = 0.0
    handle = Scheduler.handle

    def timed_handle(self: Scheduler, event):  # type: ignore[no-untyped-def]
        nonlocal inside
        start = time.perf_counter()
        try:
            return handle(self, event)
        finally:
            inside += time.perf_counter() - start

    Scheduler.handle = timed_handle  # type: ignore[method-assign]
    total = 0.0
    print(
        f"{'policy':9} {'wall s':>7} {'executions':>10} {'exec/s':>8} {'x real time':>12}"
        f" {'in scheduler':>12}"
    )
    for policy in POLICIES:
        config = retarget(base, args.target_staleness, policy)
        inside = 0.0
        start = time.perf_counter()
        result = simulate(config, workload)
        wall = time.perf_counter() - start
        total += wall
        print(
            f"{policy:9} {wall:7.2f} {result.launched:10d} {result.launched / wall:8.0f}"
            f" {result.end_to_end_s / wall:12.0f} {inside / wall:12.0%}"
        )
    print(f"all three policies: {total:.1f} s wall ({total / 60:.0%} of a minute)")


if __name__ == "__main__":
    main()
