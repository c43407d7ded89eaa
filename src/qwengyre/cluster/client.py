"""Typed clients of the actors that serve rollout and train: what the runtime calls.

A cell (:class:`~qwengyre.cluster.cell.Cell`) and the standalone pool
(:class:`~qwengyre.cluster.standalone.StandalonePool`) live in other processes, behind
a :class:`CellHandle`: a local process, a Ray actor, or a cell's ranks together
(:mod:`qwengyre.cluster.placement`). The handle's transport is one generic call by
method name; :class:`EngineClient` (rollout: the standalone pool) and
:class:`CellClient` (rollout and training: a cell) give every call its name, its
arguments' and its result's types. Nothing outside this module names a method.

A call runs on every rank of a cell and answers with shard 0's result; it raises
:class:`~qwengyre.cluster.local.ActorError` when the method raised inside the actor and
:class:`~qwengyre.cluster.local.ActorDied` when the actor is gone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast

from torch import Tensor

from qwengyre.cluster.engine_host import Endpoint
from qwengyre.training.backend import MicroStepResult, StepResult
from qwengyre.training.buffers import BatchSummary, MicroStep

__all__ = ["CellClient", "CellHandle", "EngineClient"]


class CellHandle(Protocol):
    """An actor in another process: one call at a time, in order."""

    name: str

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any: ...

    def call_sync(self, method: str, *args: Any, **kwargs: Any) -> Any: ...

    async def check_alive(self) -> None:
        """Raise ``ActorDied`` if the actor is gone; answers even while a call runs."""
        ...

    def close(self) -> None: ...


class EngineClient:
    """An actor that serves a rollout engine whose weights come from the core's boards."""

    def __init__(self, handle: CellHandle) -> None:
        self.handle = handle  # the transport

    @property
    def name(self) -> str:
        return self.handle.name

    async def start_engine(self) -> Endpoint:
        """Serve rollout with the boards' newest weights; where (a cell's shard 0)."""
        endpoint: Endpoint | None = await self.handle.call("start_engine")
        if endpoint is None:
            raise RuntimeError(f"{self.name} serves no engine: it is not a cell's shard 0")
        return endpoint

    async def update_engine_weights(self) -> int:
        """Load the boards' weights into the engine if newer; their version."""
        return cast(int, await self.handle.call("update_engine_weights"))

    async def revive_engine(self) -> bool:
        """Start the engine's server again if it crashed; True if it did."""
        return cast(bool, await self.handle.call("revive_engine"))

    async def pid(self) -> int:
        """The process id of the actor (shard 0's), once its object is built: a new
        process has loaded its model."""
        return cast(int, await self.handle.call("pid"))

    async def check_alive(self) -> None:
        """Raise ``ActorDied`` if the actor is gone (also while a call runs)."""
        await self.handle.check_alive()

    def close(self) -> None:
        self.handle.close()


class CellClient(EngineClient):
    """A cell: rollout (its engine) and training (its trainer backend)."""

    async def connect(
        self, members: Sequence[int] | None = None, generation: int = 0, *, takeover: bool = False
    ) -> int:
        """Join the cells' groups and build the trainer; shard 0's process id. Call it
        on every cell at once (creating the groups is collective); a replacement with
        the live cells' ``members`` and the groups' new ``generation``, while they
        :meth:`regroup` (see :meth:`~qwengyre.cluster.cell.Cell.connect`)."""
        return cast(int, await self.handle.call("connect", members, generation, takeover=takeover))

    async def regroup(self, members: Sequence[int], generation: int) -> None:
        """Re-form the cells' groups among ``members`` (collective over them)."""
        await self.handle.call("regroup", members, generation)

    async def release_engine(self) -> str:
        """Free the engine's memory for training (after the proxy drained it); how the
        engine freed it."""
        return cast(str, await self.handle.call("release_engine"))

    async def resume_engine(self) -> int:
        """Serve rollout again with the newest weights; their version."""
        return cast(int, await self.handle.call("resume_engine"))

    async def join_training(self) -> int:
        """Take the core's current weights (a satellite); their version."""
        return cast(int, await self.handle.call("join_training"))

    async def train_micro_step(self, micro_step: MicroStep) -> MicroStepResult:
        """Add ``micro_step``'s gradient to the cell's."""
        return cast(MicroStepResult, await self.handle.call("train_micro_step", micro_step))

    async def finish_batch(self, summary: BatchSummary, cells: int) -> StepResult:
        """Reduce over the prefix of ``cells`` cells and update (all of them call it)."""
        return cast(StepResult, await self.handle.call("finish_batch", summary, cells))

    async def discard_gradient(self) -> None:
        """Drop the gradient of the open step (it is trained again)."""
        await self.handle.call("discard_gradient")

    async def save_checkpoint(
        self, root: str, step: int, state: Mapping[str, Any], keep: int
    ) -> str:
        """The core writes a checkpoint under ``root``; its path."""
        return cast(str, await self.handle.call("save_checkpoint", root, step, state, keep))

    async def parameters(self) -> dict[str, Tensor]:
        """A copy of the whole current parameters (tests)."""
        return cast(dict[str, Tensor], await self.handle.call("parameters"))

    async def shard_numels(self) -> list[dict[str, int]]:
        """Elements each rank holds (parameters, gradients, optimizer), in shard order."""
        return cast(list[dict[str, int]], await self.handle.call("shard_numels"))
