"""bf16 training throughput of the FSDP2-sharded Trainer on one GPU against plain HF,
and whether one 32k-token row fits.

No download: each model is built from a config with random weights
(``AutoModelForCausalLM.from_config``, SDPA attention, fp32 parameters on the device):
Qwen3-0.6B-shaped (hidden 1024, 28 layers, 16/8 heads, head_dim 128, intermediate 3072,
vocab 151,936, tied embeddings) and Qwen3-4B-shaped (hidden 2560, 36 layers, 32/8
heads, intermediate 9728, tied). Per model, one after the other (never both in memory):

- **HF**: ``--rows`` x ``--row-tokens`` random tokens, ``model(input_ids, labels=input_ids)``
  under ``torch.autocast(bfloat16)`` (fp32 master weights), backward, gradient clipping
  to 1.0, ``torch.optim.AdamW`` step;
- **qwengyre**: :class:`~qwengyre.training.trainer.Trainer` with ``trainer.dtype =
  "bfloat16"`` (FSDP2 mixed precision, fp32 master weights and Adam state), a cell of
  one rank (``CellComm(0, 1, "", device=...)``); one micro-step of ``--rows`` documents
  of ``--row-tokens`` tokens (one execution each, every token after a document's first
  a target, as HF's labels), which ``packed_hidden_states`` runs as the same
  ``[rows, row_tokens]`` causal batch; ``train_micro_step`` + ``finish_batch``.

Tokens/s over ``--steps`` timed steps (after ``--warmup``), their ratio, and MFU as
``6 N tokens/s`` over ``--peak-tflops`` (N: the model's parameters, tied embeddings
counted once; recomputation under activation checkpointing is not counted). Then one
row of one ``--long-row``-token document through the same Trainer: whether it fits,
its peak memory (``torch.cuda.max_memory_allocated``) and tokens/s. The 4B shape uses
activation checkpointing in both paths (``--checkpointing auto``): its fp32 weights,
gradients and Adam state take 64 GB, and 16k tokens of its activations would not fit
beside them. Every case runs under its own ``try``: an OOM is reported and the rest
goes on; no new case starts after ``--budget-s`` seconds. One summary table at the end.

    python benchmarks/gpu_fsdp.py                          # one H200: ~3-5 minutes
    python benchmarks/gpu_fsdp.py --models 0.6b            # the small shape only
    python benchmarks/gpu_fsdp.py --device cpu --smoke     # smoke run of every path here
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from _smoke import parse
from qwengyre.config import TrainerConfig
from qwengyre.training.buffers import (
    BatchSummary,
    ExecutionSample,
    GroupSample,
    MicroStep,
    PackingBuffer,
    TrajectoryBuffer,
)
from qwengyre.training.distributed import CellComm
from qwengyre.training.trainer import Trainer
from qwengyre.trajectories.selection import AdmittedTrajectory

GIB = 2**30


def shape(name: str) -> PretrainedConfig:
    """The config of a model shape: ``0.6b``, ``4b`` or ``tiny`` (the "test" tiny model)."""
    if name == "tiny":
        from qwengyre.models import cached_tiny_model

        return AutoConfig.from_pretrained(cached_tiny_model("test"))
    from transformers import Qwen3Config

    common = {
        "vocab_size": 151_936,
        "head_dim": 128,
        "num_key_value_heads": 8,
        "max_position_embeddings": 40_960,
        "tie_word_embeddings": True,
        "eos_token_id": 151_645,
    }
    if name == "0.6b":
        return Qwen3Config(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            **common,
        )
    if name == "4b":
        return Qwen3Config(
            hidden_size=2560,
            intermediate_size=9728,
            num_hidden_layers=36,
            num_attention_heads=32,
            **common,
        )
    raise ValueError(f"unknown model shape {name!r}")


def build(config: PretrainedConfig, device: torch.device) -> PreTrainedModel:
    """Random fp32 weights, made on ``device`` (no host copy of a large model)."""
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = model.float()
    model.config.use_cache = False
    return model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated() / GIB if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------ data


def document(length: int, vocab: int, rng: random.Random, eid: str) -> AdmittedTrajectory:
    """Random tokens; every token after the first is a target (as HF's shifted labels)."""
    return AdmittedTrajectory(
        leaf=0,
        request_class="main.task",
        nodes=(0,),
        input_ids=tuple(rng.randrange(10, vocab - 10) for _ in range(length)),
        target_mask=(False,) + (True,) * (length - 1),
        behaviour_logprobs=(0.0,) + (-math.log(vocab),) * (length - 1),
        versions=(-1,) + (0,) * (length - 1),
        execution_id=eid,
    )


def one_micro_step(
    rows: int, row_tokens: int, vocab: int, seed: int
) -> tuple[MicroStep, BatchSummary]:
    """``rows`` documents of ``row_tokens`` tokens, one execution each (advantages +-1),
    packed into exactly one micro-step of ``rows * row_tokens`` tokens."""
    rng = random.Random(seed)
    executions = [
        ExecutionSample(
            f"e{i}", 1.0 if i % 2 else -1.0, (document(row_tokens, vocab, rng, f"e{i}"),)
        )
        for i in range(rows)
    ]
    buffer = TrajectoryBuffer()
    buffer.add(GroupSample(0, 0, tuple(executions)))
    packing = PackingBuffer(buffer, rows * row_tokens)
    micro = packing.assign(0, [0], closes_batch=True)
    if len(micro) != 1 or micro[0].num_tokens != rows * row_tokens:
        raise RuntimeError(f"expected one full micro-step, got {[m.num_tokens for m in micro]}")
    return micro[0], packing.summary(0)


# ----------------------------------------------------------------------- cases


@dataclass
class Row:
    model: str
    path: str
    checkpointing: bool
    params: int = 0
    tokens_per_s: float | None = None
    peak_gib: float | None = None
    seconds: float | None = None
    note: str = ""


def timed_steps(step: Any, warmup: int, steps: int, device: torch.device) -> float:
    """Seconds per step, after ``warmup`` untimed steps."""
    for _ in range(warmup):
        step()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return (time.perf_counter() - start) / steps


def run_hf(row: Row, config: PretrainedConfig, args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    model = build(config, device)
    row.params = sum(p.numel() for p in model.parameters())
    if row.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(
        10, config.vocab_size - 10, (args.rows, args.row_tokens), generator=generator
    )
    ids = ids.to(device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    reset_peak(device)
    seconds = timed_steps(step, args.warmup, args.steps, device)
    row.seconds, row.peak_gib = seconds, peak_gib(device)
    row.tokens_per_s = args.rows * args.row_tokens / seconds


def run_trainer(row: Row, long: Row, config: PretrainedConfig, args: argparse.Namespace) -> None:
    """Throughput into ``row``, then the long row into ``long`` (same trainer)."""
    device = torch.device(args.device)
    model = build(config, device)
    row.params = long.params = sum(p.numel() for p in model.parameters())
    trainer_config = TrainerConfig(
        lr=1e-6,
        dtype="bfloat16",
        micro_step_tokens=args.rows * args.row_tokens,
        logprob_chunk_tokens=args.chunk,
        activation_checkpointing=row.checkpointing,
    )
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    comm = CellComm(0, 1, "", backend=backend, device=args.device)
    trainer = Trainer(model, trainer_config, comm)
    ms, summary = one_micro_step(args.rows, args.row_tokens, config.vocab_size, seed=0)

    def step() -> None:
        trainer.train_micro_step(ms)
        trainer.finish_batch(summary, 1)

    try:
        reset_peak(device)
        seconds = timed_steps(step, args.warmup, args.steps, device)
        row.seconds, row.peak_gib = seconds, peak_gib(device)
        row.tokens_per_s = ms.num_tokens / seconds
    except Exception as exc:  # the long row may still fit (e.g. with fewer documents)
        row.note = describe(exc)
    free(device)
    if args.long_row <= 0:
        return
    if time.perf_counter() - args.start > args.budget_s:
        long.note = "skipped: time budget"
        return
    long_ms, long_summary = one_micro_step(1, args.long_row, config.vocab_size, seed=1)
    try:
        reset_peak(device)
        sync(device)
        start = time.perf_counter()
        trainer.train_micro_step(long_ms)
        trainer.finish_batch(long_summary, 1)
        sync(device)
        long.seconds = time.perf_counter() - start
        long.tokens_per_s = long_ms.num_tokens / long.seconds
        long.peak_gib = peak_gib(device)
        long.note = "fits"
    except Exception as exc:
        long.note = "does not fit: " + describe(exc) if is_oom(exc) else describe(exc)


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def describe(exc: BaseException) -> str:
    if is_oom(exc):
        return "OOM"
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:70]}"


def attempt(row: Row, args: argparse.Namespace, run: Any, *extra: Any) -> None:
    """``run(row, *extra, args)`` with any failure recorded in the row; frees memory after."""
    if time.perf_counter() - args.start > args.budget_s:
        row.note = "skipped: time budget"
        return
    try:
        run(row, *extra, args)
    except Exception as exc:
        row.note = describe(exc)
    free(torch.device(args.device))
    print(f"  {row.model} {row.path}: {format_row(row)}", flush=True)


def format_row(row: Row) -> str:
    tps = f"{row.tokens_per_s:,.0f} tokens/s" if row.tokens_per_s else "-"
    peak = f", peak {row.peak_gib:.1f} GiB" if row.peak_gib is not None else ""
    note = f" ({row.note})" if row.note else ""
    return f"{tps}{peak}{note}"


def count(params: int) -> str:
    if not params:
        return "-"
    return f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params / 1e6:.2f}M"


