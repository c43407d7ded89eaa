"""An inference server launched as a subprocess on a cell's devices: the rollout host
of every server backend (``engine.backend=vllm``, ``sglang``; docs/design.md §3).

A :class:`ServerHost` launches its server (with the one launcher,
:mod:`qwengyre.engines.launch`; its :class:`~qwengyre.engines.launch.ServerBackend`
says what is the server's own) with a fresh API key, on ``engine.host`` and a port free
there, on the GPUs ``gpus`` (``CUDA_VISIBLE_DEVICES``, tensor parallel over all of them)
or on the CPU. The server runs in its own session, so that stopping it stops its
workers too (SIGTERM to the process group, SIGKILL after 30 s), and the kernel stops it
when the thread that launched it dies (PDEATHSIG): no orphaned servers. The host
drives it with the server's own client on a private event loop thread, so that a
cell's synchronous actor methods can call it.

Weights: ``version`` is the policy version of the weights in ``model_dir``: -1 serves
nothing of the run's until :meth:`ServerHost.load_newest` loaded the boards' weights
(``qwengyre train``), a version >= 0 serves ``model_dir`` labelled with it from the
start. A backend that takes weights from memory gets them so
(:meth:`~qwengyre.engines.launch.ServerBackend.load_from_memory`); otherwise
:meth:`~ServerHost.load_newest` writes the boards' newest weights into a fresh model
directory (the base model's config and tokenizer files, and one ``model.safetensors``
written shard by shard, under the checkpoint's names,
:meth:`~qwengyre.cluster.weights.BoardShards.write_safetensors`), which the server
loads in place; only the newest directory is kept, and a server restarted later
starts from it.

Role switches: :meth:`~ServerHost.release` frees the device memory once the proxy
drained the server and answers how (``"asleep"``: the server's weights and KV cache
left the device; ``"stopped"``: the server was stopped, where its sleep frees
nothing, or it had crashed); :meth:`~ServerHost.resume` serves again (a stopped server
is started again) with the boards' newest weights. Each switch is logged with what
happened and how long it took.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import logging
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from functools import partial
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

from qwengyre.cluster.engine_host import Endpoint
from qwengyre.cluster.net import advertised, free_port
from qwengyre.cluster.weights import BoardShards
from qwengyre.engines.base import WeightsOnDisk
from qwengyre.engines.launch import (
    ServerBackend,
    ServerClient,
    ServerPlacement,
    routed_experts_shape,
    start_server,
    stop_server,
    wait_until_healthy,
)
from qwengyre.models.saved_form import saved_form

__all__ = ["START_TIMEOUT_S", "ServerHost"]

T = TypeVar("T")
C = TypeVar("C", bound=ServerClient)
log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0
"""How long a server may take to become healthy (vLLM on a busy CPU: ~20-60 s)."""

_EXIT_GRACE_S = 10.0
"""How long a server whose call just failed may take to exit before the failure is
taken for the call's own (a crash is seen by its exit, not guessed from the error)."""

_MODEL_FILES = ("*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken")
"""The base model's files a weights directory copies: config, tokenizer, template (not
its weights, nor their index)."""


def _only(patterns: tuple[str, ...]) -> Callable[[str, list[str]], list[str]]:
    """A ``copytree`` ignore function keeping top-level files matching ``patterns``."""

    def ignore(directory: str, names: list[str]) -> list[str]:
        def kept(name: str) -> bool:
            weights = name.endswith(".index.json")
            return not weights and any(fnmatch.fnmatch(name, p) for p in patterns)

        return [n for n in names if not kept(n)]

    return ignore


