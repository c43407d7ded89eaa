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


def store(lengths: list[int], width: int, max_columns: int = 4096) -> SlotKV:
    """A store whose rows hold ``lengths`` tokens ending at ``width``; row i's token t
    (0-based) is the key 1000*i + t and the value -(1000*i + t)."""
    kv = SlotKV(max_rows=8, max_columns=max_columns, device=torch.device("cpu"))
    kv.fit(in_use=0, longest=0, least_width=width - 1, joining=len(lengths))
    kv.buffers(0, torch.zeros(1, 2, 1, 3), torch.zeros(1, 2, 1, 3))
    kv.width = width  # as after a decode step
    for row, length in enumerate(lengths):
        for t in range(length):
            kv.keys[0][row, :, width - length + t] = 1000 * row + t
            kv.values[0][row, :, width - length + t] = -(1000 * row + t)
    return kv


def cached(kv: SlotKV, row: int, length: int) -> list[int]:
    keys = kv.keys[0][row, 0, kv.width - length : kv.width, 0]
    values = kv.values[0][row, 0, kv.width - length : kv.width, 0]
    assert torch.equal(values, -keys)
    return [int(x) for x in keys]


def tokens(row: int, length: int) -> list[int]:
    return [1000 * row + t for t in range(length)]


def test_buffers_are_shaped_like_the_first_write_and_sized_to_what_is_in_use() -> None:
    kv = SlotKV(max_rows=8, max_columns=2000, device=torch.device("cpu"))
    kv.fit(in_use=0, longest=0, least_width=9, joining=3)
    keys, values = kv.buffers(0, torch.zeros(5, 2, 7, 4), torch.zeros(5, 2, 7, 6))
    assert keys.shape == (4, 2, MIN_COLUMNS, 4) and values.shape == (4, 2, MIN_COLUMNS, 6)
    kv = store([4, 10], width=10, max_columns=2000)
    assert kv.fit(in_use=2, longest=10, least_width=600)  # grown: the buffers moved
    assert (kv.rows, kv.columns, kv.width) == (2, 1024, 600)
    assert cached(kv, 0, 4) == tokens(0, 4) and cached(kv, 1, 10) == tokens(1, 10)
    assert not kv.fit(in_use=2, longest=10, least_width=700)  # room enough: not moved
    assert kv.width == 700 and cached(kv, 1, 10) == tokens(1, 10)
    # The long prompt left: the write column comes back and the columns shrink.
    assert kv.fit(in_use=2, longest=10)
    assert (kv.columns, kv.width) == (MIN_COLUMNS, 10)
    assert cached(kv, 0, 4) == tokens(0, 4) and cached(kv, 1, 10) == tokens(1, 10)
    assert kv.fit(in_use=2, longest=10, joining=6)  # rows grow for joining requests
    assert kv.rows == 8 and cached(kv, 1, 10) == tokens(1, 10)
    assert kv.fit(in_use=1, longest=4)  # and shrink to twice what is in use
    assert kv.rows == 2 and cached(kv, 0, 4) == tokens(0, 4)
    assert not kv.fit(in_use=1, longest=4)


def test_the_write_column_is_pulled_back_when_padding_dominates() -> None:
    kv = store([30, 45], width=100)
    kv.fit(in_use=2, longest=45)  # 55 padding columns > 45: pulled back
    assert kv.width == 45
    assert cached(kv, 0, 30) == tokens(0, 30) and cached(kv, 1, 45) == tokens(1, 45)
    kv.fit(in_use=2, longest=45)
    assert kv.width == 45  # nothing to gain
    kv = store([30, 45], width=80)
    kv.fit(in_use=2, longest=45)  # 35 padding columns <= 45: left alone
    assert kv.width == 80 and cached(kv, 1, 45) == tokens(1, 45)


def test_a_full_buffer_is_compacted_before_it_grows() -> None:
    kv = store([100, 200], width=MIN_COLUMNS, max_columns=512)  # no column after it
    assert kv.columns == MIN_COLUMNS
    assert not kv.fit(in_use=2, longest=200)
    assert kv.width == 200 and kv.columns == MIN_COLUMNS
    assert cached(kv, 0, 100) == tokens(0, 100) and cached(kv, 1, 200) == tokens(1, 200)
    with pytest.raises(ValueError, match="513 KV columns exceed the context limit 512"):
        kv.fit(in_use=2, longest=200, least_width=512)
    assert kv.width == 200 and cached(kv, 1, 200) == tokens(1, 200)  # unchanged


def test_a_row_moves_into_a_hole() -> None:
    kv = store([10, 20, 30], width=50)
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
