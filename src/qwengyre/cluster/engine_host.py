"""A rollout engine served from inside a cell or standalone process (docs/design.md §3).

:class:`EngineHost` runs an :class:`~qwengyre.engines.embedded.EmbeddedEngine` behind
SGLang's HTTP API on ``engine.host`` (127.0.0.1 by default; an address other nodes
reach when the proxy runs elsewhere, with every call authenticated by the engine's
API key either way; the proxy drives it with
:class:`~qwengyre.engines.sglang.SGLangEngine`, as it would a real SGLang server), in an
event loop on its own thread, so the process's synchronous actor methods can call it.
Elastic cells (:class:`~qwengyre.cluster.cell.Cell`) and the standalone pool
(:class:`~qwengyre.cluster.standalone.StandalonePool`) both host their engine with it,
or with a server host of another ``engine.backend`` (:func:`rollout_host`): weights
come from the core's weights board either way.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from aiohttp import web

from qwengyre.cluster.net import advertised
from qwengyre.cluster.weights import BoardShards
from qwengyre.config import EngineBackend
from qwengyre.engines.base import InferenceEngine
from qwengyre.engines.factory import embedded_engine, server_backend, server_engine
from qwengyre.engines.server import engine_app

__all__ = ["Endpoint", "EngineHost", "RolloutHost", "rollout_host"]

T = TypeVar("T")


@dataclass(frozen=True)
class Endpoint:
    """Where a rollout server listens, its key, and the HTTP API it speaks;
    ``routed_experts``: ``(layers, k)`` of the MoE it serves when its clients ask for
    the routed experts of every position (``engine.return_routed_experts``), else None."""

    url: str
    api_key: str
    api: str  # a server backend's name (engines.factory.SERVER_BACKENDS)
    routed_experts: tuple[int, int] | None = None

    def client(self, name: str, capacity: int, version: int) -> InferenceEngine:
        """The proxy's engine for this server."""
        return server_engine(
            self.api,
            self.url,
            name=name,
            capacity=capacity,
            api_key=self.api_key,
            version=version,
            routed_experts=self.routed_experts,
        )


class RolloutHost(Protocol):
    """A cell's (or the standalone pool's) rollout server, one kind per engine backend:
    :class:`EngineHost` (embedded), :class:`~qwengyre.cluster.server_host.ServerHost`
    (a server backend's)."""

    def start(self) -> Endpoint:
        """Serve; where, with which key and API."""
        ...

    def release(self, timeout_s: float = 60.0) -> str:
        """Free the server's device memory once the proxy drained it; what freed it:
        ``"released"`` (the embedded engine let go of its weights and KV cache),
        ``"asleep"`` (a server put them aside: vLLM's sleep, SGLang's
        ``release_memory_occupation``) or ``"stopped"`` (the server was stopped: vLLM
        on the CPU, where its sleep frees nothing)."""
        ...

    def resume(self, boards: BoardShards) -> int:
        """Serve again with the boards' newest weights; returns their version."""
        ...

    def load_newest(self, boards: BoardShards) -> int:
        """Load the boards' weights if newer (between steps of generation); the version."""
        ...

    def revive(self, boards: BoardShards) -> bool:
        """If the server crashed (its process exited while it should serve), start it
        again, at the same address and key, with the boards' newest weights; True if it
        did. A server that runs, or was stopped on purpose, is left alone."""
        ...

    def close(self) -> None: ...


def rollout_host(
    backend: EngineBackend,
    model_dir: str,
    *,
    name: str,
    capacity: int,
    device: str,
    max_context: int | None,
    seed: int,
    host: str,
    gpus: tuple[str, ...] = (),
    version: int = -1,
    routed_experts: bool = False,
) -> RolloutHost:
    """The rollout server of ``backend`` (``engine.backend``) for one cell or pool: the
    embedded engine's host, or a server host of a registered server backend
    (:data:`~qwengyre.engines.factory.SERVER_BACKENDS`).

    ``gpus``: the physical ids of the cell's GPUs, a server's tensor parallel group
    (the embedded engine has no tensor parallelism: it runs on ``device`` alone).
    ``version``: the policy version of ``model_dir``'s weights; -1 serves nothing of
    the run's until :meth:`RolloutHost.load_newest` loaded the core's weights (a
    server still needs weights to start: it starts from ``model_dir``'s, labelled -1).
    ``capacity`` and ``seed`` concern the embedded engine only. ``routed_experts``
    (``engine.return_routed_experts``): an MoE's server reports the experts of every
    position and its endpoint's clients ask for them.
    """
    if backend == "embedded":
        return EngineHost(
            model_dir,
            name=name,
            capacity=capacity,
            device=device,
            max_context=max_context,
            seed=seed,
            version=version,
            host=host,
            routed_experts=routed_experts,
        )
    from qwengyre.cluster.server_host import ServerHost  # it imports this module

    return ServerHost(
        server_backend(backend),
        model_dir,
        name=name,
        device=device,
        gpus=gpus,
        max_context=max_context,
        host=host,
        version=version,
        routed_experts=routed_experts,
    )


class EngineHost:
    """One engine and its HTTP server; see the module docstring.

    ``start`` serves and returns its :class:`Endpoint`; ``release`` frees the
    engine's memory once the proxy drained it; ``resume`` serves again; ``load_newest``
    loads the board's weights if they are newer than the engine's. With
    ``routed_experts``, an MoE's endpoint asks for the routed experts the engine records.
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
        routed_experts: bool = False,
    ) -> None:
        self.engine = embedded_engine(
            model_dir,
            name=name,
            capacity=capacity,
            device=device,
            dtype="float32",  # train's cells (engine.dtype's description)
            max_context=max_context,
            seed=seed,
            routed_experts=routed_experts,
        )
        self.engine.version = version
        self.routed_experts = self.engine.routed_experts  # what its clients ask for
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
        url = f"http://{advertised(self.host)}:{port}"
        return Endpoint(url, api_key, "sglang", self.routed_experts)

    def release(self, timeout_s: float = 60.0) -> str:
        """Free the engine's memory once the requests the proxy aborted have left;
        ``"released"``."""
        deadline = time.monotonic() + timeout_s
        while self.engine.load:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.engine.name}: {self.engine.load} requests did not drain")
            time.sleep(0.01)
        self._on_loop(self.engine.release_memory())
        return "released"

    def resume(self, boards: BoardShards) -> int:
        """Serve again with the boards' newest weights; returns their version."""
        self._on_loop(self.engine.resume_memory())
        return self.load_newest(boards)

    def load_newest(self, boards: BoardShards) -> int:
        """Load the boards' weights (between decode steps, shard by shard) if newer;
        returns the engine's version."""
        return boards.load_newest(
            self.engine.version,
            lambda version: self._on_loop(
                self.engine.update_weights(boards.source(version), version)
            ),
        )

    def revive(self, boards: BoardShards) -> bool:
        return False  # the engine lives in this process: it cannot crash on its own

    def close(self) -> None:
        self.engine.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
