"""The engine interface the proxy and the cells use (docs/design.md §3).

An engine generates from token ids and returns the ids it sampled with their
behaviour log-probs and the policy version of the weights that produced them, either
all at once (:meth:`InferenceEngine.generate`) or as they are sampled
(:meth:`InferenceEngine.stream`, whose deltas :func:`collect` joins into the same result).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from qwengyre.trajectories import routed_experts
from qwengyre.types import SamplingParams

FinishReason = Literal["stop", "length", "abort"]


class EngineAborted(Exception):
    """The request was aborted on this engine (e.g. it is draining); retry elsewhere."""


@dataclass(frozen=True)
class GenerateRequest:
    """``tags`` carry routing facts (execution id, request class) an engine may use."""

    request_id: str
    input_ids: Sequence[int]
    sampling: SamplingParams
    tags: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class GenerateResult:
    """Sampled ids, their behaviour log-probs, and the policy version of the weights that
    produced each one (a weight update mid-request changes it for the later tokens).

    ``routing``: for a mixture-of-experts model served by an engine that reports it, the
    experts each position of the request was routed to
    (:mod:`qwengyre.trajectories.routed_experts`, by position: ``len(input_ids) +
    len(output_ids) - 1`` rows, none without output); None otherwise."""

    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish_reason: FinishReason
    routing: np.ndarray | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not len(self.output_ids) == len(self.logprobs) == len(self.versions):
            raise ValueError("output_ids, logprobs and versions must have one entry per token")

    @property
    def policy_version(self) -> int:
        """The newest version that produced a token of this output (-1 if none)."""
        return max(self.versions, default=-1)


@dataclass(frozen=True)
class TokenDelta:
    """Tokens an engine sampled since its previous delta of the same request (one or
    more), with their behaviour log-probs and policy versions; ``finish_reason`` is set
    on the last delta of a request only, which may carry no tokens.

    ``routing`` (an MoE, where the engine reports it): the routed experts of the
    positions that predicted these tokens, by position, continuing the previous
    delta's: the delta with a request's first token carries its prompt's positions too.
    An engine that learns them only at the end (SGLang) gives the earlier deltas zero
    rows and the last all of them. None where not reported."""

    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish_reason: FinishReason | None = None
    routing: np.ndarray | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not len(self.output_ids) == len(self.logprobs) == len(self.versions):
            raise ValueError("output_ids, logprobs and versions must have one entry per token")


async def collect(deltas: AsyncIterator[TokenDelta]) -> GenerateResult:
    """The result of a request from all its deltas (consumed to the end).

    Raises what the stream raises (e.g. :class:`EngineAborted`), and RuntimeError if it
    ends without a delta that has a finish reason.
    """
    joined = Joined()
    async for delta in deltas:
        joined.add(delta)
    return joined.result()


class Joined:
    """A request's deltas joined, as they come, into its result so far."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.finish: FinishReason | None = None
        self._routing: list[np.ndarray] = []
        self._unrouted = False  # a delta with tokens came without routing

    def add(self, delta: TokenDelta) -> None:
        self.ids.extend(delta.output_ids)
        self.logprobs.extend(delta.logprobs)
        self.versions.extend(delta.versions)
        if delta.finish_reason is not None:
            self.finish = delta.finish_reason
        if delta.routing is not None:
            self._routing.append(delta.routing)
        elif delta.output_ids:
            self._unrouted = True

    def result(self, otherwise: FinishReason | None = None) -> GenerateResult:
        """The result, finishing with ``otherwise`` if the stream gave no finish reason
        (RuntimeError if neither did). Routing is kept only if every token came with it."""
        finish = self.finish or otherwise
        if finish is None:
            raise RuntimeError("the engine's stream ended without a finish reason")
        routing = None
        if self._routing and not self._unrouted:
            routing = routed_experts.compact(np.concatenate(self._routing))
            routing = routing if len(routing) else None  # zero rows: none reported
        return GenerateResult(
            tuple(self.ids), tuple(self.logprobs), tuple(self.versions), finish, routing
        )


@dataclass(frozen=True)
class WeightsOnDisk:
    """A HuggingFace checkpoint directory (safetensors) to load weights from."""

    path: str


@dataclass(frozen=True)
class WeightsInMemory:
    """Named tensors (``model.state_dict()`` names) handed over in-process."""

    tensors: Mapping[str, Any]


@dataclass(frozen=True)
class WeightsInShards:
    """Named tensors cut along dim 0 into ``count`` parts (``torch.chunk`` order, as
    FSDP2 shards them); ``read(r)`` returns part ``r``. The engine reads one part at a
    time, so no whole-model buffer exists beside its own weights. ``read`` raises
    :class:`StaleWeights` when part ``r`` is no longer of the version being loaded."""

    count: int
    read: Callable[[int], Mapping[str, Any]]


@dataclass(frozen=True)
class WeightsByName:
    """Named tensors of one version, read a few at a time: ``meta`` gives every name's
    shape and dtype (meta tensors, in load order) and ``read(names)`` returns those
    tensors whole. An engine that sends weights in buckets reads each bucket as it sends
    it, so the whole model never sits in host memory beside the trainer's. ``read``
    raises :class:`StaleWeights` once the version being loaded is gone."""

    meta: Mapping[str, Any]
    read: Callable[[Sequence[str]], Mapping[str, Any]]

    @classmethod
    def of(cls, tensors: Mapping[str, Any]) -> WeightsByName:
        """Tensors already in memory, read by name."""
        return cls(tensors, lambda names: {name: tensors[name] for name in names})


class StaleWeights(RuntimeError):
    """A shard changed version while an engine was loading the others."""


WeightSource = WeightsOnDisk | WeightsInMemory | WeightsInShards


class InferenceEngine(Protocol):
    """What every backend implements.

    Role switches use :meth:`release_memory` (drop the weights' and KV cache's memory;
    in-flight requests must be aborted first) and :meth:`resume_memory`; publication
    uses :meth:`update_weights`, applied between decode steps without dropping
    in-flight requests.
    """

    name: str
    capacity: int  # concurrent requests it serves well

    @property
    def load(self) -> int:
        """Requests in flight."""
        ...

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Generate; raises :class:`EngineAborted` if aborted before finishing.

        Equivalent to ``await collect(self.stream(request))``.
        """
        ...

    def stream(self, request: GenerateRequest) -> AsyncGenerator[TokenDelta, None]:
        """Generate, yielding the tokens as they are sampled (an async generator).

        The last delta has a finish reason. Raises :class:`EngineAborted` when the
        request is aborted, possibly after some deltas. A consumer that stops early
        (``aclose()``, or its task is cancelled) aborts the request: the engine frees its
        place at once instead of generating on.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Abort ``request_id``; its :meth:`generate` or :meth:`stream` raises
        :class:`EngineAborted` (nothing happens if it is not in flight)."""
        ...

    async def update_weights(self, source: WeightSource, version: int) -> None:
        """Load new weights between decode steps; later tokens carry ``version``."""
        ...

    async def release_memory(self) -> None:
        """Free the weights' and the KV cache's memory (the cell is going to train)."""
        ...

    async def resume_memory(self) -> None:
        """Restore what :meth:`release_memory` freed (the cell is back in rollout)."""
        ...

    async def health(self) -> bool:
        """Whether it can serve now (False while released). A server engine's client
        raises ``ConnectionRefusedError`` when nothing answers at the server's address:
        its server is gone, which the router tells from a server that answers unhealthy
        (busy loading weights past its own check) -- only the first is started again."""
        ...
