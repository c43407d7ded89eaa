"""The real serving engines (vLLM, SGLang) on one GPU, launched through qwengyre's own
code, against an HF forward, the embedded engine and HF ``generate``.

No download: a Qwen3-0.6B-shaped model with random weights (``bench_engine``'s, tied
embeddings) is saved into a temporary directory in the serving dtype, with a byte-level
tokenizer that has a token for every id of its vocabulary (:func:`byte_tokenizer`: the
servers need one to start and to decode what they sample), and beside it a copy with
noise on every weight (the update). The embedded engine (in this process) and each
server engine whose package its python imports (vLLM: ``$QWENGYRE_VLLM_PYTHON``, SGLang:
``$QWENGYRE_SGLANG_PYTHON``, else this python) are put through the same steps:

- **start**: seconds from launch (:func:`~qwengyre.engines.launch.launch`) until
  :func:`~qwengyre.engines.launch.wait_until_healthy` returns (the embedded engine: its
  constructor);
- **log-probs**: a greedy and a sampled (T=1) output of ``--check-tokens`` tokens; the
  largest ``|served - HF|`` of their log-probs, HF being a forward of the same weights
  in the same dtype on the same device;
- **update**: ``update_weights(WeightsOnDisk(copy))``, then the same against HF with the
  new weights (``new``) and with the old ones (``old``: what a layer that kept its old
  weights would match); ``follows`` when the served log-probs are nearer the new;
- **memory**: ``nvidia-smi --query-gpu=memory.used`` of the device before
  ``release_memory``, released, and after ``resume_memory`` (vLLM runs with
  ``--enable-sleep-mode``, SGLang with ``--enable-memory-saver``), then one request;
- **throughput**: output tokens/s of ``c`` concurrent requests (``--concurrency``) of
  ``--new`` tokens after ``--prompt`` random prompt tokens (T=1, ``ignore_eos``) through
  qwengyre's client, after a short warm-up at the same concurrency; HF ``generate`` runs
  the same prompts as one batch. Ratios to the embedded engine and to HF, all measured
  in this run.

An engine whose package is missing prints ``vllm: not installed (pip install vllm)``
and the rest goes on; a failing step ends its engine's row with a note. No server starts
after ``--budget-s`` seconds. One table at the end; the rows as JSON in
``$OUT/gpu-engines.json`` (and the servers' logs beside it) when ``$OUT`` is set.

    python benchmarks/gpu_engines.py                      # one GPU, both engines: ~6 min (est.)
    python benchmarks/gpu_engines.py --engines vllm       # one server engine only
    python benchmarks/gpu_engines.py --device cpu --smoke  # smoke run: the demo-sized model
        # in fp32, small loads; vLLM on the CPU when $QWENGYRE_VLLM_PYTHON is set
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import itertools
import json
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from _smoke import parse
from bench_engine import qwen3_0p6b_shaped, run_hf
from qwengyre.engines.base import GenerateRequest, GenerateResult, InferenceEngine, WeightsOnDisk
from qwengyre.engines.embedded import EmbeddedEngine, behaviour_logprobs
from qwengyre.models import cached_tiny_model
from qwengyre.types import SamplingParams

try:  # the server engines' clients need aiohttp, which a bare GPU image may lack
    from qwengyre.engines import launch, sglang, vllm
except ImportError as missing:
    CLIENTS_MISSING: str | None = str(missing)
else:
    CLIENTS_MISSING = None

CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
INSTALL = {"vllm": "pip install vllm", "sglang": "pip install 'sglang[all]'"}

# ------------------------------------------------------------------------- the model


def byte_tokenizer(vocab_size: int, eos_id: int) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with a token for every id below ``vocab_size``: the 256
    bytes, filler tokens of 2 or 3 bytes (no merges, so encoding never makes them; they
    decode to their bytes) and Qwen's control tokens at ``eos_id - 2 .. eos_id``."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    fillers = ("".join(p) for n in (2, 3) for p in itertools.product(alphabet, repeat=n))
    tokens = alphabet + list(itertools.islice(fillers, vocab_size - len(alphabet)))
    tokens[eos_id - 2 : eos_id + 1] = CONTROL_TOKENS
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(CONTROL_TOKENS))
    assert tokenizer.get_vocab_size() == vocab_size
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=CONTROL_TOKENS[2], pad_token=CONTROL_TOKENS[0]
    )


def build_models(root: Path, tiny: bool, dtype: torch.dtype) -> tuple[Path, Path]:
    """(the model, its update) as HF directories under ``root``: Qwen3-0.6B-shaped, or
    with ``tiny`` the weights of the demo tiny model."""
    old, new = root / "v0", root / "v1"
    if tiny:
        demo = AutoModelForCausalLM.from_pretrained(cached_tiny_model("demo"), dtype=dtype)
        demo.save_pretrained(old)
    else:
        qwen3_0p6b_shaped(old, dtype)
    config = AutoConfig.from_pretrained(old)
    byte_tokenizer(config.vocab_size, config.eos_token_id).save_pretrained(old)
    model = AutoModelForCausalLM.from_pretrained(old, dtype=torch.float32)
    noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():  # std 0.02: the init's own scale
            p.add_(torch.randn(p.shape, generator=noise) * 0.02)
    shutil.copytree(old, new, ignore=shutil.ignore_patterns("*.safetensors*"))
    model.to(dtype).save_pretrained(new)
    return old, new


def hf_reference(path: Path, dtype: torch.dtype, device: torch.device) -> Any:
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def max_diff(results: Sequence[GenerateResult], prompt: Sequence[int], model: Any) -> float:
    """The largest ``|served - HF|`` log-prob over ``results`` (outputs of ``prompt``)."""
    worst = 0.0
    for result in results:
        ids = torch.tensor([[*prompt, *result.output_ids]], device=model.device)
        with torch.inference_mode():
            logits = model(ids).logits[0, len(prompt) - 1 : -1]
        expected = behaviour_logprobs(logits, ids[0, len(prompt) :], 1.0).cpu()
        worst = max(worst, (torch.tensor(result.logprobs) - expected).abs().max().item())
    return worst


# ------------------------------------------------------------------------ the steps


@dataclass
class Row:
    engine: str
    start_s: float | None = None
    greedy: float | None = None  # max |served - HF| log-prob
    sampled: float | None = None
    updated: float | None = None  # after the update, against HF with the new weights
    stale: float | None = None  # the same outputs against HF with the old weights
    memory_mib: list[int | None] | None = None  # before release, released, resumed
    rates: dict[int, float] = field(default_factory=dict)  # concurrency: output tokens/s
    note: str = ""

    @property
    def follows(self) -> bool | None:
        if self.updated is None or self.stale is None:
            return None
        return self.updated < self.stale


@dataclass
class Bench:
    """What every engine is measured with."""

    args: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    old_dir: Path
    new_dir: Path
    old: Any  # the HF references, on the device
    new: Any
    logs: Path
    vocab: int
    ids: itertools.count[int] = field(default_factory=itertools.count)

    def request(self, ids: Sequence[int], max_tokens: int, temperature: float) -> GenerateRequest:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True)
        return GenerateRequest(f"bench-{next(self.ids)}", tuple(ids), sampling)

    def prompts(self, count: int) -> list[list[int]]:
        """``count`` random prompts of ``--prompt`` tokens, the same for every engine."""
        g = torch.Generator().manual_seed(count)
        return torch.randint(10, self.vocab - 10, (count, self.args.prompt), generator=g).tolist()

    @property
    def context(self) -> int:
        return self.args.prompt + max(self.args.new, self.args.check_tokens) + 16


def say(row: Row, text: str) -> None:
    print(f"{row.engine}: {text}", flush=True)


async def check_logprobs(engine: InferenceEngine, row: Row, bench: Bench) -> None:
    """Log-probs against HF, then again after the update (module docstring)."""
    prompt = bench.prompts(1)[0]
    tokens = bench.args.check_tokens

    async def outputs() -> list[GenerateResult]:
        greedy = await engine.generate(bench.request(prompt, tokens, 0.0))
        return [greedy, await engine.generate(bench.request(prompt, tokens, 1.0))]

    greedy, sampled = await outputs()
    row.greedy, row.sampled = (max_diff([r], prompt, bench.old) for r in (greedy, sampled))
    say(row, f"log-probs vs HF: greedy {row.greedy:.4f}, sampled {row.sampled:.4f}")
    started = time.monotonic()
    await engine.update_weights(WeightsOnDisk(str(bench.new_dir)), version=1)
    after = await outputs()
    row.updated, row.stale = max_diff(after, prompt, bench.new), max_diff(after, prompt, bench.old)
    say(
        row,
        f"updated in {time.monotonic() - started:.1f} s; log-probs vs new {row.updated:.4f}, "
        f"vs old {row.stale:.4f}",
    )


def gpu_memory_mib(device: torch.device) -> int | None:
    """``nvidia-smi``'s memory.used of ``device`` in MiB; None without a GPU."""
    if device.type != "cuda":
        return None
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    which = f"GPU-{uuid}" if uuid else str(device.index or 0)
    query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", which]
    return int(subprocess.run(query, capture_output=True, text=True, check=True).stdout.strip())


