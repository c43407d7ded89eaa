"""Ray placement: each cell is a Ray actor, for runs on more than one machine
(docs/design.md §3, cluster).

:class:`RayActor` runs the same :class:`~qwengyre.cluster.cell.Cell` code as
:class:`~qwengyre.cluster.local.ProcessActor` and offers the same interface
(:class:`~qwengyre.cluster.client.CellHandle`): ``await call(method, ...)``,
``call_sync``, ``check_alive``, ``close``. A Ray actor runs one call at a time, in
order. An exception inside the actor comes back as
:class:`~qwengyre.cluster.local.ActorError` with the remote traceback (a full disk as
:class:`~qwengyre.durable.DiskFullError`), a dead actor as
:class:`~qwengyre.cluster.local.ActorDied`, so callers handle both backends alike.

:class:`RayCells` starts Ray when needed and reserves one placement-group bundle per
cell (strategy ``PACK`` by default; ``SPREAD`` puts cells on distinct nodes where
possible).

- **Which Ray.** If Ray is already initialised in this process it is used as it is.
  Otherwise, when ``RAY_ADDRESS`` is set (e.g. ``ray://head:10001`` or ``auto`` on a
  cluster node), :func:`ray.init` connects to that cluster; else a local Ray is
  started with ``num_cpus`` logical CPUs, no dashboard, and its temp dir under the
  run dir (or ``/tmp`` when that path is too long: Ray's unix sockets need paths
  < 108 characters). ``RAY_AUTH_MODE=disabled`` is set if unset.
- **Rendezvous.** ``CellSpec.init_method`` (``tcp://host:port``) must be reachable
  from every actor. On one node ``127.0.0.1`` is fine. When the bundles span several
  nodes and the spec's host is a loopback address, :meth:`RayCells.specs_for_nodes`
  replaces it by the core node's IP and a port free there (:func:`core_address`).
- **Weights.** The cells' weights board is :class:`RayWeights`: the core puts each
  version into Ray's object store and a named actor holds the newest reference, so
  satellites and rollout engines on any node read it (Ray moves the bytes).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from qwengyre.cluster.local import ActorDied, ActorError
from qwengyre.durable import DiskFullError

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # before Ray reads its settings

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from torch import Tensor

from qwengyre.cluster.cell import Cell, CellSpec
from qwengyre.cluster.placement import BundleStrategy

__all__ = ["RayActor", "RayCells", "core_address"]

HEALTH_GROUP = "health"
"""The concurrency group of liveness checks: its own thread, beside the one that runs
the cell's calls in order."""

_MAX_TEMP_DIR = 40  # + "/session_<date>_<pid>/sockets/plasma_store" stays < 108


def _reraise(name: str, exc: BaseException) -> BaseException:
    if isinstance(exc, RayTaskError) and isinstance(exc.cause, DiskFullError):
        return DiskFullError(*exc.cause.args)  # one line that says it all: no traceback
    if isinstance(exc, RayTaskError):
        return ActorError(f"{name}: {exc}")
    if isinstance(exc, RayActorError):
        return ActorDied(f"{name} died: {exc}")
    return exc


class RayActor:
    """``factory(*args)`` as a Ray actor; call its methods with :meth:`call`."""

    def __init__(
        self,
        factory: Callable[..., Any],
        *args: Any,
        name: str = "actor",
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        placement: PlacementGroup | None = None,
        bundle_index: int = -1,
    ) -> None:
        self.name = name
        self.cells: RayCells | None = None  # the group that started it (for stop_cells)
        options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus}
        if placement is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement, placement_group_bundle_index=bundle_index
            )
        # Ray's typed overloads omit concurrency_groups, a documented remote() option.
        remote = ray.remote(concurrency_groups={HEALTH_GROUP: 1})(factory)  # type: ignore[call-overload]
        self.actor = remote.options(**options).remote(*args)

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``method`` in the actor and return its result without blocking the loop."""
        try:
            return await getattr(self.actor, method).remote(*args, **kwargs)
        except (RayTaskError, RayActorError) as exc:
            raise _reraise(self.name, exc) from exc

    def call_sync(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``method`` in the actor and return its result (blocking)."""
        try:
            return ray.get(getattr(self.actor, method).remote(*args, **kwargs))
        except (RayTaskError, RayActorError) as exc:
            raise _reraise(self.name, exc) from exc

    async def check_alive(self) -> None:
        """Raise :class:`~qwengyre.cluster.local.ActorDied` if the actor is gone.

        Ray's built-in ``__ray_ready__`` runs in the actor's own health group, so it
        answers at once even while a long call (a training step) occupies the actor.
        """
        try:
            await self.actor.__ray_ready__.options(concurrency_group=HEALTH_GROUP).remote()
        except RayActorError as exc:
            raise _reraise(self.name, exc) from exc

    def close(self, timeout_s: float = 10.0) -> None:
        """Call the object's ``close`` (if it has one), then kill the actor."""
        with contextlib.suppress(AttributeError, RayTaskError, RayActorError, GetTimeoutError):
            ray.get(self.actor.close.remote(), timeout=timeout_s)
        ray.kill(self.actor, no_restart=True)


def _node_address() -> tuple[str, int]:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        port = int(s.getsockname()[1])
    return ray.util.get_node_ip_address(), port


def core_address(placement: PlacementGroup, bundle_index: int = 0) -> str:
    """``tcp://IP:PORT`` on the node of ``bundle_index`` (the core's), port free there."""
    probe = ray.remote(_node_address).options(
        num_cpus=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement, placement_group_bundle_index=bundle_index
        ),
    )
    ip, port = ray.get(probe.remote())
    return f"tcp://{ip}:{port}"


