"""Launching an inference server as a subprocess: the one launcher every server backend
uses (vLLM's, SGLang's; docs/design.md §3).

A backend says only what is its own, in its module: its command line and environment
(a :class:`ServerSpec`: the ``python -m`` module, its flags, how it takes its API key)
and, for a server that serves a cell's devices, a :class:`ServerBackend`: the spec for a
:class:`ServerPlacement`, its client, what it does once healthy, whether its sleep frees the
device and whether it takes weights from memory. The rest is here:

- :func:`launch`: checks that the server's ``python`` can import the server's package
  (a clear error otherwise), writes its key files if it has any, starts the command.
- :func:`start_server`: :func:`launch` in its own session, so that :func:`stop_server`
  stops its workers too (SIGTERM to the process group, SIGKILL after a grace period),
  and with the kernel stopping it when the thread that launched it dies (PDEATHSIG): no
  orphaned servers.
- :func:`wait_until_healthy`: polls its client's ``health`` until it answers.

It imports only the standard library and :mod:`qwengyre.engines.base`: the vLLM
module, imported inside vLLM's own environment, builds on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, ClassVar, Generic, Protocol, TypeVar

from qwengyre.engines.base import WeightsByName, WeightSource

__all__ = [
    "HealthChecked",
    "ServerBackend",
    "ServerClient",
    "ServerNotInstalled",
    "ServerPlacement",
    "ServerSpec",
    "importable",
    "launch",
    "routed_experts_shape",
    "start_server",
    "stop_server",
    "wait_until_healthy",
    "write_private",
]


class ServerNotInstalled(ValueError):
    """The server's Python cannot import the server's package (a setup to fix, so a
    ``ValueError``: the command line says it in one line)."""


def importable(python: str, package: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether ``python`` (in ``env``) can import ``package`` (without importing it)."""
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({package!r}) is None)"
    try:
        done = subprocess.run([python, "-c", code], env=env, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@dataclass(kw_only=True, frozen=True)
class ServerSpec(ABC):
    """How to start one server: ``python -m <module> <model flag> MODEL --host --port``,
    the backend's own flags (:meth:`flags`), then ``extra_args`` as given.

    ``python`` is the interpreter of the server's environment (empty: ``$<python_var>``,
    else this one). ``api_key`` never goes on the command line, where every local user
    could read it (``ps``): each backend hands it over its own way (an environment
    variable, a private file). ``max_context`` caps prompt plus output. ``extra_env``
    adds to the environment (e.g. ``CUDA_VISIBLE_DEVICES``).
    """

    model: str
    port: int
    host: str = "127.0.0.1"
    api_key: str | None = field(default=None, repr=False)
    max_context: int | None = None
    python: str = ""
    extra_args: tuple[str, ...] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)

    server: ClassVar[str]  # its name, in messages
    package: ClassVar[str]  # what its python must import
    module: ClassVar[str]  # python -m MODULE
    model_flag: ClassVar[str]
    python_var: ClassVar[str]  # the environment variable naming its python
    install_hint: ClassVar[str]  # how to get one, for the error when there is none
    not_installed: ClassVar[type[ServerNotInstalled]] = ServerNotInstalled

    def __post_init__(self) -> None:
        if not self.python:
            object.__setattr__(self, "python", os.environ.get(self.python_var) or sys.executable)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @abstractmethod
    def flags(self) -> list[str]:
        """The backend's own flags (after the model, host and port)."""

    def command(self) -> list[str]:
        argv = [self.python, "-m", self.module, self.model_flag, self.model]
        argv += ["--host", self.host, "--port", str(self.port)]
        return argv + self.flags() + list(self.extra_args)

    def server_env(self) -> dict[str, str]:
        """What the backend adds to the environment (before :attr:`extra_env`)."""
        return {}

    def env(self) -> dict[str, str]:
        """The server's environment: this one, the backend's, then :attr:`extra_env`."""
        return {**os.environ, **self.server_env(), **self.extra_env}

    def key_files(self) -> dict[Path, str]:
        """The private files that hand over the key, by path, with their text; written
        (mode 0600) before each launch."""
        return {}


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, readable by this user only (mode 0600; a link there is
    refused)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
    with os.fdopen(os.open(path, flags, 0o600), "w") as file:
        file.write(text)


