"""Placement of cells: local processes or Ray actors behind one interface
(docs/design.md §3, cluster).

``start_cells("local", specs, run_dir=...)`` builds each rank of each cell in its own
process on this machine (:class:`~qwengyre.cluster.local.ProcessActor`);
``start_cells("ray", ...)`` builds them as Ray actors in one placement group, one bundle
(one GPU on accelerators) per rank (:mod:`qwengyre.cluster.ray`, which documents
``RAY_ADDRESS`` and multi-node rendezvous). Either way one handle per cell comes back,
in cell order, as a :class:`~qwengyre.cluster.client.CellClient` (a cell of several
ranks behind a :class:`CellGroup`). Call ``connect`` on all of them concurrently, and
end with :func:`stop_cells`. The standalone rollout pool, when
configured, is one more actor (:func:`start_standalone`), started once the cells are
connected.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from itertools import groupby
from pathlib import Path
from typing import Any, Literal

from qwengyre.cluster.cell import Cell, CellSpec
from qwengyre.cluster.client import CellClient, CellHandle, EngineClient
from qwengyre.cluster.devices import rank_device
from qwengyre.cluster.local import ProcessActor
from qwengyre.cluster.standalone import STANDALONE_NAME, StandalonePool, StandaloneSpec
from qwengyre.config import Placement
from qwengyre.scheduler.events import STANDALONE

__all__ = [
    "CellGroup",
    "engine_name",
    "start_cells",
    "start_standalone",
    "stop_cells",
]

BundleStrategy = Literal["PACK", "SPREAD"]
"""How Ray places a cell's bundles: on as few nodes as possible, or across them."""


def engine_name(engine: int) -> str:
    """The proxy's name for the scheduler's engine id: a cell's, or the standalone pool's."""
    return STANDALONE_NAME if engine == STANDALONE else f"cell-{engine}"


class CellGroup:
    """The ranks of one cell behind one :class:`~qwengyre.cluster.client.CellHandle`: a
    call runs on every rank at once (FSDP2's collectives need them together) and answers
    with shard 0's result.
    A rank that fails makes the call fail (its peers may then wait in a collective
    until the process group's timeout: a failed cell stops the run)."""

    def __init__(self, ranks: Sequence[CellHandle], name: str) -> None:
        self.ranks = list(ranks)
        self.name = name

    @property
    def cells(self) -> object:
        """The Ray group that started the ranks (for :func:`stop_cells`), if any."""
        return getattr(self.ranks[0], "cells", None)

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        results = await asyncio.gather(*(r.call(method, *args, **kwargs) for r in self.ranks))
        return results[0]

    def call_sync(self, method: str, *args: Any, **kwargs: Any) -> Any:
        with ThreadPoolExecutor(len(self.ranks)) as pool:
            futures = [pool.submit(r.call_sync, method, *args, **kwargs) for r in self.ranks]
            results = [f.result() for f in futures]  # every rank's, so any failure raises
        return results[0]

    async def check_alive(self) -> None:
        for rank in self.ranks:
            await rank.check_alive()

    def close(self) -> None:
        for rank in self.ranks:
            rank.close()


def _on_device(spec: CellSpec, device: str) -> CellSpec:
    """``spec`` on ``device``, with the collectives' backend for it."""
    backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else spec.backend
    return replace(spec, device=device, backend=backend)


def start_cells(
    backend: Placement,
    specs: Sequence[CellSpec],
    *,
    run_dir: Path,
    cpus_per_cell: float = 1.0,
    gpus_per_cell: float = 0.0,
    strategy: BundleStrategy = "PACK",
) -> list[CellClient]:
    """Build one process per spec (a rank of a cell) on its device
    (:func:`~qwengyre.cluster.devices.rank_device` locally; one GPU per rank under Ray);
    one handle per cell, in cell order. ``cpus_per_cell``, ``gpus_per_cell`` (per rank)
    and ``strategy`` (placement-group strategy) apply to Ray."""
    specs = sorted(specs, key=lambda spec: (spec.rank, spec.shard))
    if backend == "local":
        specs = [_on_device(spec, rank_device(spec.device, i)) for i, spec in enumerate(specs)]
        ranks: list[CellHandle] = [ProcessActor(Cell, spec, name=spec.name) for spec in specs]
    elif backend == "ray":
        from qwengyre.cluster.ray import RayCells

        if any(spec.device.startswith("cuda") for spec in specs):
            # One GPU per rank; Ray shows each actor only its own, as cuda:0.
            specs = [_on_device(spec, "cuda:0") for spec in specs]
            gpus_per_cell = max(gpus_per_cell, 1.0)
        cells = RayCells(
            specs,
            run_dir=run_dir,
            cpus_per_cell=cpus_per_cell,
            gpus_per_cell=gpus_per_cell,
            strategy=strategy,
        )
        ranks = list(cells.handles)
    else:
        raise ValueError(f"unknown placement backend {backend!r}")
    clients: list[CellClient] = []
    for cell, group in groupby(zip(specs, ranks, strict=True), key=lambda pair: pair[0].rank):
        members = [handle for _, handle in group]
        handle = members[0] if len(members) == 1 else CellGroup(members, engine_name(cell))
        clients.append(CellClient(handle))
    return clients


def start_standalone(
    backend: Placement, spec: StandaloneSpec, *, gpus: float = 0.0
) -> EngineClient:
    """The standalone pool's actor (a process, or a Ray actor outside the cells'
    placement group, on any node with room); start it after the cells connected."""
    if backend == "local":
        return EngineClient(ProcessActor(StandalonePool, spec, name=STANDALONE_NAME))
    if backend == "ray":
        from qwengyre.cluster.ray import RayActor

        spec = replace(spec, board_kind="ray")
        return EngineClient(RayActor(StandalonePool, spec, name=STANDALONE_NAME, num_gpus=gpus))
    raise ValueError(f"unknown placement backend {backend!r}")


def stop_cells(clients: Sequence[EngineClient]) -> None:
    """Close every cell; for Ray also release what :func:`start_cells` started."""
    handles = [client.handle for client in clients]
    groups: dict[int, Any] = {
        id(g): g for h in handles if (g := getattr(h, "cells", None)) is not None
    }
    for handle in handles:
        if getattr(handle, "cells", None) is None:
            handle.close()
    for group in groups.values():
        group.stop()