async def release_and_resume(engine: InferenceEngine, row: Row, bench: Bench) -> None:
    before = gpu_memory_mib(bench.device)
    await engine.release_memory()
    await asyncio.sleep(1)  # the driver's count lags a moment
    released = gpu_memory_mib(bench.device)
    await engine.resume_memory()
    row.memory_mib = [before, released, gpu_memory_mib(bench.device)]
    result = await engine.generate(bench.request(bench.prompts(1)[0], 4, 1.0))
    if len(result.output_ids) != 4:
        raise RuntimeError(f"after resume_memory it answered {result}")
    say(row, f"released and resumed; GPU MiB before/released/resumed {row.memory_mib}")


async def throughput(engine: InferenceEngine, row: Row, bench: Bench) -> None:
    for c in bench.args.concurrency:
        prompts = bench.prompts(c)
        warmup = [bench.request(p, 8, 1.0) for p in prompts]
        await asyncio.gather(*(engine.generate(r) for r in warmup))
        requests = [bench.request(p, bench.args.new, 1.0) for p in prompts]
        started = time.perf_counter()
        results = await asyncio.wait_for(
            asyncio.gather(*(engine.generate(r) for r in requests)), bench.args.request_timeout
        )
        row.rates[c] = sum(len(r.output_ids) for r in results) / (time.perf_counter() - started)
        say(row, f"{c} concurrent: {row.rates[c]:,.0f} output tokens/s")


