"""Proxy overhead and per-call CPU against history length (issue: proxy performance).

Part 1 — latency: calls through the proxy (HTTP, parse, TITO, routing, durable record,
answer) against calling the same scripted engine directly, at 1, 64 and 256
concurrent executions; prints p50/p99 of both and the overhead.

Part 2 — history: one execution grows to ~1k, 32k and 256k tokens of history; the
proxy process's CPU time for one more call (its own rusage, the client runs in another
process) at each length, and the ratio to the 1k case (goal: at most 1.5x).

    python benchmarks/bench_proxy.py [--calls 512]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
from aiohttp import web
from transformers import AutoTokenizer

from qwengyre.engines.base import GenerateRequest
from qwengyre.engines.scripted import ScriptedEngine
from qwengyre.models import cached_tiny_model
from qwengyre.proxy.render import ChatRenderer
from qwengyre.proxy.routing import Router
from qwengyre.proxy.server import ProxyServer
from qwengyre.proxy.store import Store
from qwengyre.proxy.types import Message
from qwengyre.types import SamplingParams

ADMIN = "bench-admin-token-0123456789"
SCRIPT = {"default": ["Sure, here is the answer you asked for."]}


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def start_proxy(store: Path) -> tuple[str, ProxyServer, ScriptedEngine]:
    model = cached_tiny_model("test")
    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = ScriptedEngine(tokenizer, SCRIPT, capacity=1024)
    router = Router()
    router.register(engine, preference=0)
    server = ProxyServer(
        ChatRenderer(tokenizer),
        router,
        Store(store / "p.sqlite"),
        model="tiny",
        max_context=2_000_000,
        admin_token=ADMIN,
    )
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box: dict[str, str] = {}

    async def boot() -> None:
        runner = web.AppRunner(server.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        box["url"] = f"http://127.0.0.1:{runner.addresses[0][1]}"
        ready.set()

    threading.Thread(target=loop.run_forever, daemon=True).start()
    asyncio.run_coroutine_threadsafe(boot(), loop)
    ready.wait(30)
    return box["url"], server, engine


async def direct(engine: ScriptedEngine, prompt: tuple[int, ...], n: int, conc: int) -> list[float]:
    sem = asyncio.Semaphore(conc)
    lat: list[float] = []

    async def one(i: int) -> None:
        async with sem:
            t = time.perf_counter()
            await engine.generate(
                GenerateRequest(f"d{i}", prompt, SamplingParams(64), {"execution": str(i)})
            )
            lat.append(time.perf_counter() - t)

    await asyncio.gather(*(one(i) for i in range(n)))
    return lat


async def through_proxy(url: str, n: int, conc: int) -> list[float]:
    lat: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conc)) as http:
        keys = []
        for _ in range(conc):
            async with http.post(
                url + "/admin/executions", headers={"authorization": f"Bearer {ADMIN}"}
            ) as r:
                keys.append((await r.json())["key"])
        sem = asyncio.Semaphore(conc)

        async def one(i: int) -> None:
            body = {
                "model": "tiny",
                "max_tokens": 64,
                "messages": [{"role": "user", "content": f"question {i}"}],
            }
            async with sem:
                t = time.perf_counter()
                async with http.post(
                    url + "/v1/chat/completions",
                    json=body,
                    headers={"authorization": f"Bearer {keys[i % conc]}"},
                ) as r:
                    await r.read()
                    assert r.status == 200, await r.text()
                lat.append(time.perf_counter() - t)

        await asyncio.gather(*(one(i) for i in range(n)))
    return lat


CLIENT = r"""
import json, sys, time, urllib.request
url, key, target = sys.argv[1], sys.argv[2], int(sys.argv[3])
chunk = ("lorem ipsum dolor sit amet " * 300).strip()  # ~1.6k tokens per message
messages = [{"role": "system", "content": "You are terse."}]
def call(extra):
    body = json.dumps({"model": "tiny", "max_tokens": 32, "messages": messages + extra}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
        headers={"authorization": "Bearer " + key, "content-type": "application/json"})
    out = json.load(urllib.request.urlopen(req))
    return out["usage"]["prompt_tokens"], out["choices"][0]["message"]["content"]
tokens = 0
while tokens < target:
    messages.append({"role": "user", "content": chunk if tokens + 2000 < target else "go"})
    tokens, reply = call([])
    messages.append({"role": "assistant", "content": reply})
print(json.dumps({"tokens": tokens, "messages": messages}))
"""


def measure_history(url: str, target: int, repeats: int = 5) -> tuple[int, float]:
    """Grow one execution to ``target`` tokens, then time ``repeats`` more calls (CPU)."""
    import urllib.request

    req = urllib.request.Request(
        url + "/admin/executions", method="POST", headers={"authorization": f"Bearer {ADMIN}"}
    )
    key = json.load(urllib.request.urlopen(req))["key"]
    grown = subprocess.run(
        [sys.executable, "-c", CLIENT, url, key, str(target)],
        capture_output=True,
        text=True,
        check=True,
    )
    state = json.loads(grown.stdout)
    messages = state["messages"]
    bodies = [
        json.dumps(
            {
                "model": "tiny",
                "max_tokens": 32,
                "messages": [*messages, {"role": "user", "content": f"one more {i}"}],
            }
        )
        for i in range(repeats)
    ]
    before = resource.getrusage(resource.RUSAGE_SELF)
    for body in bodies:
        subprocess.run(
            [
                "curl",
                "-s",
                "-o",
                "/dev/null",
                "-H",
                f"authorization: Bearer {key}",
                "-H",
                "content-type: application/json",
                "--data-binary",
                "@-",
                url + "/v1/chat/completions",
            ],
            input=body,
            text=True,
            check=True,
        )
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return state["tokens"], cpu / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=512)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url, server, engine = start_proxy(Path(tmp))
        prompt = tuple(server.renderer.prompt_ids([Message("user", "question 0")], ()))
        print("latency (ms)          direct p50   p99   proxy p50    p99  overhead p50")
        for conc in (1, 64, 256):
            d = asyncio.run(direct(engine, prompt, args.calls, conc))
            p = asyncio.run(through_proxy(url, args.calls, conc))
            d50, d99, p50, p99 = (percentile(x, q) * 1e3 for x in (d, p) for q in (50, 99))
            print(
                f"  concurrency {conc:4d}   {d50:9.3f} {d99:6.3f}   {p50:9.2f} {p99:6.2f}"
                f"   +{p50 - d50:.2f} ms"
            )
        print("per-call proxy CPU vs history")
        base = None
        for target in (1_000, 32_000, 256_000):
            tokens, cpu = measure_history(url, target)
            base = base or cpu
            print(f"  {tokens:8d} tokens: {cpu * 1e3:7.2f} ms CPU per call ({cpu / base:.2f}x)")


if __name__ == "__main__":
    main()
