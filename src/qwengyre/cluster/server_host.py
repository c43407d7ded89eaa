"""An inference server launched as a subprocess on a cell's devices: what the rollout
hosts of ``engine.backend=vllm`` and ``sglang`` share (DESIGN.md §3).

A :class:`ServerHost` launches its server (:class:`~qwengyre.cluster.vllm_host.VLLMHost`,
:class:`~qwengyre.cluster.sglang_host.SGLangHost` say how) with a fresh API key, on
``engine.host`` and a port free there, on the GPUs ``gpus`` (``CUDA_VISIBLE_DEVICES``,
tensor parallel over all of them) or on the CPU. The server runs in its own session,
so that stopping it stops its workers too (SIGTERM to the process group, SIGKILL after
30 s), and the kernel stops it when the thread that launched it dies (PDEATHSIG): no
orphaned servers. The host drives it with the server's own client on a private event
loop thread, so that a cell's synchronous actor methods can call it.

Weights: ``version`` is the policy version of the weights in ``model_dir``: -1 serves
nothing of the run's until :meth:`ServerHost.load_newest` loaded the boards' weights
(``qwengyre train``), a version >= 0 serves ``model_dir`` labelled with it from the
start. By default :meth:`~ServerHost.load_newest` writes the boards' newest weights
into a fresh model directory (the base model's config and tokenizer files, and one
``model.safetensors`` written shard by shard,
:meth:`~qwengyre.cluster.weights.BoardShards.write_safetensors`), which the server
loads in place; only the newest directory is kept, and a server restarted later
starts from it.

Role switches: :meth:`~ServerHost.release` frees the device memory once the proxy
drained the server and answers how (``"asleep"``: the server's weights and KV cache
left the device; ``"stopped"``: the server was stopped); :meth:`~ServerHost.resume`
serves again (a stopped server is started again) with the boards' newest weights.
Each switch is logged with what happened and how long it took.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fnmatch
import logging
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, Generic, Literal, Protocol, TypeVar

import torch

from qwengyre.cluster.engine_host import Endpoint
from qwengyre.cluster.net import advertised, free_port
from qwengyre.cluster.weights import BoardShards
from qwengyre.engines.base import WeightsOnDisk, WeightSource
from qwengyre.engines.sglang import HealthChecked, wait_until_healthy

__all__ = ["START_TIMEOUT_S", "ServerClient", "ServerHost"]

T = TypeVar("T")
log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0
"""How long a server may take to become healthy (vLLM on a busy CPU: ~20-60 s)."""

_MODEL_FILES = ("*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken")
"""The base model's files a weights directory copies: config, tokenizer, template (not
its weights, nor their index)."""

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the server's process before it runs: SIGTERM when the thread that started it
    dies (Linux; hosts start servers from their process's main thread)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _only(patterns: tuple[str, ...]) -> Callable[[str, list[str]], list[str]]:
    """A ``copytree`` ignore function keeping top-level files matching ``patterns``."""

    def ignore(directory: str, names: list[str]) -> list[str]:
        def kept(name: str) -> bool:
            weights = name.endswith(".index.json")
            return not weights and any(fnmatch.fnmatch(name, p) for p in patterns)

        return [n for n in names if not kept(n)]

    return ignore


class ServerClient(HealthChecked, Protocol):
    """What a host needs of its server's client."""

    async def update_weights(self, source: WeightSource, version: int) -> None: ...

    async def release_memory(self) -> None: ...

    async def resume_memory(self) -> None: ...

    async def close(self) -> None: ...


C = TypeVar("C", bound=ServerClient)


