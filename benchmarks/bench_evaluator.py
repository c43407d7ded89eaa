"""What an execution pays for its evaluation: the model evaluator against a command evaluator.

Each execution's workspace is a git repository of --files Python files of about 1 kB,
one of them changed after the commit. Three evaluators assess every workspace once
(:func:`qwengyre.rollout.evaluation.evaluate_once`, the call an execution makes),
interleaved so that a busy moment of the shared machine weighs on all three alike:

- ``command``: ``python -c`` printing ``{"score": 1.0, "valid": true}`` (a grader's
  floor: one interpreter start);
- ``model``: the judge (``"type": "model"``, api --api) over HTTP to a qwengyre proxy
  in this process whose scripted engine answers ``SCORE: 0.8``; the artifact is the
  diff and every file, at most --max-chars characters (the proxy tokenises and
  records each prompt: a real judge's generation time comes on top);
- ``model+tests``: the same judge with the command above as its ``tests``.

Printed: each one's median and 90th percentile wall time per execution, the prompt's
size, and the ratios to ``command`` (measured in this one run).

    python benchmarks/bench_evaluator.py            # 40 executions
    python benchmarks/bench_evaluator.py --smoke    # 3 executions
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from aiohttp import web
from transformers import AutoTokenizer

from _smoke import parse
from qwengyre.engines.scripted import ScriptedEngine
from qwengyre.models import cached_tiny_model
from qwengyre.proxy.render import ChatRenderer
from qwengyre.proxy.routing import Router
from qwengyre.proxy.server import ProxyServer
from qwengyre.proxy.store import Store
from qwengyre.rollout.evaluation import Evaluator, evaluate_once
from qwengyre.rollout.model_evaluator import build_prompt, gather_artifact
from qwengyre.rollout.tasks import CommandEvaluator, ModelEvaluator

KEY_ENV = "QWENGYRE_BENCH_JUDGE_KEY"
GRADER = [sys.executable, "-c", 'print(\'{"score": 1.0, "valid": true}\')']


def workspace(root: Path, index: int, files: int) -> Path:
    """A git repository of ``files`` modules, the first changed after its commit."""
    path = root / f"ws{index}"
    (path / "src").mkdir(parents=True)
    for number in range(files):
        body = "".join(f"def f{number}_{i}(x):\n    return x + {i}\n\n" for i in range(30))
        (path / "src" / f"m{number}.py").write_text(body)

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=path, check=True, capture_output=True)

    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=b", "-c", "user.email=b@b", "commit", "-qm", "start")
    (path / "src" / "m0.py").write_text(f"# execution {index}\nVALUE = {index}\n")
    return path


async def serve(store: Path, max_context: int) -> tuple[web.AppRunner, ProxyServer]:
    tokenizer = AutoTokenizer.from_pretrained(cached_tiny_model("test"))
    router = Router()
    router.register(ScriptedEngine(tokenizer, {"default": ["Fine.\nSCORE: 0.8"]}), preference=0)
    server = ProxyServer(
        ChatRenderer(tokenizer),
        router,
        Store(store),
        model="tiny",
        max_context=max_context,
        admin_token="bench-admin-token-0123456789abcdef",
    )
    runner = web.AppRunner(server.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    server.base_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    return runner, server


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        runner, server = await serve(root / "proxy.sqlite", max_context=args.max_chars + 4096)
        try:
            os.environ[KEY_ENV] = (await server.create_execution())["key"]
            judge = {
                "api": args.api,
                "base_url": f"{server.base_url}/v1",
                "model": "tiny",
                "api_key_env": KEY_ENV,
                "rubric": "Judge whether the change to src/m0.py is sound.",
                "artifact": {"files": ["src/*.py"], "diff": True, "max_chars": args.max_chars},
                "max_tokens": 16,
            }
            command = CommandEvaluator(command=GRADER, timeout_s=60)
            specs: dict[str, Evaluator] = {
                "command": command,
                "model": ModelEvaluator.model_validate(judge),
                "model+tests": ModelEvaluator.model_validate({**judge, "tests": command}),
            }
            spaces = [workspace(root, i, args.files) for i in range(args.executions)]
            await evaluate_once(specs["model"], spaces[0])  # warm-up: imports, connections
            seconds: dict[str, list[float]] = {name: [] for name in specs}
            for path in spaces:
                for name, spec in specs.items():
                    began = time.perf_counter()
                    result = await evaluate_once(spec, path, timeout_s=120)
                    seconds[name].append(time.perf_counter() - began)
                    if not result.valid:
                        raise SystemExit(f"{name} on {path.name}: invalid: {result.detail}")
        finally:
            await runner.cleanup()
            server.store.close()
        judged = ModelEvaluator.model_validate(judge)
        prompt = build_prompt(judged.rubric, gather_artifact(judged.artifact, spaces[0], None))
    print(
        f"evaluation per execution: {args.executions} executions, {args.files} files each,"
        f" api {args.api}, prompt {len(prompt):,} characters (max_chars {args.max_chars:,})"
    )
    print(f"  {'evaluator':<12} {'median ms':>10} {'p90 ms':>8} {'x command':>10}")
    base = statistics.median(seconds["command"])
    for name, values in seconds.items():
        median = statistics.median(values)
        print(
            f"  {name:<12} {median * 1e3:>10.1f} {quantile(values, 0.9) * 1e3:>8.1f}"
            f" {median / base:>9.2f}x"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--executions", type=int, default=40)
    parser.add_argument("--files", type=int, default=12)
    parser.add_argument("--max-chars", type=int, default=20_000)
    parser.add_argument("--api", choices=["openai", "anthropic"], default="openai")
    asyncio.run(main(parse(parser, executions=3, files=3)))
