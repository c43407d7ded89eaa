"""A cell's FSDP2-sharded trainer: memory per rank for G=1 vs G=2, and the sharded
path's step time against a plain replica.

(a) Memory. One cell of ``G`` ranks (one process each, ``start_cells("local", ...)``)
trains ``--batches`` batches of the same micro-steps (``train_micro_step`` on every
rank, then ``finish_batch``). Per rank: the parameter, gradient and Adam-state bytes it
holds (``shard_numels`` x 4 bytes, fp32, read before the last ``finish_batch`` so that
all three exist), its resident memory once connected, and its peak resident memory
while training (``VmHWM`` of ``/proc/<pid>/status``, read by this process; the mark is
reset through ``/proc/<pid>/clear_refs`` after connecting). Each rank of a G=2 cell
trains about half of every micro-step (whole executions), so activations halve too;
the process's fixed cost (Python, torch, the libraries) does not, and dominates on the
tiny model: compare the state bytes and the growth while training.

(b) Step time, in this process: the sharded path (:class:`~qwengyre.training.trainer.Trainer`
on ``CellComm(0, 1, "")``, a cell of one rank) against a replica, the same model
unwrapped: ``packed_hidden_states`` + ``token_logprobs`` + ``execution_gspo_loss``
(summed objective), backward per micro-step, then the batch's normalisation, gradient
clipping and one ``torch.optim.Adam`` step, as the trainer does, but without FSDP2.
Both train the same micro-steps from the same weights, in alternating repetitions; the
ratio is the median of the per-repetition ratios, and the two models' parameters are
compared at the end (same updates up to float rounding).

    python benchmarks/bench_sharded.py              # ~2 minutes on a quiet machine
    python benchmarks/bench_sharded.py --quick      # a smaller run
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from _smoke import parse
from bench_trainer import trajectories
from qwengyre.cluster.cell import CellSpec
from qwengyre.cluster.client import CellClient
from qwengyre.cluster.placement import start_cells, stop_cells
from qwengyre.config import CellsConfig, Config, RunConfig, TrainerConfig
from qwengyre.models import cached_tiny_model
from qwengyre.models.tiny import quiet_progress_bars
from qwengyre.training.buffers import (
    BatchSummary,
    ExecutionSample,
    GroupSample,
    MicroStep,
    PackingBuffer,
    TrajectoryBuffer,
)
from qwengyre.training.distributed import CellComm
from qwengyre.training.logprobs import token_logprobs
from qwengyre.training.objective import execution_gspo_loss
from qwengyre.training.packed import packed_hidden_states
from qwengyre.training.sharding import full_tensor
from qwengyre.training.trainer import Trainer

Batch = tuple[list[MicroStep], BatchSummary]
MB = 2**20


def batch(tokens: int, median: int, vocab: int, budget: int) -> Batch:
    """About ``tokens`` tokens of agent-like trajectories, 3 per execution (advantages
    +-1), packed into micro-steps of ``budget`` tokens; one closed batch."""
    rows = trajectories(tokens, median, vocab, seed=0)
    executions = [
        ExecutionSample(f"e{i}", 1.0 if i % 2 else -1.0, tuple(rows[i : i + 3]))
        for i in range(0, len(rows), 3)
    ]
    buffer = TrajectoryBuffer()
    buffer.add(GroupSample(0, 0, tuple(executions)))
    packing = PackingBuffer(buffer, budget)
    micro = packing.assign(0, [0], closes_batch=True)
    return micro, packing.summary(0)


# ------------------------------------------------------------------ (a) memory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def proc_status(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of process ``pid``, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak(pid: int) -> None:
    """Reset ``pid``'s peak resident memory (``VmHWM``) to its current ``VmRSS``."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def memory_run(
    model_dir: Path, shards: int, data: Batch, batches: int, config: TrainerConfig, threads: int
) -> list[dict[str, Any]]:
    """One cell of ``shards`` ranks trains ``batches`` batches; one dict per rank."""
    port, board = free_port(), f"qg-bench-{uuid.uuid4().hex[:12]}"
    run_config = Config(
        cells=CellsConfig(count=1, devices_per_cell=shards),
        trainer=config,
        run=RunConfig(torch_threads=threads),
    )
    specs = [
        CellSpec(
            rank=0,
            shard=s,
            init_method=f"tcp://127.0.0.1:{port}",
            model_dir=str(model_dir),
            board=board,
            config=run_config,
        )
        for s in range(shards)
    ]

    async def train(
        cell: CellClient, pids: list[int]
    ) -> tuple[list[int], list[dict[str, int]], float]:
        """Train the batches; returns the ranks' idle memory, their shard sizes and the
        seconds of the last batch."""
        await cell.connect()
        idle = [proc_status(pid)["VmRSS"] for pid in pids]
        for pid in pids:
            reset_peak(pid)
        micro, summary = data
        for b in range(batches):
            start = time.perf_counter()
            for ms in micro:
                await cell.train_micro_step(ms)
            if b == batches - 1:  # gradients are held and Adam's state exists
                sizes = await cell.shard_numels()
            await cell.finish_batch(summary, 1)
            seconds = time.perf_counter() - start
        return idle, sizes, seconds

    with tempfile.TemporaryDirectory() as run_dir:
        (cell,) = start_cells("local", specs, run_dir=Path(run_dir))
        try:
            pids = [r.pid for r in getattr(cell.handle, "ranks", [cell.handle])]
            idle, sizes, seconds = asyncio.run(train(cell, pids))
            peaks = [proc_status(pid)["VmHWM"] for pid in pids]
        finally:
            stop_cells([cell])
    return [
        {
            "shard": s,
            "parameters": size["parameters"] * 4,
            "gradients": size["gradients"] * 4,
            "optimizer": size["optimizer"] * 4,
            "idle": idle[s],
            "peak": peaks[s],
            "seconds": seconds,
        }
        for s, size in enumerate(sizes)
    ]


