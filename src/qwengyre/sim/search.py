"""The settings a policy may take at a target staleness, and the fastest of them.

A *shape* is what the scheduler decides with beyond the workload: the policy, its burst
length mu and extra dispatch phi (Eq 2 ties them to the target: phi = E[d] - (mu - 1) / 2),
Async's training split, and how many of the K cells serve as a standalone rollout pool
instead of switching. :func:`shapes` lists every shape a policy may take;
:func:`fastest` simulates them on one workload. ``simulate --compare`` and
``qwengyre plan`` both search through here.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from qwengyre.config import Config, Policy
from qwengyre.sim.simulator import SimResult, simulate
from qwengyre.sim.workload import Workload


@dataclass(kw_only=True, frozen=True)
class Shape:
    """One setting of the scheduler for a fixed pool of cells.

    ``standalone_cells`` of the config's K cells become standalone capacity (each adds
    ``cells.capacity``); ``training_cells`` is Async's split (ignored by the others).
    """

    policy: Policy
    mu: int
    phi: float
    training_cells: int = 1
    standalone_cells: int = 0

    def apply(self, config: Config) -> Config:
        """``config`` with this shape (a new, validated :class:`Config`)."""
        data = config.model_dump()
        data["scheduler"].update(
            policy=self.policy,
            target_staleness=None,
            mu=self.mu,
            phi=self.phi,
            async_training_cells=self.training_cells,
        )
        cells = data["cells"]
        cells["standalone_capacity"] += self.standalone_cells * cells["capacity"]
        cells["count"] -= self.standalone_cells
        return Config.model_validate(data)

    def describe(self) -> str:
        parts = [f"mu {self.mu}", f"phi {self.phi:g}"]
        if self.policy == "async":
            parts.insert(0, _cells(self.training_cells, "training"))
        if self.standalone_cells:
            parts.append(_cells(self.standalone_cells, "standalone"))
        return ", ".join(parts)


def _cells(n: int, kind: str) -> str:
    return f"{n} {kind} cell{'' if n == 1 else 's'}"


def bursts(target: float) -> list[tuple[int, float]]:
    """Every (mu, phi) with phi >= 0 at E[d] = ``target`` (Eq 2)."""
    if target < 0:
        raise ValueError(f"target staleness must be >= 0, got {target}")
    return [(mu, target - (mu - 1) / 2) for mu in range(1, math.floor(2 * target + 1e-9) + 2)]


def shapes(config: Config, target: float, policy: Policy) -> list[Shape]:
    """Every shape of ``policy`` at E[d] = ``target`` on the config's K cells.

    - ``async``: each training split 1..K-1 with each burst;
    - ``colocate``: each number of standalone cells 0..K-1 with each burst, extra
      dispatch (phi > 0) only where a standalone pool runs the extra groups (the
      paper's C1-C3; the scheduler refuses it otherwise);
    - ``elastic``: each burst, with 0 or 1 standalone cells.

    Shapes whose (phi + mu) B is not a whole number of groups are left out.
    """
    k, standing = config.cells.count, config.cells.standalone_capacity
    found = []
    for mu, phi in bursts(target):
        depth = (phi + mu) * config.groups.batch
        if not math.isclose(depth, round(depth), abs_tol=1e-9):
            continue
        if policy == "async":
            found += [Shape(policy="async", mu=mu, phi=phi, training_cells=t) for t in range(1, k)]
        elif policy == "colocate":
            for s in range(k):
                if phi == 0 or s or standing:
                    found.append(Shape(policy="colocate", mu=mu, phi=phi, standalone_cells=s))
        else:
            found += [
                Shape(policy="elastic", mu=mu, phi=phi, standalone_cells=s)
                for s in range(min(2, k))
            ]
    return found


def simulate_each(
    config: Config, workload: Workload, candidates: Sequence[Shape]
) -> Iterator[tuple[SimResult, Shape]]:
    """Each candidate simulated on ``workload`` (the same executions for all), in order,
    one at a time: a result (megabytes on a paper preset) is freed once the caller lets
    it go, so a search of many shapes holds one or two."""
    for shape in candidates:
        yield simulate(shape.apply(config), workload), shape


def fastest(
    config: Config, workload: Workload, candidates: Sequence[Shape]
) -> tuple[SimResult, Shape]:
    """The candidate with the shortest end-to-end time on ``workload``; the first of
    equals. ValueError when there is no candidate."""
    if not candidates:
        raise ValueError("no candidate shape to simulate")
    return min(simulate_each(config, workload, candidates), key=lambda p: p[0].end_to_end_s)
