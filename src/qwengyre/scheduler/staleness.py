"""Scheduling staleness under boundary dispatch (Eq 2) and the (mu, phi) choice per policy."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class BurstShape:
    """Steps per burst ``mu`` and extra dispatch ``phi`` (in units of B groups)."""

    mu: int
    phi: float


def predicted_staleness(mu: int, phi: float) -> float:
    """Eq 2: steady-state mean scheduling staleness ``E[d] = phi + (mu - 1) / 2``."""
    return phi + (mu - 1) / 2


ELASTIC_MAX_MU = 3
"""Elastic takes the longest burst up to 3 steps that the target allows (the paper's
E[d]=1.5 setting, mu=3 phi=0.5): longer bursts amortise publication, the rest of the
staleness budget goes to extra dispatch that keeps rollout busy."""


def burst_for_staleness(policy: str, target: float) -> BurstShape:
    """Pick (mu, phi) for a target E[d] as the paper does (Eq 2).

    - ``async``: one step per burst, all staleness as extra dispatch (mu=1, phi=E[d]).
    - ``colocate``: no extra dispatch (phi=0), so mu = 2 E[d] + 1 must be a whole number.
    - ``elastic``: mu = min(3, floor(2 E[d]) + 1), phi = E[d] - (mu - 1) / 2.

    At E[d]=1.5 this gives async (1, 1.5), colocate (4, 0), elastic (3, 0.5).
    Raises ValueError for a negative target, an unknown policy, or a colocate target
    that is not a multiple of 0.5.
    """
    if target < 0:
        raise ValueError(f"target staleness must be >= 0, got {target}")
    if policy == "async":
        return BurstShape(mu=1, phi=target)
    if policy == "colocate":
        mu = 2 * target + 1
        if not math.isclose(mu, round(mu)):
            raise ValueError(
                f"colocate has phi=0, so target staleness {target} must be a multiple of 0.5"
            )
        return BurstShape(mu=round(mu), phi=0.0)
    if policy == "elastic":
        mu = min(ELASTIC_MAX_MU, math.floor(2 * target + 1e-9) + 1)
        return BurstShape(mu=mu, phi=target - (mu - 1) / 2)
    raise ValueError(f"unknown policy {policy!r}; allowed: elastic, async, colocate")
