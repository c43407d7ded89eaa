"""Trainer state out of device memory while its cell serves rollout.

:class:`Offloaded` frees the storage of the given tensors (parameter shards, their
optimizer state) and keeps a host copy (pinned for CUDA) when asked to keep it;
:meth:`Offloaded.restore` reallocates the storage in place and copies the bytes back.
Working on storages rather than tensors keeps every alias valid: FSDP2's shards are
views of one padded buffer per parameter, and the optimizer holds the parameters
themselves, so nothing has to be re-registered after the round trip.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

__all__ = ["Offloaded"]


class Offloaded:
    """The storages of ``tensors``, freed; ``keep`` saves their bytes to the host first
    (without it the contents are lost: a satellite re-reads its weights on joining)."""

    def __init__(self, tensors: Iterable[Tensor], *, keep: bool) -> None:
        seen: dict[int, torch.UntypedStorage] = {}
        for t in tensors:
            storage = t.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen[storage.data_ptr()] = storage
        self._storages = list(seen.values())
        self._sizes = [s.nbytes() for s in self._storages]
        self._copies: list[Tensor | None] = []
        for storage in self._storages:
            copy = None
            if keep:
                data = _bytes(storage)
                copy = torch.empty_like(data, device="cpu", pin_memory=data.is_cuda)
                copy.copy_(data)
            self._copies.append(copy)
            storage.resize_(0)

    @property
    def nbytes(self) -> int:
        """Bytes freed."""
        return sum(self._sizes)

    def restore(self) -> None:
        """Reallocate every storage (and copy the kept bytes back)."""
        for storage, size, copy in zip(self._storages, self._sizes, self._copies, strict=True):
            storage.resize_(size)
            if copy is not None:
                _bytes(storage).copy_(copy)
        self._storages, self._copies = [], []


def _bytes(storage: torch.UntypedStorage) -> Tensor:
    """A uint8 tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
