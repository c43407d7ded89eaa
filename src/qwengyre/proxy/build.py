"""The one way a proxy is built: ``qwengyre train``'s, ``proxy serve``'s and
``rollout``'s (docs/design.md §3)."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qwengyre.config import DEFAULT_RULE_SET, ConfigError, ProxyConfig
from qwengyre.engines.base import InferenceEngine
from qwengyre.proxy.classes import RuleSetError, load_rule_set
from qwengyre.proxy.render import ChatRenderer
from qwengyre.proxy.routing import Router
from qwengyre.proxy.server import ProxyServer
from qwengyre.proxy.store import Store

__all__ = ["STORE_FILE", "build_proxy"]

STORE_FILE = "proxy.sqlite"
"""The proxy's durable store, in the directory it is given."""


def build_proxy(
    settings: ProxyConfig,
    model: Path,
    tokenizer: Any,
    store_dir: Path,
    *,
    max_context: int | None,
    temperature: float,
    admin_token: str | None = None,
    engines: Sequence[InferenceEngine] = (),
) -> ProxyServer:
    """A proxy for the model in directory ``model`` (its name, its ``tokenizer`` and chat
    template), its store in ``store_dir``, its residency, streaming and sampling rule
    from the ``proxy`` section (``settings``), every call sampled at ``temperature``
    (``trainer.temperature``) and capped at ``max_context`` tokens (None: the model's
    ``max_position_embeddings``). ``engines`` are registered in order of preference
    (more can be registered later); the admin token is generated when None. The caller
    sets :attr:`~ProxyServer.base_url` once it knows where the proxy listens. Calls are
    classified by the rule set ``settings.classes`` names (unset: the default,
    :func:`~qwengyre.proxy.classes.default_rule_set`; :class:`ConfigError` naming the
    key if it does not load); replies are parsed by ``settings.tool_parser`` and
    ``settings.reasoning_parser`` (``auto``: found in the chat template); a reply is at
    most ``settings.max_reply_tokens`` long, whatever the harness asks."""
    try:
        classes = load_rule_set(settings.classes or DEFAULT_RULE_SET)
    except RuleSetError as exc:
        raise ConfigError(f"proxy.classes: {exc}") from None
    if max_context is None:
        from transformers import AutoConfig

        max_context = int(AutoConfig.from_pretrained(model).max_position_embeddings)
    router = Router(engine_wait_s=settings.engine_wait_s)
    for preference, engine in enumerate(engines):
        router.register(engine, preference=preference)
    return ProxyServer(
        ChatRenderer(tokenizer, settings.tool_parser, settings.reasoning_parser),
        router,
        Store(store_dir / STORE_FILE),
        model=model.name,
        max_context=max_context,
        admin_token=admin_token or secrets.token_urlsafe(24),
        temperature=temperature,
        force_sampling=not settings.harness_sampling,
        max_resident=settings.max_resident,
        idle_s=settings.idle_s,
        ping_s=settings.ping_s,
        classes=classes,
        max_reply_tokens=settings.max_reply_tokens,
    )
