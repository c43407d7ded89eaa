"""A cell: one slice of the accelerators that serves rollout or training (PAPER: elastic
cells; DESIGN.md §3).

The same :class:`Cell` runs as a local process (:class:`~qwengyre.cluster.local.ProcessActor`)
or as a Ray actor. It holds the policy model. Cell 0, the core, owns the optimizer
and the weights board (shared memory, or Ray's object store under Ray placement:
:class:`~qwengyre.cluster.weights.WeightsBoard`); satellites pull the core's weights
when they join training. Every method is synchronous: the placement backend runs one call at a time.

Start-up: build all ``K`` cells, then call :meth:`Cell.connect` on all of them
concurrently (creating the torch.distributed groups is collective).

Rollout: :meth:`Cell.start_engine` serves an embedded engine behind SGLang's HTTP API
(:class:`~qwengyre.cluster.engine_host.EngineHost`).
A move to training is :meth:`release_engine` (after the proxy drained it); the way
back is :meth:`resume_engine`, which also loads the newest weights from the board.
Publication is :meth:`update_engine_weights` (from the board). The
engine keeps its own copy of the weights: on an accelerator they would share one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from qwengyre.cluster.engine_host import EngineHost
from qwengyre.cluster.weights import SharedWeights, WeightsBoard, WeightsLayout, layout_of
from qwengyre.config import TrainerConfig
from qwengyre.models.tiny import quiet_progress_bars
from qwengyre.training.buffers import BatchSummary, MicroStep
from qwengyre.training.checkpoint import load_checkpoint, save_checkpoint
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
    board: str  # name of the core's weights board
    board_kind: Literal["shared_memory", "ray"] = "shared_memory"  # see WeightsBoard
    backend: str = "gloo"
    device: str = "cpu"
    torch_threads: int = 1
    seed: int = 0
    engine_capacity: int = 8
    max_context: int | None = None
    version: int = 0  # policy version of the weights in model_dir
    checkpoint: str | None = None  # resume: the core loads its optimizer state from here


class Cell:
    """One cell's process-side state; see the module docstring."""

    def __init__(self, spec: CellSpec) -> None:
        torch.set_num_threads(spec.torch_threads)
        torch.manual_seed(spec.seed + spec.rank)
        self.spec = spec
        with quiet_progress_bars():
            model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
                spec.model_dir, dtype=torch.float32
            )
        self.model = model.to(torch.device(spec.device))  # type: ignore[arg-type]
        self.trainer: Trainer | None = None
        self.engine: EngineHost | None = None
        self._tokenizer: Any = None

    @property
    def rank(self) -> int:
        return self.spec.rank

    def connect(self) -> int:
        """Join the cells' communication groups; the core opens the weights board.

        Returns this process's id (for logs and kill tests).
        """
        layout = layout_of(self.model.named_parameters())
        core = self.spec.rank == 0
        board = self._open_board(layout, create=True) if core else None
        comm = PrefixGroups(
            self.spec.rank, self.spec.world, self.spec.init_method, backend=self.spec.backend
        )
        # new_group() is collective: once it returned everywhere the core's board exists.
        if board is None:
            board = self._open_board(layout, create=False)
        self.trainer = Trainer(
            self.model, self.spec.trainer, comm, version=self.spec.version, board=board
        )
        if core:
            if self.spec.checkpoint is not None:
                load_checkpoint(self.spec.checkpoint, self.model, self.trainer.optimizer)
            self.trainer.publish_weights()
        return os.getpid()

    def _open_board(self, layout: WeightsLayout, *, create: bool) -> WeightsBoard:
        if self.spec.board_kind == "ray":
            from qwengyre.cluster.ray import RayWeights

            return RayWeights(self.spec.board, create=create)
        return SharedWeights(self.spec.board, layout, create=create)

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

    # ------------------------------------------------------------------ rollout

    def _engine(self) -> EngineHost:
        if self.engine is None:
            raise RuntimeError(f"cell {self.rank}: start_engine() first")
        return self.engine

    def _board(self) -> WeightsBoard:
        board = self._trainer().board
        assert board is not None
        return board

    def start_engine(self) -> tuple[str, str]:
        """Serve rollout; returns the engine's base URL and API key."""
        if self.engine is not None:
            raise RuntimeError(f"cell {self.rank}: the engine is already running")
        self.engine = EngineHost(
            self.spec.model_dir,
            name=f"cell-{self.rank}",
            capacity=self.spec.engine_capacity,
            device=self.spec.device,
            max_context=self.spec.max_context,
            seed=self.spec.seed + 1000 * self.rank,
            version=self.spec.version,
        )
        return self.engine.start()

    def release_engine(self, timeout_s: float = 60.0) -> None:
        """Free the engine's memory once the requests the proxy aborted have left."""
        self._engine().release(timeout_s)

    def resume_engine(self) -> int:
        """Serve rollout again with the newest weights; returns their version."""
        return self._engine().resume(self._board())

    def update_engine_weights(self) -> int:
        """Load the board's weights into the engine (between decode steps) if newer."""
        return self._engine().load_newest(self._board())

    # ------------------------------------------------------------------ state

    def save_checkpoint(self, root: str, step: int, state: dict[str, Any], keep: int) -> str:
        """The core writes model, optimizer and the caller's state atomically; the
        ``keep`` newest checkpoints under ``root`` remain."""
        trainer = self._trainer()
        if not trainer.is_core:
            raise RuntimeError("only the core holds the optimizer")
        if self._tokenizer is None:  # saved too, so the checkpoint is a whole model dir
            self._tokenizer = AutoTokenizer.from_pretrained(self.spec.model_dir)
        path = save_checkpoint(
            Path(root),
            step=step,
            model=self.model,
            optimizer=trainer.optimizer,
            state=state,
            keep=keep,
            tokenizer=self._tokenizer,
        )
        return str(path)

    def parameters(self) -> dict[str, torch.Tensor]:
        """A copy of the current parameters (tests, checkpoints)."""
        return {k: v.detach().clone() for k, v in self.model.named_parameters()}

    def save_model(self, path: str) -> str:
        self.model.save_pretrained(Path(path))
        return path

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self.trainer is not None:
            self.trainer.comm.close()
            if self.trainer.board is not None:
                self.trainer.board.close()