def report_memory(runs: dict[int, list[dict[str, Any]]]) -> None:
    columns = ("parameters", "gradients", "optimizer")
    print(
        f"{'G':>5} {'rank':>4} {'params MB':>10} {'grads MB':>9} {'Adam MB':>8} "
        f"{'state MB':>9} {'idle RSS MB':>12} {'peak RSS MB':>12} {'growth MB':>10} "
        f"{'last batch s':>13}"
    )
    for shards, ranks in runs.items():
        for r in ranks:
            state = sum(r[c] for c in columns)
            print(
                f"{shards:>5} {r['shard']:>4} {r['parameters'] / MB:>10.2f} "
                f"{r['gradients'] / MB:>9.2f} {r['optimizer'] / MB:>8.2f} {state / MB:>9.2f} "
                f"{r['idle'] / MB:>12.0f} {r['peak'] / MB:>12.0f} "
                f"{(r['peak'] - r['idle']) / MB:>10.1f} {r['seconds']:>13.2f}"
            )
    one = runs[1][0]
    print(
        f"{'G2/G1':>5} {'rank':>4} {'params x':>10} {'grads x':>9} {'Adam x':>8} {'state x':>9} "
        f"{'idle RSS x':>12} {'peak RSS x':>12} {'growth x':>10}  (vs G=1's rank 0)"
    )
    for r in runs[2]:
        ratio = {c: r[c] / one[c] for c in (*columns, "idle", "peak")}
        state = sum(r[c] for c in columns) / sum(one[c] for c in columns)
        growth = (r["peak"] - r["idle"]) / max(one["peak"] - one["idle"], 1)
        print(
            f"{'':>5} {r['shard']:>4} {ratio['parameters']:>10.2f} "
            f"{ratio['gradients']:>9.2f} {ratio['optimizer']:>8.2f} {state:>9.2f} "
            f"{ratio['idle']:>12.2f} {ratio['peak']:>12.2f} {growth:>10.2f}"
        )


# --------------------------------------------------------------- (b) step time