class ServerHost(Generic[C]):
    """One server of ``backend`` for a cell or the standalone pool; see the module
    docstring.

    ``gpus``: the physical ids of the cell's GPUs, none on the CPU; left empty on a
    GPU ``device``, the device's own index (right where this process sees every GPU).
    """

    def __init__(
        self,
        backend: ServerBackend[C],
        model_dir: str,
        *,
        name: str,
        device: str,
        gpus: tuple[str, ...],
        max_context: int | None,
        host: str,
        version: int,
        routed_experts: bool = False,
    ) -> None:
        self.backend = backend
        self.routed_experts = routed_experts
        self.model_dir = Path(model_dir)
        self.name = name
        self.device = device
        if not gpus and device.startswith("cuda"):
            gpus = (device.partition(":")[2] or "0",)
        self.gpus = gpus
        self.max_context = max_context
        self.host = host
        self.port = free_port(host)
        # Hex: a key must not begin with '-', which a server may read as a flag (SGLang's
        # --config, as first released, turns the file's options back into arguments).
        self.api_key = secrets.token_hex(24)
        self.version = version
        self._work = Path(tempfile.mkdtemp(prefix=f"qg-{backend.api}-{name}-"))
        self._weights = self.model_dir  # the directory the server starts from
        self._process: subprocess.Popen[bytes] | None = None
        self._client: C | None = None
        self._loop = asyncio.new_event_loop()
        thread = threading.Thread(target=self._loop.run_forever, name=f"{backend.api}-host")
        thread.daemon = True
        thread.start()

    @property
    def url(self) -> str:
        """The server's base URL, at an address others reach."""
        return f"http://{advertised(self.host)}:{self.port}"

    def placement(self, model: str | None = None) -> ServerPlacement:
        """Where the server starts, on the weights in ``model`` (default: the base model)."""
        return ServerPlacement(
            model=model or str(self.model_dir),
            host=self.host,
            port=self.port,
            api_key=self.api_key,
            device=self.device,
            gpus=self.gpus,
            max_context=self.max_context,
            version=self.version,
            work=self._work,
            routed_experts=self.routed_experts,
        )

    def _on_loop(self, coro: Coroutine[Any, Any, T], timeout_s: float = 600.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def _engine(self) -> C:
        if self._client is None:
            raise RuntimeError(f"{self.name}: the {self.backend.api} server is not running")
        return self._client

    def _exit_code(self) -> int | None:
        """The exit code of a server process that ended by itself (a crash); None while
        it runs, and for a server stopped on purpose (it has no process)."""
        return None if self._process is None else self._process.poll()

    def _launch(self) -> None:
        place = self.placement(str(self._weights))
        self._process = start_server(self.backend.spec(place))
        self._client = client = self.backend.host_client(self.url, self.name, place)

        async def ready() -> None:
            await wait_until_healthy(client, START_TIMEOUT_S, self._process)
            await self.backend.ready(client, self.version)

        try:
            self._on_loop(ready())
        except BaseException:
            self._stop()
            raise

    def _stop(self) -> None:
        if self._client is not None:
            self._on_loop(self._client.close())
            self._client = None
        if self._process is not None:
            stop_server(self._process)
        self._process = None

    def _load(self, boards: BoardShards, version: int) -> None:
        """Load ``version`` of the boards' weights into the server: from memory if its
        backend takes them so, else through a model directory."""
        client = self._engine()
        if self._on_loop(self.backend.load_from_memory(client, boards.by_name(version), version)):
            return
        target = self._work / f"v{version}"
        shutil.copytree(self.model_dir, target, ignore=_only(_MODEL_FILES))
        try:
            to_saved = saved_form(self.model_dir)  # an MoE's experts: one by one, as Qwen's
            boards.write_safetensors(version, target / "model.safetensors", torch.float32, to_saved)
            self._on_loop(client.update_weights(WeightsOnDisk(str(target)), version))
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise
        if self._weights != self.model_dir:
            shutil.rmtree(self._weights, ignore_errors=True)
        self._weights = target

    def start(self) -> Endpoint:
        """Launch the server; where it serves, its key and API."""
        self._launch()
        shape = routed_experts_shape(self.model_dir) if self.routed_experts else None
        return Endpoint(self.url, self.api_key, self.backend.api, shape)

    def load_newest(self, boards: BoardShards) -> int:
        """Load the boards' weights if newer; returns the version served. A server that
        crashed, before the load or during it, fails nothing: the answer is the older
        version it held, which tells the caller to have it revived (:meth:`revive`
        starts it again with the newest weights)."""
        if self._exit_code() is None:
            try:
                self.version = boards.load_newest(self.version, partial(self._load, boards))
                return self.version
            except Exception:
                if self._exited_within(_EXIT_GRACE_S) is None:
                    raise  # it still runs: the load itself failed
        log.warning(
            "%s: the %s server exited (code %s); it takes version %d when started again",
            self.name,
            self.backend.api,
            self._exit_code(),
            boards.version,
        )
        return self.version

    def _exited_within(self, seconds: float) -> int | None:
        """The exit code of a server process that ends by itself within ``seconds`` (a
        call to it just failed: a crashed server may take a moment to be reaped)."""
        if self._process is None:
            return None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(seconds)
        return self._exit_code()

    def release(self, timeout_s: float = 60.0) -> str:
        """Free the device once the proxy drained the server; ``"asleep"`` or
        ``"stopped"`` (see the module docstring)."""
        start = time.monotonic()
        state = "stopped"
        if self._exit_code() is None and self.backend.sleep_frees(self.device):
            try:
                self._release_memory(start + timeout_s)
                state = "asleep"
            except Exception:
                if self._exited_within(_EXIT_GRACE_S) is None:
                    raise  # it still runs: the release itself failed
                # it crashed while asked to release: nothing left to free
        if state == "stopped":
            self._stop()  # a crashed one has nothing to free; resume starts it again
        log.info("%s: %s in %.1f s", self.name, state, time.monotonic() - start)
        return state

    def _release_memory(self, deadline: float) -> None:
        """Put the server to sleep. The proxy drained it, but a server may still be
        finishing the requests it aborted and refuse (SGLang: "abort or drain in-flight
        requests first"): ask again until ``deadline``, then raise what it said."""
        while True:
            try:
                self._on_loop(
                    self._engine().release_memory(), max(1.0, deadline - time.monotonic())
                )
                return
            except ValueError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)

    def resume(self, boards: BoardShards) -> int:
        """Serve again with the boards' newest weights; returns their version."""
        start = time.monotonic()
        if self._process is None or self._exit_code() is not None:  # stopped, or crashed
            self._stop()
            self._launch()  # from the newest weights directory: already at self.version
            state = "started"
        else:
            self._on_loop(self._engine().resume_memory())
            state = "awake"
        log.info("%s: %s in %.1f s", self.name, state, time.monotonic() - start)
        return self.load_newest(boards)

    def revive(self, boards: BoardShards) -> bool:
        """Start the server again if its process exited (a crash; a server stopped on
        purpose has no process) and load the boards' newest weights; True if it did."""
        if (code := self._exit_code()) is None:
            return False
        log.warning(
            "%s: the %s server exited (code %s); starting it again",
            self.name,
            self.backend.api,
            code,
        )
        self._stop()  # reap it and whatever it left in its group
        self._launch()  # the same port and key, from the newest weights directory
        self.load_newest(boards)
        return True

    def close(self) -> None:
        self._stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        shutil.rmtree(self._work, ignore_errors=True)