class ServerHost(ABC, Generic[C]):
    """One server for a cell or the standalone pool; see the module docstring.

    ``gpus``: the physical ids of the cell's GPUs, none on the CPU; left empty on a
    GPU ``device``, the device's own index (right where this process sees every GPU).
    """

    api: ClassVar[Literal["sglang", "vllm"]]

    def __init__(
        self,
        model_dir: str,
        *,
        name: str,
        device: str,
        gpus: tuple[str, ...],
        max_context: int | None,
        host: str,
        version: int,
    ) -> None:
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
        self._work = Path(tempfile.mkdtemp(prefix=f"qg-{self.api}-{name}-"))
        self._weights = self.model_dir  # the directory the server starts from
        self._process: subprocess.Popen[bytes] | None = None
        self._client: C | None = None
        self._loop = asyncio.new_event_loop()
        thread = threading.Thread(target=self._loop.run_forever, name=f"{self.api}-host")
        thread.daemon = True
        thread.start()

    @property
    def url(self) -> str:
        """The server's base URL, at an address others reach."""
        return f"http://{advertised(self.host)}:{self.port}"

    @property
    def tp_size(self) -> int:
        """Tensor parallel degree: every GPU of the cell (1 on the CPU)."""
        return len(self.gpus) or 1

    def gpu_env(self) -> dict[str, str]:
        """The environment that shows the server the cell's GPUs (none on the CPU)."""
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.gpus)} if self.gpus else {}

    # -- what each server does its own way -----------------------------------------------

    @abstractmethod
    def _popen(self, model: str, **popen_kwargs: Any) -> subprocess.Popen[bytes]:
        """Start the server on the weights in directory ``model``."""

    @abstractmethod
    def _new_client(self) -> C:
        """A client of the server, whose tokens default to :attr:`version`."""

    async def _ready(self, client: C, process: subprocess.Popen[bytes]) -> None:
        """Wait until the server just started serves."""
        await wait_until_healthy(client, START_TIMEOUT_S, process)

    def _free(self, timeout_s: float) -> str:
        """Free the device memory; what happened (for :meth:`release`)."""
        self._on_loop(self._engine().release_memory(), timeout_s)
        return "asleep"

    def _load(self, boards: BoardShards, version: int) -> None:
        """Load ``version`` of the boards' weights into the server."""
        self._load_from_disk(boards, version)

    # -- shared ------------------------------------------------------------------------

    def _on_loop(self, coro: Coroutine[Any, Any, T], timeout_s: float = 600.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def _engine(self) -> C:
        if self._client is None:
            raise RuntimeError(f"{self.name}: the {self.api} server is not running")
        return self._client

    def _launch(self) -> None:
        self._process = self._popen(
            str(self._weights), start_new_session=True, preexec_fn=_die_with_parent
        )
        self._client = self._new_client()
        try:
            self._on_loop(self._ready(self._client, self._process))
        except BaseException:
            self._stop()
            raise

    def _stop(self) -> None:
        if self._client is not None:
            self._on_loop(self._client.close())
            self._client = None
        if self._process is not None:
            group = self._process.pid
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(30)
            with contextlib.suppress(ProcessLookupError):  # workers that outlived it
                os.killpg(group, signal.SIGKILL)
            self._process.wait()
        self._process = None

    def _load_from_disk(self, boards: BoardShards, version: int) -> None:
        target = self._work / f"v{version}"
        shutil.copytree(self.model_dir, target, ignore=_only(_MODEL_FILES))
        try:
            boards.write_safetensors(version, target / "model.safetensors", torch.float32)
            self._on_loop(self._engine().update_weights(WeightsOnDisk(str(target)), version))
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise
        if self._weights != self.model_dir:
            shutil.rmtree(self._weights, ignore_errors=True)
        self._weights = target

    def start(self) -> Endpoint:
        """Launch the server; where it serves, its key and API."""
        self._launch()
        return Endpoint(self.url, self.api_key, self.api)

    def load_newest(self, boards: BoardShards) -> int:
        """Load the boards' weights if newer; returns the version served."""
        self.version = boards.load_newest(self.version, partial(self._load, boards))
        return self.version

    def release(self, timeout_s: float = 60.0) -> str:
        """Free the device once the proxy drained the server; ``"asleep"`` or
        ``"stopped"`` (see the module docstring)."""
        start = time.monotonic()
        if self._process is not None and self._process.poll() is not None:
            self._stop()  # it crashed: nothing to free; resume starts it again
            state = "stopped"
        else:
            state = self._free(timeout_s)
        log.info("%s: %s in %.1f s", self.name, state, time.monotonic() - start)
        return state

    def resume(self, boards: BoardShards) -> int:
        """Serve again with the boards' newest weights; returns their version."""
        start = time.monotonic()
        if self._process is None or self._process.poll() is not None:  # stopped, or crashed
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
        if self._process is None or (code := self._process.poll()) is None:
            return False
        log.warning(
            "%s: the %s server exited (code %s); starting it again", self.name, self.api, code
        )
        self._stop()  # reap it and whatever it left in its group
        self._launch()  # the same port and key, from the newest weights directory
        self.load_newest(boards)
        return True

    def close(self) -> None:
        self._stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        shutil.rmtree(self._work, ignore_errors=True)
