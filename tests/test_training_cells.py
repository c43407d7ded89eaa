"""Cells training one batch together: micro-steps claimed by several
cells of one or two FSDP2 ranks each, gradient shards reduced over the participating
prefix, one update on the core, a satellite joining mid-batch with the core's current
weights, sharded checkpoints resumed with another number of ranks per cell."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from tests.training_data import groups
from transformers import AutoModelForCausalLM

from qwengyre.cluster.cell import Cell, CellSpec
from qwengyre.cluster.client import CellClient
from qwengyre.cluster.local import ActorError, ProcessActor
from qwengyre.cluster.net import free_port
from qwengyre.cluster.placement import CellGroup, start_cells, stop_cells
from qwengyre.config import CellsConfig, Config, TrainerConfig
from qwengyre.training.buffers import BatchSummary, MicroStep, PackingBuffer, TrajectoryBuffer
from qwengyre.training.distributed import CellComm, call_off, connect_store
from qwengyre.training.trainer import Trainer

CONFIG = TrainerConfig(lr=1e-3, micro_step_tokens=160, grad_clip=1e9)


def cells_config(cells: int, shards: int = 1) -> Config:
    """A run of ``cells`` cells of ``shards`` ranks training with :data:`CONFIG`."""
    return Config(cells=CellsConfig(count=cells, devices_per_cell=shards), trainer=CONFIG)


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
    trainer = Trainer(model, CONFIG, CellComm(0, 1, ""))
    for micro_steps, summary in data:
        for ms in micro_steps:
            trainer.train_micro_step(ms)
        assert trainer.finish_batch(summary, 1).version == summary.step + 1
    return {k: v.detach().full_tensor().clone() for k, v in model.named_parameters()}


def specs(
    model_dir: Path,
    cells: int,
    shards: int,
    *,
    port: int,
    board: str,
    checkpoint: str | None = None,
    store_on_core: bool = True,
    ranks: Sequence[int] | None = None,
    incarnation: int = 0,
) -> list[CellSpec]:
    config = cells_config(cells, shards)
    return [
        CellSpec(
            rank=r,
            shard=s,
            init_method=f"tcp://127.0.0.1:{port}",
            model_dir=str(model_dir),
            board=board,
            config=config,
            checkpoint=checkpoint,
            store_on_core=store_on_core,
            incarnation=incarnation,
        )
        for r in (range(cells) if ranks is None else ranks)
        for s in range(shards)
    ]


async def start(
    model_dir: Path,
    run_dir: Path,
    cells: int,
    shards: int,
    *,
    checkpoint: str | None = None,
    port: int | None = None,
) -> list[CellClient]:
    """``cells`` cells of ``shards`` ranks, connected; the core serves the rendezvous
    store unless ``port`` is one the caller serves."""
    board = f"qg-test-{uuid.uuid4().hex[:12]}"
    found = specs(
        model_dir,
        cells,
        shards,
        port=free_port() if port is None else port,
        board=board,
        checkpoint=checkpoint,
        store_on_core=port is None,
    )
    handles = start_cells("local", found, run_dir=run_dir)
    try:
        await asyncio.gather(*(c.connect() for c in handles))
    except BaseException:
        stop_cells(handles)
        raise
    return handles


async def train_in_cells(
    model_dir: Path, run_dir: Path, data: list[tuple[list[MicroStep], BatchSummary]], shards: int
) -> list[dict[str, torch.Tensor]]:
    cells = await start(model_dir, run_dir, 3, shards)
    try:
        # Step 0: the core and cell 1 train; cell 2 is in rollout.
        (first, summary0), (second, summary1) = data
        assert await cells[1].join_training() == 0
        for i, ms in enumerate(first):
            result = await cells[i % 2].train_micro_step(ms)
            assert result.executions == len(ms.execution_ids)  # all ranks' parts counted
        results = await asyncio.gather(*(c.finish_batch(summary0, 2) for c in cells[:2]))
        assert {r.version for r in results} == {1}
        # Step 1: cell 2 joins mid-batch, after the core trained the first micro-step;
        # it must take the core's current weights (version 1), not its stale ones.
        await cells[0].train_micro_step(second[0])
        assert await cells[2].join_training() == 1
        for i, ms in enumerate(second[1:]):
            await cells[(1, 2)[i % 2]].train_micro_step(ms)
        results = await asyncio.gather(*(c.finish_batch(summary1, 3) for c in cells))
        assert {r.version for r in results} == {2}
        return [await c.parameters() for c in cells]
    finally:
        stop_cells(cells)


@pytest.mark.parametrize("shards", [1, 2])
def test_three_cells_with_one_joining_mid_batch_match_one_unsharded_trainer(
    tiny_model_dir: Path, tmp_path: Path, shards: int
) -> None:
    data = batches(tiny_model_dir)
    assert all(len(micro) >= 3 for micro, _ in data), "each step needs several micro-steps"
    initial = {
        k: v.detach().clone()
        for k, v in AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters()
    }
    alone = train_alone(tiny_model_dir, data)
    core, satellite1, satellite2 = asyncio.run(
        train_in_cells(tiny_model_dir, tmp_path, data, shards)
    )
    moved = max((alone[k] - initial[k]).abs().max().item() for k in alone)
    assert moved > 1e-3  # two Adam steps at lr 1e-3 really changed the weights
    for name, expected in alone.items():
        # Summation order differs (per-cell, per-rank partial sums): float rounding only.
        torch.testing.assert_close(core[name], expected, rtol=0, atol=1e-5)
        # Satellites that trained the last step hold the core's new parameters.
        torch.testing.assert_close(satellite1[name], core[name], rtol=0, atol=0)
        torch.testing.assert_close(satellite2[name], core[name], rtol=0, atol=0)


async def two_steps(
    model_dir: Path, run_dir: Path, data: list[tuple[list[MicroStep], BatchSummary]], shards: int
) -> tuple[dict[str, torch.Tensor], list[dict[str, int]], str]:
    """Two cells of ``shards`` ranks train both steps; returns the parameters, each
    core rank's shard sizes, and the checkpoint written after step 0."""
    cells = await start(model_dir, run_dir, 2, shards)
    try:
        path = ""
        for step, (micro, summary) in enumerate(data):
            assert await cells[1].join_training() == step
            for i, ms in enumerate(micro):
                await cells[i % 2].train_micro_step(ms)
            if step == 1:  # gradients are held: measure them with the parameters
                sizes = await cells[0].shard_numels()
            await asyncio.gather(*(c.finish_batch(summary, 2) for c in cells))
            if step == 0:
                path = await cells[0].save_checkpoint(
                    str(run_dir / "checkpoints"), 1, {"version": 1}, 2
                )
        return await cells[0].parameters(), sizes, path
    finally:
        stop_cells(cells)


