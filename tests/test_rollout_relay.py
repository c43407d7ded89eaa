"""The proxy relay (:mod:`qwengyre.rollout.relay`, :mod:`qwengyre.rollout.netns_relay`):
every call leaves with the execution's own key whatever the harness sent, an answer
streams through as it is produced, an unreachable proxy is a 502 a client retries, and
a sandboxed harness reaches its proxy through both halves over real HTTP."""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from qwengyre.rollout import netns_relay
from qwengyre.rollout.harness import HarnessSpec, prepare_harness, supervise
from qwengyre.rollout.relay import (
    PLACEHOLDER_KEY,
    SANDBOX_PORT,
    RelayTarget,
    inside_base_url,
    new_socket_path,
    relay,
)
from qwengyre.rollout.sandbox import Bubblewrap

needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None,
    reason="bubblewrap is not installed (apt-get install bubblewrap)",
)


class Upstream:
    """A stand-in proxy: records what each call presented; ``/stream`` sends its first
    SSE event, then waits for :attr:`go` before the second."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []
        self.go = asyncio.Event()
        self.arrived = asyncio.Event()  # a ``/slow`` call came in
        self.hung_up = asyncio.Event()  # ``/slow``'s caller left before its answer
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("POST", "/x/ex_1/v1/echo", self._echo)
        app.router.add_route("GET", "/x/ex_1/stream", self._stream)
        app.router.add_route("GET", "/x/ex_1/slow", self._slow)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}/x/ex_1"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _echo(self, request: web.Request) -> web.Response:
        self.seen.append({k.lower(): v for k, v in request.headers.items()})
        return web.json_response({"body": (await request.read()).decode()}, status=201)

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        self.seen.append({k.lower(): v for k, v in request.headers.items()})
        answer = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await answer.prepare(request)
        await answer.write(b"data: first\n\n")
        await self.go.wait()
        await answer.write(b"data: second\n\n")
        return answer

    async def _slow(self, request: web.Request) -> web.Response:
        """Answers once :attr:`go` is set, noting whether its caller is still there."""
        self.arrived.set()
        await self.go.wait()
        await asyncio.sleep(0.1)  # the relay's hang-up reaches this side
        if request.transport is None or request.transport.is_closing():
            self.hung_up.set()
        return web.json_response({})


def with_upstream(
    scenario: Callable[[Upstream], Awaitable[None]],
) -> None:
    async def main() -> None:
        upstream = Upstream()
        await upstream.start()
        try:
            await scenario(upstream)
        finally:
            await upstream.stop()

    asyncio.run(main())


def target(base_url: str) -> RelayTarget:
    return RelayTarget(base_url=base_url, api_key="qg-real", socket=new_socket_path())


def test_the_relay_puts_the_executions_key_in_place_of_any_the_harness_sends() -> None:
    async def scenario(upstream: Upstream) -> None:
        async with relay(target(upstream.url)) as socket:
            assert socket.stat().st_mode & 0o777 == 0o600
            connector = aiohttp.UnixConnector(path=str(socket))
            async with aiohttp.ClientSession(connector=connector) as http:
                for stolen in (
                    {"x-api-key": "qg-someone-elses"},
                    {"authorization": "Bearer qg-someone-elses"},
                    {"authorization": "Bearer x", "x-api-key": "y", "api-key": "z"},
                    {},
                ):
                    async with http.post(
                        "http://relay/x/ex_1/v1/echo", data=b"hi", headers=stolen
                    ) as r:
                        assert r.status == 201 and (await r.json()) == {"body": "hi"}
        assert socket.exists() is False  # removed with its directory
        assert [(s["x-api-key"], s["authorization"]) for s in upstream.seen] == [
            ("qg-real", "Bearer qg-real")
        ] * 4
        assert all("api-key" not in s for s in upstream.seen)

    with_upstream(scenario)


def test_an_answer_streams_through_the_relay_as_it_is_produced() -> None:
    async def scenario(upstream: Upstream) -> None:
        async with relay(target(upstream.url)) as socket:
            connector = aiohttp.UnixConnector(path=str(socket))
            async with (
                aiohttp.ClientSession(connector=connector) as http,
                http.get("http://relay/x/ex_1/stream") as r,
            ):
                # the first event arrives while the proxy still holds back the second
                assert await r.content.readuntil(b"\n\n") == b"data: first\n\n"
                upstream.go.set()
                assert await r.content.read() == b"data: second\n\n"

    with_upstream(scenario)


def test_a_harness_that_hangs_up_hangs_up_on_the_proxy_too() -> None:
    """Else the proxy would count an answer nobody received as delivered."""

    async def scenario(upstream: Upstream) -> None:
        async with relay(target(upstream.url)) as socket:
            connector = aiohttp.UnixConnector(path=str(socket))
            async with aiohttp.ClientSession(connector=connector) as http:
                call = asyncio.ensure_future(http.get("http://relay/x/ex_1/slow"))
                await asyncio.wait_for(upstream.arrived.wait(), timeout=60)
                call.cancel()  # the harness gives up: its connection closes
            upstream.go.set()
            await asyncio.wait_for(upstream.hung_up.wait(), timeout=60)

    with_upstream(scenario)


def test_an_unreachable_proxy_is_a_502_in_the_error_shape() -> None:
    async def scenario() -> None:
        with_port = "http://127.0.0.1:9/x/ex_1"  # discard: nothing listens
        async with relay(target(with_port)) as socket:
            connector = aiohttp.UnixConnector(path=str(socket))
            async with (
                aiohttp.ClientSession(connector=connector) as http,
                http.post("http://relay/x/ex_1/v1/echo", data=b"{}") as r,
            ):
                assert r.status == 502
                body = await r.json()
        assert body["type"] == "error" and "proxy unreachable" in body["error"]["message"]

    asyncio.run(scenario())


def test_the_inside_url_keeps_the_executions_path() -> None:
    url = inside_base_url("http://10.0.0.7:8123/x/ex_9")
    assert url == f"http://127.0.0.1:{SANDBOX_PORT}/x/ex_9"


# A harness that streams through its base URL with the key it was given, then prints it.
STREAMER = """
import os, urllib.request
base, key = os.environ["ANTHROPIC_BASE_URL"], os.environ["ANTHROPIC_API_KEY"]
request = urllib.request.Request(base + "/stream", headers={{"x-api-key": key}})
with urllib.request.urlopen(request) as answer:
    first = answer.readline() + answer.readline()
    open("first", "wb").write(first)  # the test lets the second event go on seeing it
    rest = answer.read()
