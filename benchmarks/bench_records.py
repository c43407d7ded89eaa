"""Bytes per trained token of the ready-group ledger and of the proxy's store, and what a
resume costs against the ledger's size, measured in one run.

The ledger before: one JSON line per group (``GroupSample.to_json``), parsed whole on
resume. After: one npz file per group (:mod:`qwengyre.runtime.ledger`), listed on resume
and each group read only when it is taken for training. Groups are realistic in shape:
8 executions of ``--trajectories`` trajectories of 2-8k tokens, a quarter of each call
injected (no log-prob, version -1), the rest sampled with fp32 log-probs as engines give
them. Resume is :func:`qwengyre.apps.train.resume_state` on a run directory holding only
the ledger; its peak memory is traced (tracemalloc) in a run of its own.

    python benchmarks/bench_records.py [--groups 10 100 1000] [--json-groups 10 100]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from _smoke import parse
from qwengyre.apps.train import resume_state
from qwengyre.proxy.store import Store
from qwengyre.proxy.tito import Turn
from qwengyre.proxy.types import Message
from qwengyre.runtime.ledger import LEDGER_DIR, Ledger
from qwengyre.training.buffers import ExecutionSample, GroupSample
from qwengyre.trajectories.selection import AdmittedTrajectory
from qwengyre.trajectories.tree import Node, NodeMeta

VOCAB = 151_936  # Qwen's
CALL_TOKENS = 500  # tokens a call adds: a quarter injected, the rest sampled


def trajectory(rng: np.random.Generator, execution_id: str, length: int) -> AdmittedTrajectory:
    injected = np.zeros(length, dtype=bool)
    for start in range(0, length, CALL_TOKENS):
        injected[start : start + CALL_TOKENS // 4] = True
    logprobs = np.log(rng.uniform(0.05, 1.0, length)).astype(np.float32)
    versions = np.where(injected, -1, 7 + np.arange(length) // 3000)
    return AdmittedTrajectory(
        leaf=length,
        request_class="main.task",
        nodes=tuple(range(length // CALL_TOKENS + 1)),
        input_ids=tuple(rng.integers(0, VOCAB, length).tolist()),
        target_mask=tuple((~injected).tolist()),
        behaviour_logprobs=tuple(np.where(injected, 0.0, logprobs).tolist()),
        versions=tuple(versions.tolist()),
        execution_id=execution_id,
        advantage=0.25,
    )


def group(rng: np.random.Generator, gid: int, trajectories: int) -> GroupSample:
    executions = tuple(
        ExecutionSample(
            f"ex_{gid}_{e}",
            float(rng.normal()),
            tuple(
                trajectory(rng, f"ex_{gid}_{e}", int(rng.integers(2000, 8001)))
                for _ in range(trajectories)
            ),
        )
        for e in range(8)
    )
    return GroupSample(gid, gid // 4, executions)


def tokens(g: GroupSample) -> int:
    return sum(e.num_tokens for e in g.executions)


def read_json_ledger(path: Path) -> list[GroupSample]:
    """What ``--resume`` did with the JSON ledger: parse every line."""
    with path.open(encoding="utf-8") as f:
        return [GroupSample.from_json(json.loads(line)) for line in f if line.strip()]


def measured(call: Callable[[], Any]) -> tuple[float, float]:
    """Seconds of ``call`` and its peak traced memory in MiB (a second, traced call)."""
    start = time.perf_counter()
    call()
    seconds = time.perf_counter() - start
    tracemalloc.start()
    call()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return seconds, peak / 2**20


def ledger_sizes(samples: list[GroupSample]) -> None:
    count = sum(tokens(g) for g in samples)
    as_json = sum(len(json.dumps(g.to_json(), separators=(",", ":"))) + 1 for g in samples)
    with tempfile.TemporaryDirectory() as tmp:
        ledger = Ledger(Path(tmp))
        for g in samples:
            ledger.append(g, {})
        npz = sum(ledger.path(g.group_id).stat().st_size for g in samples)
        start = time.perf_counter()
        for g in samples:
            ledger.load(g.group_id)
        load_s = (time.perf_counter() - start) / len(samples)
    print(f"ledger, {len(samples)} groups of {count // len(samples):,} tokens on average:")
    print(f"  JSON lines (before): {as_json / count:6.2f} B/token")
    print(f"  npz files (after):   {npz / count:6.2f} B/token  ({as_json / npz:.1f}x smaller)")
    print(f"  reading one group when it is taken: {load_s * 1e3:.0f} ms")


def resumes(samples: list[GroupSample], sizes: list[int], json_sizes: list[int]) -> None:
    print("resume (resume_state) against ledger size:")
    print(f"  {'groups':>7} {'format':>5} {'ledger MB':>10} {'seconds':>8} {'peak MiB':>9}")
    found: dict[tuple[int, str], tuple[float, float]] = {}
    for n in sorted(set(sizes) | set(json_sizes)):
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp)
            rows = [replace(samples[i % len(samples)], group_id=i) for i in range(n)]
            if n in sizes:
                ledger = Ledger(run_dir / LEDGER_DIR)
                for g in rows:
                    ledger.append(g, {})
                disk = sum(p.stat().st_size for p in ledger.directory.iterdir())
                seconds, peak = found[n, "npz"] = measured(partial(resume_state, run_dir, run_dir))
                print(f"  {n:>7} {'npz':>5} {disk / 1e6:>10.0f} {seconds:>8.3f} {peak:>9.2f}")
            if n in json_sizes:
                path = run_dir / "ledger.jsonl"
                with path.open("w", encoding="utf-8") as f:
                    for g in rows:
                        f.write(json.dumps(g.to_json(), separators=(",", ":")) + "\n")
                disk = path.stat().st_size
                seconds, peak = found[n, "JSON"] = measured(partial(read_json_ledger, path))
                print(f"  {n:>7} {'JSON':>5} {disk / 1e6:>10.0f} {seconds:>8.3f} {peak:>9.2f}")
    for n in sorted(set(sizes) & set(json_sizes)):
        (npz_s, npz_mib), (json_s, json_mib) = found[n, "npz"], found[n, "JSON"]
        print(
            f"  {n} groups: npz resumes {json_s / npz_s:.0f}x faster "
            f"with {json_mib / npz_mib:.0f}x less peak memory than JSON"
        )
    grown = sorted(sizes)
    if len(grown) > 1:
        (s0, m0), (s1, m1) = found[grown[0], "npz"], found[grown[-1], "npz"]
        print(
            f"  npz, {grown[-1] // grown[0]}x the groups: {s1 / s0:.1f}x the time, "
            f"{m1 / m0:.1f}x the peak memory"
        )


def store_size(rng: np.random.Generator, calls: int) -> None:
    meta = NodeMeta(
        request_class="main.task",
        agent_id="main",
        engine="e0",
        policy_version=7,
        started_s=0.0,
        finished_s=1.0,
        finish_reason="stop",
    )
    injected = sampled = 0
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "proxy.sqlite")
        store.add_execution("ex", "hash", 0.0)
        for i in range(calls):
            n_in, n_out = CALL_TOKENS // 4, CALL_TOKENS - CALL_TOKENS // 4
            logprobs = np.log(rng.uniform(0.05, 1.0, n_out)).astype(np.float32).tolist()
            node = Node(
                id=i,
                parent=i - 1 if i else None,
                input_ids=rng.integers(0, VOCAB, n_in).tolist(),
                output_ids=rng.integers(0, VOCAB, n_out).tolist(),
                logprobs=logprobs,
                versions=[7] * n_out,
                meta=meta,
            )
            turn = Turn(
                node_id=i,
                parent=node.parent,
                new_messages=(Message(role="user", content="x"), Message(role="assistant")),
                tools=(),
                toolset="none",
                length=2 * (i + 1),
            )
            store.add_call("ex", node, turn)
            injected, sampled = injected + n_in, sampled + n_out
        store.close()
        disk = sum(p.stat().st_size for p in Path(tmp).iterdir())
    count = injected + sampled
    blobs = 4 * count + 8 * sampled
    print(f"proxy store, {calls} calls of {CALL_TOKENS} tokens (a quarter injected):")
    print(f"  float32 log-probs (after): {disk / count:6.2f} B/token on disk")
    print(f"  float64 log-probs (before): {(disk + 4 * sampled) / count:6.2f} B/token")
    print(f"  token arrays alone: {blobs / count:.2f} B/token")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--json-groups", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--distinct", type=int, default=4, help="distinct groups generated")
    parser.add_argument("--trajectories", type=int, default=3, help="per execution")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--store-calls", type=int, default=400, help="calls in the store")
    args = parse(parser, groups=[10], json_groups=[10], distinct=2, store_calls=40)
    rng = np.random.default_rng(args.seed)
    samples = [group(rng, gid, args.trajectories) for gid in range(args.distinct)]
    ledger_sizes(samples)
    resumes(samples, args.groups, args.json_groups)
    store_size(rng, args.store_calls)


if __name__ == "__main__":
    main()
