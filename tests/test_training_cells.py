"""Cells training one batch together (issue 7): micro-steps claimed by several cell
processes, gradients reduced over the participating prefix, one update on the core,
a satellite joining mid-batch with the core's current weights."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
import torch
from tests.training_data import groups
from transformers import AutoModelForCausalLM

from qwengyre.cluster.cell import Cell, CellSpec
from qwengyre.cluster.local import ActorError, ProcessActor
from qwengyre.config import TrainerConfig
from qwengyre.runtime.train import free_port
from qwengyre.training.buffers import BatchSummary, MicroStep, PackingBuffer, TrajectoryBuffer
from qwengyre.training.distributed import PrefixGroups
from qwengyre.training.trainer import Trainer

CONFIG = TrainerConfig(lr=1e-3, micro_step_tokens=160, grad_clip=1e9)


def batches(model_dir: Path) -> list[tuple[list[MicroStep], BatchSummary]]:
    """Two steps of 2 groups x 4 executions, packed into several micro-steps each."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trajectories = TrajectoryBuffer()
    for group in groups(model, count=4, size=4, seed=1):
        trajectories.add(group)
    packing = PackingBuffer(trajectories, CONFIG.micro_step_tokens)
    out = []
    for step, ids in ((0, (0, 1)), (1, (2, 3))):
        micro = packing.assign(step, ids[:1], closes_batch=False)
        micro += packing.assign(step, ids[1:], closes_batch=True)
        out.append((micro, packing.summary(step)))
    return out


def train_alone(model_dir: Path, data: list[tuple[list[MicroStep], BatchSummary]]) -> dict:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = Trainer(model, CONFIG, PrefixGroups(0, 1, ""))
    for micro_steps, summary in data:
        for ms in micro_steps:
            trainer.train_micro_step(ms)
        assert trainer.finish_batch(summary, 1).version == summary.step + 1
    return {k: v.detach().clone() for k, v in model.named_parameters()}


async def train_in_cells(model_dir: Path, data: list[tuple[list[MicroStep], BatchSummary]]):
    port, board = free_port(), f"qg-test-{uuid.uuid4().hex[:12]}"
    cells = [
        ProcessActor(
            Cell,
            CellSpec(r, 3, f"tcp://127.0.0.1:{port}", str(model_dir), CONFIG, board),
            name=f"cell-{r}",
        )
        for r in range(3)
    ]
    try:
        await asyncio.gather(*(c.call("connect") for c in cells))
        # Step 0: the core and cell 1 train; cell 2 is in rollout.
        (first, summary0), (second, summary1) = data
        assert await cells[1].call("join_training") == 0
        claims: dict[int, int] = {}
        for i, ms in enumerate(first):
            cell = i % 2
            await cells[cell].call("train_micro_step", ms)
            claims[ms.index] = cell
        results = await asyncio.gather(*(c.call("finish_batch", summary0, 2) for c in cells[:2]))
        assert {r.version for r in results} == {1}
        # Step 1: cell 2 joins mid-batch, after the core trained the first micro-step;
        # it must take the core's current weights (version 1), not its stale ones.
        await cells[0].call("train_micro_step", second[0])
        assert await cells[2].call("join_training") == 1
        for i, ms in enumerate(second[1:]):
            await cells[(1, 2)[i % 2]].call("train_micro_step", ms)
        results = await asyncio.gather(*(c.call("finish_batch", summary1, 3) for c in cells))
        assert {r.version for r in results} == {2}
        return [await c.call("parameters") for c in cells]
    finally:
        for c in cells:
            c.close()


def test_three_cells_with_one_joining_mid_batch_match_one_cell(tiny_model_dir: Path) -> None:
    data = batches(tiny_model_dir)
    assert all(len(micro) >= 3 for micro, _ in data), "each step needs several micro-steps"
    initial = {
        k: v.detach().clone()
        for k, v in AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters()
    }
    alone = train_alone(tiny_model_dir, data)
    core, satellite1, satellite2 = asyncio.run(train_in_cells(tiny_model_dir, data))
    moved = max((alone[k] - initial[k]).abs().max().item() for k in alone)
    assert moved > 1e-3  # two Adam steps at lr 1e-3 really changed the weights
    for name, expected in alone.items():
        # Summation order differs (per-cell partial sums): float rounding only.
        torch.testing.assert_close(core[name], expected, rtol=0, atol=1e-5)
        # Satellites that trained the last step hold the core's new parameters.
        torch.testing.assert_close(satellite1[name], core[name], rtol=0, atol=0)
        torch.testing.assert_close(satellite2[name], core[name], rtol=0, atol=0)


def test_a_cell_error_comes_back_and_the_cell_keeps_serving(tiny_model_dir: Path) -> None:
    spec = CellSpec(0, 1, "", str(tiny_model_dir), CONFIG, f"qg-test-{uuid.uuid4().hex[:12]}")
    cell = ProcessActor(Cell, spec, name="cell-0")
    try:
        with pytest.raises(ActorError, match="connect\\(\\) first"):
            cell.call_sync("join_training")
        cell.call_sync("connect")
        assert cell.call_sync("join_training") == 0
    finally:
        cell.close()
