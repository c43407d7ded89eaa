"""Cell-to-cell collectives over the participating prefix of cells (DESIGN.md §3).

Cells join training serially, core first, so the cells training a batch are always a
prefix ``0..k-1`` of the ``K`` cells. torch.distributed needs every rank to take part
in creating a communication group, so one group per prefix ``k = 2..K`` is built once
at start-up; a batch then reduces gradients to the core and broadcasts the updated
parameters over the group of its prefix, leaving the other cells (serving rollout)
untouched. gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["PrefixGroups", "flatten", "unflatten_into"]


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


class PrefixGroups:
    """This process's place among ``world`` cells and the groups of every prefix."""

    def __init__(
        self,
        rank: int,
        world: int,
        init_method: str,
        *,
        backend: str = "gloo",
        timeout_s: float = 600.0,
    ) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, {world}), got {rank}")
        self.rank = rank
        self.world = world
        self._groups: dict[int, dist.ProcessGroup] = {}
        if world == 1:
            return
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
        for k in range(2, world + 1):  # every rank creates every group, in order
            group = dist.new_group(list(range(k)))
            if rank < k:
                self._groups[k] = group

    def _group(self, k: int) -> dist.ProcessGroup | None:
        if not 1 <= k <= self.world or self.rank >= k:
            raise ValueError(f"cell {self.rank} is not in the prefix of {k} cells")
        return self._groups.get(k)

    def reduce_to_core(self, flat: Tensor, k: int) -> None:
        """Sum ``flat`` over cells ``0..k-1`` into the core's copy (in place)."""
        group = self._group(k)
        if group is not None:
            dist.reduce(flat, dst=0, group=group)

    def broadcast_from_core(self, flat: Tensor, k: int) -> None:
        """Overwrite ``flat`` on cells ``1..k-1`` with the core's."""
        group = self._group(k)
        if group is not None:
            dist.broadcast(flat, src=0, group=group)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