class Replica:
    """The trainer's batch, unsharded: the same forward, objective, normalisation,
    clipping and Adam step on a plain HF model."""

    def __init__(self, model: PreTrainedModel, config: TrainerConfig) -> None:
        self.model, self.config = model, config
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(self.params, lr=config.lr)
        self.version = 0

    def train_micro_step(self, ms: MicroStep) -> float:
        self.model.train()
        hidden = packed_hidden_states(self.model.model, ms.input_ids, ms.position_ids)
        mask = ms.target_mask[:, 1:]
        head = self.model.get_output_embeddings()
        assert head is not None
        logprobs = token_logprobs(
            hidden[:, :-1][mask],
            head.weight,
            ms.input_ids[:, 1:][mask],
            temperature=self.config.temperature,
            chunk_tokens=self.config.logprob_chunk_tokens,
        )
        out = execution_gspo_loss(
            logprobs,
            ms.behaviour_logprobs[:, 1:][mask],
            ms.execution_index[:, 1:][mask],
            ms.advantages,
            token_weight_cap=self.config.token_weight_cap,
            clip_low=self.config.clip_low,
            clip_high=self.config.clip_high,
            variant=self.config.variant,
            trajectory_index=ms.trajectory_index[:, 1:][mask],
            normaliser=1.0,
        )
        out.loss.backward()
        return float(out.loss.detach())

    def finish_batch(self, summary: BatchSummary) -> None:
        token_sum = self.config.variant == "token_sum"
        normaliser = summary.num_target_tokens if token_sum else summary.num_executions
        with torch.no_grad():
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad /= max(normaliser, 1)
        torch.nn.utils.clip_grad_norm_(self.params, self.config.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = self.config.lr_at(self.version)
        self.optimizer.step()
        self.version += 1
        for p in self.params:
            p.grad = None


def timed(run: Any, data: Batch) -> float:
    micro, summary = data
    start = time.perf_counter()
    for ms in micro:
        run.train_micro_step(ms)
    if isinstance(run, Trainer):
        run.finish_batch(summary, 1)
    else:
        run.finish_batch(summary)
    return time.perf_counter() - start


def step_times(
    model_dir: Path, data: Batch, config: TrainerConfig, repeats: int
) -> tuple[list[float], list[float], float, float]:
    """Seconds per batch of each path, alternating which goes first; then the largest
    parameter difference between them and the largest move from the initial weights."""
    with quiet_progress_bars():
        sharded_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        replica_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    initial = {k: v.detach().clone() for k, v in replica_model.named_parameters()}
    trainer = Trainer(sharded_model, config, CellComm(0, 1, ""))
    replica = Replica(replica_model, config)
    timed(trainer, data)  # warm-up (and Adam's state)
    timed(replica, data)
    sharded, plain = [], []
    for r in range(repeats):
        if r % 2 == 0:
            sharded.append(timed(trainer, data))
            plain.append(timed(replica, data))
        else:
            plain.append(timed(replica, data))
            sharded.append(timed(trainer, data))
    ours = {k: full_tensor(v.detach()) for k, v in sharded_model.named_parameters()}
    theirs = dict(replica_model.named_parameters())
    diff = max((ours[k] - theirs[k].detach()).abs().max().item() for k in ours)
    moved = max((theirs[k].detach() - initial[k]).abs().max().item() for k in theirs)
    return sharded, plain, diff, moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repetitions")
    parser.add_argument("--tokens", type=int, default=16_384, help="tokens per batch")
    parser.add_argument("--median", type=int, default=384, help="median trajectory length")
    parser.add_argument("--micro-step-tokens", type=int, default=4096)
    parser.add_argument("--batches", type=int, default=2, help="batches per memory run")
    parser.add_argument("--repeats", type=int, default=7, help="step-time repetitions")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parse(parser, tokens=1024, median=64, micro_step_tokens=512, repeats=1)
    if args.batches < 2:  # the last batch's sizes include Adam's state: made by the first
        parser.error(
            f"--batches must be at least 2 (got {args.batches}):"
            " Adam's state exists from the second"
        )
    if args.quick:
        args.tokens, args.micro_step_tokens, args.repeats = 4096, 2048, 3

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model_dir = cached_tiny_model("demo")
    with quiet_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    vocab, params = model.config.vocab_size, sum(p.numel() for p in model.parameters())
    del model
    config = TrainerConfig(
        lr=1e-3, micro_step_tokens=args.micro_step_tokens, logprob_chunk_tokens=1024
    )
    data = batch(args.tokens, args.median, vocab, args.micro_step_tokens)
    micro, summary = data
    print(
        f"demo model: {params / 1e6:.2f}M params (fp32: {params * 4 / MB:.1f} MB), vocab {vocab}; "
        f"{args.threads} torch thread(s) per process; a batch: {summary.num_executions} "
        f"executions, {summary.num_tokens} tokens in {len(micro)} micro-steps of "
        f"<= {args.micro_step_tokens}"
    )

    print(f"\n(a) memory per rank, one cell of G ranks, {args.batches} batches")
    runs = {g: memory_run(model_dir, g, data, args.batches, config, args.threads) for g in (1, 2)}
    report_memory(runs)

    print(f"\n(b) step time per batch, one process, {args.repeats} alternating repetitions")
    sharded, plain, diff, moved = step_times(model_dir, data, config, args.repeats)
    ratios = [s / p for s, p in zip(sharded, plain, strict=True)]
    tokens = summary.num_tokens
    print(f"{'path':<36}{'median s':>10}{'min s':>8}{'tokens/s':>10}")
    for name, times in (("sharded (Trainer, FSDP2, G=1)", sharded), ("replica (plain HF)", plain)):
        med = statistics.median(times)
        print(f"{name:<36}{med:>10.3f}{min(times):>8.3f}{tokens / med:>10,.0f}")
    print(
        f"ratio sharded / replica: median of the {len(ratios)} per-repetition ratios "
        f"{statistics.median(ratios):.2f}x (range {min(ratios):.2f}-{max(ratios):.2f}); "
        f"best / best {min(sharded) / min(plain):.2f}x"
    )
    print(
        f"parameters after {args.repeats + 1} updates: max |sharded - replica| = {diff:.1e} "
        f"(weights moved by up to {moved:.1e})"
    )


if __name__ == "__main__":
    main()
