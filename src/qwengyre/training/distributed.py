"""The process groups of sharded cells (docs/design.md §3).

A run has ``K`` cells of ``G`` ranks each. Every rank meets the others through one
key-value store, the run's rendezvous (a :class:`torch.distributed.TCPStore` at
``CellSpec.init_method``, held by the controller, or by the core when the controller
cannot be reached from every node), and builds two kinds of groups from it:

- **the cell's group** (its ``G`` ranks): the process's default group. FSDP2 shards the
  model over it (:func:`qwengyre.training.sharding.shard_policy`) and a micro-step's
  statistics are summed over it. A cell's death takes all its ranks, so this group
  never outlives a member.
- **a prefix group per shard index and prefix** ``k = 2..M`` of the live cells
  ``members`` (core first): ranks ``shard`` of the first ``k`` members. Cells join
  training serially, core first, so the cells training a batch are always such a
  prefix, and rank ``r`` of every participating cell holds the same shard: gradients
  are reduced to the core and updated parameters broadcast back between rank-``r``
  peers only, on shards, in bounded buckets (never a whole-model buffer), leaving the
  cells serving rollout untouched.

The prefix groups are re-formed without a restart (:meth:`CellComm.regroup`, a new
*generation* of groups under their own keys of the store) when a cell dies: among the
survivors, so that cells past the dead one train again, or with a replacement process
that took the dead cell's place (which builds its own cell group under a key of its
own). Nothing else changes: the trainers keep their weights, gradients and optimizer.
Before building a generation's groups its members meet under the store's keys, and the
controller can call the meeting off (:func:`call_off`) when one of them died meanwhile:
the others stop waiting for it at once instead of at the rendezvous timeout, and a
later generation forms the groups without it (or with its replacement). A member that
dies after all met, inside the groups' own rendezvous, is waited for until the timeout.

gloo on CPU, NCCL for CUDA tensors (``"cpu:gloo,cuda:nccl"``).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any, cast
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "BUCKET_BYTES",
    "CellComm",
    "GroupsCalledOff",
    "buckets",
    "call_off",
    "flatten",
    "unflatten_into",
]

BUCKET_BYTES = 64 << 20
"""Most bytes one cross-cell collective moves at once (a larger tensor goes alone)."""

MEET_POLL_S = 0.01
"""How often a member waiting for a generation's others looks at the store."""


class GroupsCalledOff(RuntimeError):
    """The controller called off forming a generation's groups: a member died."""


def _called_off_key(generation: int) -> str:
    return f"prefix.{generation}/off"


def call_off(store: dist.Store, generation: int) -> None:
    """The members forming ``generation``'s prefix groups stop waiting for each other
    (:class:`GroupsCalledOff`): one of them died before it came."""
    store.set(_called_off_key(generation), "1")


def flatten(tensors: Sequence[Tensor]) -> Tensor:
    """One contiguous fp32 buffer of ``tensors`` (so a collective is one call)."""
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def unflatten_into(flat: Tensor, tensors: Sequence[Tensor]) -> None:
    """Copy ``flat`` back into ``tensors`` in order, casting to each one's dtype."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n
    if offset != flat.numel():
        raise ValueError(f"flat buffer holds {flat.numel()} values, tensors take {offset}")


def buckets(tensors: Sequence[Tensor], max_bytes: int) -> Iterator[list[Tensor]]:
    """Consecutive runs of ``tensors`` of at most ``max_bytes`` (fp32) each; a tensor
    larger than that is a run of its own."""
    run: list[Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * 4
        if run and size + nbytes > max_bytes:
            yield run
            run, size = [], 0
        run.append(t)
        size += nbytes
    if run:
        yield run


_SINGLE: list[bool] = []  # a one-process default group exists (made once per process)


def connect_store(init_method: str, *, master: bool, timeout_s: float) -> dist.TCPStore:
    """The run's rendezvous store at ``tcp://host:port``; ``master``: serve it here."""
    where = urlsplit(init_method)
    if where.scheme != "tcp" or where.hostname is None or where.port is None:
        raise ValueError(f"the rendezvous must be tcp://host:port, got {init_method!r}")
    return dist.TCPStore(
        where.hostname,
        where.port,
        is_master=master,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
    )


