"""The standalone rollout pool: engines that never train (the paper: "an optional
standalone pool remains in rollout"; docs/design.md §2, C_s in Eq 3).

:class:`StandalonePool` is an actor like :class:`~qwengyre.cluster.cell.Cell` (a local
process, or a Ray actor) that holds no trainer: it serves one engine
(:func:`~qwengyre.cluster.engine_host.rollout_host`) on its own device for the whole
run. It reads weights from the core's weights board, so the cells must be connected
(the core opened the board) before :meth:`StandalonePool.start_engine`. The core's
publication after each burst reaches it through :meth:`update_engine_weights`, as it
reaches the rollout cells; the scheduler routes launches and reroutes to it first.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from qwengyre.cluster.devices import physical_gpu
from qwengyre.cluster.engine_host import Endpoint, rollout_host
from qwengyre.cluster.weights import BoardKind, BoardShards, model_parameters
from qwengyre.config import Config

__all__ = ["STANDALONE_NAME", "StandalonePool", "StandaloneSpec"]

STANDALONE_NAME = "standalone"
"""The proxy's name for the pool's engine."""


@dataclass(frozen=True)
class StandaloneSpec:
    """Everything the pool's process needs to start (picklable): the model directory,
    the base name of the core's weights boards and their kind, and the run's config,
    from which the pool reads ``cells.standalone_capacity`` (C_s),
    ``cells.standalone_device`` (else ``run.device``), ``cells.devices_per_cell`` (G:
    the core's weights come as this many shards), ``run.torch_threads``,
    ``engine.max_context``, ``engine.host`` (the engine's bind address),
    ``engine.backend`` and ``seed``."""

    model_dir: str
    board: str
    config: Config
    board_kind: BoardKind = "shared_memory"

    @property
    def capacity(self) -> int:
        return self.config.cells.standalone_capacity

    @property
    def device(self) -> str:
        return self.config.cells.standalone_device or self.config.run.device


class StandalonePool:
    """The standalone pool's process-side state; see the module docstring."""

    def __init__(self, spec: StandaloneSpec) -> None:
        config = spec.config
        torch.set_num_threads(config.run.torch_threads)
        self.spec = spec
        gpu = physical_gpu(spec.device)  # one: the cells hold the other GPUs
        self.host = rollout_host(
            config.engine.backend,
            spec.model_dir,
            name=STANDALONE_NAME,
            capacity=spec.capacity,
            device=spec.device,
            max_context=config.engine.max_context,
            seed=config.seed + 999_983,  # sampling streams apart from every cell's
            host=config.engine.host,
            routed_experts=config.engine.return_routed_experts,
            gpus=(gpu,) if gpu is not None else (),
        )
        self.board: BoardShards | None = None

    def start_engine(self) -> Endpoint:
        """Open the core's boards (they must exist), serve and load their weights;
        returns where."""
        named = model_parameters(self.spec.model_dir)
        shards = self.spec.config.cells.devices_per_cell
        self.board = BoardShards(self.spec.board_kind, self.spec.board, named, shards)
        endpoint = self.host.start()
        self.host.load_newest(self.board)
        return endpoint

    def update_engine_weights(self) -> int:
        """Load the board's weights if newer (the core's publication); their version."""
        return self.host.load_newest(self._board())

    def revive_engine(self) -> bool:
        """Start the engine's server again if it crashed; True if it did."""
        return self.host.revive(self._board())

    def _board(self) -> BoardShards:
        if self.board is None:
            raise RuntimeError("standalone pool: start_engine() first")
        return self.board

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        self.host.close()
        if self.board is not None:
            self.board.close()
