"""Async's best fixed split: end-to-end time for every training/rollout split of K cells.

The comparison (``qwengyre simulate --compare``) uses ``scheduler.async_training_cells``;
this sweep shows which split is Async's best on a preset, so the baseline is not a
straw man. Ratios are to the best split, measured in this run.

    python benchmarks/sweep_async_split.py [--preset paper-122b] [--target-staleness 1.5]
    python benchmarks/sweep_async_split.py --smoke    # 3 simulated steps per split
"""

from __future__ import annotations

import argparse
from concurrent.futures import ProcessPoolExecutor

from _smoke import parse
from qwengyre.config import load_config, retarget
from qwengyre.presets import preset_path
from qwengyre.sim.simulator import simulate
from qwengyre.sim.workload import workload_from_name


def run(job: tuple[str, float, list[str], int]) -> tuple[int, float]:
    preset, target, overrides, split = job
    config = load_config(
        preset_path(preset), [*overrides, f"scheduler.async_training_cells={split}"]
    )
    config = retarget(config, target, "async")
    result = simulate(config, workload_from_name(config.sim.workload, config.seed))
    return split, result.end_to_end_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="paper-122b")
    parser.add_argument("--target-staleness", type=float, default=1.5)
    parser.add_argument("--steps", type=int, help="sim.steps (default: the preset's)")
    args = parse(parser, steps=3)
    overrides = [] if args.steps is None else [f"sim.steps={args.steps}"]
    cells = load_config(preset_path(args.preset)).cells.count
    jobs = [(args.preset, args.target_staleness, overrides, s) for s in range(1, cells)]
    with ProcessPoolExecutor(2) as pool:
        times = dict(pool.map(run, jobs))
    best = min(times.values())
    print(f"async on {args.preset} at E[d]={args.target_staleness}: training cells of {cells}")
    for split, seconds in times.items():
        print(
            f"  {split} training / {cells - split} rollout: {seconds / 3600:7.1f} h"
            f"  ({seconds / best:.2f}x the best)"
        )


if __name__ == "__main__":
    main()
