"""The forward pass of a packed row with attention memory linear in its length.

A micro-step packs whole executions into one row: documents (trajectories) one after
another, ``position_ids`` restarting at 0 at each. Given such ``position_ids``,
transformers' SDPA path builds a dense block-diagonal ``L x L`` mask and attends with
it: memory grows with the square of the row (measured on the demo model, forward and
backward: 124 MB at 2k tokens, 851 MB at 8k; a 5 x 128k-token execution would need
~400 GB for the mask alone). :func:`packed_hidden_states` instead stacks the documents
into one right-padded batch ``[D, max length]`` and runs it with no mask: causal
attention never lets a real token see the padding after it, so SDPA serves it with its
memory-efficient causal kernels, linear in the batch, and the padding's outputs are
dropped (``benchmarks/bench_packed_attention.py``). It is a single forward call, which
FSDP2 needs: every rank of a cell must run the same collectives in the same order,
whatever its number of documents. A model loaded with flash-attention
(``attn_implementation="flash_attention_2"``, on CUDA) keeps the packed row: transformers
turns restarting ``position_ids`` into varlen sequence boundaries there, which is
linear already and has no padding. The result is the same either way: attention never
crosses a document.

An MoE's recorded routing (``routing``, by position) is laid out as the tokens are, for
the model's :class:`~qwengyre.models.experts.RoutingReplay`; the padding keeps its own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from qwengyre.models.experts import RoutingReplay

__all__ = ["document_spans", "packed_hidden_states"]

VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3")
"""Attention implementations that read document boundaries from ``position_ids``."""


def document_spans(position_ids: Tensor) -> list[tuple[int, int]]:
    """``[start, stop)`` of each document of a packed row ``[1, L]`` (a new document
    starts wherever the position is 0)."""
    if position_ids.dim() != 2 or position_ids.shape[0] != 1:
        raise ValueError(f"expected position_ids [1, L], got {tuple(position_ids.shape)}")
    starts = torch.nonzero(position_ids[0] == 0).flatten().tolist()
    length = int(position_ids.shape[1])
    if not starts or starts[0] != 0:
        raise ValueError("a packed row must start a document at position 0")
    return list(zip(starts, [*starts[1:], length], strict=True))


def packed_hidden_states(
    model: Any,
    input_ids: Tensor,
    position_ids: Tensor,
    replay: RoutingReplay | None = None,
    routing: Tensor | None = None,
) -> Tensor:
    """The decoder's last hidden states ``[1, L, H]`` of a packed row, each document
    attending only to itself; ``model`` is the causal LM's base model (``model.model``
    of an HF ``*ForCausalLM``). See the module docstring for the memory it takes.

    ``replay``: the model's routing replay, given the row's recorded ``routing`` ``[1,
    L, layers, k]`` (None: its routers choose) for this forward and any recompute of it
    (activation checkpointing) until the next call."""
    if getattr(model.config, "_attn_implementation", None) in VARLEN_ATTENTION:
        if replay is not None:
            replay.routing = None if routing is None else routing[0].long().to(input_ids.device)
        out: Tensor = model(
            input_ids=input_ids, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        return out
    spans = document_spans(position_ids)
    batch = _documents(input_ids, spans, 0)
    if replay is not None:
        replay.routing = (
            None if routing is None else _documents(routing, spans, -1).flatten(0, 1).long()
        )
    longest = batch.shape[1]
    positions = torch.arange(longest, device=input_ids.device).expand(len(spans), -1)
    hidden: Tensor = model(
        input_ids=batch, position_ids=positions, use_cache=False
    ).last_hidden_state
    return torch.cat(
        [hidden[d, : stop - start] for d, (start, stop) in enumerate(spans)]
    ).unsqueeze(0)


def _documents(row: Tensor, spans: list[tuple[int, int]], fill: int) -> Tensor:
    """A packed row ``[1, L, ...]`` as its documents, right-padded with ``fill`` to the
    longest: ``[D, longest, ...]``, on the device of ``row``."""
    longest = max(stop - start for start, stop in spans)
    batch = row.new_full((len(spans), longest, *row.shape[2:]), fill)
    for d, (start, stop) in enumerate(spans):
        batch[d, : stop - start] = row[0, start:stop]
    return batch