class _Board:
    """The newest weights' object references, one per tensor, and their version (one
    named actor)."""

    def __init__(self) -> None:
        self.version = -1
        self.refs: dict[str, ray.ObjectRef[Tensor]] = {}

    def set(self, version: int, refs: dict[str, ray.ObjectRef[Tensor]]) -> None:
        self.version, self.refs = version, refs

    def get(self) -> tuple[int, dict[str, ray.ObjectRef[Tensor]]]:
        return self.version, self.refs


class RayWeights:
    """The weights board of Ray-placed cells (:class:`~qwengyre.training.backend.WeightsBoard`).

    :meth:`write` puts the tensors into Ray's object store, one object each, and leaves
    their references with a named actor (``name``); :meth:`read` fetches the newest, or
    only the tensors it names, from whichever node. The references travel in a dict, so
    that the actor keeps them, not their values.
    Every cell opens the same actor (``get_if_exists``), whichever comes first; the
    creator (``create``, the core) kills it on :meth:`close`.
    """

    def __init__(self, name: str, *, create: bool = False) -> None:
        self.name = name
        self._owner = create
        board = ray.remote(_Board).options(name=name, num_cpus=0, get_if_exists=True)
        self._actor: Any = board.remote()  # Ray's typing of handles is partial

    @property
    def version(self) -> int:
        """The version last written (-1 before the first write)."""
        return int(ray.get(self._actor.get.remote())[0])

    def write(self, named: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Put ``named`` tensors in the object store as ``version`` (``ray.put``
        serialises a snapshot at once, so no copy of CPU tensors is needed first)."""
        refs = {name: ray.put(t.detach().cpu()) for name, t in named}
        ray.get(self._actor.set.remote(version, refs))

    def read(
        self, names: Collection[str] | None = None, *, timeout_s: float = 10.0
    ) -> tuple[int, dict[str, Tensor]]:
        """The newest weights (only ``names``, if given) and their version (``(-1, {})``
        before the first write)."""
        version, refs = ray.get(self._actor.get.remote(), timeout=timeout_s)
        if not refs:
            return -1, {}
        chosen = list(refs) if names is None else list(names)
        if unknown := sorted(set(chosen) - set(refs)):
            raise ValueError(f"weights board {self.name!r} holds no tensor {unknown[:3]}")
        tensors = ray.get([refs[name] for name in chosen], timeout=timeout_s)
        return int(version), dict(zip(chosen, tensors, strict=True))

    def close(self) -> None:
        if self._owner:
            ray.kill(self._actor, no_restart=True)


class RayCells:
    """Ray (started or joined), one placement group, and the cells' actors in it."""

    def __init__(
        self,
        specs: Sequence[CellSpec],
        *,
        run_dir: Path,
        cpus_per_cell: float = 1.0,
        gpus_per_cell: float = 0.0,
        strategy: BundleStrategy = "PACK",
        timeout_s: float = 120.0,
    ) -> None:
        self.started_ray = False
        self.temp_dir: str | None = None
        if not ray.is_initialized():
            self._init(run_dir, math.ceil(cpus_per_cell * len(specs)))
        bundle: dict[str, float] = {"CPU": cpus_per_cell}
        if gpus_per_cell:
            bundle["GPU"] = gpus_per_cell
        self.placement = placement_group([dict(bundle) for _ in specs], strategy=strategy)
        self.handles: list[RayActor] = []
        try:
            ray.get(self.placement.ready(), timeout=timeout_s)
        except GetTimeoutError as exc:
            self.stop()
            raise RuntimeError(
                f"Ray could not reserve {len(specs)} x {bundle} within {timeout_s} s "
                f"(cluster resources: {ray.cluster_resources()})"
            ) from exc
        specs = [replace(spec, board_kind="ray") for spec in self.specs_for_nodes(specs)]
        self.handles = [
            RayActor(
                Cell,
                spec,
                name=spec.name,
                num_cpus=cpus_per_cell,
                num_gpus=gpus_per_cell,
                placement=self.placement,
                bundle_index=i,
            )
            for i, spec in enumerate(specs)
        ]
        for handle in self.handles:
            handle.cells = self

    def _init(self, run_dir: Path, cpus: int) -> None:
        if os.environ.get("RAY_ADDRESS"):
            ray.init(logging_level=logging.WARNING)
        else:
            temp = run_dir.resolve() / "ray"
            if len(str(temp)) > _MAX_TEMP_DIR:
                self.temp_dir = tempfile.mkdtemp(prefix="qg-ray-", dir="/tmp")
                temp = Path(self.temp_dir)
            temp.mkdir(parents=True, exist_ok=True)
            ray.init(
                num_cpus=max(os.cpu_count() or 1, cpus),
                include_dashboard=False,
                _temp_dir=str(temp),
                logging_level=logging.WARNING,
            )
        self.started_ray = True

    def specs_for_nodes(self, specs: Sequence[CellSpec]) -> list[CellSpec]:
        """The specs, with a loopback rendezvous moved to the core's node IP if the
        bundles span several nodes."""
        nodes = set(placement_group_table(self.placement)["bundles_to_node_id"].values())
        host = urlsplit(specs[0].init_method).hostname if specs[0].init_method else None
        if len(nodes) <= 1 or host not in ("127.0.0.1", "localhost"):
            return list(specs)
        address = core_address(self.placement)
        return [replace(spec, init_method=address) for spec in specs]

    def stop(self) -> None:
        """Kill the actors, remove the placement group, shut Ray down if we started it."""
        for handle in self.handles:
            handle.close()
        remove_placement_group(self.placement)
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None
