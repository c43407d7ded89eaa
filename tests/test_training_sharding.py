"""The pieces of sharded cells that one process can check: a micro-step cut
into whole executions for a cell's ranks, shards cut as FSDP2 cuts them, engines loading
weights one shard at a time, bounded collectives, and trainer state leaving and
re-entering (device) memory without changing the next update."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tests.training_data import groups
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers import AutoModelForCausalLM

from qwengyre.config import TrainerConfig
from qwengyre.engines.base import StaleWeights, WeightsInShards
from qwengyre.engines.embedded import EmbeddedEngine
from qwengyre.training.buffers import (
    MicroStep,
    PackingBuffer,
    TrajectoryBuffer,
    split_micro_step,
)
from qwengyre.training.distributed import CellComm, buckets
from qwengyre.training.offload import Offloaded
from qwengyre.training.sharding import shard_policy, shard_rows
from qwengyre.training.trainer import Trainer

CONFIG = TrainerConfig(lr=1e-3, micro_step_tokens=2048, grad_clip=1e9)


def micro_steps(model_dir: Path, seed: int = 7) -> tuple[list[MicroStep], PackingBuffer]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trajectories = TrajectoryBuffer()
    for group in groups(model, count=2, size=4, seed=seed):
        trajectories.add(group)
    packing = PackingBuffer(trajectories, CONFIG.micro_step_tokens)
    return packing.assign(0, [0, 1], closes_batch=True), packing


def executions(ms: MicroStep) -> dict[str, tuple[list[int], float]]:
    """Each execution's tokens and advantage, as a row holds them."""
    out: dict[str, tuple[list[int], float]] = {}
    for e, execution in enumerate(ms.execution_ids):
        tokens = ms.input_ids[0][ms.execution_index[0] == e].tolist()
        out[execution] = (tokens, float(ms.advantages[e]))
    return out


@pytest.mark.parametrize("parts", [1, 2, 3, 8, 9])
def test_a_micro_step_splits_into_whole_executions_balanced_by_tokens(
    tiny_model_dir: Path, parts: int
) -> None:
    (ms,), _ = micro_steps(tiny_model_dir)
    assert len(ms.execution_ids) == 8
    cut = split_micro_step(ms, parts)
    assert len(cut) == parts
    found = [p for p in cut if p is not None]
    assert len(found) == min(parts, 8)  # a part per execution at most; the rest get None
    whole = executions(ms)
    seen: dict[str, tuple[list[int], float]] = {}
    for part in found:
        assert part.position_ids[0, 0] == 0  # each part starts a document
        seen.update(executions(part))
    assert seen == whole  # every execution exactly once, tokens and advantage intact
    sizes = sorted(p.num_tokens for p in found)
    largest = max(len(tokens) for tokens, _ in whole.values())
    assert sizes[-1] - sizes[0] <= largest  # greedy balance: within one execution


def test_shard_rows_cut_like_torch_chunk_with_empty_shards() -> None:
    for rows in range(0, 12):
        for shards in range(1, 6):
            chunks = [c.shape[0] for c in torch.arange(rows).chunk(shards)] if rows else []
            chunks += [0] * (shards - len(chunks))
            cut = [shard_rows(rows, shards, s) for s in range(shards)]
            assert [n for _, n in cut] == chunks
            assert [start for start, _ in cut] == [sum(chunks[:s]) for s in range(shards)]


LAYOUTS = ((2, 0), (2, 1), (3, 1), (3, 2))
"""(G, rank) pairs whose MoE shards :func:`_moe_layouts` takes: 4 experts on 3 ranks
cut 2, 2, 0."""


def _moe_layouts(model_dir: str) -> list[tuple[dict, dict]]:
    """For each of :data:`LAYOUTS`, this rank's ``{name: (placements, local shard)}`` of
    the MoE parameters and their whole values, from a fake process group (no peers,
    only the layout). Runs in a process of its own: the default group is per process."""
    out = []
    for shards, rank in LAYOUTS:
        dist.init_process_group("fake", rank=rank, world_size=shards, store=FakeStore())
        try:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            full = {k: v.detach().clone() for k, v in model.named_parameters() if ".mlp." in k}
            shard_policy(model, init_device_mesh("cpu", (shards,)))
            local = {
                k: (str(v.placements), v.to_local().detach().clone())
                for k, v in model.named_parameters()
                if k in full and isinstance(v, DTensor)
            }
        finally:
            dist.destroy_process_group()
        out.append((local, full))
    return out


def test_each_rank_holds_whole_experts_of_every_moe_layer(tiny_moe_model_dir: Path) -> None:
    """Rank ``r`` of a cell of ``G`` keeps experts ``shard_rows(E, G, r)`` of every fused
    expert tensor and the router's rows for them, whole."""
    with mp.get_context("spawn").Pool(1) as pool:
        layouts = pool.apply(_moe_layouts, (str(tiny_moe_model_dir),))
    experts = 4
    for (shards, rank), (local, full) in zip(LAYOUTS, layouts, strict=True):
        first, count = shard_rows(experts, shards, rank)
        assert count == (0 if (shards, rank) == (3, 2) else 2)
        assert len(full) == 3 * 2  # gate_up_proj, down_proj, gate; two layers
        assert local.keys() == full.keys()
        for name, (placements, shard) in local.items():
            assert placements == str((Shard(0),)), name
            assert full[name].shape[0] == experts
            torch.testing.assert_close(shard, full[name][first : first + count], rtol=0, atol=0)


