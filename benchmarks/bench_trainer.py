"""Trainer throughput: packed micro-steps with chunked log-probs against plain HF.

The same trajectories (agent-like, log-normal lengths with a long tail) are trained
by (a) plain HF: batches of ``--rows`` trajectories right-padded to the longest,
``model(...).logits`` over the full vocabulary, ``log_softmax`` and a gather, then
backward; and (b) qwengyre's trainer: the packing buffer's micro-steps (whole
trajectories concatenated, no padding), the execution-level objective and chunked
log-probs. Both count real (non-pad) tokens per second of forward+backward; the
ratio is measured in this run. A last check trains one row of ``--long-row`` tokens
through (b) and reports its peak memory (CUDA) or that it finished (CPU).

    python benchmarks/bench_trainer.py                      # CPU, the tiny demo model
    python benchmarks/bench_trainer.py --qwen3-0.6b --device cuda --dtype bfloat16 \
        --tokens 131072 --micro-step-tokens 16384 --long-row 32768
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from _smoke import parse
from bench_engine import qwen3_0p6b_shaped
from qwengyre.config import TrainerConfig
from qwengyre.models import cached_tiny_model
from qwengyre.training.buffers import (
    ExecutionSample,
    GroupSample,
    MicroStep,
    PackingBuffer,
    TrajectoryBuffer,
)
from qwengyre.training.distributed import CellComm
from qwengyre.training.trainer import Trainer
from qwengyre.trajectories.selection import AdmittedTrajectory


def trajectory(length: int, vocab: int, rng: random.Random) -> AdmittedTrajectory:
    """A prompt (a quarter), then alternating sampled replies and tool results."""
    prompt = max(8, length // 4)
    mask = [False] * prompt
    while len(mask) < length:
        turn = min(rng.randint(16, 128), length - len(mask))
        mask += [len(mask) // 64 % 2 == 0] * turn
    return AdmittedTrajectory(
        leaf=0,
        request_class="main.task",
        nodes=(0,),
        input_ids=tuple(rng.randrange(10, vocab - 10) for _ in range(length)),
        target_mask=tuple(mask),
        behaviour_logprobs=tuple(-8.0 if m else 0.0 for m in mask),
        versions=tuple(0 if m else -1 for m in mask),
    )


def trajectories(tokens: int, median: int, vocab: int, seed: int) -> list[AdmittedTrajectory]:
    """About ``tokens`` tokens of trajectories with log-normal lengths."""
    rng = random.Random(seed)
    out: list[AdmittedTrajectory] = []
    while sum(len(t.input_ids) for t in out) < tokens:
        length = max(32, min(int(rng.lognormvariate(0, 0.8) * median), 8 * median))
        out.append(trajectory(length, vocab, rng))
    return out


def micro_steps(rows: list[AdmittedTrajectory], budget: int) -> list[MicroStep]:
    """Executions of up to 3 trajectories each, packed by the packing buffer."""
    executions = [
        ExecutionSample(f"e{i}", 1.0 if i % 2 else -1.0, tuple(rows[i : i + 3]))
        for i in range(0, len(rows), 3)
    ]
    buffer = TrajectoryBuffer()
    buffer.add(GroupSample(0, 0, tuple(executions)))
    return PackingBuffer(buffer, budget).assign(0, [0], closes_batch=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_hf(
    model: PreTrainedModel, rows: list[AdmittedTrajectory], batch: int, device: torch.device
) -> tuple[int, float]:
    """Plain HF forward+backward over padded batches; returns (real tokens, seconds)."""
    sync(device)
    start = time.perf_counter()
    real = 0
    for i in range(0, len(rows), batch):
        chunk = rows[i : i + batch]
        width = max(len(r.input_ids) for r in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        attention = torch.zeros(len(chunk), width, dtype=torch.long)
        target = torch.zeros(len(chunk), width, dtype=torch.bool)
        for j, r in enumerate(chunk):
            ids[j, : len(r.input_ids)] = torch.tensor(r.input_ids)
            attention[j, : len(r.input_ids)] = 1
            target[j, : len(r.input_ids)] = torch.tensor(r.target_mask)
            real += len(r.input_ids)
        ids, attention, target = ids.to(device), attention.to(device), target.to(device)
        logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits
        logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        picked = logprobs.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        loss = -(picked * target[:, 1:]).sum() / target.sum()
        loss.backward()
        model.zero_grad(set_to_none=True)
    sync(device)
    return real, time.perf_counter() - start


def run_ours(trainer: Trainer, steps: list[MicroStep], device: torch.device) -> tuple[int, float]:
    sync(device)
    start = time.perf_counter()
    real = 0
    for ms in steps:
        real += trainer.train_micro_step(ms).tokens
    sync(device)
    trainer.model.zero_grad(set_to_none=True)
    return real, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--qwen3-0.6b", dest="qwen", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=24_576, help="tokens per measurement")
    parser.add_argument("--median", type=int, default=384, help="median trajectory length")
    parser.add_argument("--rows", type=int, default=8, help="HF batch size (trajectories)")
    parser.add_argument("--micro-step-tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=1024, help="log-prob chunk tokens")
    parser.add_argument("--long-row", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    args = parse(
        parser,
        tokens=1024,
        median=64,
        rows=2,
        micro_step_tokens=512,
        chunk=256,
        long_row=512,
        repeats=1,
    )

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        path = qwen3_0p6b_shaped(Path(tmp), dtype) if args.qwen else cached_tiny_model("demo")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        # The trainer shards its own fp32 copy (FSDP2) and computes in ``dtype``.
        sharded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    model.config.use_cache = False
    vocab = model.config.vocab_size
    config = TrainerConfig(
        micro_step_tokens=args.micro_step_tokens,
        logprob_chunk_tokens=args.chunk,
        dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
    )
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    trainer = Trainer(sharded, config, CellComm(0, 1, "", backend=backend, device=str(device)))
    rows = trajectories(args.tokens, args.median, vocab, seed=0)
    steps = micro_steps(rows, args.micro_step_tokens)
    real_fraction = sum(ms.num_tokens for ms in steps) / (len(steps) * args.micro_step_tokens)
    print(
        f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, vocab {vocab}, "
        f"{args.dtype} on {device}; {len(rows)} trajectories, "
        f"{sum(len(r.input_ids) for r in rows)} tokens; {len(steps)} micro-steps of "
        f"{args.micro_step_tokens} ({real_fraction:.1%} filled)"
    )
    run_ours(trainer, steps[:1], device)  # warm-up
    run_hf(model, rows[: args.rows], args.rows, device)
    hf, ours = [], []
    for _ in range(args.repeats):  # interleaved, so both see the same machine load
        n, s = run_hf(model, rows, args.rows, device)
        hf.append(n / s)
        n, s = run_ours(trainer, steps, device)
        ours.append(n / s)
    best_hf, best_ours = max(hf), max(ours)
    print(f"{'path':<34}{'tokens/s (best of ' + str(args.repeats) + ')':>26}")
    print(f"{'HF padded, full-vocab logits':<34}{best_hf:>26,.0f}")
    print(f"{'qwengyre packed, chunked':<34}{best_ours:>26,.0f}")
    print(f"ratio qwengyre / HF: {best_ours / best_hf:.2f}x")

    long = [trajectory(args.long_row, vocab, random.Random(1))]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    n, s = run_ours(trainer, micro_steps(long, args.long_row), device)
    peak = (
        f", peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
        if device.type == "cuda"
        else ""
    )
    print(f"one row of {n} tokens: {n / s:,.0f} tokens/s{peak}")


if __name__ == "__main__":
    main()
