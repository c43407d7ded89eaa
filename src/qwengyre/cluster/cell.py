"""A cell: one slice of the accelerators that serves rollout or training (PAPER: elastic
cells; DESIGN.md §3; issue 17).

A cell is ``G`` ranks (``cells.devices_per_cell``), each a :class:`Cell` object in its
own process on its own device: a local process
(:class:`~qwengyre.cluster.local.ProcessActor`) or a Ray actor, driven together through
one handle (:class:`~qwengyre.cluster.placement.CellGroup`), which calls every rank and
answers with shard 0's result. The ranks hold the policy sharded with FSDP2
(:class:`~qwengyre.training.trainer.Trainer`). Cell 0, the core, owns the optimizer and
the weights boards, one per shard index (shared memory, or Ray's object store under
Ray placement: :mod:`qwengyre.cluster.weights`); a satellite's rank ``r`` pulls shard
``r`` of the core's weights when it joins training. Every method is synchronous: the
placement backend runs one call at a time.

Start-up: build all ``K x G`` ranks, then call :meth:`Cell.connect` on all of them
concurrently (creating the torch.distributed groups is collective).

Rollout: shard 0 serves an embedded engine behind SGLang's HTTP API
(:class:`~qwengyre.cluster.engine_host.EngineHost`), which reads the core's ``G``
boards shard by shard. A move to training is :meth:`release_engine` (after the proxy
drained it); the way back is :meth:`resume_engine`, which frees the trainer state's
device memory (:meth:`~qwengyre.training.trainer.Trainer.offload`, on accelerators) and
loads the newest weights. Publication is :meth:`update_engine_weights`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from qwengyre.cluster.devices import physical_gpu
from qwengyre.cluster.engine_host import Endpoint, RolloutHost, rollout_host
from qwengyre.cluster.weights import (
    BoardKind,
    BoardShards,
    board_name,
    model_parameters,
    open_board,
    shard_layout,
)
from qwengyre.config import EngineBackend, TrainerConfig
from qwengyre.models.tiny import quiet_progress_bars
from qwengyre.training.buffers import BatchSummary, MicroStep
from qwengyre.training.checkpoint import load_sharded, save_sharded_checkpoint
from qwengyre.training.distributed import CellComm
from qwengyre.training.sharding import full_tensor
from qwengyre.training.trainer import MicroStepResult, StepResult, Trainer

__all__ = ["Cell", "CellSpec"]


@dataclass(frozen=True)
class CellSpec:
    """Everything one rank of a cell needs to start (picklable)."""

    rank: int  # the cell's index (0: the core)
    world: int  # K, the number of cells
    init_method: str  # torch.distributed rendezvous, e.g. tcp://127.0.0.1:PORT
    model_dir: str
    trainer: TrainerConfig
    board: str  # base name of the core's weights boards (one per shard index)
    board_kind: BoardKind = "shared_memory"  # see qwengyre.cluster.weights
    backend: str = "gloo"
    device: str = "cpu"  # this rank's device
    torch_threads: int = 1
    seed: int = 0
    engine_capacity: int = 8
    max_context: int | None = None
    version: int = 0  # policy version of the weights in model_dir
    checkpoint: str | None = None  # resume: the core loads weights and optimizer from here
    shard: int = 0  # this rank's index within the cell
    shards: int = 1  # G, ranks per cell
    engine_host: str = "127.0.0.1"  # the engine's bind address (engine.host)
    engine_backend: EngineBackend = "embedded"  # engine.backend

    @property
    def name(self) -> str:
        return f"cell-{self.rank}" if self.shards == 1 else f"cell-{self.rank}.{self.shard}"


class Cell:
    """One rank of a cell; see the module docstring."""

    def __init__(self, spec: CellSpec) -> None:
        torch.set_num_threads(spec.torch_threads)
        torch.manual_seed(spec.seed + spec.rank)
        if spec.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(spec.device))
        self.spec = spec
        with quiet_progress_bars():
            model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
                spec.model_dir, dtype=torch.float32
            )
        self.model = model.to(torch.device(spec.device))  # type: ignore[arg-type]
        self.trainer: Trainer | None = None
        self.engine: RolloutHost | None = None
        self._boards: BoardShards | None = None
        self._gpus: tuple[str, ...] = ()  # the cell's GPUs, for its engine's tensor parallel

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def _serves(self) -> bool:
        """Shard 0 hosts the cell's engine."""
        return self.spec.shard == 0

    def connect(self) -> int:
        """Join the cells' communication groups, shard the model; the core opens the
        weights boards (and loads the checkpoint it resumes from).

        Returns this process's id (for logs and kill tests).
        """
        spec = self.spec
        core = spec.rank == 0
        name = board_name(spec.board, spec.shard)
        layout = shard_layout(self.model.named_parameters(), spec.shards, spec.shard)
        board = open_board(spec.board_kind, name, layout, create=True) if core else None
        comm = CellComm(
            spec.rank,
            spec.world,
            spec.init_method,
            shard=spec.shard,
            shards=spec.shards,
            backend=spec.backend,
            device=spec.device,
        )
        # Creating the groups is collective: once it returned everywhere the boards exist.
        if board is None:
            board = open_board(spec.board_kind, name, layout)
        self.trainer = Trainer(self.model, spec.trainer, comm, version=spec.version, board=board)
        gpus = comm.cell_gather(physical_gpu(spec.device))
        self._gpus = tuple(str(g) for g in gpus if g is not None)
        if core:
            if spec.checkpoint is not None:
                load_sharded(spec.checkpoint, self.trainer)
            self.trainer.publish_weights()
        return os.getpid()

    def _trainer(self) -> Trainer:
        if self.trainer is None:
            raise RuntimeError(f"{self.spec.name}: connect() first")
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

    def _engine(self) -> RolloutHost:
        if self.engine is None:
            raise RuntimeError(f"{self.spec.name}: start_engine() first")
        return self.engine

    def _board_shards(self) -> BoardShards:
        if self._boards is None:
            spec, trainer = self.spec, self._trainer()
            named = model_parameters(spec.model_dir)
            opened = {spec.shard: trainer.board} if trainer.is_core and trainer.board else {}
            self._boards = BoardShards(
                spec.board_kind, spec.board, named, spec.shards, opened=opened
            )
        return self._boards

    def start_engine(self) -> Endpoint | None:
        """Shard 0 serves rollout (``engine.backend``) with the core's published
        weights; returns where (``None`` on the other shards). On an accelerator every
        shard's trainer state leaves the device first, as in :meth:`resume_engine`: a
        server spanning the cell's GPUs sizes its memory from what is free when it
        starts (vLLM's ``--gpu-memory-utilization``, SGLang's ``--mem-fraction-static``)."""
        self._make_room()
        if not self._serves:
            return None
        if self.engine is not None:
            raise RuntimeError(f"{self.spec.name}: the engine is already running")
        self.engine = rollout_host(
            self.spec.engine_backend,
            self.spec.model_dir,
            name=self.spec.name,
            capacity=self.spec.engine_capacity,
            device=self.spec.device,
            max_context=self.spec.max_context,
            seed=self.spec.seed + 1000 * self.rank,
            host=self.spec.engine_host,
            gpus=self._gpus,
        )
        endpoint = self.engine.start()
        self.engine.load_newest(self._board_shards())
        return endpoint

    def release_engine(self, timeout_s: float = 60.0) -> str:
        """Free the engine's memory once the requests the proxy aborted have left, and
        bring the trainer state back to the device. Answers how the engine freed it
        (:meth:`~qwengyre.cluster.engine_host.RolloutHost.release`; "" off shard 0)."""
        how = self._engine().release(timeout_s) if self._serves else ""
        trainer = self._trainer()
        if trainer.offloaded:
            trainer.restore()
        return how

    def resume_engine(self) -> int:
        """Serve rollout again with the newest weights; returns their version. On an
        accelerator the trainer state leaves the device first."""
        self._make_room()
        if not self._serves:
            return self._trainer().version
        return self._engine().resume(self._board_shards())

    def _make_room(self) -> None:
        """The trainer state leaves the device for the engine (an accelerator's only: on
        the CPU there is no device memory to free); :meth:`release_engine` brings it
        back."""
        if self.spec.device != "cpu":
            self._trainer().offload()

    def revive_engine(self) -> bool:
        """Start the engine's server again if it crashed (True if it did; False on the
        other shards). Only for a cell that serves rollout."""
        return self._serves and self._engine().revive(self._board_shards())

    def update_engine_weights(self) -> int:
        """Load the boards' weights into the engine (between decode steps) if newer."""
        if not self._serves:
            return self._trainer().version
        return self._engine().load_newest(self._board_shards())

    # ------------------------------------------------------------------ state

    def save_checkpoint(self, root: str, step: int, state: dict[str, Any], keep: int) -> str:
        """The core's ranks write weights and optimizer (sharded), shard 0 the caller's
        state, atomically; the ``keep`` newest checkpoints under ``root`` remain."""
        trainer = self._trainer()
        if not trainer.is_core:
            raise RuntimeError("only the core holds the optimizer")
        return save_sharded_checkpoint(
            root, step=step, trainer=trainer, state=state, keep=keep, model_dir=self.spec.model_dir
        )

    def parameters(self) -> dict[str, torch.Tensor]:
        """A copy of the whole current parameters (tests; collective over the cell)."""
        return {k: full_tensor(v.detach()).clone() for k, v in self.model.named_parameters()}

    def shard_numels(self) -> dict[str, int]:
        """Elements this rank holds: parameters, gradients, optimizer state (tests)."""
        return self._trainer().shard_numels()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self._boards is not None:
            self._boards.close()
        if self.trainer is not None:
            self.trainer.comm.close()
            if self.trainer.board is not None:
                self.trainer.board.close()
