"""What confinement costs a harness: the proxy relay per model call, and the sandbox's start.

1. calls: a harness makes N model calls (keep-alive, a 2 KiB JSON body; a plain JSON
   answer, then an SSE answer of 20 events) to a stand-in proxy that answers at once, so
   the figures are the transport's alone. Measured inside the harness, in one run:
   unconfined straight to the proxy (``direct``), and under ``harness.sandbox=bwrap``
   through both relays (in-sandbox TCP -> Unix socket -> the key-injecting relay ->
   the proxy). Prints the mean and median per call and the ratio relay / direct.
2. start: ``true`` as the harness, K times each, unconfined and under bubblewrap with
   its relay, limits and cgroup: the wall time of ``supervise(prepare_harness(...))``
   (:mod:`qwengyre.rollout.harness`) from call to return (median), and the ratio.

    python benchmarks/bench_sandbox.py             # N=500 calls, K=20 starts
    python benchmarks/bench_sandbox.py --calls 2000 --starts 50
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from aiohttp import web

from _smoke import parse
from qwengyre.rollout.harness import HarnessSpec, prepare_harness, supervise
from qwengyre.rollout.limits import Limits
from qwengyre.rollout.sandbox import Bubblewrap, NoSandbox, Sandbox

# The harness: N calls of each kind over one keep-alive connection; prints the seconds
# of each call as JSON. Braces doubled: a command template.
CALLER = """
import http.client, json, os, sys, time, urllib.parse
n = int(sys.argv[1])
url = urllib.parse.urlsplit(os.environ["OPENAI_BASE_URL"])
key = os.environ["OPENAI_API_KEY"]
body = json.dumps({{"messages": [{{"role": "user", "content": "x" * 2048}}]}})
connection = http.client.HTTPConnection(url.hostname, url.port)
times = {{}}
for kind in ("json", "sse"):
    took = []
    for _ in range(n):
        start = time.perf_counter()
        headers = {{"authorization": "Bearer " + key}}
        connection.request("POST", url.path + "/" + kind, body, headers)
        answer = connection.getresponse()
        data = answer.read()
        took.append(time.perf_counter() - start)
        assert answer.status == 200 and data, (answer.status, data[:200])
    times[kind] = took
print(json.dumps(times))
"""


async def _json(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response({"choices": [{"message": {"content": "y" * 1024}}]})


async def _sse(request: web.Request) -> web.StreamResponse:
    await request.read()
    answer = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await answer.prepare(request)
    for i in range(20):
        await answer.write(f'data: {{"delta": "token {i}"}}\n\n'.encode())
    await answer.write_eof()
    return answer


async def _proxy() -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/x/ex_bench/v1/json", _json)
    app.router.add_post("/x/ex_bench/v1/sse", _sse)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}/x/ex_bench"


async def _harness(
    spec: HarnessSpec, scratch: Path, base_url: str, execution_id: str = "ex_bench"
) -> str:
    """Run ``spec`` once in a fresh workspace under ``scratch``; its stdout."""
    workspace = Path(tempfile.mkdtemp(dir=scratch))
    run = await supervise(
        prepare_harness(
            spec,
            workspace=workspace,
            logs_dir=workspace / "logs",
            execution_id=execution_id,
            base_url=base_url,
            api_key="qg-bench",
            instructions="bench",
            hidden=(scratch,),
        )
    )
    if not run.ok:
        raise RuntimeError((workspace / "logs" / "stderr.log").read_text())
    return (workspace / "logs" / "stdout.log").read_text()


def _ms(values: list[float]) -> str:
    return f"{statistics.mean(values) * 1e3:7.3f} {statistics.median(values) * 1e3:7.3f}"


async def calls(n: int, scratch: Path) -> None:
    runner, base_url = await _proxy()
    try:
        per_call = {}
        for name, confine in (("direct", NoSandbox()), ("relay", Bubblewrap())):
            spec = HarnessSpec(
                command=(sys.executable, "-c", CALLER, str(n)), deadline_s=3600, sandbox=confine
            )
            per_call[name] = json.loads(await _harness(spec, scratch, base_url))
    finally:
        await runner.cleanup()
    print(f"\n1. calls: {n} of each kind per mode, ms per call (mean, median)")
    print(f"{'kind':6} {'direct':>15} {'relay':>15} {'ratio (median)':>15} {'added ms':>9}")
    for kind in ("json", "sse"):
        direct, relayed = per_call["direct"][kind], per_call["relay"][kind]
        ratio = statistics.median(relayed) / statistics.median(direct)
        added = (statistics.median(relayed) - statistics.median(direct)) * 1e3
        print(f"{kind:6} {_ms(direct)} {_ms(relayed)} {ratio:15.2f} {added:9.3f}")


async def starts(k: int, scratch: Path) -> None:
    limits = Limits(processes=1024, memory_mb=8192, open_files=4096)
    runner, base_url = await _proxy()
    took: dict[str, list[float]] = {}
    try:
        confines: tuple[tuple[str, Sandbox], ...] = (
            ("none", NoSandbox()),
            ("bwrap", Bubblewrap()),
        )
        for name, confine in confines:
            spec = HarnessSpec(command=("true",), deadline_s=600, sandbox=confine, limits=limits)
            took[name] = []
            for i in range(k):
                start = time.perf_counter()
                await _harness(spec, scratch, base_url, f"ex_start_{i}")
                took[name].append(time.perf_counter() - start)
    finally:
        await runner.cleanup()
    print(f"\n2. start: `true` as the harness, {k} times, ms from launch to return")
    print(f"{'sandbox':8} {'mean':>7} {'median':>7}")
    for name, values in took.items():
        print(f"{name:8} {_ms(values)}")
    ratio = statistics.median(took["bwrap"]) / statistics.median(took["none"])
    added = (statistics.median(took["bwrap"]) - statistics.median(took["none"])) * 1e3
    print(f"bwrap / none (median): {ratio:.2f}x, {added:.1f} ms more per harness")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=500, help="model calls per kind and mode")
    parser.add_argument("--starts", type=int, default=20, help="harness starts per sandbox")
    args = parse(parser, calls=4, starts=2)
    if shutil.which("bwrap") is None:
        sys.exit("bubblewrap is not installed (apt-get install bubblewrap)")
    scratch = Path(tempfile.mkdtemp(prefix="qwengyre-bench-sandbox-"))
    try:
        asyncio.run(calls(args.calls, scratch))
        asyncio.run(starts(args.starts, scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
