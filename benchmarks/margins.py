"""Elastic's margins over its strongest baselines, as the README reports them.

Usage::

    python benchmarks/margins.py [--seeds 5] [--steps 48] [--supply in_hand|ready]
                                 [--tuned-elastic]

For each workload preset (paper-122b, paper-2p4t) and target staleness (1.0, 1.5) it
runs ``simulate --compare`` on seeds 0..N-1 and prints, per baseline row, the mean
(min-max) of the baseline's time over Elastic's (> 1: Elastic is faster), plus
Elastic's mean T/bound and hours. Every number comes from runs in this invocation;
``--supply ready`` runs the paper's supply check instead of the default.
``--tuned-elastic`` gives Elastic the tuning the baselines get (the fastest of its
shapes on each seed's executions) instead of its default shape: best against best.
"""

from __future__ import annotations

import argparse
import statistics

from _smoke import parse
from qwengyre.config import load_config
from qwengyre.presets import preset_path
from qwengyre.sim.compare import compare_policies
from qwengyre.sim.search import fastest, shapes
from qwengyre.sim.workload import workload_from_name

CASES = [(p, t) for p in ("paper-122b", "paper-2p4t") for t in (1.0, 1.5)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--supply", choices=["in_hand", "ready"], default="in_hand")
    parser.add_argument("--tuned-elastic", action="store_true", help="Elastic's best shape")
    args = parse(parser, seeds=1, steps=3)
    rows = None
    which = "its best shape" if args.tuned_elastic else "its default shape"
    print(f"{args.seeds} seeds, {args.steps} steps; baseline time / elastic time ({which})")
    for preset, target in CASES:
        speedups: dict[str, list[float]] = {}
        over_bound, hours = [], []
        for seed in range(args.seeds):
            overrides = [
                f"seed={seed}",
                f"sim.steps={args.steps}",
                f"scheduler.supply={args.supply}",
            ]
            config = load_config(preset_path(preset), overrides)
            workload = workload_from_name(config.sim.workload, seed)
            comparison = compare_policies(config, workload, target)
            elastic = comparison.results["elastic"]
            if args.tuned_elastic:
                elastic, _ = fastest(config, workload, shapes(config, target, "elastic"))
            over_bound.append(elastic.end_to_end_s / elastic.bound.seconds)
            hours.append(elastic.end_to_end_s / 3600)
            for name, result in comparison.results.items():
                if name != "elastic":
                    speedups.setdefault(name, []).append(result.end_to_end_s / elastic.end_to_end_s)
        if rows is None:
            rows = list(speedups)
            print("| preset, E[d] | " + " | ".join(rows) + " | elastic T/bound | elastic h |")
            print("|---" * (len(rows) + 3) + "|")
        cells = [
            f"{statistics.mean(v):.2f}x ({min(v):.2f}-{max(v):.2f})"
            for v in (speedups[name] for name in rows)
        ]
        bound = f"{statistics.mean(over_bound):.3f} | {statistics.mean(hours):.2f}"
        print(f"| {preset}, {target} | " + " | ".join(cells) + f" | {bound} |", flush=True)


if __name__ == "__main__":
    main()
