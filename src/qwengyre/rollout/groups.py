"""Group-relative advantages (docs/design.md §2): computed from a group's *valid* rewards only.

A group's rewards map execution ids to real scores; executions without a valid
assessment are simply absent (never a zero). Every execution of the group inherits
its advantage for all its admitted trajectories.
"""

from __future__ import annotations

import math
from collections.abc import Mapping


def group_advantages(
    rewards: Mapping[int, float], *, scale_by_std: bool = False, eps: float = 1e-6
) -> dict[int, float]:
    """``A_i = r_i - mean(r)`` (GRPO-style), optionally divided by ``std(r) + eps``.

    ``rewards`` holds only valid rewards (execution id -> score); a single one gets
    advantage 0 (no group-relative signal). Raises ValueError for no rewards or
    non-finite scores.
    """
    if not rewards:
        raise ValueError("a group-relative advantage needs at least one valid reward")
    bad = {k: v for k, v in rewards.items() if not math.isfinite(v)}
    if bad:
        raise ValueError(f"rewards must be finite numbers, got {bad}")
    mean = sum(rewards.values()) / len(rewards)
    centred = {k: v - mean for k, v in rewards.items()}
    if not scale_by_std:
        return centred
    std = math.sqrt(sum(c * c for c in centred.values()) / len(centred))
    return {k: c / (std + eps) for k, c in centred.items()}
