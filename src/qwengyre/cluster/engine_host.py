"""A rollout engine served from inside a cell or standalone process (DESIGN.md §3).

:class:`EngineHost` runs an :class:`~qwengyre.engines.embedded.EmbeddedEngine` behind
SGLang's HTTP API on ``engine.host`` (127.0.0.1 by default; an address other nodes
reach when the proxy runs elsewhere, with every call authenticated by the engine's
API key either way; the proxy drives it with
:class:`~qwengyre.engines.sglang.SGLangEngine`, as it would a real SGLang server), in an
event loop on its own thread, so the process's synchronous actor methods can call it.
Elastic cells (:class:`~qwengyre.cluster.cell.Cell`) and the standalone pool
(:class:`~qwengyre.cluster.standalone.StandalonePool`) both host their engine with it:
weights come from the core's weights board either way.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

from aiohttp import web

from qwengyre.cluster.weights import BoardShards
from qwengyre.engines.base import InferenceEngine, StaleWeights
from qwengyre.engines.embedded import EmbeddedEngine
from qwengyre.engines.server import engine_app
from qwengyre.engines.sglang import SGLangEngine

__all__ = ["Endpoint", "EngineHost", "RolloutHost", "advertised", "rollout_host"]

T = TypeVar("T")


def advertised(host: str) -> str:
    """The address to reach a server bound to ``host``: this node's own address for
    the wildcard (``0.0.0.0``, ``::``), else ``host`` itself (IPv6 in brackets)."""
    if host in ("0.0.0.0", "::", ""):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:  # no packet is sent: connecting a UDP socket only picks the route
                probe.connect(("10.255.255.255", 1))
                return str(probe.getsockname()[0])
            except OSError:
                return socket.gethostbyname(socket.gethostname())
    return f"[{host}]" if ":" in host else host


@dataclass(frozen=True)
class Endpoint:
    """Where a rollout server listens, its key, and the HTTP API it speaks."""

    url: str
    api_key: str
    api: Literal["sglang", "vllm"]

    def client(self, name: str, capacity: int, version: int) -> InferenceEngine:
        """The proxy's engine for this server."""
        if self.api == "vllm":
            from qwengyre.engines.vllm import VLLMEngine

            return VLLMEngine(
                self.url, name, capacity=capacity, api_key=self.api_key, policy_version=version
            )
        return SGLangEngine(
            self.url, name, capacity=capacity, api_key=self.api_key, policy_version=version
        )


class RolloutHost(Protocol):
    """A cell's (or the standalone pool's) rollout server, one kind per engine backend:
    :class:`EngineHost` (embedded), :class:`~qwengyre.cluster.vllm_host.VLLMHost`."""

    def start(self) -> Endpoint:
        """Serve; where, with which key and API."""
        ...

    def release(self, timeout_s: float = 60.0) -> None:
        """Free the server's device memory once the proxy drained it."""
        ...

    def resume(self, boards: BoardShards) -> int:
        """Serve again with the boards' newest weights; returns their version."""
        ...

    def load_newest(self, boards: BoardShards) -> int:
        """Load the boards' weights if newer (between steps of generation); the version."""
        ...

    def close(self) -> None: ...


def rollout_host(
    backend: Literal["embedded", "vllm"],
    model_dir: str,
    *,
    name: str,
    capacity: int,
    device: str,
    max_context: int | None,
    seed: int,
    host: str,
) -> RolloutHost:
    """The rollout server of ``backend`` (``engine.backend``) for one cell or pool. It
    serves the core's weights once :meth:`RolloutHost.load_newest` loaded them."""
    if backend == "vllm":
        from qwengyre.cluster.vllm_host import VLLMHost

        return VLLMHost(model_dir, name=name, device=device, max_context=max_context, host=host)
    return EngineHost(
        model_dir,
        name=name,
        capacity=capacity,
        device=device,
        max_context=max_context,
        seed=seed,
        version=-1,  # whatever model_dir holds, serve the core's weights
        host=host,
    )


class EngineHost:
    """One engine and its HTTP server; see the module docstring.

    ``start`` serves and returns its :class:`Endpoint`; ``release`` frees the
    engine's memory once the proxy drained it; ``resume`` serves again; ``load_newest``
    loads the board's weights if they are newer than the engine's.
    """

    def __init__(
        self,
        model_dir: str,
        *,
        name: str,
        capacity: int,
        device: str,
        max_context: int | None,
        seed: int,
        version: int,
        host: str = "127.0.0.1",
    ) -> None:
        self.engine = EmbeddedEngine(
            model_dir,
            name=name,
            capacity=capacity,
            device=device,
            max_context=max_context,
            seed=seed,
        )
        self.engine.version = version
        self.host = host
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="engine-http", daemon=True).start()

    def _on_loop(self, coro: Coroutine[Any, Any, T], timeout_s: float = 120.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def start(self) -> Endpoint:
        """Serve on :attr:`host` with a fresh API key; returns the base URL (at an
        address others reach: this node's, when bound to all interfaces) and the key."""
        api_key = secrets.token_urlsafe(24)

        async def serve() -> int:
            runner = web.AppRunner(engine_app(self.engine, api_key), access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, self.host, 0)
            await site.start()
            return int(runner.addresses[0][1])

        port = self._on_loop(serve())
        return Endpoint(f"http://{advertised(self.host)}:{port}", api_key, "sglang")

    def release(self, timeout_s: float = 60.0) -> None:
        """Free the engine's memory once the requests the proxy aborted have left."""
        deadline = time.monotonic() + timeout_s
        while self.engine.load:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.engine.name}: {self.engine.load} requests did not drain")
            time.sleep(0.01)
        self._on_loop(self.engine.release_memory())

    def resume(self, boards: BoardShards) -> int:
        """Serve again with the boards' newest weights; returns their version."""
        self._on_loop(self.engine.resume_memory())
        return self.load_newest(boards)

    def load_newest(self, boards: BoardShards, attempts: int = 3) -> int:
        """Load the boards' weights (between decode steps, shard by shard) if newer;
        returns the engine's version. A shard the core rewrote during the load makes
        it start over with the newer version."""
        for attempt in range(attempts):
            version = boards.version
            if version <= self.engine.version:
                break
            try:
                self._on_loop(self.engine.update_weights(boards.source(version), version))
            except StaleWeights:
                if attempt == attempts - 1:
                    raise
        return self.engine.version

    def close(self) -> None:
        self.engine.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
