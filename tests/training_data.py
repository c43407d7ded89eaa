"""Synthetic rollout groups for trainer tests: random agent-like rows with behaviour
log-probs taken from a real model (slightly perturbed, so that ratios are near 1 and
some executions clip)."""

from __future__ import annotations

import random

import torch
from transformers import PreTrainedModel

from qwengyre.engines.embedded import behaviour_logprobs
from qwengyre.training.buffers import ExecutionSample, GroupSample
from qwengyre.trajectories.selection import AdmittedTrajectory


def trajectory(
    model: PreTrainedModel, rng: random.Random, execution_id: str, noise: float
) -> AdmittedTrajectory:
    """Two model calls: prompt, sampled reply, tool result, sampled reply."""
    vocab = model.config.vocab_size
    lengths = [rng.randint(8, 40), rng.randint(4, 24), rng.randint(4, 16), rng.randint(4, 24)]
    ids: list[int] = []
    mask: list[bool] = []
    for i, n in enumerate(lengths):
        ids += [rng.randrange(vocab) for _ in range(n)]
        mask += [i % 2 == 1] * n
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
        exact = behaviour_logprobs(logits, torch.tensor(ids[1:]), 1.0).tolist()
    behaviour = [0.0] + [lp + rng.gauss(0.0, noise) for lp in exact]
    return AdmittedTrajectory(
        leaf=0,
        request_class="main.task",
        nodes=(0,),
        input_ids=tuple(ids),
        target_mask=tuple(mask),
        behaviour_logprobs=tuple(b if m else 0.0 for b, m in zip(behaviour, mask, strict=True)),
        versions=tuple(0 if m else -1 for m in mask),
        execution_id=execution_id,
    )


def groups(
    model: PreTrainedModel,
    *,
    count: int,
    size: int,
    seed: int,
    first_id: int = 0,
    noise: float = 0.004,
) -> list[GroupSample]:
    """``count`` groups of ``size`` executions with 1-3 trajectories each."""
    rng = random.Random(seed)
    out = []
    for g in range(first_id, first_id + count):
        rewards = [float(rng.random() < 0.5) for _ in range(size)]
        mean = sum(rewards) / size
        executions = []
        for i, reward in enumerate(rewards):
            eid = f"g{g}-e{i}"
            trajectories = tuple(
                trajectory(model, rng, eid, noise) for _ in range(rng.randint(1, 3))
            )
            executions.append(ExecutionSample(eid, reward - mean, trajectories))
        out.append(GroupSample(g, 0, tuple(executions)))
    return out
