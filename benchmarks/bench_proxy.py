"""Proxy cost as harnesses see it: per-call CPU against history, memory per execution, start-up.

The proxy runs in its own process (``--serve``: a ProxyServer over a ScriptedEngine whose
every reply is a tool call, ``max_context`` 2,000,000), with two routes added by this
benchmark only: ``GET /bench/stats`` (the process's own CPU time from getrusage, VmRSS,
and with ``?settle=1``, after gc and malloc_trim, its live heap: bytes in pymalloc's
allocated blocks plus bytes malloc has in use) and ``POST /bench/direct`` (the engine
called directly, for the latency baseline). This process is the harness: over HTTP
(aiohttp) it runs multi-turn tool loops, resending the whole conversation with each
tool result, in four modes: Anthropic (tool_use / tool_result blocks) and OpenAI
(tool_calls / role tool), each streaming (SSE parsed for the tool call ids) and not.
Per-call figures are the proxy process's CPU time (rusage, not wall time): the median
over rounds of calls after a warm-up. Goals are ratios, since the machine is shared.
Each group of sections gets a fresh proxy process and store, so that what one leaves
in memory does not weigh on the next one's figures.

Sections (each prints a table, each figure against its goal):

1. executions: E executions x C calls, then half finished (DELETE) and half left idle
   for 2 x --idle-s + 1 s: RSS and live heap before, after the calls and after (goal:
   at most a quarter of the growth kept, by live heap: RSS rarely falls back when
   small objects are freed among ones that stay); an idle one is called again
   (reloaded on demand: its chain must continue) and a finished one's tree is served.
2. messages: per mode, one execution per point grown by short calls to 10, 1,000 and
   4,000 calls, then all measured in interleaved rounds: CPU per call at each (goal:
   4000/10 <= 2x). The largest is grown first, alone, with snapshots at 2,000 and
   4,000 calls: RSS and live heap per call against the bytes of unique tokens (4
   bytes each) and messages the calls added (goal: a call stores its increment: the
   live heap per call of the second half <= 1.5x the first's). Growth stops after
   --messages-budget-s or past --rss-cap-gb (a quadratic proxy would not finish): the
   points not reached FAIL, and the CPU per call where the growth stopped is shown.
3. tokens: per mode, one execution per point grown by large tool results to ~1k, 32k
   and 256k tokens of history (from the responses' usage), then all measured in
   interleaved rounds: CPU per call at each, labelled with the mean history of the
   measured calls (goal: 256k/1k <= 1.5x).
4. latency: calls through the proxy against the engine called directly, at 1, 64 and
   256 concurrent executions (report only).
5. start-up: the proxy restarted on the store of sections 1-2 against an empty store:
   start-up CPU (imports included) and RSS (goal: flat, <= 1.25x), and the longest
   execution continued after the restart (its chain must continue).

    python benchmarks/bench_proxy.py            # full run (1 min; 8 at most if quadratic)
    python benchmarks/bench_proxy.py --smoke    # smoke run (small points)
    python benchmarks/bench_proxy.py --sections tokens,messages --json out.json
    PYTHONPATH=/other/src python benchmarks/bench_proxy.py   # another proxy source tree

A ProxyServer keyword argument whose name contains ``idle`` and ends in ``_s`` is set
to ``--idle-s`` automatically; ``--server-kwargs '{"name": value}'`` sets any other.
The exit code is 0 whatever the verdicts (it is a report); the last line is a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import dataclasses
import gc
import itertools
import json
import math
import os
import random
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from _smoke import parse

ADMIN = "bench-admin-token-0123456789"
MODEL = "tiny"
READY = "BENCH-READY "
REPLY = (
    "Running it.\n<tool_call>\n"
    '{"name": "bash", "arguments": {"cmd": "cat notes.txt"}}\n</tool_call>'
)
SCRIPT = {"default": [REPLY]}
SYSTEM = "You are a coding agent. Use the tools to inspect and fix the repository."
TASK = "The test suite fails in src/app.py; find the cause and fix it."
_TOOLS = [
    ("bash", "Run a shell command", {"cmd": {"type": "string"}}),
    ("read_file", "Read a file", {"path": {"type": "string"}}),
    (
        "edit_file",
        "Replace text in a file",
        {"path": {"type": "string"}, "new": {"type": "string"}},
    ),
]
TOOLS_ANTHROPIC = [
    {"name": n, "description": d, "input_schema": {"type": "object", "properties": p}}
    for n, d, p in _TOOLS
]
TOOLS_OPENAI = [
    {
        "type": "function",
        "function": {
            "name": n,
            "description": d,
            "parameters": {"type": "object", "properties": p},
        },
    }
    for n, d, p in _TOOLS
]
MODES: tuple[tuple[str, bool], ...] = (
    ("anthropic", False),
    ("anthropic", True),
    ("openai", False),
    ("openai", True),
)


def mode_name(mode: tuple[str, bool]) -> str:
    return mode[0] + ("-stream" if mode[1] else "")


# ======================================================================================
# the proxy process (--serve)


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _status_kb(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return 0


def _settle() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _heap_bytes() -> int | None:
    """Live heap: bytes in pymalloc's allocated blocks plus bytes malloc has in use.

    Unlike RSS it does not count pages the allocators keep after frees (freed small
    objects among live ones keep their arenas resident), nor garbage (call gc first).
    None where glibc's mallinfo2 or CPython's pymalloc statistics are unavailable.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        info = libc.mallinfo2()
    except (OSError, AttributeError):
        return None
    with tempfile.TemporaryFile() as f:
        saved = os.dup(2)
        try:
            os.dup2(f.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        found = re.search(rb"# bytes in allocated blocks\s*=\s*([\d,]+)", f.read())
    if found is None:
        return None
    return int(found.group(1).replace(b",", b"")) + info.uordblks + info.hblkhd


def serve(store_dir: Path, given_kwargs: dict[str, Any], idle_s: float) -> None:
    asyncio.run(_serve(store_dir, given_kwargs, idle_s))


async def _serve(store_dir: Path, given_kwargs: dict[str, Any], idle_s: float) -> None:
    import inspect

    from transformers import AutoTokenizer

    from qwengyre.engines.base import GenerateRequest
    from qwengyre.engines.scripted import ScriptedEngine
    from qwengyre.models import cached_tiny_model
    from qwengyre.proxy.render import ChatRenderer
    from qwengyre.proxy.routing import Router
    from qwengyre.proxy.server import ProxyServer
    from qwengyre.proxy.store import Store
    from qwengyre.types import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(cached_tiny_model("test"))
    engine = ScriptedEngine(tokenizer, SCRIPT, capacity=4096)
    router = Router()
    router.register(engine, preference=0)
    kwargs = dict(given_kwargs)
    for name in inspect.signature(ProxyServer.__init__).parameters:
        if "idle" in name and name.endswith("_s") and name not in kwargs:
            kwargs[name] = idle_s
    cpu_before, wall_before = _cpu_s(), time.perf_counter()
    server = ProxyServer(
        ChatRenderer(tokenizer),
        router,
        Store(store_dir / "proxy.sqlite"),
        model=MODEL,
        max_context=2_000_000,
        admin_token=ADMIN,
        **kwargs,
    )
    construct = {"cpu_s": _cpu_s() - cpu_before, "wall_s": time.perf_counter() - wall_before}
    prompt = tuple(tokenizer.encode("question 0"))

    async def stats(request: web.Request) -> web.Response:
        cpu = _cpu_s()
        heap = None
        if request.query.get("settle"):
            _settle()
            heap = _heap_bytes()
        executions = server.residency.executions
        return web.json_response(
            {
                "cpu_s": cpu,
                "rss_kb": _status_kb("VmRSS"),
                "hwm_kb": _status_kb("VmHWM"),
                "heap_kb": None if heap is None else heap / 1024,
                "blocks": sys.getallocatedblocks(),
                "executions": len(executions),
            }
        )

    async def direct(request: web.Request) -> web.Response:
        n, conc = int(request.query["n"]), int(request.query["c"])
        sem = asyncio.Semaphore(conc)
        lat: list[float] = []

        async def one(i: int) -> None:
            async with sem:
                t = time.perf_counter()
                await engine.generate(
                    GenerateRequest(
                        f"d{i}", prompt, SamplingParams(max_tokens=256), {"execution": f"d{i}"}
                    )
                )
                lat.append(time.perf_counter() - t)

        cpu = _cpu_s()
        await asyncio.gather(*(one(i) for i in range(n)))
        return web.json_response({"lat": lat, "cpu_s": _cpu_s() - cpu})

    app = server.app()
    app.router.add_route("GET", "/bench/stats", stats)
    app.router.add_route("POST", "/bench/direct", direct)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    server.base_url = url
    _settle()
    ready = {
        "url": url,
        "pid": os.getpid(),
        "construct": construct,
        "cpu_s": _cpu_s(),
        "rss_kb": _status_kb("VmRSS"),
        "kwargs": dict(kwargs),
        "executions": len(server.residency.executions),
    }
    print(READY + json.dumps(ready), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    server.store.close()


# ======================================================================================
# the harness side


class Proxy:
    """A proxy process and the admin/bench calls the benchmark makes to it."""

    def __init__(self, proc: subprocess.Popen[str], ready: dict[str, Any], log: Path) -> None:
        self.proc = proc
        self.ready = ready
        self.url: str = ready["url"]
        self.log = log

    @classmethod
    async def start(
        cls, store: Path, log: Path, server_kwargs: dict[str, Any], idle_s: float
    ) -> Proxy:
        t = time.perf_counter()
        with open(log, "ab") as err:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--serve",
                    str(store),
                    "--server-kwargs",
                    json.dumps(server_kwargs),
                    "--idle-s",
                    str(idle_s),
                ],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )

        def wait_ready() -> str:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith(READY):
                    return line[len(READY) :]
            return ""

        line = await asyncio.to_thread(wait_ready)
        if not line:
            proc.wait(30)
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the proxy process did not start; its log ends:\n{tail}")
        ready = json.loads(line)
        ready["wall_s"] = time.perf_counter() - t
        return cls(proc, ready, log)

    async def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                await asyncio.to_thread(self.proc.wait, 120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait, 30)

    async def stats(self, http: aiohttp.ClientSession, settle: bool = False) -> dict[str, Any]:
        params = {"settle": "1"} if settle else {}
        async with http.get(self.url + "/bench/stats", params=params) as r:
            return await r.json()

    async def admin(self, http: aiohttp.ClientSession, method: str, path: str) -> Any:
        headers = {"authorization": f"Bearer {ADMIN}"}
        async with http.request(method, self.url + path, headers=headers) as r:
            if r.status >= 300:
                raise RuntimeError(f"{method} {path}: {r.status} {await r.text()}")
            return await r.json()

    async def new_execution(self, http: aiohttp.ClientSession) -> dict[str, str]:
        return await self.admin(http, "POST", "/admin/executions")

    async def tree(self, http: aiohttp.ClientSession, execution_id: str) -> list[dict[str, Any]]:
        return (await self.admin(http, "GET", f"/admin/executions/{execution_id}/tree"))["nodes"]


