"""Elastic against its baselines at the same target staleness (the paper's comparison)."""

from __future__ import annotations

from dataclasses import dataclass

from qwengyre.config import Config, Policy, retarget
from qwengyre.sim.simulator import SimResult, simulate
from qwengyre.sim.workload import Workload

POLICIES: tuple[Policy, ...] = ("elastic", "async", "colocate")


@dataclass(frozen=True)
class Comparison:
    """One result per policy, all at ``target_staleness`` (Eq 2 picks each mu, phi)."""

    target_staleness: float
    results: dict[str, SimResult]

    def speedup(self, baseline: str) -> float:
        """End-to-end time of ``baseline`` over elastic's (> 1: elastic is faster)."""
        return self.results[baseline].end_to_end_s / self.results["elastic"].end_to_end_s

    def summary(self) -> dict[str, object]:
        policies: dict[str, dict[str, object]] = {
            name: r.summary() for name, r in self.results.items()
        }
        policies["elastic"]["speedup_vs_async"] = self.speedup("async")
        policies["elastic"]["speedup_vs_colocate"] = self.speedup("colocate")
        return {"target_staleness": self.target_staleness, "policies": policies}


def compare_policies(config: Config, workload: Workload, target_staleness: float) -> Comparison:
    """Simulate elastic, async and colocate on the same workload and cells.

    Each policy gets (mu, phi) from :func:`burst_for_staleness` for the target; every
    other setting (cells, groups, costs, async split, seed) comes from ``config``.
    """
    results: dict[str, SimResult] = {
        policy: simulate(retarget(config, target_staleness, policy), workload)
        for policy in POLICIES
    }
    return Comparison(target_staleness, results)
