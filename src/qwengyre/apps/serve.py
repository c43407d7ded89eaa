"""Build and run a proxy from a model directory (``qwengyre proxy serve``).

Its settings come from the config tree (:meth:`ServeOptions.from_config`); it binds
``proxy.host`` (127.0.0.1 by default) and every admin call needs the admin token.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from qwengyre.config import Config, EngineBackend
from qwengyre.engines.base import InferenceEngine
from qwengyre.engines.http_client import HTTPEngineClient
from qwengyre.engines.scripted import ScriptedEngine
from qwengyre.proxy.render import ChatRenderer
from qwengyre.proxy.routing import Router
from qwengyre.proxy.server import ProxyServer
from qwengyre.proxy.store import Store


@dataclass(frozen=True)
class ServeOptions:
    model: Path
    store: Path
    engine: str = "scripted"  # or "embedded": the model, served by backend
    backend: EngineBackend = "embedded"  # engine.backend
    script: Path | None = None  # the scripted engine's replies
    device: str = "cpu"  # the embedded engine's device
    dtype: str = "float32"  # and its torch dtype
    host: str = "127.0.0.1"
    port: int = 8080
    admin_token: str | None = None
    max_context: int | None = None  # default: the model's max_position_embeddings
    temperature: float = 1.0  # what every call samples at (see harness_sampling)
    harness_sampling: bool = False  # honour the harness's temperature / top_p / top_k
    capacity: int = 32  # the embedded engine's concurrent requests
    max_resident: int = 1024  # executions whose trees stay in memory
    idle_s: float = 300.0  # an execution idle this long leaves memory
    ping_s: float = 5.0  # a streamed answer pings after this long without output

    @classmethod
    def from_config(cls, config: Config, admin_token: str | None) -> ServeOptions:
        """``qwengyre proxy serve``'s options from the config tree: the ``proxy`` section,
        ``model.path`` (None: the tiny model, built on first use), ``run.device``,
        ``engine.dtype`` and ``engine.backend`` for the model's engine, ``cells.capacity``
        concurrent requests, ``trainer.temperature`` and ``engine.max_context`` as in
        ``train``."""
        p = config.proxy
        if p.store is None:
            raise ValueError("proxy serve needs a store directory: --store DIR or proxy.store=DIR")
        return cls(
            model=model_dir(config),
            store=p.store,
            engine=p.engine,
            backend=config.engine.backend,
            script=p.script,
            device=config.run.device,
            dtype=config.engine.dtype,
            host=p.host,
            port=p.port,
            admin_token=admin_token,
            max_context=config.engine.max_context,
            temperature=config.trainer.temperature,
            harness_sampling=p.harness_sampling,
            capacity=config.cells.capacity,
            max_resident=p.max_resident,
            idle_s=p.idle_s,
            ping_s=p.ping_s,
        )


def model_dir(config: Config) -> Path:
    """``model.path``, or the tiny model of ``model.tiny_size`` (built on first use)."""
    if config.model.path is not None:
        return config.model.path
    from qwengyre.models import cached_tiny_model

    return cached_tiny_model(config.model.tiny_size)


def read_secret_file(path: Path, what: str) -> str:
    """The text of ``path``, surrounding whitespace stripped; ValueError naming ``what``."""
    try:
        return path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the {what} file {path}: {exc}") from None


ADMIN_TOKEN_ENV = "QWENGYRE_ADMIN_TOKEN"
MIN_ADMIN_TOKEN_CHARS = 16


def resolve_admin_token(
    token: str | None, token_file: Path | None, environ: Mapping[str, str] = os.environ
) -> str | None:
    """The admin token from the first source that is set: ``token`` (``--admin-token``;
    other users see it in ``ps``), ``token_file`` (``proxy.admin_token_file`` or its
    shortcut ``--admin-token-file``: the file's text, surrounding whitespace stripped),
    then ``$QWENGYRE_ADMIN_TOKEN`` (empty counts as unset). None when none is set:
    :func:`serve` then generates one and prints it.

    Raises ValueError naming the source when both ``token`` and ``token_file`` are
    given, the file cannot be read as UTF-8 text, or the token is shorter than
    16 characters.
    """
    if token is not None and token_file is not None:
        raise ValueError(
            "give --admin-token or proxy.admin_token_file (--admin-token-file), not both"
        )
    if token is not None:
        source = "--admin-token"
    elif token_file is not None:
        source = f"proxy.admin_token_file {token_file}"
        token = read_secret_file(token_file, "admin token")
    elif environ.get(ADMIN_TOKEN_ENV):
        source, token = f"${ADMIN_TOKEN_ENV}", environ[ADMIN_TOKEN_ENV]
    else:
        return None
    if len(token) < MIN_ADMIN_TOKEN_CHARS:
        raise ValueError(
            f"the admin token from {source} has {len(token)} characters; "
            f"it must have at least {MIN_ADMIN_TOKEN_CHARS}"
        )
    return token


@contextlib.contextmanager
def model_engine(options: ServeOptions, tokenizer: Any) -> Iterator[InferenceEngine]:
    """The engine the proxy routes to, for as long as the block runs: the scripted
    replies, the embedded engine in this process (``engine.backend=embedded``), or a
    vLLM / SGLang server launched for the block on ``options.device`` (tensor parallel
    over all visible GPUs for ``cuda``) with a fresh API key, serving the model's
    weights as policy version 0, and stopped when the block ends."""
    if options.engine == "scripted":
        if options.script is None:
            raise ValueError(
                "proxy.engine=scripted needs proxy.script=FILE (JSON replies by request class)"
            )
        yield ScriptedEngine.from_file(tokenizer, options.script)
        return
    if options.engine != "embedded":
        raise ValueError(f"unknown engine {options.engine!r}; allowed: scripted, embedded")
    if options.backend == "embedded":
        import torch

        from qwengyre.engines.embedded import EmbeddedEngine

        yield EmbeddedEngine(
            options.model,
            capacity=options.capacity,
            device=options.device,
            dtype=getattr(torch, options.dtype),
            max_context=options.max_context,
        )
        return
    from qwengyre.cluster.devices import visible_gpus
    from qwengyre.cluster.engine_host import rollout_host

    host = rollout_host(
        options.backend,
        str(options.model),
        name=options.backend,
        capacity=options.capacity,
        device=options.device,
        max_context=options.max_context,
        seed=0,
        host="127.0.0.1",  # only this process's proxy talks to it
        gpus=visible_gpus(options.device),
        version=0,
    )
    try:
        yield host.start().client(options.backend, options.capacity, version=0)
    finally:
        host.close()


async def close_engine(engine: InferenceEngine) -> None:
    """Close a server engine's HTTP session (in the loop that used it)."""
    if isinstance(engine, HTTPEngineClient):
        await engine.close()


def build_proxy(options: ServeOptions, engine: InferenceEngine, tokenizer: Any) -> ProxyServer:
    """A proxy over ``engine`` (:func:`model_engine`), with the model's tokenizer
    (:func:`load_tokenizer`) and chat template."""
    from transformers import AutoConfig

    max_context = (
        options.max_context or AutoConfig.from_pretrained(options.model).max_position_embeddings
    )
    router = Router()
    router.register(engine, preference=0)
    server = ProxyServer(
        ChatRenderer(tokenizer),
        router,
        Store(options.store / "proxy.sqlite"),
        model=options.model.name,
        max_context=max_context,
        admin_token=options.admin_token or secrets.token_urlsafe(24),
        temperature=options.temperature,
        force_sampling=not options.harness_sampling,
        max_resident=options.max_resident,
        idle_s=options.idle_s,
        ping_s=options.ping_s,
    )
    server.base_url = f"http://{options.host}:{options.port}"
    return server


def load_tokenizer(model: Path) -> Any:
    """The model directory's tokenizer; ValueError when it is not a model directory."""
    from transformers import AutoTokenizer

    if not (model / "config.json").exists():
        raise ValueError(f"{model} is not a HuggingFace model directory (no config.json)")
    return AutoTokenizer.from_pretrained(model)


def serve(options: ServeOptions) -> None:
    tokenizer = load_tokenizer(options.model)
    with model_engine(options, tokenizer) as engine:
        server = build_proxy(options, engine, tokenizer)
        if options.admin_token is None:
            print(f"admin token: {server.admin_token}", flush=True)
        app = server.app()
        app.on_cleanup.append(lambda _app: close_engine(engine))
        web.run_app(app, host=options.host, port=options.port, print=None)
