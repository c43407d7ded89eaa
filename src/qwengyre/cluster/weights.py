"""Weights in shared memory: how the core hands its parameters to other cells on one
machine (docs/design.md §3, cluster: weight transfer).

A cell of ``G`` ranks holds its model in ``G`` shards (:mod:`qwengyre.training.sharding`),
so there is one board per shard index (:func:`board_name`): rank ``r`` of the core
writes shard ``r`` there and rank ``r`` of a satellite reads it. An engine reads all
``G`` as one model through :class:`BoardShards`, one shard at a time.

The core writes its parameters after every optimizer update into one named
shared-memory segment; a satellite joining training mid-batch reads the core's
current weights from it, and rollout engines on the same machine load a published
version from it (:class:`qwengyre.engines.base.WeightsInMemory`). One writer, many
readers, no locks: a sequence counter in the header is odd while a write is under
way, and a reader retries until it copied a consistent snapshot (a seqlock).

The layout (names, shapes, dtypes, offsets) comes from the model itself, so every
process that holds the same architecture derives the same layout.
"""

from __future__ import annotations

import json
import math
import struct
import sys
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from qwengyre.engines.base import StaleWeights, WeightsByName, WeightsInShards
from qwengyre.models.saved_form import ToSaved
from qwengyre.training.backend import WeightsBoard
from qwengyre.training.sharding import shard_rows

__all__ = [
    "BoardShards",
    "SharedWeights",
    "TensorSlot",
    "WeightsLayout",
    "board_name",
    "layout_of",
    "model_parameters",
    "open_board",
    "shard_layout",
]

BoardKind = Literal["shared_memory", "ray"]

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}

_HEADER = struct.Struct("<qq")  # sequence counter, policy version
_ALIGN = 64


@dataclass(frozen=True)
class TensorSlot:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # bytes from the start of the segment

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class WeightsLayout:
    slots: tuple[TensorSlot, ...]
    nbytes: int


