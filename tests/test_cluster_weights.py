"""Weights in shared memory: the core writes, other processes read a consistent copy."""

from __future__ import annotations

import multiprocessing as mp
import uuid
from pathlib import Path

import pytest
import safetensors.torch
import torch

from qwengyre.cluster.weights import (
    BoardShards,
    SharedWeights,
    board_name,
    layout_of,
    shard_layout,
)
from qwengyre.engines.base import StaleWeights
from qwengyre.training.sharding import shard_rows


def named(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("embed.weight", torch.randn(7, 5, generator=g)),
        ("norm.weight", torch.randn(5, generator=g).to(torch.bfloat16)),
        ("head.bias", torch.randn(3, generator=g)),
    ]


def _read_in_child(name: str, queue: mp.Queue) -> None:
    board = SharedWeights(name, layout_of(named(0)))
    version, tensors = board.read()
    queue.put((version, {k: v.float().sum().item() for k, v in tensors.items()}))
    board.close()


def test_write_then_read_in_another_process() -> None:
    name = f"qg-test-{uuid.uuid4().hex[:12]}"
    board = SharedWeights(name, layout_of(named(0)), create=True)
    try:
        assert board.version == -1
        board.write(named(1), version=3)
        context = mp.get_context("spawn")
        queue = context.Queue()
        child = context.Process(target=_read_in_child, args=(name, queue))
        child.start()
        version, sums = queue.get(timeout=60)
        child.join(60)
        assert child.exitcode == 0 and version == 3
        for key, tensor in named(1):
            assert sums[key] == pytest.approx(tensor.float().sum().item(), rel=1e-6)
        # The reader's exit did not unlink the segment: the owner can still use it.
        board.write(named(2), version=4)
        version, tensors = board.read()
        assert version == 4 and torch.equal(tensors["embed.weight"], named(2)[0][1])
        assert tensors["norm.weight"].dtype == torch.bfloat16
    finally:
        board.close()


def test_an_incomplete_write_and_a_wrong_architecture_are_refused() -> None:
    name = f"qg-test-{uuid.uuid4().hex[:12]}"
    board = SharedWeights(name, layout_of(named(0)), create=True)
    try:
        board.write(named(1), version=1)
        with pytest.raises(ValueError, match="missing tensors"):
            board.write(named(2)[:2], version=2)
        version, tensors = board.read(timeout_s=1.0)  # the refused write changed nothing
        assert version == 1 and torch.equal(tensors["head.bias"], named(1)[2][1])
        bigger = [("embed.weight", torch.zeros(70, 50))]
        with pytest.raises(ValueError, match="same architecture"):
            SharedWeights(name, layout_of(bigger))
    finally:
        board.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sharded_boards_write_one_safetensors_file_shard_by_shard(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    full = named(3)
    base = f"qg-test-{uuid.uuid4().hex[:12]}"
    written = []
    for r in range(2):  # the core's two ranks each write their dim-0 chunk
        board = SharedWeights(board_name(base, r), shard_layout(full, 2, r), create=True)
        board.write([(n, t.narrow(0, *shard_rows(t.shape[0], 2, r))) for n, t in full], version=4)
        written.append(board)
    # Opened as the core's own (attaching in the creating process would unregister it).
    boards = BoardShards("shared_memory", base, full, 2, opened=dict(enumerate(written)))
    try:
        path = tmp_path / "model.safetensors"
        boards.write_safetensors(4, path, dtype)
        loaded = safetensors.torch.load_file(str(path))
        assert list(loaded) == [n for n, _ in full]
        for name, tensor in full:
            assert loaded[name].dtype == dtype
            torch.testing.assert_close(loaded[name], tensor.to(dtype), rtol=0, atol=0)
        with pytest.raises(StaleWeights, match="not 5"):
            boards.write_safetensors(5, path, dtype)
    finally:
        boards.close()
        for board in written:
            board.close()
