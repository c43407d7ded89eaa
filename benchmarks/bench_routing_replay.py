"""How far an MoE's routing drifts between rollout and training, with and without
rollout routing replay (R3), and what recording it costs.

The tiny Qwen3-MoE (``init-tiny --moe``) trains at staleness exactly 1 (E[d] = 1): the
engine samples batch ``i`` with the weights of version ``i - 1`` while the trainer holds
version ``i``, trains on it, and then publishes version ``i`` to the engine. Before each
update the batch is scored by the current policy twice, in one run:

- **replay off**: the trainer's routers choose (``trainer.routing_replay=false``);
- **replay on**: every recorded position goes to the experts the engine routed it to.

Per update it prints the share of sampled tokens whose top-k experts (at any MoE layer)
differ between the behaviour and the current policy, the share of (position, layer)
choices that do, the spread (standard deviation) of the per-token log-ratio
``l_t - b_t`` each way and their ratio. Then the routing record's size per token (as
the proxy stores it) and per 1M-token execution, here and for real MoE shapes.

    python benchmarks/bench_routing_replay.py                  # 6 updates, 8 executions
    python benchmarks/bench_routing_replay.py --expert-scale 8  # experts that matter more
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from _smoke import parse
from qwengyre.config import TrainerConfig
from qwengyre.engines.base import GenerateRequest, GenerateResult, WeightsInMemory
from qwengyre.engines.embedded import EmbeddedEngine
from qwengyre.models.experts import RoutingRecorder
from qwengyre.models.tiny import cached_tiny_model
from qwengyre.training.buffers import (
    BatchSummary,
    ExecutionSample,
    GroupSample,
    MicroStep,
    PackingBuffer,
    TrajectoryBuffer,
)
from qwengyre.training.distributed import CellComm
from qwengyre.training.packed import document_spans
from qwengyre.training.trainer import Trainer
from qwengyre.trajectories import routed_experts
from qwengyre.trajectories.selection import materialise
from qwengyre.trajectories.tree import NodeMeta, TrajectoryTree
from qwengyre.types import SamplingParams

REAL_SHAPES = (  # (model, MoE layers, experts, experts per token), from their configs
    ("Qwen3-30B-A3B", 48, 128, 8),
    ("Qwen3-235B-A22B", 94, 128, 8),
    ("Qwen3-Coder-480B-A35B", 62, 160, 8),
    ("DeepSeek-V3", 58, 256, 8),
)


def moe_model(scratch: Path, size: str, scale: float) -> Path:
    """The tiny MoE, its experts' weights multiplied by ``scale`` (1: as built)."""
    built = cached_tiny_model(size, cache_dir=scratch / "cache", moe=True)  # type: ignore[arg-type]
    if scale == 1.0:
        return built
    model = AutoModelForCausalLM.from_pretrained(built, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name:
                param.mul_(scale)
    target = scratch / "scaled"
    model.save_pretrained(target)
    for file in built.iterdir():
        if not (target / file.name).exists() and file.is_file():
            (target / file.name).write_bytes(file.read_bytes())
    return target


def sample(engine: EmbeddedEngine, prompts: list[tuple[int, ...]], tokens: int) -> list:
    async def run() -> list[GenerateResult]:
        return await asyncio.gather(
            *(
                engine.generate(GenerateRequest(f"r{i}", p, SamplingParams(max_tokens=tokens)))
                for i, p in enumerate(prompts)
            )
        )

    return asyncio.run(run())


def batch(prompts: list[tuple[int, ...]], results: list[GenerateResult]) -> MicroStep:
    """One micro-step: one single-call execution per sample, advantages +-1."""
    executions = []
    for i, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        assert result.routing is not None, "the engine reported no routing"
        tree = TrajectoryTree()
        meta = NodeMeta(
            request_class="main.task",
            agent_id="main",
            engine="embedded",
            policy_version=result.policy_version,
            started_s=0.0,
            finished_s=0.0,
            finish_reason=result.finish_reason,
        )
        count = len(prompt) + len(result.output_ids)
        routing = routed_experts.before_each_token(result.routing, 0, count)
        tree.add(None, prompt, result.output_ids, result.logprobs, result.versions, meta, routing)
        row = materialise(tree, 0, frozenset({0}))
        executions.append(ExecutionSample(f"e{i}", 1.0 if i % 2 else -1.0, (row,)))
    buffer = TrajectoryBuffer()
    buffer.add(GroupSample(0, 0, tuple(executions)))
    (micro,) = PackingBuffer(buffer, 1 << 20).assign(0, [0], closes_batch=True)
    return micro


def scored(trainer: Trainer, micro: MicroStep) -> tuple[torch.Tensor, np.ndarray]:
    """The current log-probs of the targets and the experts used at every position."""
    recorder = RoutingRecorder(trainer.model)
    spans = document_spans(micro.position_ids)
    longest = max(stop - start for start, stop in spans)
    out = torch.full((len(spans) * longest, recorder.layers, recorder.k), -1, dtype=torch.long)
    recorder.out = out
    try:
        with torch.no_grad():
            logprobs = trainer.current_logprobs(micro)
    finally:
        recorder.remove()
    rows = out.view(len(spans), longest, recorder.layers, recorder.k)
    used = torch.cat([rows[d, : stop - start] for d, (start, stop) in enumerate(spans)])
    return logprobs, used.numpy()


def differing(used: np.ndarray, recorded: np.ndarray) -> np.ndarray:
    """[positions, layers]: True where the sets of experts differ."""
    return (np.sort(used, -1) != np.sort(recorded, -1)).any(-1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="test", choices=("test", "demo"))
    parser.add_argument("--updates", type=int, default=6)
    parser.add_argument("--executions", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48, help="sampled tokens a call")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--expert-scale", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parse(parser, argv, updates=1, executions=2, tokens=6)
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = moe_model(Path(scratch), args.size, args.expert_scale)
        engine = EmbeddedEngine(model_dir, capacity=args.executions, max_context=1024)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        trainer = Trainer(model, TrainerConfig(lr=args.lr), CellComm(0, 1, ""))
        vocab = int(model.config.vocab_size)
        print(
            f"tiny MoE ({args.size}): {model.config.num_hidden_layers} MoE layers,"
            f" {model.config.num_experts} experts, top-{model.config.num_experts_per_tok};"
            f" expert weights x{args.expert_scale}; lr {args.lr}; {args.executions}"
            f" executions x {args.tokens} sampled tokens a batch; staleness 1"
        )
        print(
            "update  tokens differ  choices differ  std(l-b) off  std(l-b) on  off/on"
            "  drift counted (on)"
        )
        routing_bytes: list[int] = []
        tokens: list[int] = []
        try:
            for update in range(args.updates + 1):
                prompts = [
                    tuple(rng.randrange(vocab) for _ in range(rng.randint(16, 48)))
                    for _ in range(args.executions)
                ]
                results = sample(engine, prompts, args.tokens)
                micro = batch(prompts, results)
                for r, p in zip(results, prompts, strict=True):
                    assert r.routing is not None
                    routing_bytes.append(r.routing.nbytes)
                    tokens.append(len(p) + len(r.output_ids) - 1)
                if update:  # the batch is one version behind the trainer
                    assert micro.routing is not None
                    recorded = micro.routing[0].numpy()
                    known = (recorded >= 0).all(-1)
                    behaviour = micro.behaviour_logprobs[:, 1:][micro.target_mask[:, 1:]]
                    free, used = scored(trainer, replace(micro, routing=None))
                    replayed, _ = scored(trainer, micro)
                    assert trainer.scorer.replay is not None
                    routed, drifted = trainer.scorer.replay.counts()
                    moved = differing(used, recorded) & known
                    # A target token at p was predicted from position p - 1.
                    targets = micro.target_mask[0, 1:].numpy()
                    token_moved = moved[:-1][targets].any(-1).mean()
                    off = float((free - behaviour).std())
                    on = float((replayed - behaviour).std())
                    print(
                        f"{update:6d}  {token_moved:13.1%}  {moved.sum() / known.sum():14.1%}"
                        f"  {off:12.5f}  {on:11.5f}  {off / on:6.2f}  {drifted / routed:17.1%}"
                    )
                previous = trainer.parameters()
                trainer.train_micro_step(micro)
                summary = BatchSummary(
                    step=update,
                    group_ids=(0,),
                    num_executions=args.executions,
                    num_target_tokens=micro.num_targets,
                    num_micro_steps=1,
                    num_tokens=micro.num_tokens,
                )
                trainer.finish_batch(summary, 1)
                if update:  # the engine gets the version before the trainer's new one
                    asyncio.run(engine.update_weights(WeightsInMemory(previous), update))
        finally:
            engine.close()
        per_token = sum(routing_bytes) / sum(tokens)
        print(f"\nrouting record: {per_token:.1f} B a token here ({results[0].routing.dtype})")
        print("model                   layers x k  type   B/token  MB per 1M-token execution")
        for name, layers, experts, k in REAL_SHAPES:
            dtype = routed_experts.compact(np.array([[[experts - 1]]])).dtype
            size = layers * k * dtype.itemsize
            print(f"{name:22s}  {layers:3d} x {k}  {dtype.name:5s}  {size:7d}  {size:10.0f}")


if __name__ == "__main__":
    main()
