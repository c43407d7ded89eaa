"""The process groups of sharded cells (docs/design.md §3).

A run has ``K`` cells of ``G`` ranks each: process ``cell * G + shard`` holds shard
``shard`` of cell ``cell``'s model. Two kinds of groups are built once at start-up
(torch.distributed needs every process to take part in creating every group):

- **the cell's group** (its ``G`` ranks): FSDP2 shards the model over it
  (:func:`qwengyre.training.sharding.shard_policy`) and a micro-step's statistics are
  summed over it;
- **a prefix group per shard index and prefix** ``k = 2..K``: ranks ``shard`` of cells
  ``0..k-1``. Cells join training serially, core first, so the cells training a batch
  are always such a prefix, and rank ``r`` of every participating cell holds the same
  shard: gradients are reduced to the core and updated parameters broadcast back
  between rank-``r`` peers only, on shards, in bounded buckets (never a whole-model
  buffer), leaving the cells serving rollout untouched.

gloo on CPU, NCCL for CUDA tensors (``"cpu:gloo,cuda:nccl"``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["BUCKET_BYTES", "CellComm", "buckets", "flatten", "unflatten_into"]

BUCKET_BYTES = 64 << 20
"""Most bytes one cross-cell collective moves at once (a larger tensor goes alone)."""


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


class CellComm:
    """Shard ``shard`` of cell ``cell``, among ``cells`` cells of ``shards`` ranks."""

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
    ) -> None:
        if not 0 <= cell < cells:
            raise ValueError(f"cell must be in [0, {cells}), got {cell}")
        if not 0 <= shard < shards:
            raise ValueError(f"shard must be in [0, {shards}), got {shard}")
        self.cell, self.cells, self.shard, self.shards = cell, cells, shard, shards
        self.device = torch.device(device)
        self.bucket_bytes = bucket_bytes
        self._owns_world = cells * shards > 1
        self._prefix: dict[int, dist.ProcessGroup] = {}
        if self._owns_world:
            dist.init_process_group(
                backend,
                init_method=init_method,
                rank=cell * shards + shard,
                world_size=cells * shards,
                timeout=timedelta(seconds=timeout_s),
            )
            cell_group: dist.ProcessGroup | None = None
            for c in range(cells):  # every process creates every group, in this order
                group = dist.new_group(list(range(c * shards, (c + 1) * shards)))
                if c == cell:
                    cell_group = group
            for r in range(shards):
                for k in range(2, cells + 1):
                    group = dist.new_group([c * shards + r for c in range(k)])
                    if r == shard and cell < k:
                        self._prefix[k] = group
            assert cell_group is not None
            self.cell_group = cell_group
        else:  # one process: FSDP2 still wants a (single-rank) group
            if not _SINGLE:
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
                _SINGLE.append(True)
            self.cell_group = dist.group.WORLD  # type: ignore[assignment]
        self.mesh = DeviceMesh.from_group(self.cell_group, self.device.type)

    @property
    def is_core(self) -> bool:
        """A rank of cell 0, which owns the optimizer."""
        return self.cell == 0

    def _group(self, k: int) -> dist.ProcessGroup | None:
        if not 1 <= k <= self.cells or self.cell >= k:
            raise ValueError(f"cell {self.cell} is not in the prefix of {k} cells")
        return self._prefix.get(k)

    def _bucketed(self, tensors: Sequence[Tensor], k: int, reduce: bool) -> None:
        group = self._group(k)
        if group is None:
            return
        core = dist.get_global_rank(group, 0)
        for run in buckets(tensors, self.bucket_bytes):
            one = len(run) == 1 and run[0].is_contiguous() and run[0].dtype == torch.float32
            flat = run[0] if one else flatten(run)
            if reduce:
                dist.reduce(flat, dst=core, group=group)
            else:
                dist.broadcast(flat, src=core, group=group)
            if not one:
                unflatten_into(flat, run)

    def reduce_to_core(self, tensors: Sequence[Tensor], k: int) -> None:
        """Sum ``tensors`` over this shard's peers in cells ``0..k-1`` into the core's
        (in place), bucket by bucket."""
        self._bucketed(tensors, k, reduce=True)

    def broadcast_from_core(self, tensors: Sequence[Tensor], k: int) -> None:
        """Overwrite ``tensors`` on this shard's peers in cells ``1..k-1`` with the core's."""
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
        if self._owns_world and dist.is_initialized():
            dist.destroy_process_group()