@dataclass
class Reply:
    message: dict[str, Any]  # the assistant message as the harness sends it back
    tool_ids: list[str]
    input_tokens: int
    output_tokens: int


class Conversation:
    """One harness's tool loop on one execution: every call resends the conversation."""

    def __init__(
        self, http: aiohttp.ClientSession, ex: dict[str, str], mode: tuple[str, bool]
    ) -> None:
        self.http = http
        self.ex = ex
        self.api, self.stream = mode
        head: dict[str, Any] = {"model": MODEL, "max_tokens": 256, "stream": self.stream}
        if self.api == "anthropic":
            self.url = ex["base_url"] + "/v1/messages"
            self.headers = {
                "x-api-key": ex["key"],
                "anthropic-version": "2023-06-01",
                "content-type": "application/json",
            }
            head |= {"system": SYSTEM, "tools": TOOLS_ANTHROPIC}
            self.encoded = [json.dumps({"role": "user", "content": TASK})]
        else:
            self.url = ex["openai_base_url"] + "/chat/completions"
            self.headers = {
                "authorization": f"Bearer {ex['key']}",
                "content-type": "application/json",
            }
            head["tools"] = TOOLS_OPENAI
            if self.stream:
                head["stream_options"] = {"include_usage": True}
            self.encoded = [
                json.dumps({"role": "system", "content": SYSTEM}),
                json.dumps({"role": "user", "content": TASK}),
            ]
        # The body is rebuilt for every call, as harnesses do; the messages are kept
        # encoded so that the client's own cost stays small next to the proxy's.
        self.head = json.dumps(head)[:-1] + ', "messages": ['
        self.pending: list[str] = []
        self.calls = 0
        self.input_tokens = 0
        self.output_tokens = 0
        self.unique_bytes = 0  # int32 bytes of new tokens + bytes of new messages

    @property
    def context(self) -> int:
        return self.input_tokens + self.output_tokens

    def rebase(self, old: str, new: str) -> None:
        self.url = self.url.replace(old, new, 1)

    async def step(self, result: str) -> Reply:
        """Send the tool result(s) for the last reply (if any) and get the next reply."""
        added = 0
        if self.pending:
            if self.api == "anthropic":
                blocks = [
                    {"type": "tool_result", "tool_use_id": i, "content": result}
                    for i in self.pending
                ]
                new = [json.dumps({"role": "user", "content": blocks})]
            else:
                new = [
                    json.dumps({"role": "tool", "tool_call_id": i, "content": result})
                    for i in self.pending
                ]
            self.encoded += new
            added += sum(len(m) for m in new)
        body = (self.head + ",".join(self.encoded) + "]}").encode()
        async with self.http.post(self.url, data=body, headers=self.headers) as r:
            if r.status != 200:
                raise RuntimeError(f"{mode_name((self.api, self.stream))}: {await r.text()}")
            if not self.stream:
                reply = _parse_body(self.api, await r.json())
            elif self.api == "anthropic":
                reply = await _parse_anthropic_sse(r)
            else:
                reply = await _parse_openai_sse(r)
        if not reply.tool_ids:
            raise RuntimeError(f"expected a tool call, got {reply.message}")
        encoded = json.dumps(reply.message)
        self.encoded.append(encoded)
        added += len(encoded)
        new_tokens = reply.input_tokens - self.context + reply.output_tokens
        self.unique_bytes += added + 4 * new_tokens
        self.input_tokens, self.output_tokens = reply.input_tokens, reply.output_tokens
        self.pending = reply.tool_ids
        self.calls += 1
        return reply