async def resumed_step(
    model_dir: Path,
    run_dir: Path,
    data: list[tuple[list[MicroStep], BatchSummary]],
    shards: int,
    checkpoint: str,
) -> dict[str, torch.Tensor]:
    """One cell of ``shards`` ranks resumes from ``checkpoint`` and trains step 1."""
    (cell,) = await start(model_dir, run_dir, 1, shards, checkpoint=checkpoint)
    try:
        micro, summary = data[1]
        for ms in micro:
            await cell.train_micro_step(ms)
        assert (await cell.finish_batch(summary, 1)).version == 2
        return await cell.parameters()
    finally:
        stop_cells([cell])


@pytest.mark.parametrize("model", ["tiny_model_dir", "tiny_moe_model_dir"], ids=["dense", "moe"])
def test_two_sharded_cells_match_one_cell_hold_half_each_and_resume_with_any_g(
    model: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # The MoE's fused expert tensors are cut on their experts dim like any other
    # parameter: half the experts (and of their gradients and moments) per rank.
    tiny_model_dir: Path = request.getfixturevalue(model)
    data = batches(tiny_model_dir)
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    alone = train_alone(tiny_model_dir, data)
    for name, expected in alone.items():  # every parameter was trained, every expert too
        moved = (expected - initial[name].detach()).abs()
        per_expert = moved.flatten(1).amax(1) if ".experts." in name else moved.amax()
        assert bool((per_expert > 1e-4).all()), name
    sharded, sizes, path = asyncio.run(two_steps(tiny_model_dir, tmp_path / "g2", data, 2))
    for name, expected in alone.items():
        torch.testing.assert_close(sharded[name], expected, rtol=0, atol=1e-5)
    total = sum(t.numel() for t in alone.values())
    for rank in sizes:  # parameters, gradients and Adam's two moments: ~1/G each
        assert abs(rank["parameters"] / total - 0.5) < 0.01, rank
        assert rank["gradients"] == rank["parameters"]
        assert rank["optimizer"] == 2 * rank["parameters"]
    assert sum(rank["parameters"] for rank in sizes) == total
    # The checkpoint written by two ranks resumes with two and with one.
    for shards in (2, 1):
        resumed = asyncio.run(
            resumed_step(tiny_model_dir, tmp_path / f"resume-{shards}", data, shards, path)
        )
        for name, expected in sharded.items():
            torch.testing.assert_close(resumed[name], expected, rtol=0, atol=1e-5)


def test_a_cell_error_comes_back_and_the_cell_keeps_serving(tiny_model_dir: Path) -> None:
    board = f"qg-test-{uuid.uuid4().hex[:12]}"
    spec = CellSpec(
        rank=0,
        shard=0,
        init_method="",
        model_dir=str(tiny_model_dir),
        board=board,
        config=cells_config(1),
    )
    cell = CellClient(ProcessActor(Cell, spec, name="cell-0"))

    async def calls() -> None:
        with pytest.raises(ActorError, match="connect\\(\\) first"):
            await cell.join_training()
        await cell.connect()
        assert await cell.join_training() == 0

    try:
        asyncio.run(calls())
    finally:
        cell.close()


def rank_pids(cell: CellClient) -> list[int]:
    handle = cell.handle
    ranks = handle.ranks if isinstance(handle, CellGroup) else [handle]
    return [rank.pid for rank in ranks]  # type: ignore[union-attr]


async def after_a_death(
    model_dir: Path,
    run_dir: Path,
    data: list[tuple[list[MicroStep], BatchSummary]],
    shards: int,
    case: str,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    """Three cells; cells 0 and 1 train step 0; then one dies (``case``): the core, or
    cell 1, which is replaced or left out. The live cells re-form their groups and
    train step 1 together. Returns the core's parameters and version before step 1 and
    its parameters after. The checkpoint is written after step 0, but for "core
    replaced, no checkpoint". The rendezvous store is this process's, as a
    controller holds it."""
    port, board = free_port(), f"qg-test-{uuid.uuid4().hex[:12]}"
    store = connect_store(f"tcp://127.0.0.1:{port}", master=True, timeout_s=60)
    made = specs(model_dir, 3, shards, port=port, board=board, store_on_core=False)
    cells = start_cells("local", made, run_dir=run_dir)
    try:
        await asyncio.gather(*(c.connect() for c in cells))
        (first, summary0), (second, summary1) = data
        await cells[1].join_training()
        for i, ms in enumerate(first):
            await cells[i % 2].train_micro_step(ms)
        await asyncio.gather(*(c.finish_batch(summary0, 2) for c in cells[:2]))
        path = None
        if case != "core replaced, no checkpoint":
            path = await cells[0].save_checkpoint(str(run_dir / "ckpt"), 1, {"version": 1}, 1)
        victim = 0 if case.startswith("core replaced") else 1
        for pid in rank_pids(cells[victim]):
            os.kill(pid, signal.SIGKILL)
        cells[victim].close()
        members = (0, 2) if case == "cell 1 left out" else (0, 1, 2)
        survivors = [cells[c] for c in members if c != victim]
        regroup = [c.regroup(members, 1) for c in survivors]
        if case == "cell 1 left out":
            await asyncio.gather(*regroup)
        else:
            again = specs(
                model_dir,
                3,
                shards,
                port=port,
                board=board,
                checkpoint=path if victim == 0 else None,
                store_on_core=False,
                ranks=[victim],
                incarnation=1,
            )
            (cells[victim],) = start_cells("local", again, run_dir=run_dir)
            connect = cells[victim].connect(members, 1, takeover=victim == 0)
            await asyncio.gather(connect, *regroup)
        version = await cells[0].join_training()
        before = await cells[0].parameters()
        training = [cells[c] for c in members]
        for cell in training[1:]:
            assert await cell.join_training() == version
        for i, ms in enumerate(second):
            await training[i % len(training)].train_micro_step(ms)
        k = len(training)
        results = await asyncio.gather(*(c.finish_batch(summary1, k) for c in training))
        assert {r.version for r in results} == {version + 1}
        return before, await cells[0].parameters(), version
    finally:
        stop_cells([c for c in cells if c.handle is not None])
        del store


@pytest.mark.parametrize(
    ("case", "shards"),
    [
        ("cell 1 left out", 1),
        ("cell 1 replaced", 1),
        ("core replaced", 1),
        ("core replaced", 2),
        ("core replaced, no checkpoint", 1),
    ],
)
def test_cells_regroup_after_a_death_and_train_as_if_it_never_happened(
    tiny_model_dir: Path, tmp_path: Path, case: str, shards: int
) -> None:
    """Without a restart: the survivors of a satellite's death (cell 1, between steps)
    train on together, cell 2 included (cells past a dead one are no longer cut off);
    a replacement for cell 1 joins them; the core's replacement takes over from the
    boards (weights, version) and the checkpoint (optimizer: as new as the weights, so
    nothing is lost). Step 1 then gives the update one unsharded trainer gives. Without a
    checkpoint, the replacement still has the newest weights and version (no step is
    redone); only the optimizer's moments start afresh (the update differs)."""
    data = batches(tiny_model_dir)
    alone = train_alone(tiny_model_dir, data)
    before, after, version = asyncio.run(
        after_a_death(tiny_model_dir, tmp_path, data, shards, case)
    )
    assert version == 1
    step0 = train_alone(tiny_model_dir, data[:1])
    for name, expected in step0.items():
        torch.testing.assert_close(before[name], expected, rtol=0, atol=1e-5)
    lagging = case == "core replaced, no checkpoint"
    moved = max((after[k] - alone[k]).abs().max().item() for k in alone)
    assert (moved > 1e-4) if lagging else (moved < 1e-5), moved


async def a_death_in_the_update(
    model_dir: Path, run_dir: Path, data: list[tuple[list[MicroStep], BatchSummary]]
) -> tuple[dict[str, torch.Tensor], int]:
    """Cells 0, 1 and 2 train step 0; cell 1 dies as the update begins: the update of
    cells 0 and 2 fails, not hangs, and does not happen. They drop their gradients and
    re-form their groups: first still with cell 1 (as when its death is not seen yet),
    which a controller calls off, then without it. They train the step again. Returns
    the core's parameters and its version after the failed update."""
    port, board = free_port(), f"qg-test-{uuid.uuid4().hex[:12]}"
    cells = start_cells("local", specs(model_dir, 3, 1, port=port, board=board), run_dir=run_dir)
    try:
        await asyncio.gather(*(c.connect() for c in cells))
        micro, summary = data[0]
        for cell in cells[1:]:
            await cell.join_training()
        for i, ms in enumerate(micro):
            await cells[i % 3].train_micro_step(ms)
        for pid in rank_pids(cells[1]):
            os.kill(pid, signal.SIGKILL)
        failed = await asyncio.gather(
            cells[0].finish_batch(summary, 3),
            cells[2].finish_batch(summary, 3),
            return_exceptions=True,
        )
        assert all(isinstance(f, ActorError) for f in failed), failed
        version = await cells[0].join_training()
        await asyncio.gather(*(cells[c].discard_gradient() for c in (0, 2)))
        waiting = asyncio.gather(
            *(cells[c].regroup((0, 1, 2), 1) for c in (0, 2)), return_exceptions=True
        )
        call_off(connect_store(f"tcp://127.0.0.1:{port}", master=False, timeout_s=60), 1)
        called_off = await waiting
        assert all("GroupsCalledOff" in str(f) for f in called_off), called_off
        await asyncio.gather(*(cells[c].regroup((0, 2), 2) for c in (0, 2)))
        await cells[2].join_training()
        for i, ms in enumerate(micro):
            await cells[(0, 2)[i % 2]].train_micro_step(ms)
        await asyncio.gather(*(cells[c].finish_batch(summary, 2) for c in (0, 2)))
        return await cells[0].parameters(), version
    finally:
        stop_cells(cells)


def test_a_death_in_the_update_fails_it_and_the_survivors_train_the_step_again(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    data = batches(tiny_model_dir)
    alone = train_alone(tiny_model_dir, data[:1])
    params, version = asyncio.run(a_death_in_the_update(tiny_model_dir, tmp_path, data))
    assert version == 0
    for name, expected in alone.items():
        torch.testing.assert_close(params[name], expected, rtol=0, atol=1e-5)