def summary_table(rows: list[Row], longs: list[Row], args: argparse.Namespace) -> None:
    tokens = args.rows * args.row_tokens
    peak_flops = args.peak_tflops * 1e12
    print(
        f"\nsummary: {args.rows} x {args.row_tokens} = {tokens:,} tokens per step, "
        f"{args.steps} timed steps after {args.warmup}; bf16 compute, fp32 master weights; "
        f"MFU = 6 N tokens/s / {args.peak_tflops:.0f} TFLOP/s; device {args.device_name}"
    )
    head = (
        f"{'model':<6}{'path':<28}{'ckpt':>5}{'params':>9}{'tokens/s':>11}{'vs HF':>7}"
        f"{'MFU':>7}{'s/step':>8}{'peak GiB':>9}  note"
    )
    print(head)
    print("-" * len(head))
    hf = {r.model: r.tokens_per_s for r in rows if r.path.startswith("HF") and r.tokens_per_s}
    for r in rows:
        ratio = f"{r.tokens_per_s / hf[r.model]:.2f}x" if r.tokens_per_s and r.model in hf else "-"
        mfu = f"{6 * r.params * r.tokens_per_s / peak_flops:.1%}" if r.tokens_per_s else "-"
        print(
            f"{r.model:<6}{r.path:<28}{'on' if r.checkpointing else 'off':>5}"
            f"{count(r.params):>9}"
            f"{f'{r.tokens_per_s:,.0f}' if r.tokens_per_s else '-':>11}{ratio:>7}{mfu:>7}"
            f"{f'{r.seconds:.3f}' if r.seconds else '-':>8}"
            f"{f'{r.peak_gib:.1f}' if r.peak_gib is not None else '-':>9}  {r.note}"
        )
    for r in longs:
        print(
            f"{r.model:<6}{f'Trainer, one {args.long_row:,}-token row':<28}"
            f"{'on' if r.checkpointing else 'off':>5}{count(r.params):>9}"
            f"{f'{r.tokens_per_s:,.0f}' if r.tokens_per_s else '-':>11}{'':>7}{'':>7}"
            f"{f'{r.seconds:.3f}' if r.seconds else '-':>8}"
            f"{f'{r.peak_gib:.1f}' if r.peak_gib is not None else '-':>9}  {r.note or '-'}"
        )


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", nargs="+", default=["0.6b", "4b"], choices=["0.6b", "4b"])
    parser.add_argument("--rows", type=int, default=8, help="documents (rows) per step")
    parser.add_argument("--row-tokens", type=int, default=2048)
    parser.add_argument("--long-row", type=int, default=32_768, help="0: skip the long row")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=1024, help="the trainer's log-prob chunk")
    parser.add_argument(
        "--checkpointing",
        default="auto",
        choices=["auto", "on", "off"],
        help="activation checkpointing in both paths; auto: on for the 4B shape",
    )
    parser.add_argument("--peak-tflops", type=float, default=800.0, help="for MFU")
    parser.add_argument("--budget-s", type=float, default=420.0, help="no new case after this")
    # The smoke run: the 'test' tiny model, 2 x 128-token rows, a 1,024-token long row.
    return parse(
        parser, argv, models=["tiny"], rows=2, row_tokens=128, long_row=1024, steps=2, warmup=1
    )


