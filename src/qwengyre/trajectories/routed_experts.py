"""The experts a mixture-of-experts model routed each position to: what rollout
routing replay (R3) records at the engine and replays in the trainer (docs/design.md
§3, MoE).

Form: an integer array ``[rows, layers, k]`` (numpy): for each row, each MoE layer in
model order, the ``k`` experts its router chose, in the router's order. ``int8`` while
every expert id is below 128 (Qwen3-MoE's 128 experts fit), else ``int16``;
:data:`UNKNOWN` (-1) where a row was not reported. A position's routing fixes every
expert its hidden states went through, so ``layers x k`` bytes a token (int8) hold all
of it: 2 x 2 for the tiny MoE, 48 x 8 = 384 for Qwen3-30B-A3B.

Two alignments, each used in one place:

- **by position** (what an engine reports for a request, :attr:`GenerateResult.routing`):
  row ``p`` is the routing of the request's position ``p`` (its input ids, then its
  output ids), for every position the request ran through the model: its prompt and
  every output token but the last, ``len(input) + len(output) - 1`` rows;
- **before each token** (a recorded node, an admitted trajectory): row ``i`` is the
  routing of the position *before* token ``i``, the forward whose output predicted
  token ``i`` (as its behaviour log-prob). Rows of consecutive nodes then simply join
  along a trajectory; a trajectory's first row is :data:`UNKNOWN` (nothing predicts
  the first token), and so is a node's where its call was served without routing.

The trainer turns a row of trajectories back into positions (:func:`by_position`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = [
    "UNKNOWN",
    "before_each_token",
    "by_position",
    "compact",
    "decode",
    "encode",
    "join",
    "unknown",
]

UNKNOWN = -1
"""An expert id meaning: not reported (the model's own router decides there)."""

_DTYPES = {"int8": np.int8, "int16": np.int16}


def compact(ids: object) -> np.ndarray:
    """``ids`` (any integer array ``[rows, layers, k]``) as int8 if every id fits, else
    int16; ValueError for another shape or an id outside ``[-1, 32767]``."""
    array = np.asarray(ids)
    if array.ndim != 3:
        raise ValueError(f"routed experts must be [rows, layers, k], got shape {array.shape}")
    if array.size and (array.min() < UNKNOWN or array.max() > np.iinfo(np.int16).max):
        raise ValueError(f"expert ids must be in [-1, 32767], got {array.min()}..{array.max()}")
    fits = not array.size or array.max() <= np.iinfo(np.int8).max
    return array.astype(np.int8 if fits else np.int16, copy=False)


def unknown(rows: int, layers: int, k: int) -> np.ndarray:
    """``rows`` rows of :data:`UNKNOWN`."""
    return np.full((rows, layers, k), UNKNOWN, dtype=np.int8)


def before_each_token(positions: np.ndarray, start: int, count: int) -> np.ndarray:
    """The rows before each of the ``count`` tokens from position ``start`` of a
    request, from the routing it reported by position (the first row
    :data:`UNKNOWN` when ``start`` is 0); a copy, which keeps none of ``positions``
    alive (a call's routing covers its whole context, a node keeps its own tokens')."""
    if start < 0 or start + count > len(positions) + 1:
        raise ValueError(
            f"tokens {start}..{start + count} need {start + count - 1} routed positions,"
            f" the engine reported {len(positions)}"
        )
    rows = positions[max(start - 1, 0) : start + count - 1]
    if start == 0 and count:
        return np.concatenate([unknown(1, *positions.shape[1:]).astype(positions.dtype), rows])
    return rows.copy()


def join(parts: Sequence[np.ndarray | None], lengths: Sequence[int]) -> np.ndarray | None:
    """Consecutive parts of ``lengths`` rows joined; a missing part is :data:`UNKNOWN`
    rows. None if every part is missing; ValueError if the parts disagree in shape."""
    known = [p for p in parts if p is not None]
    if not known:
        return None
    shapes = {p.shape[1:] for p in known}
    if len(shapes) > 1:
        raise ValueError(f"routed experts of different shapes: {sorted(shapes)}")
    layers, k = known[0].shape[1:]
    filled = [
        unknown(n, layers, k) if p is None else p for p, n in zip(parts, lengths, strict=True)
    ]
    return compact(np.concatenate(filled))


def by_position(before: np.ndarray) -> np.ndarray:
    """A packed row's routing by position from its rows before each token: position
    ``p`` is the row before token ``p + 1``; the row's last position has none. Each
    trajectory starts with an :data:`UNKNOWN` row, so every trajectory's last position
    gets :data:`UNKNOWN` too (it predicts nothing the trainer scores)."""
    return np.concatenate([before[1:], unknown(1, *before.shape[1:]).astype(before.dtype)])


def encode(routing: np.ndarray) -> tuple[bytes, str]:
    """The bytes and the form (``"int8:LAYERS:K"``) that :func:`decode` reads back."""
    return routing.tobytes(), f"{routing.dtype.name}:{routing.shape[1]}:{routing.shape[2]}"


def decode(data: bytes, form: str) -> np.ndarray:
    """The array :func:`encode` wrote; ValueError naming what does not fit."""
    name, layers, k = form.split(":")
    if name not in _DTYPES:
        raise ValueError(f"routed experts of type {name!r}; allowed: {sorted(_DTYPES)}")
    dtype = np.dtype(_DTYPES[name])
    width = int(layers) * int(k) * dtype.itemsize
    if width <= 0 or len(data) % width:
        raise ValueError(f"{len(data)} bytes of routed experts are not whole {form} rows")
    return np.frombuffer(data, dtype=dtype).reshape(-1, int(layers), int(k)).copy()
