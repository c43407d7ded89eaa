"""A cell: one slice of the accelerators that serves rollout or training (the paper: elastic
cells; docs/design.md §3).

A cell is ``G`` ranks (``cells.devices_per_cell``), each a :class:`Cell` object in its
own process on its own device: a local process
(:class:`~qwengyre.cluster.local.ProcessActor`) or a Ray actor, driven together through
one handle (:class:`~qwengyre.cluster.placement.CellGroup`), which calls every rank and
answers with shard 0's result. The ranks train through the trainer backend that
``trainer.backend`` names (:mod:`qwengyre.training.backend`; ``fsdp2``:
:class:`~qwengyre.training.trainer.Trainer`, the policy sharded with FSDP2). Cell 0, the
core, owns the optimizer and the weights boards, one per shard index (shared memory,
or Ray's object store under Ray placement: :mod:`qwengyre.cluster.weights`); a
satellite's rank ``r`` pulls shard ``r`` of the core's weights when it joins training.
Every method is synchronous: the placement backend runs one call at a time; the
runtime calls them through :class:`~qwengyre.cluster.client.CellClient`.

Start-up: build all ``K x G`` ranks, then call :meth:`Cell.connect` on all of them
concurrently (creating the torch.distributed groups is collective).

Rollout: shard 0 serves an embedded engine behind SGLang's HTTP API
(:class:`~qwengyre.cluster.engine_host.EngineHost`), which reads the core's ``G``
boards shard by shard. A move to training is :meth:`release_engine` (after the proxy
drained it); the way back is :meth:`resume_engine`, which frees the trainer state's
device memory (:meth:`~qwengyre.training.backend.TrainerBackend.offload`, on
accelerators) and loads the newest weights. Publication is :meth:`update_engine_weights`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

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
from qwengyre.config import Config
from qwengyre.models.tiny import quiet_progress_bars
from qwengyre.training.backend import (
    MicroStepResult,
    StepResult,
    TrainerBackend,
    WeightsBoard,
    trainer_backend,
)
from qwengyre.training.buffers import BatchSummary, MicroStep
from qwengyre.training.distributed import CellComm

__all__ = ["Cell", "CellSpec"]


@dataclass(kw_only=True, frozen=True)
class CellSpec:
    """Everything one rank of a cell needs to start (picklable). The run's settings
    come from ``config`` as they are: ``cells`` (K, G, the engine's capacity),
    ``trainer``, ``engine`` (backend, bind address), ``run`` (torch threads, max
    context) and ``seed``."""

    rank: int  # the cell's index (0: the core)
    shard: int  # this rank's index within the cell
    init_method: str  # torch.distributed rendezvous, e.g. tcp://127.0.0.1:PORT
    model_dir: str
    board: str  # base name of the core's weights boards (one per shard index)
    config: Config
    board_kind: BoardKind = "shared_memory"  # see qwengyre.cluster.weights
    backend: str = "gloo"  # torch.distributed's, for this rank's device
    device: str = "cpu"  # this rank's device (placement derives it from run.device)
    version: int = 0  # policy version of the weights in model_dir
    checkpoint: str | None = None  # resume: the core loads weights and optimizer from here
    store_on_core: bool = True  # its shard 0 serves the rendezvous store (else the controller)
    incarnation: int = 0  # replacements of this cell so far (its own group's key)

    @property
    def shards(self) -> int:
        """G, ranks per cell."""
        return self.config.cells.devices_per_cell

    @property
    def name(self) -> str:
        return f"cell-{self.rank}" if self.shards == 1 else f"cell-{self.rank}.{self.shard}"


class Cell:
    """One rank of a cell; see the module docstring."""

    def __init__(self, spec: CellSpec) -> None:
        torch.set_num_threads(spec.config.run.torch_threads)
        torch.manual_seed(spec.config.seed + spec.rank)
        if spec.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(spec.device))
        self.spec = spec
        with quiet_progress_bars():
            model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
                spec.model_dir, dtype=torch.float32
            )
        self.model = model.to(torch.device(spec.device))  # type: ignore[arg-type]
        self.trainer: TrainerBackend | None = None
        self.engine: RolloutHost | None = None
        self._comm: CellComm | None = None
        self._board: WeightsBoard | None = None  # the core's board of this rank's shard
        self._boards: BoardShards | None = None
        self._gpus: tuple[str, ...] = ()  # the cell's GPUs, for its engine's tensor parallel

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def _serves(self) -> bool:
        """Shard 0 hosts the cell's engine."""
        return self.spec.shard == 0

    def connect(
        self, members: Sequence[int] | None = None, generation: int = 0, *, takeover: bool = False
    ) -> int:
        """Join the cells' communication groups, build the trainer backend; the core
        opens the weights boards (and loads the checkpoint it resumes from).
        ``members`` and ``generation``: the live cells and their groups' generation
        (:meth:`regroup`; all cells and 0 at start-up). ``takeover``: this is the core's
        replacement: it adopts the dead core's boards and takes their weights and
        version, and the optimizer state of ``spec.checkpoint`` (fresh without one).
        Groups called off (a member died: :class:`~qwengyre.training.distributed.GroupsCalledOff`)
        leave it to be called again, with the next generation.

        Returns this process's id (for logs and kill tests).
        """
        spec = self.spec
        core = spec.rank == 0
        name = board_name(spec.board, spec.shard)
        layout = shard_layout(self.model.named_parameters(), spec.shards, spec.shard)
        owned = core and not takeover
        if owned and self._board is None:
            self._board = open_board(spec.board_kind, name, layout, create=True)
        if self._comm is None:  # kept if the groups are called off: connect again
            self._comm = CellComm(
                spec.rank,
                spec.config.cells.count,
                spec.init_method,
                shard=spec.shard,
                shards=spec.shards,
                backend=spec.backend,
                device=spec.device,
                store_master=spec.store_on_core,
                incarnation=spec.incarnation,
            )
        comm = self._comm
        comm.regroup(range(spec.config.cells.count) if members is None else members, generation)
        # Creating the groups is collective: once it returned everywhere the boards exist.
        if self._board is None:
            self._board = open_board(spec.board_kind, name, layout, adopt=takeover)
        board = self._board
        build = trainer_backend(spec.config.trainer.backend)
        self.trainer = build(
            self.model, spec.config.trainer, comm, version=spec.version, board=board
        )
        gpus = comm.cell_gather(physical_gpu(spec.device))
        self._gpus = tuple(str(g) for g in gpus if g is not None)
        if core:
            if spec.checkpoint is not None:
                self.trainer.load_checkpoint(spec.checkpoint)
            if takeover:
                self.trainer.pull_weights()  # newer than the checkpoint's, if it lags
            else:
                self.trainer.publish_weights()
        return os.getpid()

    def pid(self) -> int:
        return os.getpid()

    def regroup(self, members: Sequence[int], generation: int) -> None:
        """Re-form the groups among the live cells ``members`` (after a cell died, or
        once its replacement is ready to connect); the trainer keeps its state."""
        if self._comm is None:
            raise RuntimeError(f"{self.spec.name}: connect() first")
        self._comm.regroup(members, generation)

    def _trainer(self) -> TrainerBackend:
        if self.trainer is None:
            raise RuntimeError(f"{self.spec.name}: connect() first")
        return self.trainer

    def join_training(self) -> int:
        """Enter training: a satellite takes the core's current weights. Returns the version."""
        return self._trainer().join_training()

    def train_micro_step(self, micro_step: MicroStep) -> MicroStepResult:
        return self._trainer().train_micro_step(micro_step)

    def finish_batch(self, summary: BatchSummary, cells: int) -> StepResult:
        return self._trainer().finish_batch(summary, cells)

    def discard_gradient(self) -> None:
        """Drop the gradient of the open step (it is trained again)."""
        self._trainer().discard_gradient()

    # ------------------------------------------------------------------ rollout

    def _engine(self) -> RolloutHost:
        if self.engine is None:
            raise RuntimeError(f"{self.spec.name}: start_engine() first")
        return self.engine

    def _board_shards(self) -> BoardShards:
        if self._boards is None:
            spec, trainer = self.spec, self._trainer()
            named = model_parameters(spec.model_dir)
            opened = {spec.shard: self._board} if trainer.is_core and self._board else {}
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
        config = self.spec.config
        self.engine = rollout_host(
            config.engine.backend,
            self.spec.model_dir,
            name=self.spec.name,
            capacity=config.cells.capacity,
            device=self.spec.device,
            max_context=config.engine.max_context,
            seed=config.seed + 1000 * self.rank,
            host=config.engine.host,
            routed_experts=config.engine.return_routed_experts,
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
        """Serve rollout again with the newest weights; returns their version. The
        gradient of a step the cell left before its update is dropped (the cells that
        stay train its micro-steps again); on an accelerator the trainer state leaves
        the device first."""
        self._trainer().discard_gradient()
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

    def save_checkpoint(self, root: str, step: int, state: Mapping[str, Any], keep: int) -> str:
        """The core's ranks write weights and optimizer (sharded), shard 0 the caller's
        state, atomically; the ``keep`` newest checkpoints under ``root`` remain."""
        return self._trainer().save_checkpoint(root, step, state, keep, self.spec.model_dir)

    def parameters(self) -> dict[str, torch.Tensor]:
        """A copy of the whole current parameters (tests; collective over the cell)."""
        return self._trainer().parameters()

    def shard_numels(self) -> list[dict[str, int]]:
        """Elements each rank of the cell holds, in shard order: parameters, gradients,
        optimizer state (tests; collective over the cell)."""
        numels = self._trainer().shard_numels()
        assert self._comm is not None  # connected: it has a trainer
        return cast(list[dict[str, int]], self._comm.cell_gather(numels))

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self._boards is not None:
            self._boards.close()
        if self._comm is not None:
            self._comm.close()
        if self._board is not None:
            self._board.close()
