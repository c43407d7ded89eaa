"""The core's weights boards, as the tests of rollout hosts publish through them."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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