async def exercise(engine: InferenceEngine, row: Row, bench: Bench) -> None:
    """The steps after the start; a failure names its step."""
    steps = (check_logprobs, release_and_resume, throughput)
    for step in steps:
        try:
            await step(engine, row, bench)
        except Exception as exc:
            raise RuntimeError(f"{step.__name__}: {describe(exc)}") from exc


def describe(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:160]}" if first else type(exc).__name__


# ----------------------------------------------------------------------- the engines


def run_embedded(bench: Bench) -> Row:
    row = Row("embedded")
    started = time.monotonic()
    engine = EmbeddedEngine(
        bench.old_dir,
        capacity=max(bench.args.concurrency),
        device=str(bench.device),
        dtype=bench.dtype,
        max_context=bench.context,
    )
    row.start_s = time.monotonic() - started
    try:
        asyncio.run(exercise(engine, row, bench))
    except Exception as exc:
        row.note = describe(exc)
        say(row, row.note)
    finally:
        engine.close()
    del engine
    free(bench.device)
    return row


def run_hf_generate(bench: Bench) -> Row:
    """HF ``generate`` of the old weights: each load's prompts as one batch."""
    row = Row("HF generate")
    try:
        run_hf(bench.old, [bench.request(p, 4, 1.0) for p in bench.prompts(2)], bench.device)
        for c in bench.args.concurrency:
            requests = [bench.request(p, bench.args.new, 1.0) for p in bench.prompts(c)]
            tokens, wall = run_hf(bench.old, requests, bench.device)
            row.rates[c] = tokens / wall
            say(row, f"{c} in one batch: {row.rates[c]:,.0f} output tokens/s")
    except Exception as exc:
        row.note = describe(exc)
        say(row, row.note)
    free(bench.device)
    return row


