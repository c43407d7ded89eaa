"""The embedded engine's KV cache: one row per running request, written in place.

Each attention layer's keys and values live in one buffer ``[rows, kv_heads, columns,
head_dim]``. Running request ``i`` owns row ``i`` (rows ``0..n-1`` are in use) and its
``length`` cached tokens sit right-aligned before the shared *write column* ``width``:
columns ``[width - length, width)``; every other column of the row is masked out.

A decode step writes each row's new key and value at column ``width`` (one
``index_copy_`` per layer, the column read from a device tensor) and attends over the
first ``width + 1`` columns under a mask. Its tensor shapes therefore depend only on
(rows, columns), which is what lets :mod:`qwengyre.engines.decode_graphs` capture it as
a CUDA graph; and nothing is concatenated per token (HF's dynamic cache copies the whole
cache once per generated token).

:class:`SlotCache` hands these buffers to an HF model through transformers' ``Cache``
interface, so any HF causal LM whose attention calls ``cache.update`` runs on them.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

MIN_COLUMNS = 256  # the fewest columns allocated (up to the context limit)
SHRINK_AT = 4  # a dimension shrinks once a quarter of it would do (hysteresis)


def power_of_two_at_least(n: int, limit: int) -> int:
    """The smallest power of two >= ``n``, capped at ``limit`` (the bucket of ``n``)."""
    return min(limit, 1 << max(0, n - 1).bit_length())


class SlotKV:
    """The per-layer key and value buffers and the shared write column.

    Buffers hold ``rows x columns`` slots sized to what is in use, so memory follows the
    running requests: a dimension doubles past what is needed when it must grow (up to
    ``max_rows`` or ``max_columns``) and shrinks to twice what is needed once a quarter
    would do. Resizing moves the buffers (:meth:`fit` says so). Each layer's buffers are
    allocated at its first write, shaped like what it writes.
    """

    def __init__(self, max_rows: int, max_columns: int, device: torch.device) -> None:
        self.max_rows = max_rows
        self.max_columns = max_columns
        self.device = device
        self.rows = 0
        self.columns = 0
        self.width = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def buffers(
        self, layer: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s buffers, allocated like ``key``/``value`` at its first write."""
        if layer == len(self.keys):
            self.keys.append(self._empty(key, self.rows, self.columns))
            self.values.append(self._empty(value, self.rows, self.columns))
        return self.keys[layer], self.values[layer]

    def fit(self, in_use: int, longest: int, least_width: int = 0, joining: int = 0) -> bool:
        """Size the buffers and place the write column for the next forward; True if the
        buffers moved.

        Rows ``0..in_use-1`` are kept, and ``joining`` more follow them. The write column
        ends up at least ``least_width`` (a prefill's padded prompt must end there) with
        a free column after it. It is pulled back to the longest running row (``longest``
        tokens) when it must move anyway or when padding is more than half of what a
        decode step attends over. A width past the context limit is refused before
        anything changes.
        """
        width = self.width
        packed = max(longest, least_width)
        if width < least_width or width + 1 > self.columns or width - packed > packed:
            width = packed
        if width + 1 > self.max_columns:
            raise ValueError(f"{width + 1} KV columns exceed the context limit {self.max_columns}")
        rows = _sized(in_use + joining, self.rows, self.max_rows, 1)
        columns = _sized(width + 1, self.columns, self.max_columns, MIN_COLUMNS)
        if columns < self.columns:  # the kept tokens must be inside the cut first
            self._realign(in_use, width, longest)
        moved = self._resize(rows, columns, in_use)
        self._realign(in_use, width, longest)
        return moved

    def move_row(self, source: int, target: int, length: int) -> None:
        """Copy row ``source``'s last ``length`` cached tokens into row ``target``."""
        span = slice(self.width - length, self.width)
        for buffer in self.keys + self.values:
            buffer[target, :, span] = buffer[source, :, span]

    def _resize(self, rows: int, columns: int, in_use: int) -> bool:
        if (rows, columns) == (self.rows, self.columns):
            return False
        kept_rows, kept_columns = min(in_use, rows), min(columns, self.columns)

        def resized(buffer: torch.Tensor) -> torch.Tensor:
            new = self._empty(buffer, rows, columns)
            new[:kept_rows, :, :kept_columns] = buffer[:kept_rows, :, :kept_columns]
            return new

        self.keys = [resized(buffer) for buffer in self.keys]
        self.values = [resized(buffer) for buffer in self.values]
        self.rows, self.columns = rows, columns
        return True

    def _realign(self, in_use: int, width: int, keep: int) -> None:
        """Move the first ``in_use`` rows' last ``keep`` columns to end at ``width``."""
        if width != self.width and in_use and keep:
            source = slice(self.width - keep, self.width)
            target = slice(width - keep, width)
            for buffer in self.keys + self.values:
                buffer[:in_use, :, target] = buffer[:in_use, :, source].clone()
        self.width = width

    def _empty(self, like: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
        shape = (rows, like.shape[1], columns, like.shape[3])
        return torch.zeros(shape, dtype=like.dtype, device=self.device)


def _sized(needed: int, size: int, limit: int, least: int) -> int:
    """A dimension's next size: ``size`` while it fits ``needed`` with no more than
    ``SHRINK_AT`` times to spare; else a power of two in [``least``, ``limit``]."""
    if needed <= size < SHRINK_AT * needed or (size <= min(least, limit) and needed <= size):
        return size
    target = needed if needed > size else 2 * needed
    return max(min(least, limit), power_of_two_at_least(target, limit))


class SlotCache(Cache):
    """An HF ``Cache`` over a :class:`SlotKV`, for one forward.

    :meth:`prefill` writes a block of new rows (their padded prompts end at the write
    column) and attends over the new tokens only; :meth:`decode` writes one column of
    the first ``rows`` rows at the device column ``write`` and attends over the first
    ``columns`` columns.
    """

    def __init__(self, kv: SlotKV, layers: int) -> None:
        super().__init__(layers=[_SlotLayer(self, i) for i in range(layers)])
        self.kv = kv
        self._rows = slice(0)
        self._prompt: slice | None = None
        self._write: torch.Tensor | None = None
        self._columns = 0

    @classmethod
    def prefill(cls, kv: SlotKV, layers: int, rows: slice, prompt: int) -> SlotCache:
        cache = cls(kv, layers)
        cache._rows, cache._prompt = rows, slice(kv.width - prompt, kv.width)
        return cache

    @classmethod
    def decode(
        cls, kv: SlotKV, layers: int, rows: int, columns: int, write: torch.Tensor
    ) -> SlotCache:
        cache = cls(kv, layers)
        cache._rows, cache._write, cache._columns = slice(0, rows), write, columns
        return cache

    @property
    def prefilling(self) -> bool:
        return self._prompt is not None

    def write(
        self, layer: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.kv.buffers(layer, key, value)
        if self._prompt is not None:
            keys[self._rows, :, self._prompt] = key
            values[self._rows, :, self._prompt] = value
            return key, value
        assert self._write is not None
        keys, values = keys[self._rows], values[self._rows]
        keys.index_copy_(2, self._write, key)
        values.index_copy_(2, self._write, value)
        return keys[:, :, : self._columns], values[:, :, : self._columns]


class _SlotLayer(CacheLayerMixin):
    """One layer of a :class:`SlotCache`; its sizes are what HF's mask building asks."""

    is_sliding = False

    def __init__(self, cache: SlotCache, index: int) -> None:
        super().__init__()
        self.cache, self.index = cache, index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.write(self.index, key_states, value_states)

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        # earlier transformers 5.x releases pass the cache positions of the queries
        length = query_length if isinstance(query_length, int) else query_length.shape[0]
        return self.get_seq_length() + length, 0

    def get_seq_length(self) -> int:
        """Tokens before the forward's queries: none for a prefill (HF then builds its
        causal mask over the prompt alone), the write column for a decode step."""
        return 0 if self.cache.prefilling else self.cache.kv.width

    def get_max_length(self) -> int:
        return self.cache.kv.columns

    get_max_cache_shape = get_max_length  # the name in transformers 5.0


def decode_mask(lengths: torch.Tensor, width: torch.Tensor, columns: int) -> torch.Tensor:
    """``[rows, 1, 1, columns]``: row ``i`` sees its ``lengths[i]`` cached tokens and the
    new one at column ``width`` (a row of length 0, padding, sees only that one)."""
    column = torch.arange(columns, device=lengths.device)
    seen = (column >= width - lengths.unsqueeze(1)) & (column <= width)
    return seen[:, None, None, :]


def prefill_mask(lengths: torch.Tensor, prompt: int) -> torch.Tensor:
    """``[rows, 1, prompt, prompt]``: causal over each row's left-padded prompt.

    A padding position also sees itself, so no query row is fully masked (SDPA would
    return NaN there, and the NaN would reach real rows through the values).
    """
    query = torch.arange(prompt, device=lengths.device).view(1, prompt, 1)
    key = query.view(1, 1, prompt)
    real = key >= prompt - lengths.view(-1, 1, 1)
    return (((key <= query) & real) | (key == query)).unsqueeze(1)


def sliding(mask: torch.Tensor, window: int, query_at: torch.Tensor) -> torch.Tensor:
    """``mask`` restricted to keys less than ``window`` columns behind each query.

    ``query_at``: the query's column, broadcastable to the mask's last two dimensions.
    """
    column = torch.arange(mask.shape[-1], device=mask.device)
    return mask & (column > query_at - window)
