"""The shared nouns of qwengyre: small, dependency-free types used across packages."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

TinySize = Literal["test", "demo"]
TinyTemplate = Literal["qwen3", "qwen3-coder", "qwen3-thinking"]
"""The built-in tiny model's sizes (:mod:`qwengyre.models.tiny`, ``model.tiny_size``)."""


class Outcome(StrEnum):
    """How a launched execution terminated; every launched execution has exactly one.

    - ``completed``: the harness finished by itself and a valid assessment exists.
    - ``failed``: the harness or its workspace failed; it may still have been assessed.
    - ``harness_timeout``: the harness deadline stopped it; its work is still evaluated.
    - ``overall_timeout``: the overall budget (evaluation retries included) expired before
      a valid reward existed; the execution is excluded from training.
    - ``cancelled``: stopped by the framework (e.g. a surplus execution under
      oversampling once its group has N valid rewards).
    """

    COMPLETED = "completed"
    FAILED = "failed"
    HARNESS_TIMEOUT = "harness_timeout"
    OVERALL_TIMEOUT = "overall_timeout"
    CANCELLED = "cancelled"


@dataclass(kw_only=True, frozen=True)
class SamplingParams:
    """What an engine samples with; ``max_tokens`` is required by both APIs' clients."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # besides the model's end-of-sequence ids
    ignore_eos: bool = False  # run to max_tokens (benchmarks, length tests), as in SGLang
