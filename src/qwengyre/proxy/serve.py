"""Build and run a proxy from a model directory (``qwengyre proxy serve``).

Its settings come from the config tree (:meth:`ServeOptions.from_config`); it binds
``proxy.host`` (127.0.0.1 by default) and every admin call needs the admin token.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from qwengyre.config import Config
from qwengyre.engines.base import InferenceEngine
from qwengyre.engines.scripted import ScriptedEngine
from qwengyre.proxy.render import ChatRenderer
from qwengyre.proxy.routing import Router
from qwengyre.proxy.server import ProxyServer
from qwengyre.proxy.store import Store


@dataclass(frozen=True)
class ServeOptions:
    model: Path
    store: Path
    engine: str = "scripted"  # or "embedded"
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
        ``model.path`` (None: the tiny model, built on first use), ``run.device`` and
        ``engine.dtype`` for the embedded engine, ``cells.capacity`` concurrent requests,
        ``trainer.temperature`` and ``run.max_context`` as in ``train``."""
        p = config.proxy
        if p.store is None:
            raise ValueError("proxy serve needs a store directory: --store DIR or proxy.store=DIR")
        return cls(
            model=model_dir(config),
            store=p.store,
            engine=p.engine,
            script=p.script,
            device=config.run.device,
            dtype=config.engine.dtype,
            host=p.host,
            port=p.port,
            admin_token=admin_token,
            max_context=config.run.max_context,
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


def build_engine(options: ServeOptions, tokenizer: Any) -> InferenceEngine:
    if options.engine == "scripted":
        if options.script is None:
            raise ValueError(
                "proxy.engine=scripted needs proxy.script=FILE (JSON replies by request class)"
            )
        return ScriptedEngine.from_file(tokenizer, options.script)
    if options.engine == "embedded":
        import torch

        from qwengyre.engines.embedded import EmbeddedEngine

        return EmbeddedEngine(
            options.model,
            capacity=options.capacity,
            device=options.device,
            dtype=getattr(torch, options.dtype),
            max_context=options.max_context,
        )
    raise ValueError(f"unknown engine {options.engine!r}; allowed: scripted, embedded")


def build_proxy(options: ServeOptions) -> ProxyServer:
    """A proxy over one engine, with the model's tokenizer and chat template."""
    from transformers import AutoConfig, AutoTokenizer

    if not (options.model / "config.json").exists():
        raise ValueError(f"{options.model} is not a HuggingFace model directory (no config.json)")
    tokenizer = AutoTokenizer.from_pretrained(options.model)
    max_context = (
        options.max_context or AutoConfig.from_pretrained(options.model).max_position_embeddings
    )
    router = Router()
    router.register(build_engine(options, tokenizer), preference=0)
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


def serve(options: ServeOptions) -> None:
    server = build_proxy(options)
    if options.admin_token is None:
        print(f"admin token: {server.admin_token}", flush=True)
    web.run_app(server.app(), host=options.host, port=options.port, print=None)
