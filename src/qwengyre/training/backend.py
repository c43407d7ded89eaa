"""The trainer backend: what one rank of a cell runs to train, behind one interface
(docs/architecture.md, "The trainer backend").

A cell (:class:`~qwengyre.cluster.cell.Cell`) builds its backend with
:func:`trainer_backend` from ``trainer.backend`` and drives it only through
:class:`TrainerBackend`; the controller drives the cell through its client. The FSDP2
:class:`~qwengyre.training.trainer.Trainer` is the first backend. Another (a
Megatron-core one: tensor, pipeline and expert parallel inside a cell) is a module that
implements :class:`TrainerBackend`, one line in :data:`TRAINER_BACKENDS` and its name
in :data:`~qwengyre.config.TrainerBackendName`; no cell or controller code changes.

A backend publishes its weights to a :class:`WeightsBoard`, the contract the engines
and satellites read: shard ``r`` of every parameter, cut along dim 0, under the
parameter's HuggingFace name. The boards themselves live in :mod:`qwengyre.cluster.weights`.
"""

from __future__ import annotations

import importlib
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor
from transformers import PreTrainedModel

from qwengyre.config import TrainerBackendName, TrainerConfig
from qwengyre.training.buffers import BatchSummary, MicroStep
from qwengyre.training.distributed import CellComm

__all__ = [
    "TRAINER_BACKENDS",
    "BuildTrainer",
    "MicroStepResult",
    "StepResult",
    "TrainerBackend",
    "WeightsBoard",
    "trainer_backend",
]


@dataclass(kw_only=True, frozen=True)
class MicroStepResult:
    """What one micro-step contributed (``loss`` is its summed, unnormalised objective)."""

    step: int
    index: int
    cell: int
    tokens: int
    targets: int
    loss: float
    clipped: int  # executions clipped in it
    executions: int
    seconds: float
    ratio_sum: float = 0.0  # sum over its executions of the execution ratio s_i
    kl_sum: float = 0.0  # sum over its target tokens of r - 1 - log r (objective.py)
    routed: int = 0  # an MoE's (position, layer) routings replayed from the rollout
    drifted: int = 0  # ... of which the current router would have chosen otherwise


@dataclass(kw_only=True, frozen=True)
class StepResult:
    """The update of one batch, as the core saw it."""

    step: int
    version: int  # policy version after the update
    cells: int
    grad_norm: float  # before clipping, of the normalised gradient
    seconds: float


class WeightsBoard(Protocol):
    """Where the core leaves its newest weights for the other cells: one writer (the
    core), many readers. Implemented in :mod:`qwengyre.cluster.weights` (shared
    memory on one machine) and :mod:`qwengyre.cluster.ray` (Ray's object store)."""

    @property
    def version(self) -> int:
        """The version last written completely (-1 before the first write)."""
        ...

    def write(self, named: Iterable[tuple[str, Tensor]], version: int) -> None: ...

    def read(
        self, names: Collection[str] | None = None, *, timeout_s: float = 10.0
    ) -> tuple[int, dict[str, Tensor]]:
        """A consistent copy of the weights (only ``names``, if given) and their version."""
        ...

    def close(self) -> None: ...


class TrainerBackend(Protocol):
    """One rank of a cell's trainer. Every rank of a cell makes each call together
    (they may be collective over the cell); the results are the same on every rank."""

    @property
    def version(self) -> int:
        """The policy version of the weights this rank holds."""
        ...

    @property
    def is_core(self) -> bool:
        """Cell 0's ranks: they own the optimizer and write the weights boards."""
        ...

    def join_training(self) -> int:
        """Enter training: a satellite takes the core's current weights from the
        boards (its ranks their own shards). Returns the version."""
        ...

    def pull_weights(self) -> int:
        """Take this rank's shard of the newest weights from the boards: a satellite
        joining training, or the core's replacement taking over from the dead core's
        last publication. Returns their version."""
        ...

    def train_micro_step(self, ms: MicroStep) -> MicroStepResult:
        """Add the gradient of ``ms``'s *summed* objective (normaliser 1) to the cell's
        gradient; the result covers the whole micro-step."""
        ...

    def finish_batch(self, summary: BatchSummary, cells: int) -> StepResult:
        """The ``cells`` participating cells (a prefix) sum their gradients into the
        core, which divides by the normaliser, clips and makes one optimizer update
        (version + 1); every participant and the boards get the new weights."""
        ...

    def publish_weights(self) -> None:
        """The core writes its current weights to its board (e.g. at start-up)."""
        ...

    def discard_gradient(self) -> None:
        """Drop the gradient accumulated since the last update: the cell left the step
        before it (its micro-steps are trained again by the cells that stay)."""
        ...

    @property
    def offloaded(self) -> bool: ...

    def offload(self) -> int:
        """Free the trainer state's device memory (the cell serves rollout); returns
        the bytes freed."""
        ...

    def restore(self) -> None:
        """Bring back, unchanged, what :meth:`offload` freed."""
        ...

    def save_checkpoint(
        self, root: str, step: int, state: Mapping[str, Any], keep: int, model_dir: str
    ) -> str:
        """The core's ranks write model and optimizer, resumable by any layout of the
        same backend, plus ``state``; the ``keep`` newest under ``root`` remain.
        Returns the checkpoint's path."""
        ...

    def load_checkpoint(self, path: str) -> None:
        """The core's ranks restore model, optimizer and version from ``path``."""
        ...

    def parameters(self) -> dict[str, Tensor]:
        """A copy of the whole current parameters under their HuggingFace names."""
        ...

    def shard_numels(self) -> dict[str, int]:
        """Elements this rank holds: parameters, gradients, optimizer state."""
        ...


class BuildTrainer(Protocol):
    """How a cell's rank builds its backend once the cells' groups exist: ``model``
    (HuggingFace, fp32, on the rank's device), the cells' communication, the version of
    the weights in the model, and the board (the core's: its own; others': the core's)."""

    def __call__(
        self,
        model: PreTrainedModel,
        config: TrainerConfig,
        comm: CellComm,
        *,
        version: int,
        board: WeightsBoard | None,
    ) -> TrainerBackend: ...


TRAINER_BACKENDS: dict[TrainerBackendName, str] = {
    "fsdp2": "qwengyre.training.trainer:Trainer",
}
"""``trainer.backend`` -> ``module:factory`` (a :class:`BuildTrainer`), imported on
first use: a backend's dependencies load only in the runs that choose it."""


def trainer_backend(name: TrainerBackendName) -> BuildTrainer:
    """The factory of the backend ``name`` (``trainer.backend``)."""
    module, _, factory = TRAINER_BACKENDS[name].partition(":")
    build: BuildTrainer = getattr(importlib.import_module(module), factory)
    return build
