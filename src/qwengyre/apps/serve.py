"""Build and run a proxy from a model directory (``qwengyre proxy serve``).

Its settings are the config tree's sections (``proxy``, ``engine``, ``run``, ``cells``,
``trainer``); it binds ``proxy.host`` (127.0.0.1 by default) and every admin call needs
the admin token.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from aiohttp import web

from qwengyre.cluster.devices import require_device, visible_gpus
from qwengyre.cluster.engine_host import rollout_host
from qwengyre.config import Config, EngineConfig
from qwengyre.engines.base import InferenceEngine
from qwengyre.engines.factory import embedded_engine, server_backend
from qwengyre.engines.http_client import HTTPEngineClient
from qwengyre.engines.scripted import ScriptedEngine
from qwengyre.proxy.build import build_proxy
from qwengyre.runtime.lock import lock_run_dir


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
def model_engine(
    model: Path, settings: EngineConfig, *, device: str, capacity: int, max_context: int | None
) -> Iterator[InferenceEngine]:
    """The model's engine for as long as the block runs, of ``settings.backend``
    (``engine.backend``): the embedded engine in this process, or a vLLM / SGLang server
    launched for the block on ``device`` (tensor parallel over all visible GPUs for
    ``cuda``) with a fresh API key, serving the model's weights as policy version 0, and
    stopped when the block ends. ``capacity`` concurrent requests, each capped at
    ``max_context`` tokens (None: the model's limit).

    The embedded engine's worker thread is stopped and joined when the block ends: a
    daemon thread still in a torch call when the interpreter exits aborts the process
    ("terminate called without an active exception", exit 134)."""
    if settings.backend == "embedded":
        engine = embedded_engine(
            model,
            capacity=capacity,
            device=device,
            dtype=settings.dtype,
            max_context=max_context,
            routed_experts=settings.return_routed_experts,
        )
        try:
            yield engine
        finally:
            engine.close()
        return
    host = rollout_host(
        settings.backend,
        str(model),
        name=settings.backend,
        capacity=capacity,
        device=device,
        max_context=max_context,
        seed=0,
        host="127.0.0.1",  # only this process's proxy talks to it
        gpus=visible_gpus(device),
        version=0,
        routed_experts=settings.return_routed_experts,
    )
    try:
        yield host.start().client(settings.backend, capacity, version=0)
    finally:
        host.close()


DEFAULT_REPLIES = Path(__file__).resolve().parents[1] / "engines" / "default_replies.json"
"""The scripted replies of a proxy without ``proxy.script``: one that says how to set it."""


@contextlib.contextmanager
def proxy_engine(config: Config, model: Path, tokenizer: Any) -> Iterator[InferenceEngine]:
    """``proxy serve``'s engine (``proxy.engine``): the scripted replies of
    ``proxy.script`` (:data:`DEFAULT_REPLIES` when unset), or the model's engine
    (:func:`model_engine`) on ``run.device``, serving ``cells.capacity`` concurrent
    requests of at most ``engine.max_context`` tokens, as in ``train``."""
    if config.proxy.engine == "scripted":
        yield ScriptedEngine.from_file(tokenizer, config.proxy.script or DEFAULT_REPLIES)
        return
    with model_engine(
        model,
        config.engine,
        device=config.run.device,
        capacity=config.cells.capacity,
        max_context=config.engine.max_context,
    ) as engine:
        yield engine


async def close_engine(engine: InferenceEngine) -> None:
    """Close a server engine's HTTP session (in the loop that used it)."""
    if isinstance(engine, HTTPEngineClient):
        await engine.close()


def load_tokenizer(model: Path) -> Any:
    """The model directory's tokenizer; ValueError when it is not a model directory."""
    from transformers import AutoTokenizer

    if not (model / "config.json").exists():
        raise ValueError(f"{model} is not a HuggingFace model directory (no config.json)")
    return AutoTokenizer.from_pretrained(model)


def serve(config: Config, admin_token: str | None) -> None:
    """``qwengyre proxy serve``: the proxy over :func:`proxy_engine` on ``proxy.host``:
    ``proxy.port``, its store in ``proxy.store``, until interrupted; without an
    ``admin_token`` it generates one and prints it."""
    settings = config.proxy
    if settings.store is None:
        raise ValueError("proxy serve needs a store directory: --store DIR or proxy.store=DIR")
    if settings.engine == "embedded":  # before the model loads
        require_device(config.run.device)
        if config.engine.backend != "embedded":
            server_backend(config.engine.backend).require_installed()
    model = model_dir(config)
    where = f"http://{settings.host}:{settings.port}"
    tokenizer = load_tokenizer(model)
    # One proxy per store: a second one on it (or a run using it) is refused, naming it.
    with lock_run_dir(settings.store), proxy_engine(config, model, tokenizer) as engine:
        print(f"proxy on {where} (model {model})", flush=True)
        server = build_proxy(
            settings,
            model,
            tokenizer,
            settings.store,
            max_context=config.engine.max_context,
            temperature=config.trainer.temperature,
            admin_token=admin_token,
            engines=[engine],
        )
        server.base_url = where
        if admin_token is None:
            print(f"admin token: {server.admin.token}", flush=True)
        app = server.app()
        app.on_cleanup.append(lambda _app: close_engine(engine))
        web.run_app(app, host=settings.host, port=settings.port, print=None)
