"""Where engines are made: every command builds its engines here (docs/design.md §3).

- :func:`embedded_engine`: this package's engine, in this process (``engine serve``,
  ``proxy serve`` and ``rollout`` with ``engine.backend=embedded``, a cell's or the
  standalone pool's engine host).
- :func:`server_engine`: the client of a server that speaks ``api`` (the proxy's
  client of a cell's server, of a server launched for ``proxy serve``).
- :data:`SERVER_BACKENDS`: the server backends by ``engine.backend`` name, each in
  its own module behind :class:`~qwengyre.engines.launch.ServerBackend`: another
  server is a module and an entry here (and its name in ``engine.backend``'s type).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qwengyre.engines.base import InferenceEngine
from qwengyre.engines.embedded import EmbeddedEngine
from qwengyre.engines.launch import ServerBackend
from qwengyre.engines.sglang import SGLangBackend
from qwengyre.engines.vllm import VLLMBackend

__all__ = ["SERVER_BACKENDS", "embedded_engine", "server_backend", "server_engine"]

SERVER_BACKENDS: dict[str, ServerBackend[Any]] = {
    "vllm": VLLMBackend(),
    "sglang": SGLangBackend(),
}


def server_backend(name: str) -> ServerBackend[Any]:
    """The server backend ``name``; ValueError naming the others."""
    try:
        return SERVER_BACKENDS[name]
    except KeyError:
        known = ", ".join(["embedded", *SERVER_BACKENDS])
        raise ValueError(f"engine.backend {name!r}: use one of {known}") from None


def embedded_engine(
    model_dir: str | Path,
    *,
    name: str = "embedded",
    capacity: int,
    device: str,
    dtype: str,
    max_context: int | None,
    seed: int = 0,
    routed_experts: bool,
) -> EmbeddedEngine:
    """The embedded engine of ``model_dir``: ``capacity`` concurrent requests on
    ``device``, weights and KV cache in ``dtype`` (``engine.dtype``), each call capped
    at ``max_context`` tokens (None: the model's limit), sampling seeded with ``seed``;
    an MoE's reports the experts of every position with ``routed_experts``
    (``engine.return_routed_experts``)."""
    return EmbeddedEngine(
        model_dir,
        name=name,
        capacity=capacity,
        device=device,
        dtype=getattr(torch, dtype),
        max_context=max_context,
        seed=seed,
        routed_experts=routed_experts,
    )


def server_engine(
    api: str,
    url: str,
    *,
    name: str,
    capacity: int,
    api_key: str,
    version: int,
    routed_experts: tuple[int, int] | None = None,
) -> InferenceEngine:
    """The client of the server at ``url`` speaking ``api`` (a server backend's name; the
    embedded engine's server speaks ``"sglang"``), ``capacity`` concurrent
    requests, its tokens labelled ``version`` until the server says otherwise; asking
    for the routed experts of an MoE of ``routed_experts`` = ``(layers, k)``
    (:func:`~qwengyre.engines.launch.routed_experts_shape`; None: not asked)."""
    return server_backend(api).client(
        url,
        name=name,
        capacity=capacity,
        api_key=api_key,
        version=version,
        routed_experts=routed_experts,
    )
