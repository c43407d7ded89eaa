"""Host memory of the SGLang tensor route's reads from the weights boards, in one run.

A model-sized set of fp32 tensors is published into ``--shards`` shared-memory boards.
Two fresh processes (each its own resource tracker) then read the whole model from
them through :meth:`~qwengyre.cluster.weights.BoardShards.by_name`:

- ``whole``: every name at once, which is what the route did before it read by bucket;
- ``buckets``: one bucket of at most ``--bucket-mb`` at a time, as
  :class:`~qwengyre.engines.sglang.SGLangEngine` reads them now, each bucket dropped
  before the next one (as the route does once it has sent a bucket).

Each reports the most private memory (``RssAnon``, Linux) the tensors it read held at
once; the boards' shared pages are not counted. The last column is that over the
model's size.

    python benchmarks/bench_weight_buckets.py [--layers 24] [--width 1024] [--shards 2]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import uuid
from pathlib import Path

import torch

from _smoke import parse
from qwengyre.cluster.weights import BoardShards, SharedWeights, board_name, shard_layout
from qwengyre.engines.sglang import tensor_buckets
from qwengyre.training.sharding import shard_rows


def model(layers: int, width: int, device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    """A transformer-shaped set of fp32 tensors: four width x width matrices a layer."""
    return [
        (f"layers.{i}.{part}.weight", torch.randn(width, width, device=device))
        for i in range(layers)
        for part in ("q", "k", "v", "o")
    ]


def private_mb() -> float:
    """This process's private resident memory (``RssAnon``): the boards' pages it reads
    are shared and not counted, the copies it makes are."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


def read(mode: str, base: str, layers: int, width: int, shards: int, bucket_mb: int) -> float:
    """Read the boards at ``base`` as ``mode`` does; the most private memory held by the
    tensors read, in MB (memory after each read less memory before the first)."""
    meta = [(name, t.to("meta")) for name, t in model(layers, width, "meta")]
    source = BoardShards("shared_memory", base, meta, shards).by_name(version=1)
    before = private_mb()
    if mode == "whole":
        buckets = [list(source.meta)]
    else:
        buckets = tensor_buckets(source.meta, bucket_mb << 20)
    held = 0.0
    for names in buckets:
        tensors = source.read(names)
        held = max(held, private_mb() - before)
        del tensors  # as the route does once it has sent a bucket
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--read", nargs=6, help=argparse.SUPPRESS)  # a reader process
    args = parse(parser, layers=2, width=64, bucket_mb=1)
    if args.read:
        mode, base, *shape = args.read
        print(read(mode, base, *map(int, shape)))
        return
    full = model(args.layers, args.width)
    size_mb = sum(t.numel() * t.element_size() for _, t in full) / 2**20
    base = f"qg-bench-{uuid.uuid4().hex[:12]}"
    boards = []
    try:
        for r in range(args.shards):
            board = SharedWeights(
                board_name(base, r), shard_layout(full, args.shards, r), create=True
            )
            board.write(
                [(n, t.narrow(0, *shard_rows(t.shape[0], args.shards, r))) for n, t in full], 1
            )
            boards.append(board)
        del full
        print(f"model {size_mb:.0f} MB in {args.shards} boards; buckets of {args.bucket_mb} MB")
        print("| read | private memory held (MB) | over the model |")
        print("|---|---|---|")
        for mode in ("whole", "buckets"):
            shape = [str(v) for v in (args.layers, args.width, args.shards, args.bucket_mb)]
            argv = [sys.executable, __file__, "--read", mode, base, *shape]
            held = float(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)
            print(f"| {mode} | {held:.0f} | {held / size_mb:.2f} |", flush=True)
    finally:
        for board in boards:
            board.close()


if __name__ == "__main__":
    main()
