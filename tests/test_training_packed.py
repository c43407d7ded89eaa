"""A packed row's forward, one document at a time: the same hidden
states and gradients as transformers' packed forward with a block-diagonal mask."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from qwengyre.training.packed import document_spans, packed_hidden_states


def test_document_spans_follow_position_restarts() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    assert document_spans(positions) == [(0, 3), (3, 5), (5, 9)]
    assert document_spans(torch.tensor([[0]])) == [(0, 1)]
    with pytest.raises(ValueError, match="start a document at position 0"):
        document_spans(torch.tensor([[1, 2, 0]]))
    with pytest.raises(ValueError, match=r"\[1, L\]"):
        document_spans(torch.tensor([0, 1]))


def test_per_document_forward_matches_the_packed_forward(tiny_model_dir: Path) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    lengths = [7, 1, 12, 5]
    ids = torch.randint(0, model.config.vocab_size, (1, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    weights = torch.randn(1, sum(lengths), model.config.hidden_size)

    def run(forward: object) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        hidden = forward()  # type: ignore[operator]
        (hidden * weights).sum().backward()
        return hidden.detach(), [p.grad.clone() for p in model.parameters()]

    packed, packed_grads = run(
        lambda: (
            model.model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
        )
    )
    split, split_grads = run(lambda: packed_hidden_states(model.model, ids, positions))
    torch.testing.assert_close(split, packed, rtol=1e-5, atol=1e-5)
    for a, b in zip(split_grads, packed_grads, strict=True):  # fp32 rounding only
        assert torch.linalg.norm(a - b) <= 1e-5 * torch.linalg.norm(b)
    # And no document sees another: the second document alone gives the same states.
    alone = model.model(input_ids=ids[:, 7:8], position_ids=positions[:, 7:8]).last_hidden_state
    torch.testing.assert_close(split[:, 7:8], alone.detach(), rtol=1e-5, atol=1e-5)
