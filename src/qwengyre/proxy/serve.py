"""Build and run a proxy from a model directory (``qwengyre proxy serve``)."""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

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


ADMIN_TOKEN_ENV = "QWENGYRE_ADMIN_TOKEN"
MIN_ADMIN_TOKEN_CHARS = 16


def resolve_admin_token(
    token: str | None, token_file: Path | None, environ: Mapping[str, str] = os.environ
) -> str | None:
    """The admin token from the first source that is set: ``token`` (``--admin-token``;
    other users see it in ``ps``), ``token_file`` (``--admin-token-file``: the file's
    text, surrounding whitespace stripped), then ``$QWENGYRE_ADMIN_TOKEN`` (empty counts
    as unset). None when none is set: :func:`serve` then generates one and prints it.

    Raises ValueError naming the source when both ``token`` and ``token_file`` are
    given, the file cannot be read as UTF-8 text, or the token is shorter than
    16 characters.
    """
    if token is not None and token_file is not None:
        raise ValueError("give --admin-token or --admin-token-file, not both")
    if token is not None:
        source = "--admin-token"
    elif token_file is not None:
        source = f"--admin-token-file {token_file}"
        try:
            token = token_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the admin token file {token_file}: {exc}") from None
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
            raise ValueError("--engine scripted needs --script FILE (class -> replies)")
        return ScriptedEngine.from_file(tokenizer, options.script)
    if options.engine == "embedded":
        import torch

        from qwengyre.engines.embedded import EmbeddedEngine

        return EmbeddedEngine(
            options.model,
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
    )
    server.base_url = f"http://{options.host}:{options.port}"
    return server


def serve(options: ServeOptions) -> None:
    server = build_proxy(options)
    if options.admin_token is None:
        print(f"admin token: {server.admin_token}", flush=True)
    web.run_app(server.app(), host=options.host, port=options.port, print=None)