def test_collective_buckets_stay_within_their_bound() -> None:
    tensors = [torch.zeros(n) for n in (10, 200, 30, 30, 5, 1000, 1, 1)]
    runs = list(buckets(tensors, max_bytes=4 * 64))
    assert [t for run in runs for t in run] == tensors  # every tensor once, in order
    for run in runs:
        assert len(run) == 1 or sum(t.numel() for t in run) * 4 <= 4 * 64


@pytest.mark.parametrize("model", ["tiny_model_dir", "tiny_moe_model_dir"], ids=["dense", "moe"])
def test_an_engine_loads_weights_one_shard_at_a_time(
    model: str, request: pytest.FixtureRequest
) -> None:
    # The MoE's shards are whole experts of each fused expert tensor (dim-0 chunks).
    tiny_model_dir: Path = request.getfixturevalue(model)
    engine = EmbeddedEngine(tiny_model_dir, capacity=2, max_context=128)
    try:
        named = dict(engine.model.named_parameters())
        target = {k: v.detach() + 0.01 * (i + 1) for i, (k, v) in enumerate(named.items())}
        total = sum(t.numel() for t in target.values())
        read_sizes: list[int] = []

        def read(shard: int) -> dict[str, torch.Tensor]:
            part = {
                k: t.narrow(0, *shard_rows(t.shape[0], 2, shard)).clone() for k, t in target.items()
            }
            read_sizes.append(sum(t.numel() for t in part.values()))
            return part

        asyncio.run(engine.update_weights(WeightsInShards(2, read), version=3))
        assert engine.version == 3 and len(read_sizes) == 2
        assert all(abs(n / total - 0.5) < 0.01 for n in read_sizes)  # never the whole model
        for name, param in engine.model.named_parameters():
            torch.testing.assert_close(param.detach(), target[name], rtol=0, atol=0)

        def stale(shard: int) -> dict[str, torch.Tensor]:
            if shard == 1:
                raise StaleWeights("shard 1 holds version 5, not 4")
            return read(shard)

        with pytest.raises(StaleWeights, match="shard 1"):
            asyncio.run(engine.update_weights(WeightsInShards(2, stale), version=4))
        assert engine.version == 3  # the caller retries; the version is not advanced
    finally:
        engine.close()


def one_update(trainer: Trainer, data: list[MicroStep], packing: PackingBuffer) -> None:
    for ms in data:
        trainer.train_micro_step(ms)
    trainer.finish_batch(packing.summary(0), 1)


def test_offloaded_trainer_state_comes_back_to_the_same_next_update(tiny_model_dir: Path) -> None:
    data, packing = micro_steps(tiny_model_dir)
    trainers = []
    for offload in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        trainer = Trainer(model, CONFIG, CellComm(0, 1, ""))
        one_update(trainer, data, packing)  # Adam has moments now
        if offload:
            freed = trainer.offload()
            params_and_moments = 3 * sum(p.numel() for p in trainer.params) * 4
            assert freed >= params_and_moments
            assert all(p.to_local().untyped_storage().nbytes() == 0 for p in trainer.params)
            trainer.restore()
        one_update(trainer, data, packing)
        trainers.append(trainer)
    for kept, moved in zip(trainers[0].params, trainers[1].params, strict=True):
        torch.testing.assert_close(moved.full_tensor(), kept.full_tensor(), rtol=0, atol=0)


def test_dropped_state_is_reallocated_but_not_kept() -> None:
    tensors = [torch.arange(6.0), torch.ones(3, 2)]
    views = [tensors[0][2:], tensors[1]]  # a view shares its base's storage
    dropped = Offloaded([*tensors, *views], keep=False)
    assert dropped.nbytes == 6 * 4 + 6 * 4  # each storage once
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    dropped.restore()
    assert [t.untyped_storage().nbytes() for t in tensors] == [24, 24]
    tensors[0].copy_(torch.arange(6.0))  # usable again (a satellite pulls its weights)
    assert views[0].tolist() == [2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize(
    ("model", "options"),
    [
        ("tiny_model_dir", {"activation_checkpointing": True}),
        ("tiny_model_dir", {"cpu_offload": True}),
        ("tiny_model_dir", {"dtype": "bfloat16"}),
        # The recompute routes every token to the experts the forward chose.
        ("tiny_moe_model_dir", {"activation_checkpointing": True}),
    ],
    ids=["activation-checkpointing", "cpu-offload", "bf16-compute", "moe-activation-checkpointing"],
)
def test_trainer_options_make_the_same_update(
    model: str, options: dict, request: pytest.FixtureRequest
) -> None:
    tiny_model_dir: Path = request.getfixturevalue(model)
    data, packing = micro_steps(tiny_model_dir)
    updated = []
    for config in (CONFIG, CONFIG.model_copy(update=options)):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        trainer = Trainer(model, config, CellComm(0, 1, ""))
        one_update(trainer, data, packing)
        # Master weights stay fp32 whatever the compute precision.
        assert all(p.dtype == torch.float32 for p in trainer.params)
        updated.append([p.detach().full_tensor().clone() for p in trainer.params])
    diff = torch.cat([(a - b).abs().flatten() for a, b in zip(*updated, strict=True)])
    if options.get("dtype") == "bfloat16":
        # bf16 rounds the gradient; Adam's first step is ~lr * sign(g), so where g is
        # near zero the sign may flip (a 2 lr difference), elsewhere the steps agree.
        assert float(diff.max()) <= 2.5 * CONFIG.lr
        assert float((diff > 1e-4).float().mean()) < 0.01
    else:
        assert float(diff.max()) < 1e-6
