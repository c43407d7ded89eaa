"""``qwengyre plan``: the simulator as a capacity planner.

Given a config (its cells, groups and costs) and a workload, every shape each policy
may take at a target staleness (:func:`qwengyre.sim.search.shapes`: policy, mu and phi
per Eq 2, Async's training split, standalone cells) is simulated on the same
executions, and the shapes are ranked by end-to-end time. A parametric workload is
planned on several seeds (ranked by the mean over them); a trace replays the same
executions every time, so it is one workload. The fastest shape is the recommendation:
:meth:`Plan.recommended_yaml` is a config ``qwengyre train`` accepts. :func:`sweep`
plans several targets, for a plot of the best time per policy against staleness.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from qwengyre.config import Config, Policy, config_to_yaml
from qwengyre.sim.plots import time_unit
from qwengyre.sim.report import table_console
from qwengyre.sim.search import Shape, shapes, simulate_each
from qwengyre.sim.simulator import SimResult
from qwengyre.sim.workload import Workload, workload_from_name

POLICIES: tuple[Policy, ...] = get_args(Policy)
SWEEP_TARGETS: tuple[float, ...] = (0.5, 1.0, 1.5, 2.0)
"""The targets ``qwengyre plan --plot`` sweeps (with the planned one)."""
RUN_CONFIG_FILE = "config.yaml"
RUN_TRACE_FILE = "traces.jsonl"
"""What ``qwengyre train`` writes in its run directory (:mod:`qwengyre.apps.train`)."""


@dataclass(kw_only=True, frozen=True)
class Candidate:
    """One shape and what it measured on each of the plan's workloads, in their order:
    end-to-end time, time over the run's lower bound, rollout utilisation, and the
    measured steady-state E[d] (NaN where the run did not reach its steady state).
    The properties are means over the workloads."""

    shape: Shape
    steps: int
    times_s: tuple[float, ...]
    over_bounds: tuple[float, ...]
    utilisations: tuple[float, ...]
    stalenesses: tuple[float, ...]

    @classmethod
    def of(cls, shape: Shape, result: SimResult) -> Candidate:
        """``shape`` measured on one workload."""
        return cls(
            shape=shape,
            steps=result.steps,
            times_s=(result.end_to_end_s,),
            over_bounds=(result.end_to_end_s / result.bound.seconds,),
            utilisations=(result.rollout_utilisation,),
            stalenesses=(result.mean_staleness,),
        )

    def join(self, other: Candidate) -> Candidate:
        """This shape measured on this candidate's workloads, then on ``other``'s."""
        return Candidate(
            shape=self.shape,
            steps=self.steps,
            times_s=self.times_s + other.times_s,
            over_bounds=self.over_bounds + other.over_bounds,
            utilisations=self.utilisations + other.utilisations,
            stalenesses=self.stalenesses + other.stalenesses,
        )

    @property
    def mean_s(self) -> float:
        """End-to-end time, the mean over the workloads: what candidates are ranked by."""
        return _mean(self.times_s)

    @property
    def step_s(self) -> float:
        """Mean time per training step."""
        return self.mean_s / self.steps

    @property
    def over_bound(self) -> float:
        return _mean(self.over_bounds)

    @property
    def utilisation(self) -> float:
        return _mean(self.utilisations)

    @property
    def staleness(self) -> float:
        """Mean of the measured E[d] over the workloads that reached a steady state."""
        reached = [d for d in self.stalenesses if not math.isnan(d)]
        return _mean(reached) if reached else math.nan

    def summary(self) -> dict[str, object]:
        shape = self.shape
        return {
            "policy": shape.policy,
            "shape": shape.describe(),
            "mu": shape.mu,
            "phi": shape.phi,
            "training_cells": shape.training_cells if shape.policy == "async" else None,
            "standalone_cells": shape.standalone_cells,
            "end_to_end_s": self.mean_s,
            "end_to_end_s_per_workload": list(self.times_s),
            "step_s": self.step_s,
            "time_over_bound": self.over_bound,
            "rollout_utilisation": self.utilisation,
            "mean_staleness": None if math.isnan(self.staleness) else self.staleness,
        }


@dataclass(kw_only=True, frozen=True)
class Plan:
    """Every candidate shape at ``target`` on ``config``'s cells, fastest first."""

    config: Config
    target: float
    workload: str
    seeds: int
    candidates: tuple[Candidate, ...]

    @property
    def best(self) -> Candidate:
        """The recommended candidate."""
        return self.candidates[0]

    def recommended_config(self) -> Config:
        return self.best.shape.apply(self.config)

    def recommended_yaml(self) -> str:
        """The recommended configuration as YAML that ``qwengyre train`` (and
        ``qwengyre simulate``, which reproduces the first workload's time) loads."""
        return config_to_yaml(self.recommended_config())

    def best_by_policy(self) -> dict[Policy, Candidate]:
        """The fastest candidate of each policy that has one."""
        found: dict[Policy, Candidate] = {}
        for candidate in self.candidates:
            found.setdefault(candidate.shape.policy, candidate)
        return found

    def summary(self) -> dict[str, object]:
        """The JSON-ready plan of ``qwengyre plan --json``."""
        return {
            "target_staleness": self.target,
            "workload": self.workload,
            "seeds": self.seeds,
            "steps": self.best.steps,
            "recommended": self.best.summary(),
            "candidates": [c.summary() for c in self.candidates],
        }


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def check_policies(policies: Sequence[str]) -> tuple[Policy, ...]:
    """The policies named in ``policies``, once each, in :data:`POLICIES`' order;
    ValueError naming an unknown one and the allowed."""
    if not policies:
        raise ValueError(f"no policy to plan: give one or more of {', '.join(POLICIES)}")
    for policy in policies:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; allowed: {', '.join(POLICIES)}")
    return tuple(p for p in POLICIES if p in policies)