def layout_of(named: Iterable[tuple[str, Tensor]]) -> WeightsLayout:
    """The segment layout of ``named`` tensors (e.g. ``model.named_parameters()``,
    which lists a tied weight once), each slot aligned to 64 bytes."""
    slots = []
    offset = _HEADER.size
    for name, tensor in named:
        offset = -(-offset // _ALIGN) * _ALIGN
        slot = TensorSlot(name, tuple(tensor.shape), tensor.dtype, offset)
        slots.append(slot)
        offset += slot.nbytes
    return WeightsLayout(tuple(slots), offset)


def shard_layout(named: Iterable[tuple[str, Tensor]], shards: int, shard: int) -> WeightsLayout:
    """The layout of shard ``shard`` of ``shards`` of whole tensors ``named`` (each
    cut along dim 0 as FSDP2 cuts it): what that shard's board holds."""
    return layout_of(
        (
            name,
            torch.empty(
                (shard_rows(t.shape[0], shards, shard)[1], *t.shape[1:]),
                dtype=t.dtype,
                device="meta",
            ),
        )
        for name, t in named
    )


def model_parameters(model_dir: str | Path) -> list[tuple[str, Tensor]]:
    """The parameters of the model in ``model_dir`` (fp32, as the trainer holds them)
    as meta tensors: names and shapes without loading any weight."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return list(model.named_parameters())


def board_name(base: str, shard: int) -> str:
    """The board of shard index ``shard`` of the run's board ``base``."""
    return f"{base}-{shard}"


class SharedWeights:
    """A named shared-memory segment holding one copy of the weights and its version:
    the :class:`~qwengyre.training.backend.WeightsBoard` of cells on one machine.

    ``create=True`` makes (and on :meth:`close`, unlinks) the segment: the core.
    Others attach by name with the same layout; ``adopt=True`` attaches as the owner
    (the core's replacement, which takes over the dead core's segment).
    """

    def __init__(
        self, name: str, layout: WeightsLayout, *, create: bool = False, adopt: bool = False
    ) -> None:
        self.name = name
        self.layout = layout
        self._owner = create or adopt
        if create:
            self._shm = shared_memory.SharedMemory(name=name, create=True, size=layout.nbytes)
        else:
            self._shm = _attach(name)
            if self._shm.size < layout.nbytes:
                raise ValueError(
                    f"shared weights {name!r} hold {self._shm.size} bytes, the model needs "
                    f"{layout.nbytes}: is it the same architecture?"
                )
        buf = self._shm.buf
        assert buf is not None  # open until close()
        self._buf: memoryview = buf
        if create:
            _HEADER.pack_into(buf, 0, 0, -1)
        self._views = {
            slot.name: torch.frombuffer(
                buf, dtype=slot.dtype, count=slot.numel, offset=slot.offset
            ).view(slot.shape)
            for slot in layout.slots
        }

    def _header(self) -> tuple[int, int]:
        seq, version = _HEADER.unpack_from(self._buf, 0)
        return int(seq), int(version)

    @property
    def version(self) -> int:
        """The version last written completely (-1 before the first write)."""
        return self._header()[1]

    def write(self, named: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Copy ``named`` tensors (every slot of the layout) in, as ``version``."""
        tensors = dict(named)
        if set(tensors) != set(self._views):
            missing = sorted(set(self._views) - set(tensors))
            unknown = sorted(set(tensors) - set(self._views))
            raise ValueError(f"write is missing tensors {missing[:3]}, unknown {unknown[:3]}")
        seq, _ = self._header()
        _HEADER.pack_into(self._buf, 0, seq + 1, -1)
        with torch.no_grad():
            for name, tensor in tensors.items():
                self._views[name].copy_(tensor.detach().to("cpu", self._views[name].dtype))
        _HEADER.pack_into(self._buf, 0, seq + 2, version)

    def read(
        self, names: Collection[str] | None = None, *, timeout_s: float = 10.0
    ) -> tuple[int, dict[str, Tensor]]:
        """A consistent copy of the weights (only ``names``, if given) and their version."""
        views = self._views
        if names is not None:
            if unknown := sorted(set(names) - set(views)):
                raise ValueError(f"shared weights {self.name!r} hold no tensor {unknown[:3]}")
            views = {name: views[name] for name in names}
        deadline = time.monotonic() + timeout_s
        while True:
            before, version = self._header()
            if before % 2 == 0:
                copy = {name: view.clone() for name, view in views.items()}
                if self._header()[0] == before:
                    return version, copy
            if time.monotonic() > deadline:
                raise TimeoutError(f"shared weights {self.name!r}: no consistent snapshot")
            time.sleep(0.001)

    def close(self) -> None:
        self._views.clear()
        self._shm.close()
        if self._owner:
            self._shm.unlink()


def _attach(name: str) -> shared_memory.SharedMemory:
    """Attach to segment ``name`` untracked (Python 3.13's ``track=False``): only the
    owner's registration with a resource tracker may exist. A tracker of this process's
    own would unlink the segment when this process exits; a tracker shared with the
    owner (processes spawned by one parent share one) would be told to forget it twice,
    the second time a ``KeyError`` traceback at the end of every run."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)  # type: ignore[call-arg]
    register = resource_tracker.register
    resource_tracker.register = lambda name, rtype: None  # read by SharedMemory at the call
    try:
        return shared_memory.SharedMemory(name=name)
    finally:
        resource_tracker.register = register


def open_board(
    kind: BoardKind,
    name: str,
    layout: WeightsLayout,
    *,
    create: bool = False,
    adopt: bool = False,
) -> WeightsBoard:
    """A board of ``kind``: shared memory on this machine, or Ray's object store.
    ``create``: the core's, new; ``adopt``: the core's replacement's, the dead core's
    (shared memory only: a Ray board's newest weights die with their owner)."""
    if kind == "ray":
        if adopt:
            raise ValueError("a Ray weights board cannot be adopted: its owner's objects died")
        from qwengyre.cluster.ray import RayWeights

        return RayWeights(name, create=create)
    return SharedWeights(name, layout, create=create, adopt=adopt)


class BoardShards:
    """The ``G`` shard boards of the core's model, read by an engine as one model.

    :attr:`version` is the version every board holds (the lowest while a write is
    under way); :meth:`source` hands the engine one shard at a time.
    """

    def __init__(
        self,
        kind: BoardKind,
        base: str,
        named: Iterable[tuple[str, Tensor]],
        shards: int,
        *,
        opened: Mapping[int, WeightsBoard] | None = None,
    ) -> None:
        """``opened``: boards this process holds already (the core's own), by shard."""
        named, opened = list(named), dict(opened or {})
        self.meta = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in named}
        self.shapes = {name: tuple(t.shape) for name, t in named}
        self._own = [r for r in range(shards) if r not in opened]
        self.boards = [
            opened[r]
            if r in opened
            else open_board(kind, board_name(base, r), shard_layout(named, shards, r))
            for r in range(shards)
        ]

    @property
    def version(self) -> int:
        return min(board.version for board in self.boards)

    def _read(
        self, shard: int, version: int, names: Collection[str] | None = None
    ) -> dict[str, Tensor]:
        """Shard ``shard``'s rows (of ``names``, or all) of ``version``; StaleWeights if
        the board holds another version."""
        found, tensors = self.boards[shard].read(names)
        if found != version:
            raise StaleWeights(f"shard {shard} holds version {found}, not {version}")
        return tensors

    def source(self, version: int) -> WeightsInShards:
        return WeightsInShards(len(self.boards), lambda shard: self._read(shard, version))

    def by_name(self, version: int) -> WeightsByName:
        """The weights of ``version`` as whole tensors, read a few names at a time: each
        board gives those names' rows, put together in host memory. ``read`` raises
        :class:`~qwengyre.engines.base.StaleWeights` if a shard moved on."""

        def read(names: Sequence[str]) -> dict[str, Tensor]:
            whole: dict[str, Tensor] = {}
            for r in range(len(self.boards)):
                for name, rows in self._read(r, version, names).items():
                    shape = self.shapes[name]
                    if tuple(rows.shape) == shape:  # one shard holds it all
                        whole[name] = rows
                        continue
                    if name not in whole:
                        whole[name] = rows.new_empty(shape)
                    first = shard_rows(shape[0], len(self.boards), r)[0]
                    whole[name][first : first + rows.shape[0]] = rows
            return whole

        return WeightsByName(self.meta, read)

    def load_newest(self, loaded: int, load: Callable[[int], object], attempts: int = 3) -> int:
        """``load(version)`` of the boards' version if it is newer than ``loaded``, the
        version an engine holds; returns the version the engine holds then. A shard the
        core rewrote during the load (:class:`~qwengyre.engines.base.StaleWeights`)
        makes it start over with the newer version, up to ``attempts`` times."""
        for attempt in range(attempts):
            version = self.version
            if version <= loaded:
                break
            try:
                load(version)
                return version
            except StaleWeights:
                if attempt == attempts - 1:
                    raise
        return loaded

    def write_safetensors(
        self, version: int, path: Path, dtype: torch.dtype, to_saved: ToSaved | None = None
    ) -> None:
        """Write the weights of ``version`` as one safetensors file at ``path`` in
        ``dtype``, for a server engine to load from disk. Each shard's rows go straight
        to their place in the file, one shard at a time: no whole-model buffer. With
        ``to_saved`` (:func:`~qwengyre.models.saved_form.saved_form`: an MoE's fused
        experts) the file holds the checkpoint's names instead, written one whole
        in-memory tensor at a time. Raises :class:`~qwengyre.engines.base.StaleWeights`
        if a shard moved on."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        shapes = self.shapes
        if to_saved is not None:
            shapes = {name: tuple(t.shape) for name, t in to_saved(self.meta).items()}
        offset = 0
        for name, shape in shapes.items():
            nbytes = math.prod(shape) * itemsize
            header[name] = {
                "dtype": _SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        encoded = json.dumps(header).encode()
        encoded += b" " * (-len(encoded) % 8)
        start = 8 + len(encoded)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(encoded)) + encoded)
            f.truncate(start + offset)
            if to_saved is not None:
                whole = self.by_name(version)
                for source_name in self.shapes:
                    for name, tensor in to_saved(whole.read([source_name])).items():
                        f.seek(start + header[name]["data_offsets"][0])  # type: ignore[index]
                        f.write(tensor.to(dtype).contiguous().view(torch.uint8).numpy().tobytes())
                return
            source = self.source(version)
            for r in range(source.count):
                for name, rows in source.read(r).items():
                    shape = self.shapes[name]
                    first = shard_rows(shape[0], source.count, r)[0]
                    row_bytes = math.prod(shape[1:]) * itemsize
                    begin = header[name]["data_offsets"][0]  # type: ignore[index]
                    f.seek(start + begin + first * row_bytes)
                    f.write(rows.to(dtype).contiguous().view(torch.uint8).numpy().tobytes())

    def close(self) -> None:
        for r in self._own:
            self.boards[r].close()