def launch(spec: ServerSpec, **popen_kwargs: Any) -> subprocess.Popen[bytes]:
    """Start the server of ``spec``; wait for it with :func:`wait_until_healthy`.

    Raises the spec's :attr:`~ServerSpec.not_installed` when its python cannot import
    the server's package."""
    env = spec.env()
    if not importable(spec.python, spec.package, env):
        raise spec.not_installed(
            f"cannot launch the {spec.server} server: {spec.python} cannot import "
            f"{spec.package!r} ({spec.install_hint})"
        )
    for path, text in spec.key_files().items():
        write_private(path, text)
    return subprocess.Popen(spec.command(), env=env, **popen_kwargs)


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the server's process before it runs: SIGTERM when the thread that started it
    dies (Linux; hosts start servers from their process's main thread)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def start_server(spec: ServerSpec, log: IO[bytes] | None = None) -> subprocess.Popen[bytes]:
    """:func:`launch` in a session of its own, dying with the thread that started it;
    its output to ``log`` (default: this process's)."""
    output: dict[str, Any] = {"stdout": log, "stderr": subprocess.STDOUT} if log else {}
    return launch(spec, start_new_session=True, preexec_fn=_die_with_parent, **output)


def stop_server(process: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """Stop a server :func:`start_server` started, and its workers: SIGTERM to its
    process group, SIGKILL to what is left after ``grace_s``."""
    group = process.pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(grace_s)
    with contextlib.suppress(ProcessLookupError):  # workers that outlived it
        os.killpg(group, signal.SIGKILL)
    process.wait()


class HealthChecked(Protocol):
    """A server's client that can ask it whether it is healthy."""

    name: str
    base_url: str

    async def health(self) -> bool: ...


async def wait_until_healthy(
    engine: HealthChecked,
    timeout_s: float,
    process: subprocess.Popen[bytes] | None = None,
    poll_s: float = 1.0,
) -> None:
    """Poll ``/health`` until it answers 200; TimeoutError after ``timeout_s``.

    With ``process``, a server that exits while starting raises RuntimeError at once.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(
                f"server {engine.name} exited with code {process.returncode} "
                "before becoming healthy"
            )
        with contextlib.suppress(ConnectionRefusedError):  # not listening yet
            if await engine.health():
                return
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"server {engine.name} at {engine.base_url} was not healthy within {timeout_s:.0f}s"
            )
        await asyncio.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


# -- a server on a cell's devices --------------------------------------------------------


@dataclass(kw_only=True, frozen=True)
class ServerPlacement:
    """Where a host starts its server: on the weights in directory ``model``, bound to
    ``host``:``port``, guarded by ``api_key``, on ``device`` and the physical GPUs
    ``gpus`` (tensor parallel over all of them; none on the CPU), each call capped at
    ``max_context`` tokens, its weights labelled ``version`` (-1: none of the run's).
    ``work`` is the host's private directory (mode 0700), for files such as a key file.
    ``routed_experts`` (``engine.return_routed_experts``): an MoE's server is started
    so that it can report the experts of every position (its backend's flag; a dense
    model's server is started as without it).
    """

    model: str
    host: str
    port: int
    api_key: str = field(repr=False)
    device: str
    gpus: tuple[str, ...]
    max_context: int | None
    version: int
    work: Path
    routed_experts: bool = False

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def tp_size(self) -> int:
        """Tensor parallel degree: every GPU given (1 on the CPU)."""
        return len(self.gpus) or 1

    def gpu_env(self) -> dict[str, str]:
        """The environment that shows the server its GPUs (none on the CPU)."""
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.gpus)} if self.gpus else {}


def routed_experts_shape(model: str | Path) -> tuple[int, int] | None:
    """``(layers, k)`` of the routed experts a server reports for each position of the
    mixture-of-experts model in directory ``model`` (its ``config.json``, or the
    ``text_config`` in it): ``num_hidden_layers`` and ``num_experts_per_tok``, the shape
    of SGLang's and vLLM's capture buffers (every layer, dense ones included). None for
    a dense model (no ``num_experts_per_tok``), an MoE with dense layers
    (``mlp_only_layers``, ``decoder_sparse_step`` > 1: the servers' rows would not be
    the MoE layers alone) or a directory without a config."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config") or config
    layers, k = text.get("num_hidden_layers"), text.get("num_experts_per_tok")
    if not isinstance(layers, int) or not isinstance(k, int) or k < 1:
        return None
    if text.get("mlp_only_layers") or text.get("decoder_sparse_step", 1) not in (None, 1):
        # Dense layers too: a server's rows hold every layer, the trainer replays the
        # MoE layers only, so such a model is not asked for them.
        return None
    return layers, k


class ServerClient(HealthChecked, Protocol):
    """What a host needs of its server's client."""

    async def update_weights(self, source: WeightSource, version: int) -> None: ...

    async def release_memory(self) -> None: ...

    async def resume_memory(self) -> None: ...

    async def close(self) -> None: ...


C = TypeVar("C", bound=ServerClient)


class ServerBackend(ABC, Generic[C]):
    """What one kind of server does its own way, for a host that serves a cell's devices
    with it (:class:`~qwengyre.cluster.server_host.ServerHost`). One instance per
    backend, registered in :mod:`qwengyre.engines.factory`."""

    api: ClassVar[str]  # the HTTP API it speaks, and engine.backend's name for it
    spec_type: ClassVar[type[ServerSpec]]  # what :meth:`spec` makes

    def require_installed(self) -> None:
        """Raise the spec's ``not_installed`` unless the python its servers start with
        (``$<python_var>``, else this one) can import the server's package: checked in
        seconds, before a run starts anything."""
        spec = self.spec_type
        python = os.environ.get(spec.python_var) or sys.executable
        if not importable(python, spec.package):
            raise spec.not_installed(
                f"engine.backend={self.api}: {python} cannot import {spec.package!r}"
                f" ({spec.install_hint})"
            )

    @abstractmethod
    def spec(self, place: ServerPlacement) -> ServerSpec:
        """How the server starts at ``place``."""

    @abstractmethod
    def client(
        self,
        url: str,
        *,
        name: str,
        capacity: int,
        api_key: str,
        version: int,
        routed_experts: tuple[int, int] | None = None,
    ) -> C:
        """A client of the server at ``url``, whose tokens default to ``version``;
        ``routed_experts``: ``(layers, k)`` of the MoE it serves, to ask for the routed
        experts of every position (:func:`routed_experts_shape`; None: not asked)."""

    def host_client(self, url: str, name: str, place: ServerPlacement) -> C:
        """The client its host drives it with (one request at a time: weights, memory)."""
        return self.client(url, name=name, capacity=1, api_key=place.api_key, version=place.version)

    async def ready(self, client: C, version: int) -> None:
        """What to do once the server just started is healthy (e.g. label its weights)."""

    def sleep_frees(self, device: str) -> bool:
        """Whether the server's sleep (``release_memory``) frees ``device``; if not, its
        host stops the server to free it."""
        return True

    async def load_from_memory(self, client: C, weights: WeightsByName, version: int) -> bool:
        """Load ``weights`` as tensors if the server takes them so; False: it does not,
        and its host loads them through disk."""
        return False
