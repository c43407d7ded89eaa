"""Placement of cells: local processes or Ray actors behind one interface
(DESIGN.md §3, cluster).

``start_cells("local", specs, run_dir=...)`` builds each cell in its own process on this
machine (:class:`~qwengyre.cluster.local.ProcessActor`); ``start_cells("ray", ...)``
builds them as Ray actors in one placement group (:mod:`qwengyre.cluster.ray`, which
documents ``RAY_ADDRESS`` and multi-node rendezvous). Either way the handles come back
in rank order; call ``connect`` on all of them concurrently, and end with
:func:`stop_cells`. The standalone rollout pool, when configured, is one more actor
(:func:`start_standalone`), started once the cells are connected.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, Protocol

from qwengyre.cluster.cell import Cell, CellSpec
from qwengyre.cluster.local import ProcessActor
from qwengyre.cluster.standalone import STANDALONE_NAME, StandalonePool, StandaloneSpec

__all__ = ["CellHandle", "start_cells", "start_standalone", "stop_cells"]


class CellHandle(Protocol):
    """A cell in another process: one call at a time, in order."""

    name: str

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any: ...

    def call_sync(self, method: str, *args: Any, **kwargs: Any) -> Any: ...

    async def check_alive(self) -> None:
        """Raise ``ActorDied`` if the cell is gone; answers even while a call runs."""
        ...

    def close(self) -> None: ...


def start_cells(
    backend: Literal["local", "ray"],
    specs: Sequence[CellSpec],
    *,
    run_dir: Path,
    cpus_per_cell: float = 1.0,
    gpus_per_cell: float = 0.0,
    strategy: Literal["PACK", "SPREAD"] = "PACK",
) -> list[CellHandle]:
    """Build one cell per spec; handles in rank order. ``cpus_per_cell``,
    ``gpus_per_cell`` and ``strategy`` (placement-group strategy) apply to Ray."""
    specs = sorted(specs, key=lambda spec: spec.rank)
    if backend == "local":
        return [ProcessActor(Cell, spec, name=f"cell-{spec.rank}") for spec in specs]
    if backend == "ray":
        from qwengyre.cluster.ray import RayCells

        cells = RayCells(
            specs,
            run_dir=run_dir,
            cpus_per_cell=cpus_per_cell,
            gpus_per_cell=gpus_per_cell,
            strategy=strategy,
        )
        return list(cells.handles)
    raise ValueError(f"unknown placement backend {backend!r}")


def start_standalone(
    backend: Literal["local", "ray"], spec: StandaloneSpec, *, gpus: float = 0.0
) -> CellHandle:
    """The standalone pool's actor (a process, or a Ray actor outside the cells'
    placement group, on any node with room); start it after the cells connected."""
    if backend == "local":
        return ProcessActor(StandalonePool, spec, name=STANDALONE_NAME)
    if backend == "ray":
        from qwengyre.cluster.ray import RayActor

        spec = replace(spec, board_kind="ray")
        return RayActor(StandalonePool, spec, name=STANDALONE_NAME, num_gpus=gpus)
    raise ValueError(f"unknown placement backend {backend!r}")


def stop_cells(handles: Sequence[CellHandle]) -> None:
    """Close every cell; for Ray also release what :func:`start_cells` started."""
    groups = {id(g): g for h in handles if (g := getattr(h, "cells", None)) is not None}
    for handle in handles:
        if getattr(handle, "cells", None) is None:
            handle.close()
    for group in groups.values():
        group.stop()
