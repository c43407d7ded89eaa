"""Embedded engine throughput against HF ``model.generate`` on the same model and prompts.

At each concurrency, ``c`` requests of mixed prompt and output lengths are generated
(sampling, T=1) by (a) the embedded engine with all ``c`` submitted at once
(continuous batching) and (b) HF ``generate`` on one left-padded batch of the same
prompts, which runs until its longest request is done. Both count only the tokens
each request asked for. Each is run ``--repeat`` times, interleaved; the table shows
median rates and the median of the paired engine/HF ratios, all measured in this run.
On CUDA the engine replays captured decode graphs; ``--also-eager`` adds a column for
the same engine without them.

    python benchmarks/bench_engine.py                       # CPU, the tiny demo model
    python benchmarks/bench_engine.py --qwen3-0.6b --device cuda --dtype bfloat16 \
        --prompt 512 --new 256 --concurrency 1 8 32 128 --also-eager --repeat 2
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch

from _smoke import parse
from qwengyre.engines.base import GenerateRequest
from qwengyre.engines.embedded import EmbeddedEngine
from qwengyre.models import cached_tiny_model
from qwengyre.types import SamplingParams


def qwen3_0p6b_shaped(directory: Path, dtype: torch.dtype) -> Path:
    """A random-init model with Qwen3-0.6B's shape (no download), saved as HF files."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=151_936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40_960,
        tie_word_embeddings=True,
        eos_token_id=151_645,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(dtype).save_pretrained(directory)
    return directory


def workload(c: int, prompt: int, new: int, vocab: int) -> list[GenerateRequest]:
    """Mixed lengths: prompts and outputs spread over [x/2, x]."""
    g = torch.Generator().manual_seed(c)
    requests = []
    for i in range(c):
        p = prompt // 2 + int(torch.randint(0, prompt // 2 + 1, (1,), generator=g))
        n = new // 2 + int(torch.randint(0, new // 2 + 1, (1,), generator=g))
        ids = torch.randint(10, vocab - 10, (p,), generator=g).tolist()
        requests.append(
            GenerateRequest(
                f"b{c}-{i}",
                tuple(ids),
                SamplingParams(max_tokens=n, temperature=1.0, ignore_eos=True),
            )
        )
    return requests


def run_engine(engine: EmbeddedEngine, requests: list[GenerateRequest]) -> tuple[int, float]:
    async def go():  # type: ignore[no-untyped-def]
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    start = time.perf_counter()
    results = asyncio.run(go())
    wall = time.perf_counter() - start
    return sum(len(r.output_ids) for r in results), wall


def run_hf(model, requests: list[GenerateRequest], device: torch.device) -> tuple[int, float]:  # type: ignore[no-untyped-def]
    width = max(len(r.input_ids) for r in requests)
    ids = torch.zeros(len(requests), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, r in enumerate(requests):
        ids[row, width - len(r.input_ids) :] = torch.tensor(r.input_ids)
        mask[row, width - len(r.input_ids) :] = 1
    longest = max(r.sampling.max_tokens for r in requests)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=longest,
            min_new_tokens=longest,
            pad_token_id=0,
        )
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    assert out.shape[1] == width + longest
    return sum(r.sampling.max_tokens for r in requests), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--qwen3-0.6b", dest="big", action="store_true")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--also-eager", action="store_true", help="the engine without CUDA graphs")
    parser.add_argument("--repeat", type=int, default=3, help="runs per cell; medians shown")
    args = parse(parser, prompt=16, new=4, concurrency=[1, 2], repeat=1)
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = qwen3_0p6b_shaped(Path(tmp), dtype) if args.big else cached_tiny_model("demo")
        capacity = max(args.concurrency)
        engines = {
            name: EmbeddedEngine(
                model_dir,
                capacity=capacity,
                device=args.device,
                dtype=dtype,
                max_context=8192,
                cuda_graphs=graphs,
            )
            for name, graphs in [("engine", True), ("eager", False)][: 1 + args.also_eager]
        }
        model = engines["engine"].model  # HF generate runs on the very same weights
        vocab = model.config.vocab_size
        for engine in engines.values():
            run_engine(engine, workload(2, 16, 4, vocab))  # warm-up
        run_hf(model, workload(2, 16, 4, vocab), device)
        print(
            f"model {model_dir.name} on {args.device} ({args.dtype}); prompts ~{args.prompt},"
            f" outputs ~{args.new} (mixed lengths)"
        )
        names = "".join(f"{name + ' tok/s':>14}" for name in engines)
        print(f"concurrency{names}   HF generate tok/s   ratio (median of {args.repeat})")
        for c in args.concurrency:
            requests = workload(c, args.prompt, args.new, vocab)
            rates: list[list[float]] = [[] for _ in range(len(engines) + 1)]  # engines, HF
            for _ in range(args.repeat):  # interleaved, so drifts of a shared machine cancel
                for engine, measured in zip(engines.values(), rates, strict=False):
                    tokens, wall = run_engine(engine, requests)
                    measured.append(tokens / wall)
                tokens, wall = run_hf(model, requests, device)
                rates[-1].append(tokens / wall)
            ratio = statistics.median(e / h for e, h in zip(rates[0], rates[-1], strict=True))
            columns = "".join(f"{statistics.median(r):14.0f}" for r in rates[:-1])
            hf = statistics.median(rates[-1])
            print(f"{c:11d}{columns} {hf:19.0f} {ratio:7.2f}x", flush=True)
        for engine in engines.values():
            engine.close()


if __name__ == "__main__":
    main()