def _parse_body(api: str, body: dict[str, Any]) -> Reply:
    if api == "anthropic":
        content = body["content"]
        return Reply(
            {"role": "assistant", "content": content},
            [b["id"] for b in content if b["type"] == "tool_use"],
            body["usage"]["input_tokens"],
            body["usage"]["output_tokens"],
        )
    message = body["choices"][0]["message"]
    calls = message.get("tool_calls") or []
    out = {"role": "assistant", "content": message.get("content"), "tool_calls": calls}
    usage = body["usage"]
    return Reply(out, [c["id"] for c in calls], usage["prompt_tokens"], usage["completion_tokens"])


async def _sse_data(response: aiohttp.ClientResponse) -> AsyncIterator[Any]:
    async for raw in response.content:
        line = raw.strip()
        if line.startswith(b"data:"):
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            yield json.loads(data)


async def _parse_anthropic_sse(response: aiohttp.ClientResponse) -> Reply:
    blocks: list[dict[str, Any]] = []
    partial: dict[int, str] = {}
    input_tokens = output_tokens = 0
    async for event in _sse_data(response):
        kind = event["type"]
        if kind == "message_start":
            input_tokens = event["message"]["usage"]["input_tokens"]
        elif kind == "content_block_start":
            blocks.append(dict(event["content_block"]))
            partial[event["index"]] = ""
        elif kind == "content_block_delta":
            delta = event["delta"]
            if delta["type"] == "text_delta":
                blocks[event["index"]]["text"] += delta["text"]
            elif delta["type"] == "input_json_delta":
                partial[event["index"]] += delta["partial_json"]
        elif kind == "content_block_stop":
            block = blocks[event["index"]]
            if block["type"] == "tool_use":
                block["input"] = json.loads(partial[event["index"]] or "{}")
        elif kind == "message_delta":
            output_tokens = event["usage"]["output_tokens"]
        elif kind == "error":
            raise RuntimeError(f"stream error: {event}")
    return Reply(
        {"role": "assistant", "content": blocks},
        [b["id"] for b in blocks if b["type"] == "tool_use"],
        input_tokens,
        output_tokens,
    )