def main() -> None:
    args = arguments()
    args.start = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)  # set_device wants an index
        args.device_name = torch.cuda.get_device_name()
    else:
        args.device_name = "cpu"
    print(
        f"torch {torch.__version__}, {args.device_name}; models {', '.join(args.models)}; "
        f"budget {args.budget_s:.0f} s",
        flush=True,
    )
    rows: list[Row] = []
    longs: list[Row] = []
    for name in args.models:
        config = shape(name)
        ckpt = args.checkpointing == "on" or (args.checkpointing == "auto" and name == "4b")
        hf = Row(name, "HF + AdamW, autocast bf16", ckpt)
        ours = Row(name, "qwengyre Trainer, FSDP2 bf16", ckpt)
        long = Row(name, "long row", ckpt)
        rows += [hf, ours]
        longs.append(long)
        attempt(hf, args, run_hf, config)
        attempt(ours, args, run_trainer, long, config)
        if args.long_row > 0:
            skipped = ours.note.startswith("skipped")
            long.note = long.note or (ours.note if skipped else "not run: the trainer failed")
            print(f"  {name} one {args.long_row:,}-token row: {format_row(long)}", flush=True)
    summary_table(rows, longs if args.long_row > 0 else [], args)
    print(f"total {time.perf_counter() - args.start:.0f} s")


if __name__ == "__main__":
    main()
