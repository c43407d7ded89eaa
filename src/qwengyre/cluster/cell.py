"""A cell: one slice of the accelerators that serves rollout or training (PAPER: elastic
cells; DESIGN.md §3).

The same :class:`Cell` runs as a local process (:class:`~qwengyre.cluster.local.ProcessActor`)
or as a Ray actor. It holds the policy model. Cell 0, the core, owns the optimizer
and the shared weights board; satellites pull the core's weights when they join
training. Every method is synchronous: the placement backend runs one call at a time.

Start-up: build all ``K`` cells, then call :meth:`Cell.connect` on all of them
concurrently (creating the torch.distributed groups is collective).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from qwengyre.cluster.weights import SharedWeights, layout_of
from qwengyre.config import TrainerConfig
from qwengyre.training.buffers import BatchSummary, MicroStep
from qwengyre.training.distributed import PrefixGroups
from qwengyre.training.trainer import MicroStepResult, StepResult, Trainer

__all__ = ["Cell", "CellSpec"]


@dataclass(frozen=True)
class CellSpec:
    """Everything a cell process needs to start (picklable)."""

    rank: int
    world: int
    init_method: str  # torch.distributed rendezvous, e.g. tcp://127.0.0.1:PORT
    model_dir: str
    trainer: TrainerConfig
    board: str  # name of the core's shared-memory weights segment
    backend: str = "gloo"
    device: str = "cpu"
    torch_threads: int = 1
    seed: int = 0


class Cell:
    """One cell's process-side state; see the module docstring."""

    def __init__(self, spec: CellSpec) -> None:
        torch.set_num_threads(spec.torch_threads)
        torch.manual_seed(spec.seed + spec.rank)
        self.spec = spec
        model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
            spec.model_dir, dtype=torch.float32
        )
        self.model = model.to(torch.device(spec.device))  # type: ignore[arg-type]
        self.trainer: Trainer | None = None

    @property
    def rank(self) -> int:
        return self.spec.rank

    def connect(self) -> int:
        """Join the cells' communication groups; the core opens the weights board.

        Returns this process's id (for logs and kill tests).
        """
        layout = layout_of(self.model.named_parameters())
        core = self.spec.rank == 0
        board = SharedWeights(self.spec.board, layout, create=True) if core else None
        comm = PrefixGroups(
            self.spec.rank, self.spec.world, self.spec.init_method, backend=self.spec.backend
        )
        # new_group() is collective: once it returned everywhere the core's board exists.
        if board is None:
            board = SharedWeights(self.spec.board, layout)
        self.trainer = Trainer(self.model, self.spec.trainer, comm, board=board)
        if core:
            self.trainer.publish_weights()
        return os.getpid()

    def _trainer(self) -> Trainer:
        if self.trainer is None:
            raise RuntimeError(f"cell {self.rank}: connect() first")
        return self.trainer

    def join_training(self) -> int:
        """Enter training: a satellite takes the core's current weights. Returns the version."""
        trainer = self._trainer()
        return trainer.version if trainer.is_core else trainer.pull_weights()

    def train_micro_step(self, micro_step: MicroStep) -> MicroStepResult:
        return self._trainer().train_micro_step(micro_step)

    def finish_batch(self, summary: BatchSummary, cells: int) -> StepResult:
        return self._trainer().finish_batch(summary, cells)

    def parameters(self) -> dict[str, torch.Tensor]:
        """A copy of the current parameters (tests, checkpoints)."""
        return {k: v.detach().clone() for k, v in self.model.named_parameters()}

    def save_model(self, path: str) -> str:
        self.model.save_pretrained(Path(path))
        return path

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.comm.close()
            if self.trainer.board is not None:
                self.trainer.board.close()