async def _parse_openai_sse(response: aiohttp.ClientResponse) -> Reply:
    text: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    usage: dict[str, int] = {}
    async for chunk in _sse_data(response):
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                text.append(delta["content"])
            for tc in delta.get("tool_calls") or []:
                call = calls.setdefault(
                    tc["index"],
                    {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
                )
                if tc.get("id"):
                    call["id"] = tc["id"]
                fn = tc.get("function") or {}
                call["function"]["name"] += fn.get("name") or ""
                call["function"]["arguments"] += fn.get("arguments") or ""
    if not usage:
        raise RuntimeError("the stream carried no usage (stream_options.include_usage)")
    tool_calls = [calls[i] for i in sorted(calls)]
    message = {"role": "assistant", "content": "".join(text) or None, "tool_calls": tool_calls}
    return Reply(
        message,
        [c["id"] for c in tool_calls],
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )


class TextPool:
    """Tool results that read like file listings and command output (~3.5 chars/token)."""

    WORDS = (
        "def return self import value for in if else the data result print list dict None",
        "True False error file path line open read write class init config test assert",
        "request response client server token index count total append update items keys",
        "0 1 2 3 42 100 255 1024 x y i j n k tmp src lib main utils parse build run",
    )

    def __init__(self, chars: int = 1 << 21, seed: int = 0) -> None:
        rng = random.Random(seed)
        words = " ".join(self.WORDS).split()
        lines, size = [], 0
        while size < chars:
            line = "    " * rng.randrange(4) + " ".join(
                rng.choice(words) for _ in range(rng.randrange(3, 14))
            )
            lines.append(line)
            size += len(line) + 1
        self.text = "\n".join(lines)
        self.rng = random.Random(seed + 1)

    def take(self, chars: int) -> str:
        chars = min(chars, len(self.text))
        start = self.rng.randrange(len(self.text) - chars + 1)
        return self.text[start : start + chars]


def short_result(n: int) -> str:
    return f"ok {n}"


# ======================================================================================
# measuring


@dataclass
class Point:
    cpu_ms: float  # median of the rounds' mean CPU per call
    cpu_min_ms: float
    tokens: float  # mean input tokens of the measured calls
    calls: int  # the execution's calls when measuring started
    increment: float  # mean tokens added per measured call


async def measure(
    proxy: Proxy,
    http: aiohttp.ClientSession,
    convs: Sequence[Conversation],
    warmup: int,
    rounds: int,
    per_round: int,
) -> list[Point]:
    """CPU per call of the proxy for each conversation: ``warmup`` short calls each,
    then ``rounds`` rounds that take every conversation in turn for ``per_round`` short
    calls (so that a busy spell of the shared machine falls on every point alike).
    A round's CPU is read from the proxy before and after, less what two reads cost."""
    for conv in convs:
        for _ in range(warmup):
            await conv.step(short_result(conv.calls))
    reads = []
    for _ in range(5):
        first = await proxy.stats(http)
        reads.append((await proxy.stats(http))["cpu_s"] - first["cpu_s"])
    overhead = statistics.median(reads)
    starts = [(c.calls, c.context) for c in convs]
    means: list[list[float]] = [[] for _ in convs]
    tokens: list[list[int]] = [[] for _ in convs]
    for _ in range(rounds):
        for i, conv in enumerate(convs):
            before = await proxy.stats(http)
            for _ in range(per_round):
                tokens[i].append((await conv.step(short_result(conv.calls))).input_tokens)
            after = await proxy.stats(http)
            means[i].append((after["cpu_s"] - before["cpu_s"] - overhead) / per_round)
    return [
        Point(
            statistics.median(means[i]) * 1e3,
            min(means[i]) * 1e3,
            statistics.fmean(tokens[i]),
            calls,
            (conv.context - context) / (rounds * per_round),
        )
        for i, (conv, (calls, context)) in enumerate(zip(convs, starts, strict=True))
    ]


@dataclass
class Report:
    goals: list[dict[str, Any]] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)

    def goal(self, section: str, figure: str, value: str, goal: str, ok: bool | None) -> str:
        verdict = "-" if ok is None else ("PASS" if ok else "FAIL")
        self.goals.append(
            {"section": section, "figure": figure, "value": value, "goal": goal, "verdict": verdict}
        )
        return verdict


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(c) for c in header], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n== {title}")
    for n, row in enumerate(cells):
        print(
            "  "
            + "  ".join(
                c.rjust(w) if i else c.ljust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if n == 0:
            print("  " + "  ".join("-" * w for w in widths))
    sys.stdout.flush()


def mb(kb: float) -> str:
    return f"{kb / 1024:.1f}"


class Stopped(Exception):
    """Growth stopped early (time budget or RSS cap); the figure is not reached."""


# ======================================================================================
# sections


async def warm_up(proxy: Proxy, http: aiohttp.ClientSession) -> None:
    """Every mode a few calls, so first-use costs (templates, caches) come before any figure."""
    for mode in MODES:
        conv = Conversation(http, await proxy.new_execution(http), mode)
        for i in range(4):
            await conv.step(short_result(i))


async def section_executions(
    proxy: Proxy,
    http: aiohttp.ClientSession,
    report: Report,
    n_exec: int,
    calls: int,
    idle_s: float,
) -> None:
    base = await proxy.stats(http, settle=True)
    done: list[tuple[dict[str, str], Conversation]] = []
    sem = asyncio.Semaphore(16)
    t = time.perf_counter()

    async def run(i: int) -> None:
        async with sem:
            ex = await proxy.new_execution(http)
            conv = Conversation(http, ex, MODES[i % len(MODES)])
            for n in range(calls):
                await conv.step(short_result(n))
            done.append((ex, conv))

    await asyncio.gather(*(run(i) for i in range(n_exec)))
    wall = time.perf_counter() - t
    peak = await proxy.stats(http, settle=True)
    finished, idle = done[::2], done[1::2]
    for ex, _ in finished:
        await proxy.admin(http, "DELETE", f"/admin/executions/{ex['id']}")
    await asyncio.sleep(idle_s * 2 + 1)
    # Another execution keeps working meanwhile (a sweep may run on calls).
    probe = Conversation(http, await proxy.new_execution(http), MODES[0])
    for n in range(3):
        await probe.step(short_result(n))
    after = await proxy.stats(http, settle=True)
    # An idle execution continues: it must extend its own chain.
    ex, conv = idle[0]
    s0 = await proxy.stats(http)
    t = time.perf_counter()
    await conv.step("ok again")
    reload_ms = (time.perf_counter() - t) * 1e3
    s1 = await proxy.stats(http)
    parents = [n["parent"] for n in await proxy.tree(http, ex["id"])]
    chain_ok = parents == [None, *range(calls)]
    finished_nodes = len(await proxy.tree(http, finished[0][0]["id"]))
    unique = statistics.fmean(c.unique_bytes for _, c in done)

    def kept(key: str) -> float:
        grown = peak[key] - base[key]
        return (after[key] - base[key]) / grown if grown > 0 else float("nan")

    rows: list[list[Any]] = []
    rows.append(
        [
            "RSS (MB): before -> after the calls -> after idle/finished",
            f"{mb(base['rss_kb'])} -> {mb(peak['rss_kb'])} -> {mb(after['rss_kb'])}",
            "report",
            "-",
        ]
    )
    heap = base["heap_kb"] is not None and peak["heap_kb"] is not None
    if heap:
        rows.append(
            [
                "live heap (MB): before -> after the calls -> after idle/finished",
                f"{mb(base['heap_kb'])} -> {mb(peak['heap_kb'])} -> {mb(after['heap_kb'])}",
                "report",
                "-",
            ]
        )
    per_exec = [(peak[k] - base[k]) / n_exec for k in ("rss_kb", *(["heap_kb"] if heap else []))]
    rows.append(
        [
            "per execution (KB): RSS / " + ("live heap / " if heap else "") + "unique content",
            " / ".join(f"{x:.1f}" for x in [*per_exec, unique / 1024]),
            "report",
            "-",
        ]
    )
    retained = kept("rss_kb")
    rows.append(["growth kept after idle/finished: RSS", f"{retained:.2f}", "report", "-"])
    # The verdict counts the live heap (or else live Python blocks): what the proxy
    # still holds, whatever pages the allocators keep for reuse after frees (RSS
    # rarely falls back when small objects are freed among ones that stay).
    key, what = ("heap_kb", "live heap") if heap else ("blocks", "live blocks")
    held = kept(key)
    goal = "<= 0.25"
    v = report.goal(
        "executions", f"memory kept after idle/finished ({what})", f"{held:.2f}", goal, held <= 0.25
    )
    rows.append([f"growth kept after idle/finished: {what}", f"{held:.2f}", goal, v])
    if peak.get("executions") is not None:
        rows.append(
            [
                "entries in server.residency.executions: peak -> after",
                f"{peak['executions']} -> {after['executions']}",
                "report",
                "-",
            ]
        )
    v = report.goal(
        "executions", "idle execution continues its chain", str(chain_ok), "True", chain_ok
    )
    rows.append(["idle execution reloaded, continues its chain", str(chain_ok), "True", v])
    rows.append(
        [
            "  its first call after idle: CPU / wall (ms)",
            f"{(s1['cpu_s'] - s0['cpu_s']) * 1e3:.2f} / {reload_ms:.1f}",
            "report",
            "-",
        ]
    )
    ok = finished_nodes == calls
    v = report.goal(
        "executions", "finished execution's tree served", str(finished_nodes), str(calls), ok
    )
    rows.append(["finished execution's tree: nodes served", finished_nodes, calls, v])
    rows.append(["wall time of the calls (s)", f"{wall:.1f}", "", ""])
    print_table(
        f"executions: {n_exec} x {calls} calls (4 modes, 16 at a time), "
        "then half finished, half idle",
        ["figure", "value", "goal", "verdict"],
        rows,
    )
    report.data["executions"] = {
        "base": base,
        "peak": peak,
        "after": after,
        "retained_rss": retained,
        "retained": held,
        "chain_ok": chain_ok,
        "unique_bytes_per_execution": unique,
    }


async def section_messages(
    proxy: Proxy,
    http: aiohttp.ClientSession,
    report: Report,
    modes: Sequence[tuple[str, bool]],
    points: Sequence[int],
    mem_points: Sequence[int],
    m: tuple[int, int, int],
    rss_cap_kb: int,
    budget_s: float,
    idle_s: float,
) -> list[Conversation]:
    """Per mode, one execution per point grown by short calls (the largest one with
    memory snapshots on the way), then all measured together in interleaved rounds."""
    names = [mode_name(mode) for mode in modes]
    convs = {
        name: [Conversation(http, await proxy.new_execution(http), mode) for _ in points]
        for name, mode in zip(names, modes, strict=True)
    }
    largest = [group[-1] for group in convs.values()]  # the memory figures are theirs
    snaps: list[dict[str, Any]] = []

    async def snapshot() -> None:
        s = await proxy.stats(http, settle=True)
        s["calls"] = sum(c.calls for c in largest)
        s["unique"] = sum(c.unique_bytes for c in largest)
        snaps.append(s)

    t = time.perf_counter()
    deadline = t + budget_s

    async def grow(group: Sequence[Conversation], target: int) -> None:
        """Short calls, the executions in turn, until each has ``target`` calls."""
        while any(c.calls < target for c in group):
            for c in group:
                if c.calls < target:
                    await c.step(short_result(c.calls))
            if time.perf_counter() > deadline:
                raise Stopped(f"time budget {budget_s:.0f} s spent")
            if group[0].calls % 250 == 0 and (await proxy.stats(http))["rss_kb"] > rss_cap_kb:
                raise Stopped(f"RSS cap {rss_cap_kb / 2**20:.1f} GB reached")

    stopped = ""
    # The largest first, alone: nothing else grows or leaves memory (idle executions
    # of earlier sections have left by now) while its memory is followed.
    await asyncio.sleep(idle_s * 2 + 1)
    try:
        await snapshot()
        for target in sorted({*(p for p in mem_points if p < points[-1]), points[-1]}):
            await grow(largest, target)
            if target in mem_points:
                await snapshot()
    except Stopped as exc:
        stopped = str(exc)
        await snapshot()
    with contextlib.suppress(Stopped):
        deadline = max(deadline, time.perf_counter() + 60)  # the small points still come
        for i, point in enumerate(points[:-1]):
            await grow([group[i] for group in convs.values()], point)
    grown = time.perf_counter() - t
    flat = [c for group in convs.values() for c in group]
    measured = iter(await measure(proxy, http, flat, *m))
    results = {name: [next(measured) for _ in group] for name, group in convs.items()}
    wall = time.perf_counter() - t

    first, last = points[0], points[-1]
    rows: list[list[Any]] = []
    figure = f"CPU/call {last}/{first} calls"
    for name, pts in results.items():
        cells = [
            f"{p.cpu_ms:.2f}" + ("" if p.calls >= want else f" @{p.calls}")
            for p, want in zip(pts, points, strict=True)
        ]
        ratio = pts[-1].cpu_ms / pts[0].cpu_ms
        if all(p.calls >= want for p, want in zip(pts, points, strict=True)):
            v = report.goal("messages", f"{figure} {name}", f"{ratio:.2f}x", "<= 2x", ratio <= 2)
            rows.append([name, *cells, f"{ratio:.2f}x", "<= 2x", v])
        else:
            seen = f"{ratio:.2f}x @{pts[-1].calls}"
            report.goal("messages", f"{figure} {name}", f"not reached ({seen})", "<= 2x", False)
            rows.append([name, *cells, seen, "<= 2x", "FAIL"])
    tokens = [
        f"{statistics.fmean(results[k][i].tokens for k in names):.0f}" for i in range(len(points))
    ]
    rows.append(["  (history tokens)", *tokens, "", "", ""])
    print_table(
        f"messages: proxy CPU per call (ms, median of {m[1]} interleaved rounds x {m[2]} calls "
        f"after {m[0]} warm-up), one execution per point grown by short calls "
        f"[{grown:.0f} s growing, {wall - grown:.0f} s measuring]"
        + (f" [growth stopped: {stopped}; @N: calls reached]" if stopped else ""),
        ["mode", *[f"{p} calls" for p in points], "ratio", "goal", "verdict"],
        rows,
    )

    # memory per call, from the snapshots (the largest executions together)
    n = len(largest)
    heap = all(x["heap_kb"] is not None for x in snaps)
    key = "heap_kb" if heap else "rss_kb"
    what = "live heap" if heap else "RSS"

    def per_call(a: dict[str, Any], b: dict[str, Any], k: str) -> float:
        return (b[k] - a[k]) * 1024 / max(1, b["calls"] - a["calls"])

    mrows: list[list[Any]] = []
    for a, b in itertools.pairwise(snaps):
        unique = (b["unique"] - a["unique"]) / max(1, b["calls"] - a["calls"])
        mrows.append(
            [
                f"calls {a['calls'] // n}-{b['calls'] // n} per execution",
                f"{(b['rss_kb'] - a['rss_kb']) / 1024 / n:.1f}",
                f"{per_call(a, b, 'rss_kb'):.0f}",
                f"{per_call(a, b, 'heap_kb'):.0f}" if heap else "n/a",
                f"{unique:.0f}",
                f"{per_call(a, b, key) / unique:.1f}x",
            ]
        )
    print_table(
        f"messages: memory of {n} execution(s) growing (after gc + malloc_trim)",
        [
            "interval",
            "RSS MB/execution",
            "RSS B/call",
            "heap B/call",
            "unique B/call",
            f"{what}/unique",
        ],
        mrows,
    )
    goals: list[list[Any]] = []
    if len(snaps) >= 3:
        a, b, c = snaps[0], snaps[1], snaps[2]
        head, tail = per_call(a, b, key), per_call(b, c, key)
        ratio = tail / head if head > 0 else float("inf")
        label = f"{what}/call, calls {b['calls'] // n}-{c['calls'] // n} / 0-{b['calls'] // n}"
        v = report.goal("messages", label, f"{ratio:.2f}x", "<= 1.5x", ratio <= 1.5)
        goals.append([label + " (a call stores its increment)", f"{ratio:.2f}x", "<= 1.5x", v])
        if heap:
            rss = per_call(b, c, "rss_kb") / max(1.0, per_call(a, b, "rss_kb"))
            goals.append(["  the same in RSS/call", f"{rss:.2f}x", "report", "-"])
    else:
        report.goal(
            "messages", f"{what}/call, second half / first", "not reached", "<= 1.5x", False
        )
        goals.append([f"{what}/call, second half / first: not reached", "", "<= 1.5x", "FAIL"])
    if len(snaps) >= 2:
        a, b = snaps[0], snaps[1]
        factor = (b[key] - a[key]) * 1024 / max(1, b["unique"] - a["unique"])
        label = f"{what} / unique bytes, calls 0-{b['calls'] // n}"
        goals.append(
            [label + " (bytes a call keeps per byte it adds)", f"{factor:.1f}x", "report", "-"]
        )
        goals.append(
            [
                f"RSS growth for {b['calls'] // n} calls of one execution (MB)",
                f"{(b['rss_kb'] - a['rss_kb']) / 1024 / n:.1f}",
                "report",
                "-",
            ]
        )
    goals.append(["wall time of the section (s)", f"{wall:.0f}", "", ""])
    print_table("messages: memory goals", ["figure", "value", "goal", "verdict"], goals)
    report.data["messages"] = {
        "cpu": {k: [vars(p) for p in pts] for k, pts in results.items()},
        "snapshots": snaps,
        "stopped": stopped,
    }
    return largest


async def section_tokens(
    proxy: Proxy,
    http: aiohttp.ClientSession,
    report: Report,
    targets: Sequence[int],
    m: tuple[int, int, int],
    chunk_tokens: int,
    pool: TextPool,
) -> None:
    """One execution per mode and target, grown by large tool results; then measured
    together, in interleaved rounds."""
    chars_per_token = 3.5
    increment = 42  # tokens a short call adds (the reply, the template, "ok N")
    t = time.perf_counter()
    convs: dict[str, list[Conversation]] = {}
    for mode in MODES:
        convs[mode_name(mode)] = []
        for target in targets:
            conv = Conversation(http, await proxy.new_execution(http), mode)
            await conv.step("")  # the task; no tool result yet
            # Grow so that the measured calls' mean history is about ``target``.
            want = target - (m[0] + m[1] * m[2] / 2) * increment
            while conv.context < want:
                size = min(chunk_tokens, want - conv.context)
                before = conv.context
                chars = max(16, int(size * chars_per_token))
                await conv.step(pool.take(chars))
                added = conv.context - before - increment  # less the reply and the template
                if added > 0 and size > 500:
                    chars_per_token = chars / added
            convs[mode_name(mode)].append(conv)
    grown = time.perf_counter() - t
    flat = [c for group in convs.values() for c in group]
    measured = iter(await measure(proxy, http, flat, *m))
    rows: list[list[Any]] = []
    data: dict[str, Any] = {}
    for name, group in convs.items():
        points = [next(measured) for _ in group]
        ratio = points[-1].cpu_ms / points[0].cpu_ms
        goal = "<= 1.5x"
        figure = f"CPU/call {targets[-1]}/{targets[0]} tokens {name}"
        v = report.goal("tokens", figure, f"{ratio:.2f}x", goal, ratio <= 1.5)
        cells = [f"{p.cpu_ms:.2f} @{p.tokens / 1000:.1f}k" for p in points]
        rows.append([name, *cells, f"{ratio:.2f}x", goal, v])
        data[name] = [vars(p) for p in points]
    print_table(
        f"tokens: proxy CPU per call (ms @ mean history tokens; median of {m[1]} interleaved "
        f"rounds x {m[2]} calls after {m[0]} warm-up), one execution per point grown by "
        f"tool results [{grown:.0f} s growing, {time.perf_counter() - t - grown:.0f} s measuring]",
        ["mode", *[f"~{x // 1000}k" for x in targets], "ratio", "goal", "verdict"],
        rows,
    )
    report.data["tokens"] = data


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


async def section_latency(
    proxy: Proxy,
    http: aiohttp.ClientSession,
    report: Report,
    n: int,
    concurrencies: Sequence[int],
) -> None:
    rows: list[list[Any]] = []
    for conc in concurrencies:
        async with http.post(proxy.url + "/bench/direct", params={"n": n, "c": conc}) as r:
            direct = (await r.json())["lat"]
        lat: list[float] = []
        per_worker = max(1, n // conc)

        async def worker(w: int, per_worker: int = per_worker, lat: list[float] = lat) -> None:
            conv: Conversation | None = None
            for j in range(per_worker):
                if j % 8 == 0:  # a harness run of 8 calls, then a new execution
                    mode = MODES[(w + j // 8) % len(MODES)]
                    conv = Conversation(http, await proxy.new_execution(http), mode)
                assert conv is not None
                t = time.perf_counter()
                await conv.step(short_result(j))
                lat.append(time.perf_counter() - t)

        s0 = await proxy.stats(http)
        await asyncio.gather(*(worker(w) for w in range(conc)))
        s1 = await proxy.stats(http)
        d50, d99 = (percentile(direct, q) * 1e3 for q in (50, 99))
        p50, p99 = (percentile(lat, q) * 1e3 for q in (50, 99))
        cpu = (s1["cpu_s"] - s0["cpu_s"]) / len(lat) * 1e3
        rows.append(
            [
                conc,
                f"{d50:.3f}",
                f"{d99:.3f}",
                f"{p50:.2f}",
                f"{p99:.2f}",
                f"+{p50 - d50:.2f}",
                f"{cpu:.2f}",
            ]
        )
        report.data.setdefault("latency", {})[conc] = {
            "direct_p50_ms": d50,
            "direct_p99_ms": d99,
            "proxy_p50_ms": p50,
            "proxy_p99_ms": p99,
            "cpu_ms_per_call": cpu,
        }
    print_table(
        f"latency (ms): engine direct vs through the proxy (HTTP from another process), "
        f"{n} calls per level; report only",
        ["concurrency", "direct p50", "p99", "proxy p50", "p99", "overhead p50", "proxy CPU/call"],
        rows,
    )


async def section_startup(
    http: aiohttp.ClientSession,
    report: Report,
    store: Path,
    empty_store: Path,
    log: Path,
    server_kwargs: dict[str, Any],
    idle_s: float,
    longest: tuple[Conversation, str] | None,
) -> None:
    """A proxy on an empty store, then one on ``store``; ``longest`` (a conversation
    and the URL it was made on) continues on the second."""
    size_mb = sum(p.stat().st_size for p in store.iterdir() if p.is_file()) / 2**20
    empty = await Proxy.start(empty_store, log, server_kwargs, idle_s)
    try:
        empty_stats = await empty.stats(http, settle=True)
    finally:
        await empty.stop()
    full = await Proxy.start(store, log, server_kwargs, idle_s)
    try:
        await _startup(http, report, empty, empty_stats, full, size_mb, longest)
    finally:
        await full.stop()


async def _startup(
    http: aiohttp.ClientSession,
    report: Report,
    empty: Proxy,
    empty_stats: dict[str, Any],
    full: Proxy,
    size_mb: float,
    longest: tuple[Conversation, str] | None,
) -> None:
    full_stats = await full.stats(http, settle=True)
    e, f = empty.ready, full.ready
    rows: list[list[Any]] = []
    rows.append(
        ["spawn to ready, wall (s)", f"{e['wall_s']:.2f}", f"{f['wall_s']:.2f}", "", "", ""]
    )
    rows.append(
        [
            "ProxyServer() CPU (s)",
            f"{e['construct']['cpu_s']:.3f}",
            f"{f['construct']['cpu_s']:.3f}",
            "",
            "report",
            "-",
        ]
    )
    ratio = f["cpu_s"] / e["cpu_s"]
    v = report.goal(
        "start-up", "start-up CPU store/empty", f"{ratio:.2f}x", "<= 1.25x", ratio <= 1.25
    )
    rows.append(
        [
            "process CPU at ready, imports included (s)",
            f"{e['cpu_s']:.2f}",
            f"{f['cpu_s']:.2f}",
            f"{ratio:.2f}x",
            "<= 1.25x",
            v,
        ]
    )
    ratio = full_stats["rss_kb"] / empty_stats["rss_kb"]
    v = report.goal(
        "start-up", "start-up RSS store/empty", f"{ratio:.2f}x", "<= 1.25x", ratio <= 1.25
    )
    rows.append(
        [
            "RSS at ready (MB)",
            mb(empty_stats["rss_kb"]),
            mb(full_stats["rss_kb"]),
            f"{ratio:.2f}x",
            "<= 1.25x",
            v,
        ]
    )
    rows.append(
        [
            "entries in server.residency.executions",
            e["executions"],
            f["executions"],
            "",
            "report",
            "-",
        ]
    )
    if longest is not None:
        conv, old_url = longest
        conv.rebase(old_url, full.url)
        before = conv.calls
        s0 = await full.stats(http)
        await conv.step("ok after restart")
        s1 = await full.stats(http)
        await conv.step("ok again")
        s2 = await full.stats(http)
        parents = [n["parent"] for n in await full.tree(http, conv.ex["id"])]
        ok = parents[-2:] == [before - 1, before]
        v = report.goal("start-up", "stored execution continues its chain", str(ok), "True", ok)
        rows.append(
            [f"execution of {before} calls continues its chain", "", str(ok), "", "True", v]
        )
        rows.append(
            [
                "  its 1st / 2nd call after restart: CPU (ms)",
                "",
                f"{(s1['cpu_s'] - s0['cpu_s']) * 1e3:.1f} / "
                f"{(s2['cpu_s'] - s1['cpu_s']) * 1e3:.1f}",
                "",
                "report",
                "-",
            ]
        )
    print_table(
        f"start-up: empty store vs the store of this run ({size_mb:.0f} MB)",
        ["figure", "empty", "store", "ratio", "goal", "verdict"],
        rows,
    )
    report.data["startup"] = {"empty": e, "full": f, "store_mb": size_mb}


# ======================================================================================


@dataclass(frozen=True)
class Plan:
    n_exec: int
    exec_calls: int
    msg_points: tuple[int, ...]
    mem_points: tuple[int, ...]
    msg_modes: tuple[tuple[str, bool], ...]
    token_targets: tuple[int, ...]
    chunk_tokens: int
    latency_calls: int
    concurrencies: tuple[int, ...]
    m: tuple[int, int, int]  # warm-up calls, rounds, calls per round
    mt: tuple[int, int, int]  # the same for the tokens section (few: the 1k point drifts)
    messages_budget_s: float  # the messages section stops growing after this


FULL = Plan(
    n_exec=200,
    exec_calls=10,
    msg_points=(10, 1000, 4000),
    mem_points=(2000, 4000),
    msg_modes=(("anthropic", True),),
    token_targets=(1000, 32_000, 256_000),
    chunk_tokens=8000,
    latency_calls=512,
    concurrencies=(1, 64, 256),
    m=(5, 5, 8),
    mt=(3, 6, 4),
    messages_budget_s=300,
)
SMOKE = Plan(
    n_exec=8,
    exec_calls=2,
    msg_points=(10, 50, 100),
    mem_points=(50, 100),
    msg_modes=(("anthropic", True), ("openai", False)),
    token_targets=(1000, 4000),
    chunk_tokens=2000,
    latency_calls=16,
    concurrencies=(1, 4),
    m=(2, 2, 2),
    mt=(2, 2, 2),
    messages_budget_s=20,
)
SECTIONS = ("executions", "messages", "tokens", "latency", "startup")


async def run(args: argparse.Namespace) -> None:
    plan = SMOKE if args.smoke else FULL
    if args.message_modes:
        by_name = {mode_name(m): m for m in MODES}
        try:
            chosen = tuple(by_name[n] for n in args.message_modes.split(","))
        except KeyError as exc:
            raise SystemExit(f"unknown mode {exc}; allowed: {','.join(by_name)}") from None
        plan = dataclasses.replace(plan, msg_modes=chosen)
    sections = set(args.sections.split(",")) if args.sections else set(SECTIONS)
    unknown = sections - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}; allowed: {','.join(SECTIONS)}")
    server_kwargs = json.loads(args.server_kwargs)
    report = Report()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-proxy-") as tmp:
        log = Path(tmp, "proxy.log")

        def store(name: str) -> Path:
            path = Path(tmp, name)
            path.mkdir(exist_ok=True)
            return path

        async def fresh(name: str) -> Proxy:
            """Each section gets its own proxy process (and store), so that what one
            section leaves in memory does not weigh on the next one's figures."""
            proxy = await Proxy.start(store(name), log, server_kwargs, args.idle_s)
            print(
                f"\n[{name}: proxy pid {proxy.ready['pid']} ready in "
                f"{proxy.ready['wall_s']:.1f} s; ProxyServer kwargs {proxy.ready['kwargs']}]",
                flush=True,
            )
            try:
                await warm_up(proxy, http)
            except BaseException:
                await proxy.stop()
                raise
            return proxy

        print(f"plan {'smoke' if args.smoke else 'full'}: {plan}", flush=True)
        timeout = aiohttp.ClientTimeout(total=900)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
            try:
                longest: tuple[Conversation, str] | None = None
                if sections & {"executions", "messages"}:
                    # One process and store for both: the start-up section restarts on it.
                    proxy = await fresh("main")
                    try:
                        if "executions" in sections:
                            await section_executions(
                                proxy, http, report, plan.n_exec, plan.exec_calls, args.idle_s
                            )
                        if "messages" in sections:
                            convs = await section_messages(
                                proxy,
                                http,
                                report,
                                plan.msg_modes,
                                plan.msg_points,
                                plan.mem_points,
                                plan.m,
                                int(args.rss_cap_gb * 2**20),
                                args.messages_budget_s or plan.messages_budget_s,
                                args.idle_s,
                            )
                            longest = (max(convs, key=lambda c: c.calls), proxy.url)
                    finally:
                        await proxy.stop()
                if "tokens" in sections:
                    proxy = await fresh("tokens")
                    try:
                        await section_tokens(
                            proxy,
                            http,
                            report,
                            plan.token_targets,
                            plan.mt,
                            plan.chunk_tokens,
                            TextPool(),
                        )
                    finally:
                        await proxy.stop()
                if "latency" in sections:
                    proxy = await fresh("latency")
                    try:
                        await section_latency(
                            proxy, http, report, plan.latency_calls, plan.concurrencies
                        )
                    finally:
                        await proxy.stop()
                if "startup" in sections:
                    await section_startup(
                        http,
                        report,
                        store("main"),
                        store("empty"),
                        log,
                        server_kwargs,
                        args.idle_s,
                        longest,
                    )
            except Exception:
                tail = log.read_text(errors="replace")[-4000:]
                print(f"\nbenchmark failed; the proxy log ends:\n{tail}", flush=True)
                raise
        errors = [
            line
            for line in log.read_text(errors="replace").splitlines()
            if "Traceback" in line or "ERROR" in line
        ]
        if errors:
            print(f"\nthe proxy logged {len(errors)} error line(s); first: {errors[0][:200]}")
    wall = time.perf_counter() - started
    failed = [g for g in report.goals if g["verdict"] == "FAIL"]
    judged = [g for g in report.goals if g["verdict"] in ("PASS", "FAIL")]
    if args.json:
        report.data["goals"] = report.goals
        report.data["wall_s"] = wall
        Path(args.json).write_text(json.dumps(report.data, indent=1, default=str))
    print(
        f"\nSUMMARY: {len(judged) - len(failed)}/{len(judged)} goals met in {wall:.0f} s"
        + (
            "; FAIL: " + "; ".join(f"{g['figure']} {g['value']} (goal {g['goal']})" for g in failed)
            if failed
            else ""
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sections", help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument(
        "--message-modes",
        help="modes of the messages section (default: anthropic-stream; smoke: "
        "anthropic-stream,openai); any of anthropic, anthropic-stream, openai, openai-stream",
    )
    parser.add_argument("--json", help="also write every figure to this JSON file")
    parser.add_argument("--idle-s", type=float, default=2.0, help="idle wait (and idle_*_s)")
    parser.add_argument("--server-kwargs", default="{}", help="JSON: extra ProxyServer kwargs")
    parser.add_argument("--rss-cap-gb", type=float, default=8.0, help="stop growing past this")
    parser.add_argument(
        "--messages-budget-s",
        type=float,
        help="stop growing the messages section after this (default 300; smoke 60)",
    )
    parser.add_argument("--serve", metavar="STORE_DIR", help=argparse.SUPPRESS)
    args = parse(parser)
    if args.serve:
        serve(Path(args.serve), json.loads(args.server_kwargs), args.idle_s)
        return
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