print(repr(first + rest), key)
"""


@needs_bwrap
def test_a_sandboxed_harness_streams_from_its_proxy_through_both_relays(tmp_path: Path) -> None:
    workspace, logs = tmp_path / "run" / "ws", tmp_path / "run" / "logs"
    workspace.mkdir(parents=True)
    spec = HarnessSpec(
        command=(sys.executable, "-c", STREAMER), deadline_s=60, sandbox=Bubblewrap()
    )

    async def scenario(upstream: Upstream) -> None:
        job = asyncio.ensure_future(
            supervise(
                prepare_harness(
                    spec,
                    workspace=workspace,
                    logs_dir=logs,
                    execution_id="ex_1",
                    base_url=upstream.url,
                    api_key="qg-real",
                    instructions="stream",
                    hidden=(tmp_path / "run",),
                )
            )
        )
        while not (workspace / "first").exists() and not job.done():
            await asyncio.sleep(0.02)
        upstream.go.set()
        run = await job
        assert run.ok, (logs / "stderr.log").read_text()
        assert [seen["x-api-key"] for seen in upstream.seen] == ["qg-real"]

    with_upstream(scenario)
    out = (logs / "stdout.log").read_text().strip().rsplit(" ", 1)
    assert out == ["b'data: first\\n\\ndata: second\\n\\n'", PLACEHOLDER_KEY]
    assert (workspace / "first").read_bytes() == b"data: first\n\n"


def _inside(*argv: str, cwd: Path | None = None) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-I", "-S", netns_relay.__file__, "--listen", "127.0.0.1:0"]
    return subprocess.Popen([*command, "--to", "/nonexistent.sock", "--", *argv], cwd=cwd)


def test_the_inside_relay_exits_with_the_harness_status() -> None:
    assert _inside("sh", "-c", "exit 3").wait() == 3
    assert _inside("sh", "-c", "kill -KILL $$").wait() == 128 + signal.SIGKILL
    assert _inside("no-such-harness-binary").wait() == 127
    bad = [sys.executable, "-I", "-S", netns_relay.__file__, "--listen", "127.0.0.1:0"]
    assert subprocess.run(bad, capture_output=True).returncode == 2


def test_the_inside_relay_passes_a_sigterm_on_and_waits_for_the_harness(tmp_path: Path) -> None:
    trap = 'trap "exit 5" TERM; touch ready; while :; do sleep 0.1; done'
    relay = _inside("sh", "-c", trap, cwd=tmp_path)
    while not (tmp_path / "ready").exists():
        assert relay.poll() is None
        time.sleep(0.02)
    relay.send_signal(signal.SIGTERM)  # the relay alone, not its process group
    assert relay.wait() == 5


def test_a_sigterm_after_the_harness_was_reaped_is_not_an_error() -> None:
    # A TERM to the sandbox's process group can end the harness, and waitpid reap it,
    # before the relay's handler runs: that handler then has no one to pass it to.
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert netns_relay._forward([gone.pid])