def server_spec(name: str, bench: Bench, port: int, key: str) -> Any:
    """How to launch server engine ``name`` on the bench's model and device."""
    env = {"HF_HUB_OFFLINE": "1"}
    if bench.device.index is not None and "CUDA_VISIBLE_DEVICES" not in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = str(bench.device.index)
    dtype = str(bench.dtype).removeprefix("torch.")
    share = str(bench.args.server_memory)
    model = str(bench.old_dir)
    extra: tuple[str, ...]
    if name == "sglang":
        extra = ("--mem-fraction-static", share, "--dtype", dtype)
        return sglang.SGLangServerSpec(
            model=model,
            port=port,
            api_key=key or None,
            key_file=str(bench.logs / "sglang-server.yaml") if key else None,
            max_context=bench.context,
            extra_args=extra,
            extra_env=env,
        )
    if bench.device.type == "cuda":
        extra = ("--enable-sleep-mode", "--gpu-memory-utilization", share)
    else:
        extra, env = ("--enforce-eager",), {**env, "VLLM_CPU_KVCACHE_SPACE": "1"}
    return vllm.VLLMServerSpec(
        model=model,
        port=port,
        api_key=key,
        dtype=dtype,
        max_context=bench.context,
        extra_args=extra,
        extra_env=env,
    )


def unavailable(name: str, bench: Bench) -> str | None:
    """Why server engine ``name`` cannot run here, or None."""
    if bench.device.type != "cuda":
        if name == "sglang":
            return "skipped: SGLang serves on a GPU only"
        if not os.environ.get("QWENGYRE_VLLM_PYTHON"):
            return "skipped on CPU: set QWENGYRE_VLLM_PYTHON (scripts/vllm_venv.sh)"
    if CLIENTS_MISSING is not None:
        return f"not installed ({INSTALL[name]}; qwengyre's client: {CLIENTS_MISSING})"
    spec = server_spec(name, bench, 0, "")
    found = launch.importable(spec.python, spec.package, spec.env())
    return None if found else f"not installed ({INSTALL[name]})"


def run_server(name: str, bench: Bench) -> Row:
    row = Row(name)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    key = secrets.token_hex(16)
    spec = server_spec(name, bench, port, key)
    client = sglang.SGLangEngine if name == "sglang" else vllm.VLLMEngine
    log = bench.logs / f"{name}-server.log"
    started = time.monotonic()
    with log.open("wb") as out:
        process = launch.launch(spec, stdout=out, stderr=subprocess.STDOUT)

    async def serve() -> None:
        capacity = max(bench.args.concurrency)
        async with client(spec.base_url, name, capacity=capacity, api_key=key) as engine:
            await launch.wait_until_healthy(engine, bench.args.start_timeout, process=process)
            row.start_s = time.monotonic() - started
            say(row, f"healthy after {row.start_s:.1f} s")
            await exercise(engine, row, bench)

    try:
        asyncio.run(serve())
    except Exception as exc:
        row.note = describe(exc)
        say(row, f"{row.note}; the server's log ends:")
        print(log.read_text(errors="replace")[-3000:], flush=True)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:  # vLLM drains requests in flight first
            process.kill()
            process.wait()
    return row


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------- the table


