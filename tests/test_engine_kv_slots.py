"""The slot KV store: rows keep their cached tokens through realignment, growth and moves."""

from __future__ import annotations

import pytest
import torch

from qwengyre.engines.kv_slots import (
    MIN_COLUMNS,
    SlotKV,
    decode_mask,
    power_of_two_at_least,
    prefill_mask,
    sliding,
)


def filled(kv: SlotKV, lengths: list[int]) -> None:
    """Write row i's token t (0-based) as the value 1000*i + t, ending at the write column."""
    kv.buffers(0, torch.zeros(1, 2, 1, 3), torch.zeros(1, 2, 1, 3))
    for row, length in enumerate(lengths):
        for t in range(length):
            kv.keys[0][row, :, kv.width - length + t] = 1000 * row + t
            kv.values[0][row, :, kv.width - length + t] = -(1000 * row + t)


def cached(kv: SlotKV, row: int, length: int) -> list[int]:
    keys = kv.keys[0][row, 0, kv.width - length : kv.width, 0]
    values = kv.values[0][row, 0, kv.width - length : kv.width, 0]
    assert torch.equal(values, -keys)
    return [int(x) for x in keys]


def tokens(row: int, length: int) -> list[int]:
    return [1000 * row + t for t in range(length)]


def test_buffers_are_shaped_like_the_first_write_and_grow_by_doubling() -> None:
    kv = SlotKV(rows=3, max_columns=2000, device=torch.device("cpu"))
    keys, values = kv.buffers(0, torch.zeros(5, 2, 7, 4), torch.zeros(5, 2, 7, 6))
    assert keys.shape == (3, 2, MIN_COLUMNS, 4) and values.shape == (3, 2, MIN_COLUMNS, 6)
    kv.width = 10
    filled(kv, [4, 10])
    assert kv.fit(in_use=2, longest=10, least_width=600)  # the buffers moved
    assert kv.columns == 1024 and kv.width == 600
    assert cached(kv, 0, 4) == tokens(0, 4) and cached(kv, 1, 10) == tokens(1, 10)
    assert not kv.fit(in_use=2, longest=10, least_width=700)  # room enough: not moved
    assert kv.width == 700 and cached(kv, 1, 10) == tokens(1, 10)


def test_the_write_column_is_pulled_back_when_padding_dominates() -> None:
    kv = SlotKV(rows=2, max_columns=512, device=torch.device("cpu"))
    kv.width = 100
    filled(kv, [30, 45])
    kv.fit(in_use=2, longest=45)  # 55 padding columns > 45: pulled back
    assert kv.width == 45
    assert cached(kv, 0, 30) == tokens(0, 30) and cached(kv, 1, 45) == tokens(1, 45)
    kv.fit(in_use=2, longest=45)
    assert kv.width == 45  # nothing to gain
    kv.width = 80
    filled(kv, [30, 45])
    kv.fit(in_use=2, longest=45)  # 35 padding columns <= 45: left alone
    assert kv.width == 80 and cached(kv, 1, 45) == tokens(1, 45)


def test_a_full_buffer_is_compacted_before_it_grows() -> None:
    kv = SlotKV(rows=2, max_columns=512, device=torch.device("cpu"))
    kv.width = MIN_COLUMNS  # no column left after the write column
    filled(kv, [100, 200])
    assert not kv.fit(in_use=2, longest=200)
    assert kv.width == 200 and kv.columns == MIN_COLUMNS
    assert cached(kv, 0, 100) == tokens(0, 100) and cached(kv, 1, 200) == tokens(1, 200)
    with pytest.raises(ValueError, match="513 KV columns exceed the context limit 512"):
        kv.fit(in_use=2, longest=200, least_width=512)
    assert kv.width == 200 and cached(kv, 1, 200) == tokens(1, 200)  # unchanged


def test_a_row_moves_into_a_hole() -> None:
    kv = SlotKV(rows=3, max_columns=512, device=torch.device("cpu"))
    kv.width = 50
    filled(kv, [10, 20, 30])
    kv.move_row(source=2, target=0, length=30)
    assert cached(kv, 0, 30) == tokens(2, 30) and cached(kv, 1, 20) == tokens(1, 20)


def test_masks_see_exactly_each_rows_tokens() -> None:
    lengths = torch.tensor([3, 0, 5])
    mask = decode_mask(lengths, torch.tensor([6]), columns=8)[:, 0, 0]
    assert mask.int().tolist() == [
        [0, 0, 0, 1, 1, 1, 1, 0],  # its 3 tokens and the new one at column 6
        [0, 0, 0, 0, 0, 0, 1, 0],  # padding: only the new one
        [0, 1, 1, 1, 1, 1, 1, 0],
    ]
    window = sliding(mask, 3, torch.tensor([6]))
    assert window[0].int().tolist() == [0, 0, 0, 0, 1, 1, 1, 0]
    prefill = prefill_mask(torch.tensor([2, 4]), prompt=4)[:, 0]
    assert prefill[0].int().tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    assert torch.equal(prefill[1], torch.ones(4, 4).tril().bool())
    window = sliding(prefill, 2, torch.arange(4).unsqueeze(1))[1]
    assert window.int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]


@pytest.mark.parametrize(
    ("n", "limit", "bucket"), [(1, 64, 1), (5, 64, 8), (64, 64, 64), (65, 96, 96)]
)
def test_buckets_are_powers_of_two_up_to_the_limit(n: int, limit: int, bucket: int) -> None:
    assert power_of_two_at_least(n, limit) == bucket
