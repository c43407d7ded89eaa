"""The core's weights boards, as the tests of rollout hosts publish through them."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from qwengyre.cluster.weights import (
    BoardShards,
    SharedWeights,
    board_name,
    model_parameters,
    shard_layout,
)


@contextmanager
def core_boards(model_dir: Path) -> Iterator[tuple[SharedWeights, BoardShards]]:
    """A one-shard board for ``model_dir``'s architecture, as the core creates it (write
    to it to publish), and the boards a host loads from."""
    named = model_parameters(model_dir)
    base = f"qg-test-{uuid.uuid4().hex[:12]}"
    board = SharedWeights(board_name(base, 0), shard_layout(named, 1, 0), create=True)
    boards = BoardShards("shared_memory", base, named, 1, opened={0: board})
    try:
        yield board, boards
    finally:
        boards.close()
        board.close()


def perturbed(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """The model's weights, moved a little (what the core publishes after a step)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    return {
        name: p.detach() + 0.05 * torch.randn(p.shape, generator=generator)
        for name, p in model.named_parameters()
    }