def table(rows: list[Row], concurrency: Sequence[int]) -> str:
    embedded, hf = rows[0].rates, rows[1].rates

    def num(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    head = f"{'engine':<12}{'start s':>8}{'greedy':>8}{'sampled':>8}{'new':>8}{'old':>8}"
    head += f"{'follows':>8}  {'GPU MiB before/released/resumed':<32}"
    head += "".join(f"{f'c={c} tok/s':>13}{'x emb':>7}{'x HF':>7}" for c in concurrency)
    lines = [head + "  note", "-" * (len(head) + 6)]
    for r in rows:
        follows = {None: "-", True: "yes", False: "NO"}[r.follows]
        memory = "/".join(num(m, "d") for m in r.memory_mib) if r.memory_mib else "-"
        line = f"{r.engine:<12}{num(r.start_s, '.1f'):>8}{num(r.greedy, '.4f'):>8}"
        line += f"{num(r.sampled, '.4f'):>8}{num(r.updated, '.4f'):>8}{num(r.stale, '.4f'):>8}"
        line += f"{follows:>8}  {memory:<32}"
        for c in concurrency:
            rate = r.rates.get(c)
            vs_emb = rate / embedded[c] if rate and embedded.get(c) else None
            vs_hf = rate / hf[c] if rate and hf.get(c) else None
            line += f"{num(rate, ',.0f'):>13}{num(vs_emb, '.2f'):>7}{num(vs_hf, '.2f'):>7}"
        lines.append(f"{line}  {r.note}")
    return "\n".join(lines)


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--engines", nargs="+", default=["vllm", "sglang"], choices=list(INSTALL))
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--new", type=int, default=256, help="output tokens per request")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--check-tokens", type=int, default=64, help="per log-prob check")
    parser.add_argument(
        "--server-memory", type=float, default=0.35, help="a server's share of the GPU memory"
    )
    parser.add_argument("--start-timeout", type=float, default=300.0, help="until healthy, s")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="per load, s")
    parser.add_argument("--budget-s", type=float, default=420.0, help="no server after this")
    # The smoke run: the demo tiny model in fp32, small loads.
    return parse(parser, argv, prompt=32, new=16, concurrency=[4, 8], check_tokens=16)


def main() -> None:
    args = arguments()
    start = time.perf_counter()
    device = torch.device(args.device)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    with tempfile.TemporaryDirectory() as tmp:
        logs = out or Path(tmp)
        old_dir, new_dir = build_models(Path(tmp), args.smoke, dtype)
        print(f"models built in {time.perf_counter() - start:.0f} s, {dtype}, on {device}")
        old, new = (hf_reference(p, dtype, device) for p in (old_dir, new_dir))
        vocab = int(old.config.vocab_size)
        bench = Bench(args, device, dtype, old_dir, new_dir, old, new, logs, vocab)
        rows = [run_embedded(bench), run_hf_generate(bench)]
        for name in args.engines:
            why = unavailable(name, bench)
            if why is None and time.perf_counter() - start > args.budget_s:
                why = "skipped: time budget"
            if why is not None:
                rows.append(Row(name, note=why))
                say(rows[-1], why)
                continue
            rows.append(run_server(name, bench))
    shape = "demo tiny" if args.smoke else "Qwen3-0.6B-shaped"
    print(
        f"\n{shape} model, {dtype}, {device}; log-prob columns: max |served - HF forward| "
        f"({args.check_tokens} tokens greedy and T=1; new/old: after the update); "
        f"{args.prompt} prompt + {args.new} new tokens per request, T=1"
    )
    print(table(rows, args.concurrency))
    print(f"total {time.perf_counter() - start:.0f} s")
    if out is not None:
        report = {
            "device": str(device),
            "dtype": str(dtype),
            "model": shape,
            "args": vars(args),
            "rows": [{**dataclasses.asdict(r), "follows": r.follows} for r in rows],
        }
        (out / "gpu-engines.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
