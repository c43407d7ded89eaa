"""The trainer on one cell: packed rows reproduce the engine's log-probs, and a run
resumed from a checkpoint continues exactly."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import get_args

import pytest
import torch
from tests.training_data import groups
from transformers import AutoModelForCausalLM

from qwengyre.config import TrainerBackendName, TrainerConfig
from qwengyre.engines.base import GenerateRequest
from qwengyre.engines.embedded import EmbeddedEngine
from qwengyre.training.backend import TRAINER_BACKENDS, trainer_backend
from qwengyre.training.buffers import (
    ExecutionSample,
    GroupSample,
    PackingBuffer,
    TrajectoryBuffer,
)
from qwengyre.training.checkpoint import latest_checkpoint, load_sharded, save_sharded_checkpoint
from qwengyre.training.distributed import CellComm
from qwengyre.training.trainer import Trainer
from qwengyre.trajectories.selection import AdmittedTrajectory
from qwengyre.types import SamplingParams


def single(model_dir: Path, config: TrainerConfig) -> Trainer:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return Trainer(model, config, CellComm(0, 1, ""))


@pytest.mark.parametrize("model", ["tiny_model_dir", "tiny_moe_model_dir"], ids=["dense", "moe"])
def test_packed_rows_reproduce_the_engines_behaviour_logprobs(
    model: str, request: pytest.FixtureRequest
) -> None:
    # Several sampled replies packed into one row: position_ids must keep each
    # trajectory attending to itself only, or l_t != b_t. (The MoE routes each token
    # alone: the padding the packed forward adds changes no real token's experts.)
    tiny_model_dir: Path = request.getfixturevalue(model)
    temperature = 0.7
    engine = EmbeddedEngine(tiny_model_dir, capacity=4, max_context=256)
    prompts = [tuple(range(20 + i, 40 + 7 * i)) for i in range(4)]

    async def sample() -> list:
        return await asyncio.gather(
            *(
                engine.generate(
                    GenerateRequest(
                        f"r{i}", p, SamplingParams(max_tokens=12, temperature=temperature)
                    )
                )
                for i, p in enumerate(prompts)
            )
        )

    try:
        results = asyncio.run(sample())
    finally:
        engine.close()
    executions = []
    for i, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        n_out = len(result.output_ids)
        row = AdmittedTrajectory(
            leaf=0,
            request_class="main.task",
            nodes=(0,),
            input_ids=prompt + result.output_ids,
            target_mask=(False,) * len(prompt) + (True,) * n_out,
            behaviour_logprobs=(0.0,) * len(prompt) + result.logprobs,
            versions=(-1,) * len(prompt) + result.versions,
        )
        executions.append(ExecutionSample(f"e{i}", 1.0 if i % 2 else -1.0, (row,)))
    buffer = TrajectoryBuffer()
    buffer.add(GroupSample(0, 0, tuple(executions)))
    (micro,) = PackingBuffer(buffer, 4096).assign(0, [0], closes_batch=True)
    assert len(micro.execution_ids) == 4
    trainer = single(tiny_model_dir, TrainerConfig(temperature=temperature))
    with torch.no_grad():
        current = trainer.current_logprobs(micro)
    behaviour = micro.behaviour_logprobs[:, 1:][micro.target_mask[:, 1:]]
    assert current.numel() == sum(len(r.output_ids) for r in results)
    torch.testing.assert_close(current, behaviour, rtol=0, atol=1e-4)


def run_steps(
    trainer: Trainer, trajectories: TrajectoryBuffer, packing: PackingBuffer, steps: range
) -> list[int]:
    """Train ``steps``, two ready groups each (oldest first); returns the groups used."""
    used = []
    for step in steps:
        ids = trajectories.ready_ids()[:2]
        micro = packing.assign(step, ids, closes_batch=True)
        for ms in micro:
            trainer.train_micro_step(ms)
        assert trainer.finish_batch(packing.summary(step), 1).version == step + 1
        used += ids
    return used


def test_a_resumed_run_continues_with_the_same_versions_and_no_group_twice(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = TrainerConfig(lr=1e-3, micro_step_tokens=256)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    samples = groups(model, count=8, size=4, seed=3)

    def fresh() -> tuple[Trainer, TrajectoryBuffer, PackingBuffer]:
        trainer = single(tiny_model_dir, config)
        trajectories = TrajectoryBuffer()
        for g in samples:
            trajectories.add(g)
        return trainer, trajectories, PackingBuffer(trajectories, config.micro_step_tokens)

    # Uninterrupted: four steps.
    trainer, trajectories, packing = fresh()
    straight = run_steps(trainer, trajectories, packing, range(4))
    expected = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}

    # Two steps, a checkpoint, a "crash", then resume for the last two.
    trainer, trajectories, packing = fresh()
    first = run_steps(trainer, trajectories, packing, range(2))
    assert trainer.optimizer is not None
    state = {
        "version": trainer.version,
        "trajectories": trajectories.state_dict(),
        "packing": packing.state_dict(),
    }
    save_sharded_checkpoint(
        tmp_path, step=2, trainer=trainer, state=state, keep=2, model_dir=tiny_model_dir
    )
    del trainer, trajectories, packing

    trainer = single(tiny_model_dir, TrainerConfig(lr=1e-3, micro_step_tokens=256))
    path = latest_checkpoint(tmp_path)
    assert path is not None
    restored = load_sharded(path, trainer)
    json.dumps(restored)  # the state is plain JSON
    trajectories = TrajectoryBuffer()
    trajectories.load_state_dict(restored["trajectories"])
    packing = PackingBuffer(trajectories, config.micro_step_tokens)
    packing.load_state_dict(restored["packing"])
    assert trainer.version == 2 and set(first).isdisjoint(trajectories.ready_ids())
    second = run_steps(trainer, trajectories, packing, range(2, 4))

    assert first + second == straight and len(set(straight)) == len(straight)
    for name, value in trainer.model.named_parameters():
        torch.testing.assert_close(
            value.full_tensor(), expected[name].full_tensor(), rtol=0, atol=1e-6
        )


def test_an_update_raises_the_log_probs_of_positive_advantage_executions(
    tiny_model_dir: Path,
) -> None:
    # The sign of the whole path (packing, objective, reduce, optimizer): after one
    # step, a rewarded execution's targets are more likely and a punished one's less.
    trainer = single(tiny_model_dir, TrainerConfig(lr=1e-3, micro_step_tokens=4096))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    good, bad = groups(model, count=1, size=2, seed=5, noise=0.0)[0].executions[:2]
    buffer = TrajectoryBuffer()
    buffer.add(
        GroupSample(
            0,
            0,
            (
                ExecutionSample(good.execution_id, 1.0, good.trajectories),
                ExecutionSample(bad.execution_id, -1.0, bad.trajectories),
            ),
        )
    )
    packing = PackingBuffer(buffer, 4096)
    (micro,) = packing.assign(0, [0], closes_batch=True)
    with torch.no_grad():
        before = trainer.current_logprobs(micro)
    trainer.train_micro_step(micro)
    trainer.finish_batch(packing.summary(0), 1)
    with torch.no_grad():
        after = trainer.current_logprobs(micro)
    index = micro.execution_index[:, 1:][micro.target_mask[:, 1:]]
    change = after - before
    assert change[index == 0].mean() > 0 > change[index == 1].mean()


def test_the_learning_rate_warms_up_linearly_and_a_resumed_trainer_continues_it(
    tiny_model_dir: Path,
) -> None:
    config = TrainerConfig(lr=1e-3, lr_warmup_steps=3, micro_step_tokens=256)
    assert [config.lr_at(u) for u in range(5)] == [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    samples = groups(model, count=2, size=4, seed=3)

    def largest_first_change(trainer: Trainer) -> float:
        # Adam's first update moves a parameter by lr * g / (|g| + eps): by the rate.
        before = [p.detach().clone() for p in trainer.params]
        trajectories = TrajectoryBuffer()
        for g in samples:
            trajectories.add(g)
        run_steps(
            trainer,
            trajectories,
            PackingBuffer(trajectories, 256),
            range(trainer.version, trainer.version + 1),
        )
        after = [p.detach() for p in trainer.params]
        return max(float((a - b).abs().max()) for a, b in zip(after, before, strict=True))

    warming = largest_first_change(single(tiny_model_dir, config))
    constant = largest_first_change(single(tiny_model_dir, TrainerConfig(lr=1e-3)))
    assert abs(warming / constant - 0.25) < 1e-3
    resumed = single(tiny_model_dir, config)
    resumed.version = 2  # as restored from a checkpoint after two updates
    assert abs(largest_first_change(resumed) / constant - 0.75) < 1e-3


def test_every_trainer_backend_the_config_allows_is_registered_and_fsdp2_is_the_trainer() -> None:
    assert set(TRAINER_BACKENDS) == set(get_args(TrainerBackendName))
    assert TrainerConfig().backend == "fsdp2"
    assert trainer_backend("fsdp2") is Trainer


def test_the_moe_routers_auxiliary_loss_is_not_part_of_the_objective(
    tiny_moe_model_dir: Path,
) -> None:
    # The trainer scores with the base model, never the causal LM's loss: a policy asking
    # for its load-balancing loss (output_router_logits, a large coefficient) makes
    # exactly the update of one that does not (docs/design.md §3, MoE).
    config = TrainerConfig(lr=1e-3, micro_step_tokens=512)
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_model_dir, dtype=torch.float32)
    buffer = TrajectoryBuffer()
    for group in groups(model, count=1, size=4, seed=11):
        buffer.add(group)
    packing = PackingBuffer(buffer, config.micro_step_tokens)
    micro = packing.assign(0, [0], closes_batch=True)
    updated = []
    for aux in ({}, {"output_router_logits": True, "router_aux_loss_coef": 10.0}):
        policy = AutoModelForCausalLM.from_pretrained(
            tiny_moe_model_dir, dtype=torch.float32, **aux
        )
        assert policy.config.output_router_logits is bool(aux)
        trainer = Trainer(policy, config, CellComm(0, 1, ""))
        for ms in micro:
            trainer.train_micro_step(ms)
        trainer.finish_batch(packing.summary(0), 1)
        updated.append(trainer.parameters())
    router = "model.layers.0.mlp.gate.weight"
    assert not torch.equal(updated[0][router], model.state_dict()[router])  # trained
    for name, value in updated[0].items():
        torch.testing.assert_close(updated[1][name], value, rtol=0, atol=0)
