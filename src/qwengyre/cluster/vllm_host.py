"""A vLLM server as a cell's rollout server (``engine.backend=vllm``; issue 18).

:class:`VLLMHost` launches ``python -m vllm.entrypoints.openai.api_server`` on the
cell's device (the interpreter of ``$QWENGYRE_VLLM_PYTHON``: vLLM usually needs its own
environment) with a fresh API key, on ``engine.host`` and a free port, and the proxy
drives it with :class:`~qwengyre.engines.vllm.VLLMEngine`.

Weights: the core's shards are written shard by shard into one safetensors file of a
model directory (:meth:`~qwengyre.cluster.weights.BoardShards.write_safetensors`; the
config and tokenizer files come from the base model), which the server loads in place
(:meth:`~qwengyre.engines.vllm.VLLMEngine.update_weights`: in-flight requests continue,
each token keeps the version that produced it). Only the newest directory is kept.

Role switches: on an accelerator, ``release`` puts the server to sleep (its weights and
KV cache leave the device) and ``resume`` wakes it. On the CPU vLLM's sleep frees
nothing, so the server is stopped and started again from the newest weights directory.
Each switch is logged with which of the two happened and how long it took.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Coroutine
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from qwengyre.cluster.engine_host import Endpoint, advertised
from qwengyre.cluster.weights import BoardShards
from qwengyre.engines.base import StaleWeights, WeightsOnDisk
from qwengyre.engines.sglang import wait_until_healthy
from qwengyre.engines.vllm import VLLMEngine, VLLMServerSpec, launch_vllm

__all__ = ["VLLMHost"]

T = TypeVar("T")
log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0
"""How long a server may take to become healthy (vLLM on a busy CPU: ~20-60 s)."""

_MODEL_FILES = ("*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken")
"""The base model's files a weights directory copies: config, tokenizer, template (not
its weights, nor their index)."""


def _device_env(device: str) -> dict[str, str]:
    """The server's environment for ``device``: its GPU, or a small CPU KV cache."""
    if device.startswith("cuda"):
        index = device.partition(":")[2] or "0"
        return {"CUDA_VISIBLE_DEVICES": index}
    return {"VLLM_CPU_KVCACHE_SPACE": "1"}


def _die_with_parent() -> None:
    """In the server's process before it runs: SIGTERM when its parent dies (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


_PR_SET_PDEATHSIG = 1


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class VLLMHost:
    """One vLLM server for a cell or the standalone pool; see the module docstring."""

    def __init__(
        self, model_dir: str, *, name: str, device: str, max_context: int | None, host: str
    ) -> None:
        self.model_dir = Path(model_dir)
        self.name = name
        self.device = device
        self.version = -1
        self._work = Path(tempfile.mkdtemp(prefix=f"qg-vllm-{name}-"))
        self._weights = self.model_dir  # the directory the server loads from
        cpu = device == "cpu"
        self._api_key = secrets.token_urlsafe(24)
        self._spec = VLLMServerSpec(
            model=str(self.model_dir),
            host=host,
            port=_free_port(host),
            api_key=self._api_key,
            dtype="float32" if cpu else "auto",
            max_model_len=max_context,
            # CPU: skip a long graph compile; GPU: without it /sleep frees nothing.
            extra_args=("--enforce-eager",) if cpu else ("--enable-sleep-mode",),
            extra_env=_device_env(device),
        )
        self._process: subprocess.Popen[bytes] | None = None
        self._client: VLLMEngine | None = None
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="vllm-host", daemon=True).start()

    def _on_loop(self, coro: Coroutine[Any, Any, T], timeout_s: float = 600.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    @property
    def _url(self) -> str:
        return f"http://{advertised(self._spec.host)}:{self._spec.port}"

    def _launch(self) -> None:
        spec = replace(self._spec, model=str(self._weights))
        # Its own process group, so that stopping it stops vLLM's workers too; and
        # stopped by the kernel if this process dies first (no orphaned servers).
        self._process = launch_vllm(spec, start_new_session=True, preexec_fn=_die_with_parent)
        self._client = VLLMEngine(
            self._url,
            self.name,
            capacity=1,
            api_key=self._api_key,
            policy_version=self.version,
        )
        try:
            self._on_loop(wait_until_healthy(self._client, START_TIMEOUT_S, self._process))
            if self.version >= 0:  # restarted from a published version: say which
                self._on_loop(self._client.label_weights(self.version))
        except BaseException:
            self._stop()
            raise

    def _stop(self) -> None:
        if self._client is not None:
            self._on_loop(self._client.close())
            self._client = None
        if self._process is not None and self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGTERM)
            try:
                self._process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait()
        self._process = None

    def start(self) -> Endpoint:
        self._launch()
        return Endpoint(self._url, self._api_key, "vllm")

    def load_newest(self, boards: BoardShards, attempts: int = 3) -> int:
        """Write the boards' newest weights to disk and load them, if newer."""
        for attempt in range(attempts):
            version = boards.version
            if version <= self.version:
                break
            target = self._work / f"v{version}"
            shutil.copytree(self.model_dir, target, ignore=_only(_MODEL_FILES))
            try:
                boards.write_safetensors(version, target / "model.safetensors", torch.float32)
            except StaleWeights:
                shutil.rmtree(target, ignore_errors=True)
                if attempt == attempts - 1:
                    raise
                continue
            assert self._client is not None, "start() first"
            self._on_loop(self._client.update_weights(WeightsOnDisk(str(target)), version))
            if self._weights != self.model_dir:
                shutil.rmtree(self._weights, ignore_errors=True)
            self._weights, self.version = target, version
        return self.version

    def release(self, timeout_s: float = 60.0) -> None:
        """Free the device once the proxy drained the server (see the module docstring)."""
        start = time.monotonic()
        if self.device == "cpu":
            self._stop()
        else:
            assert self._client is not None
            self._on_loop(self._client.release_memory(), timeout_s)
        log.info("%s: %s in %.1f s", self.name, self._switch("stopped"), time.monotonic() - start)

    def resume(self, boards: BoardShards) -> int:
        start = time.monotonic()
        if self._process is None:
            self._launch()  # from the newest weights directory: already at self.version
        else:
            assert self._client is not None
            self._on_loop(self._client.resume_memory())
        log.info("%s: %s in %.1f s", self.name, self._switch("started"), time.monotonic() - start)
        return self.load_newest(boards)

    def _switch(self, restart: str) -> str:
        if self.device == "cpu":
            return f"{restart} (vLLM's sleep frees nothing on the CPU)"
        return "asleep" if restart == "stopped" else "awake"

    def close(self) -> None:
        self._stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        shutil.rmtree(self._work, ignore_errors=True)


def _only(patterns: tuple[str, ...]) -> Any:
    """A ``copytree`` ignore function keeping top-level files matching ``patterns``."""
    import fnmatch

    def ignore(directory: str, names: list[str]) -> list[str]:
        def kept(name: str) -> bool:
            weights = name.endswith(".index.json")
            return not weights and any(fnmatch.fnmatch(name, p) for p in patterns)

        return [n for n in names if not kept(n)]

    return ignore