def plan_workloads(config: Config, seeds: int) -> list[Workload]:
    """``config.sim.workload`` at ``seeds`` seeds from ``config.seed`` on; a trace, which
    replays the same executions whatever the seed, only at one."""
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    name = config.sim.workload
    if name == "trace" and seeds > 1:
        raise ValueError("a trace replays the same executions at every seed: plan it with 1 seed")
    return [workload_from_name(name, config.seed + i, config.sim.trace) for i in range(seeds)]


def plan_run(
    config: Config,
    workloads: Sequence[Workload],
    target: float,
    policies: Sequence[str] = POLICIES,
) -> Plan:
    """Simulate every shape of ``policies`` at E[d] = ``target`` on each workload (all
    shapes on the same executions) and rank them by mean end-to-end time.

    ValueError for an unknown policy, a negative or non-finite target, no workload, or
    no shape at all (e.g. no (phi + mu) B that is a whole number of groups).
    """
    chosen = check_policies(policies)
    if not (math.isfinite(target) and target >= 0):
        raise ValueError(f"target staleness must be a number >= 0, got {target}")
    if not workloads:
        raise ValueError("no workload to plan on: give at least one")
    candidates = [shape for policy in chosen for shape in shapes(config, target, policy)]
    if not candidates:
        raise ValueError(
            f"no shape of {', '.join(chosen)} reaches E[d] = {target:g} with B = "
            f"{config.groups.batch} groups on K = {config.cells.count} cells"
        )
    measured: dict[Shape, Candidate] = {}
    for workload in workloads:
        for result, shape in simulate_each(config, workload, candidates):
            one = Candidate.of(shape, result)
            measured[shape] = measured[shape].join(one) if shape in measured else one
    ranked = sorted(measured.values(), key=lambda c: c.mean_s)
    return Plan(
        config=config,
        target=target,
        workload=workloads[0].name,
        seeds=len(workloads),
        candidates=tuple(ranked),
    )