def _cross_cell_group(
    store: dist.Store, key: str, rank: int, size: int, device: torch.device, timeout_s: float
) -> dist.ProcessGroup:
    """A group of ``size`` ranks met under ``key`` of ``store``: gloo for CPU tensors,
    NCCL for CUDA ones. Built directly rather than with ``dist.new_group``, which every
    rank of the default group (here a cell) would have to call."""
    prefixed = dist.PrefixStore(key, store)
    if device.type == "cuda":
        nccl: Any = getattr(dist, "ProcessGroupNCCL")  # noqa: B009  (CUDA builds only)
        return cast(dist.ProcessGroup, nccl(prefixed, rank, size, nccl.Options()))
    gloo = dist.ProcessGroupGloo(prefixed, rank, size, timedelta(seconds=timeout_s))
    return cast(dist.ProcessGroup, gloo)


class CellComm:
    """Shard ``shard`` of cell ``cell``, among ``cells`` cells of ``shards`` ranks that
    meet at ``init_method`` (the core's shard 0 serves the store there when
    ``store_master``). ``incarnation`` tells a replacement's cell group from its dead
    predecessor's. It has no prefix groups until :meth:`regroup` (collective) builds
    them: every rank of a run calls it at start, with all the cells and generation 0."""

    def __init__(
        self,
        cell: int,
        cells: int,
        init_method: str,
        *,
        shard: int = 0,
        shards: int = 1,
        backend: str = "gloo",
        device: str = "cpu",
        timeout_s: float = 600.0,
        bucket_bytes: int = BUCKET_BYTES,
        store_master: bool = False,
        incarnation: int = 0,
    ) -> None:
        if not 0 <= cell < cells:
            raise ValueError(f"cell must be in [0, {cells}), got {cell}")
        if not 0 <= shard < shards:
            raise ValueError(f"shard must be in [0, {shards}), got {shard}")
        self.cell, self.cells, self.shard, self.shards = cell, cells, shard, shards
        self.device = torch.device(device)
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self._owns_world = shards > 1
        self._prefix: dict[int, dist.ProcessGroup] = {}
        self.members: tuple[int, ...] = (cell,)
        self.store: dist.Store | None = None
        if cells * shards > 1:
            master = store_master and cell == 0 and shard == 0
            self.store = connect_store(init_method, master=master, timeout_s=timeout_s)
        if self._owns_world:
            assert self.store is not None
            dist.init_process_group(
                backend,
                store=dist.PrefixStore(f"cell{cell}.{incarnation}/", self.store),
                rank=shard,
                world_size=shards,
                timeout=timedelta(seconds=timeout_s),
            )
        elif not _SINGLE:  # one rank: FSDP2 still wants a (single-rank) group
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            _SINGLE.append(True)
        self.cell_group: dist.ProcessGroup = dist.group.WORLD  # type: ignore[assignment]
        self.mesh = DeviceMesh.from_group(self.cell_group, self.device.type)

    @property
    def is_core(self) -> bool:
        """A rank of cell 0, which owns the optimizer."""
        return self.cell == 0

    def regroup(self, members: Sequence[int], generation: int) -> None:
        """Build this rank's prefix groups among the live cells ``members`` (ascending,
        the core first), under ``generation``'s keys; the previous ones are dropped.
        Collective: rank ``shard`` of every member calls it with the same arguments."""
        members = tuple(members)
        if list(members) != sorted(set(members)) or self.cell not in members:
            raise ValueError(f"cell {self.cell}: members must be ascending and hold it: {members}")
        if members[0] != 0:
            raise ValueError(f"members must start with the core (cell 0): {members}")
        self._prefix.clear()  # every handle on the old groups goes before the new ones
        gc.collect()
        if len(members) > 1:
            self._meet(members, generation)
        self.members = members
        me = members.index(self.cell)
        for k in range(2, len(members) + 1):  # the same order everywhere: no deadlock
            if me < k:
                assert self.store is not None
                key = f"prefix.{generation}/shard{self.shard}/k{k}/"
                self._prefix[k] = _cross_cell_group(
                    self.store, key, me, k, self.device, self.timeout_s
                )

    def _meet(self, members: tuple[int, ...], generation: int) -> None:
        """Wait until this shard's peers in every member came to ``generation``'s
        groups; raise :class:`GroupsCalledOff` if the controller called them off
        (:func:`call_off`), ``TimeoutError`` after the store's timeout."""
        assert self.store is not None
        here = [f"prefix.{generation}/here/{c}.{self.shard}" for c in members]
        self.store.set(here[members.index(self.cell)], "1")
        off = _called_off_key(generation)
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check(here):
            if self.store.check([off]):
                raise GroupsCalledOff(
                    f"cell {self.cell}: the groups of generation {generation} among cells"
                    f" {members} were called off (a member died)"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"cell {self.cell}: not every cell of {members} came to generation"
                    f" {generation}'s groups within {self.timeout_s:.0f} s"
                )
            time.sleep(MEET_POLL_S)

    def _group(self, k: int) -> dist.ProcessGroup | None:
        if not 1 <= k <= len(self.members) or self.members.index(self.cell) >= k:
            raise ValueError(
                f"cell {self.cell} is not in the prefix of {k} of the cells {self.members}"
            )
        return self._prefix.get(k)

    def _bucketed(self, tensors: Sequence[Tensor], k: int, reduce: bool) -> None:
        group = self._group(k)
        if group is None:
            return
        for run in buckets(tensors, self.bucket_bytes):
            one = len(run) == 1 and run[0].is_contiguous() and run[0].dtype == torch.float32
            flat = run[0] if one else flatten(run)
            if reduce:
                to_core = dist.ReduceOptions()
                to_core.rootRank, to_core.reduceOp = 0, dist.ReduceOp.SUM  # type: ignore[assignment]
                group.reduce([flat], to_core).wait()
            else:
                from_core = dist.BroadcastOptions()
                from_core.rootRank, from_core.rootTensor = 0, 0
                group.broadcast([flat], from_core).wait()
            if not one:
                unflatten_into(flat, run)

    def reduce_to_core(self, tensors: Sequence[Tensor], k: int) -> None:
        """Sum ``tensors`` over this shard's peers in the first ``k`` members into the
        core's (in place), bucket by bucket."""
        self._bucketed(tensors, k, reduce=True)

    def broadcast_from_core(self, tensors: Sequence[Tensor], k: int) -> None:
        """Overwrite ``tensors`` on this shard's peers in members ``1..k-1`` with the core's."""
        self._bucketed(tensors, k, reduce=False)

    def cell_sum(self, values: Tensor) -> Tensor:
        """``values`` summed over the cell's ranks (in place; returned)."""
        if self.shards > 1:
            dist.all_reduce(values, group=self.cell_group)
        return values

    def cell_object(self, value: object) -> object:
        """Shard 0's ``value`` on every rank of the cell."""
        if self.shards == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, group_src=0, group=self.cell_group)
        return box[0]

    def cell_gather(self, value: object) -> list[object]:
        """Every rank's ``value``, in shard order, on every rank of the cell."""
        if self.shards == 1:
            return [value]
        gathered: list[object] = [None] * self.shards
        dist.all_gather_object(gathered, value, group=self.cell_group)
        return gathered

    def close(self) -> None:
        self._prefix.clear()
        if self._owns_world and dist.is_initialized():
            dist.destroy_process_group()
