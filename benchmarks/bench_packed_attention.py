"""Peak memory of a packed row's forward + backward against its length:
transformers' packed SDPA forward (a dense block-diagonal L x L mask) against
:func:`qwengyre.training.packed.packed_hidden_states` (the row's documents as one
right-padded causal batch, one forward call).

Each measurement runs in a fresh process (peak RSS above the loaded model, so one
measurement cannot inherit another's high-water mark); rows hold ``--documents``
equal documents. The packed path is skipped above ``--packed-max`` tokens, where its
quadratic mask would not fit in this machine's memory; the table then shows what the
batched path needs alone. Ratios are measured in this run.

    python benchmarks/bench_packed_attention.py                  # 2k, 8k, 32k tokens
    python benchmarks/bench_packed_attention.py --lengths 2048 4096 --documents 1
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from _smoke import parse

PROBE = "--probe"


def probe(mode: str, length: int, documents: int) -> dict[str, float]:
    """In this process: one forward + backward of a row; peak RSS growth and seconds."""
    from transformers import AutoModelForCausalLM

    from qwengyre.models import cached_tiny_model
    from qwengyre.training.packed import packed_hidden_states

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(cached_tiny_model("demo"), dtype=torch.float32)
    size = length // documents
    ids = torch.randint(0, model.config.vocab_size, (1, size * documents))
    positions = torch.arange(size).repeat(documents)[None]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    if mode == "packed":
        out = model.model(input_ids=ids, position_ids=positions, use_cache=False)
        hidden = out.last_hidden_state
    else:
        hidden = packed_hidden_states(model.model, ids, positions)
    hidden.float().pow(2).mean().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    return {"peak_mb": peak / 1024, "seconds": time.perf_counter() - start}


def measure(mode: str, length: int, documents: int) -> dict[str, float]:
    argv = [sys.executable, __file__, PROBE, mode, str(length), str(documents)]
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--documents", type=int, default=4, help="documents per row")
    parser.add_argument("--packed-max", type=int, default=8192, help="longest packed row run")
    args = parse(parser, lengths=[256], documents=2, packed_max=256)
    print(f"demo model, fp32, 1 thread, {args.documents} documents per row")
    print(f"{'tokens':>7} {'packed MB':>10} {'batched MB':>11} {'memory x':>9} {'time x':>7}")
    first: dict[str, float] | None = None
    for length in args.lengths:
        batched = measure("batched", length, args.documents)
        packed = measure("packed", length, args.documents) if length <= args.packed_max else None
        if packed is None:
            cells = f"{'skipped':>10} {batched['peak_mb']:>11.0f} {'':>9} {'':>7}"
        else:
            cells = (
                f"{packed['peak_mb']:>10.0f} {batched['peak_mb']:>11.0f}"
                f" {packed['peak_mb'] / batched['peak_mb']:>8.1f}x"
                f" {packed['seconds'] / batched['seconds']:>6.1f}x"
            )
        print(f"{length:>7} {cells}")
        if first is None:
            first = batched
        else:
            growth, longer = batched["peak_mb"] / first["peak_mb"], length / args.lengths[0]
            print(f"{'':>7} batched memory x{growth:.1f} for x{longer:.0f} tokens")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == PROBE:
        print(json.dumps(probe(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
    else:
        main()
