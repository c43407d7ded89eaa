r"""The execution-level adapted GSPO objective (docs/design.md §2).

Notation, for a batch of ``N`` executions (``N = advantages.numel()``), execution
``i`` with target tokens ``t in i`` (``n_i`` of them), current log-prob ``l_t``,
behaviour log-prob ``b_t`` (recorded by the engine) and group-relative advantage
``A_i``::

    w_t   = min(exp(sg(l_t) - b_t), cap)                 # token weight, detached, truncated
    s_i   = exp( mean_{t in i} (sg(l_t) - b_t) )          # execution ratio (no gradient)
    c_i   = (A_i > 0 and s_i > clip_high) or (A_i < 0 and s_i < clip_low)   # clipped
    J_i   = A_i * mean_{t in i} (w_t * l_t)               # surrogate
    loss  = -(1 / N) * sum_{i : not c_i} J_i              # "default"

A clipped execution contributes no gradient (its surrogate is dropped, PPO-style
against the sign of ``A_i``). Every execution weighs the same whatever its number of
admitted trajectories and token count: ``dloss/dl_t = -A_i * w_t / (n_i * N)``, so
``sum_{t in i} (dloss/dl_t) / w_t = -A_i / N`` for an unclipped execution and ``0``
for a clipped one ("gradient mass"). Repeating an execution's tokens with identical
values leaves its contribution unchanged.

A token shared by several admitted trajectories (a common prefix of the trajectory
tree) is a target once: trajectory selection emits it once, so it appears once in
the flat inputs and counts once in ``n_i``. The caller must not duplicate it.

Variants (``variant=``), not the default:

- ``"token_sum"``: ``loss = -(1 / sum_i n_i) * sum_{i : not c_i} A_i * sum_{t in i}
  w_t * l_t`` -- token-sum normalisation over the batch (longer executions weigh more).
- ``"per_trajectory_clip"``: ``trajectory_index`` gives each target token's
  trajectory (the one that selected it). Ratios ``s_j`` and clipping ``c_j`` are per
  trajectory (against its execution's ``A_i``); a clipped trajectory's tokens are
  dropped from the numerator, while normalisation stays per execution:
  ``loss = -(1/N) sum_i A_i * (1/n_i) sum_{t in i, not c_{j(t)}} w_t l_t``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qwengyre.config import Variant

__all__ = ["ObjectiveOutput", "execution_gspo_loss"]


@dataclass(frozen=True)
class ObjectiveOutput:
    """The loss (differentiable) and detached diagnostics.

    ``clipped_fraction``: clipped executions (trajectories for
    ``per_trajectory_clip``) over those with at least one target token;
    ``mean_ratio``: mean of ``s`` over the same units; ``token_weight_mean``: mean
    of ``w_t`` over target tokens; ``kl_sum``: the sum over target tokens of
    ``r - 1 - log r``, ``r = exp(l_t - b_t)`` (the "k3" estimate of
    KL(behaviour || current), non-negative, zero exactly when the policies agree).
    """

    loss: Tensor
    clipped_fraction: Tensor
    mean_ratio: Tensor
    token_weight_mean: Tensor
    kl_sum: Tensor


def _segment_sum(values: Tensor, index: Tensor, size: int) -> Tensor:
    return torch.zeros(size, dtype=values.dtype, device=values.device).index_add(0, index, values)


def _clipped(ratio: Tensor, advantage: Tensor, clip_low: float, clip_high: float) -> Tensor:
    return ((advantage > 0) & (ratio > clip_high)) | ((advantage < 0) & (ratio < clip_low))


def execution_gspo_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    execution_index: Tensor,
    advantages: Tensor,
    *,
    token_weight_cap: float = 5.0,
    clip_low: float = 0.995,
    clip_high: float = 1.005,
    variant: Variant = "default",
    trajectory_index: Tensor | None = None,
    normaliser: float | None = None,
) -> ObjectiveOutput:
    """The adapted GSPO loss over flat target tokens; see the module docstring.

    ``logprobs``, ``behaviour_logprobs``, ``execution_index`` (int, in
    ``[0, N)``) and, for ``per_trajectory_clip``, ``trajectory_index`` (int, any
    non-negative ids; each trajectory in one execution) are [T]; ``advantages`` is
    [N]. Executions without target tokens count in ``N`` and contribute zero.

    ``normaliser`` replaces the divisor (``N``, or ``sum_i n_i`` for ``token_sum``):
    a micro-step holding part of a batch passes ``1.0`` so that its loss is a plain
    sum, and the trainer divides the batch's summed gradient by the batch's ``N``
    (or target-token count) once every micro-step is in.
    """
    if logprobs.shape != behaviour_logprobs.shape or logprobs.shape != execution_index.shape:
        raise ValueError("logprobs, behaviour_logprobs and execution_index must be [T]")
    if logprobs.dim() != 1 or advantages.dim() != 1:
        raise ValueError("expected flat [T] token tensors and [N] advantages")
    n_exec = advantages.numel()
    if n_exec == 0:
        raise ValueError("need at least one execution")
    cur = logprobs.float()
    b = behaviour_logprobs.float().to(cur.device)
    adv = advantages.float().to(cur.device)
    ex = execution_index.long().to(cur.device)
    delta = cur.detach() - b
    weight = torch.exp(delta).clamp(max=token_weight_cap)
    ones = torch.ones_like(cur)
    tokens_per_exec = _segment_sum(ones, ex, n_exec)
    token_adv = adv[ex]

    if variant == "per_trajectory_clip":
        if trajectory_index is None or trajectory_index.shape != logprobs.shape:
            raise ValueError("per_trajectory_clip needs trajectory_index [T]")
        traj_ids, traj = torch.unique(trajectory_index.long().to(cur.device), return_inverse=True)
        n_traj = traj_ids.numel()
        tokens_per_traj = _segment_sum(ones, traj, n_traj)
        ratio = torch.exp(_segment_sum(delta, traj, n_traj) / tokens_per_traj)
        traj_adv = _segment_sum(token_adv, traj, n_traj) / tokens_per_traj
        clipped = _clipped(ratio, traj_adv, clip_low, clip_high)
        keep = (~clipped[traj]).float()
        per_exec = _segment_sum(keep * weight * cur, ex, n_exec) / tokens_per_exec.clamp(min=1)
        loss = -(adv * per_exec).sum() / (normaliser or n_exec)
        units = torch.ones(n_traj, dtype=torch.bool, device=cur.device)
    elif variant in ("default", "token_sum"):
        counts = tokens_per_exec.clamp(min=1)
        ratio = torch.exp(_segment_sum(delta, ex, n_exec) / counts)
        clipped = _clipped(ratio, adv, clip_low, clip_high)
        keep_exec = (~clipped).float()
        sums = _segment_sum(weight * cur, ex, n_exec)
        if variant == "default":
            loss = -(keep_exec * adv * sums / counts).sum() / (normaliser or n_exec)
        else:
            loss = -(keep_exec * adv * sums).sum() / (normaliser or max(cur.numel(), 1))
        units = tokens_per_exec > 0
    else:
        raise ValueError(f"unknown variant {variant!r}")

    n_units = units.sum().clamp(min=1)
    zero = torch.zeros((), device=cur.device)
    return ObjectiveOutput(
        loss=loss,
        clipped_fraction=((clipped & units).sum() / n_units).float().detach(),
        mean_ratio=(torch.where(units, ratio, zero).sum() / n_units).detach(),
        token_weight_mean=weight.mean() if weight.numel() else zero,
        kl_sum=(torch.expm1(delta) - delta).sum(),
    )