def sweep(
    config: Config,
    workloads: Sequence[Workload],
    targets: Sequence[float],
    policies: Sequence[str] = POLICIES,
    plans: Sequence[Plan] = (),
) -> list[Plan]:
    """One plan per target, in order of target; one of ``plans`` (made on the same
    config and workloads) is reused at its own target."""
    known = {plan.target: plan for plan in plans}
    return [known.get(t) or plan_run(config, workloads, t, policies) for t in sorted(set(targets))]


def best_times(plans: Sequence[Plan]) -> dict[str, list[tuple[float, float, str]]]:
    """Per policy, ``(target, best mean time in s, its shape)`` at each plan's target:
    the points of :func:`qwengyre.sim.plots.plot_staleness_sweep`."""
    times: dict[str, list[tuple[float, float, str]]] = {}
    for plan in sorted(plans, key=lambda p: p.target):
        for policy, best in plan.best_by_policy().items():
            times.setdefault(policy, []).append((plan.target, best.mean_s, best.shape.describe()))
    return times


def run_inputs(path: Path) -> tuple[Path, Path | None]:
    """The trace at ``path`` (a trace file, or a ``qwengyre train`` run directory: its
    trace), and the config of the run that recorded it (the run directory's resolved
    config beside its trace, whose group size and batch are the trace's), or None."""
    trace = path / RUN_TRACE_FILE if path.is_dir() else path
    if not trace.is_file():
        raise ValueError(f"no trace at {trace} (give a {RUN_TRACE_FILE} or a run directory)")
    config = trace.parent / RUN_CONFIG_FILE
    recorded = trace.name == RUN_TRACE_FILE and config.is_file()
    return trace, config if recorded else None


def print_plan(plan: Plan, top: int, console: Console | None = None) -> None:
    """The ``top`` fastest candidates, one row each, the recommended one first, and
    below them the fastest of each policy not among them (with its rank)."""
    best = plan.best
    unit = time_unit(best.mean_s)
    seeds = f", mean of {plan.seeds} seeds" if plan.seeds > 1 else ""
    table = Table(
        title=escape(
            f"{plan.workload}: {best.steps} steps at E[d] = {plan.target:g}{seeds}; "
            f"{len(plan.candidates)} shapes"
        )
    )
    columns = ["#", "policy", "shape", unit.name, "per step", "/bound"]
    columns += ["rollout use", "E[d]", "vs best"]
    for column in columns:
        left = column in ("policy", "shape")
        table.add_column(escape(column), justify="left" if left else "right")
    bests = list(plan.best_by_policy().values())
    for rank, c in enumerate(plan.candidates, start=1):
        if rank > top and c not in bests:
            continue
        table.add_row(
            str(rank),
            c.shape.policy,
            c.shape.describe(),
            f"{unit.of(c.mean_s):.2f}",
            f"{unit.of(c.step_s):.3f}",
            f"{c.over_bound:.2f}",
            f"{c.utilisation:.0%}",
            "—" if math.isnan(c.staleness) else f"{c.staleness:.2f}",
            f"{c.mean_s / best.mean_s:.3f}x",
        )
    (console or table_console(width=120)).print(table)


def print_sweep(plans: Sequence[Plan], console: Console | None = None) -> None:
    """The best time of each policy (rows) at each plan's target (columns)."""
    ordered = sorted(plans, key=lambda p: p.target)
    unit = time_unit(min(plan.best.mean_s for plan in ordered))
    table = Table(title=f"best {unit.name} per policy")
    table.add_column("policy")
    for plan in ordered:
        table.add_column(escape(f"E[d] {plan.target:g}"), justify="right")
    for policy, points in best_times(ordered).items():
        times = {target: f"{unit.of(seconds):.2f}" for target, seconds, _ in points}
        table.add_row(policy, *(times.get(plan.target, "—") for plan in ordered))
    (console or table_console(width=120)).print(table)
