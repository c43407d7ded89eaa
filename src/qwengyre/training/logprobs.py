"""Current log-probs of target tokens, computed in token chunks.

The trainer must compute ``l_t`` exactly as the engine computed the behaviour
log-prob ``b_t`` (:func:`qwengyre.engines.embedded.behaviour_logprobs`):
``log softmax(z / T)[y]`` in fp32, with ``T <= 0`` meaning untempered. Materialising
``z = hidden @ W^T`` for a whole packed sequence costs ``O(T x V)`` memory; here the
logits exist only one chunk of ``chunk_tokens`` rows at a time.

Memory strategy: a custom :class:`torch.autograd.Function`. The forward keeps only
the inputs plus one fp32 log-sum-exp per token (``O(T)``); the backward recomputes
each chunk's logits, forms ``softmax - onehot`` for that chunk, accumulates the
gradients of ``hidden`` and ``W`` and drops the chunk. Peak extra memory is
``O(chunk_tokens x V)`` in both passes. (Double backward is not supported.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["token_logprobs"]


def _scale(temperature: float) -> float:
    return temperature if temperature > 0 else 1.0


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        scale: float,
        chunk: int,
    ) -> Tensor:
        n = hidden.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        w32 = weight.float()
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            z = (hidden[start:stop].float() @ w32.T) / scale
            chunk_lse = torch.logsumexp(z, dim=-1)
            lse[start:stop] = chunk_lse
            picked = z.gather(-1, targets[start:stop].unsqueeze(-1)).squeeze(-1)
            out[start:stop] = picked - chunk_lse
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.scale = scale
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(
        ctx: Any, grad_out: Tensor
    ) -> tuple[Tensor | None, Tensor | None, None, None, None]:
        hidden, weight, targets, lse = ctx.saved_tensors
        scale: float = ctx.scale
        chunk: int = ctx.chunk
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w32 = weight.float()
        grad_h = torch.zeros_like(hidden, dtype=torch.float32) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        n = hidden.shape[0]
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            h = hidden[start:stop].float()
            z = (h @ w32.T) / scale
            # d l_t / d z = (onehot(y_t) - softmax(z_t)) / scale
            g = -torch.exp(z - lse[start:stop].unsqueeze(-1))
            g.scatter_add_(
                -1,
                targets[start:stop].unsqueeze(-1),
                torch.ones(stop - start, 1, dtype=g.dtype, device=g.device),
            )
            g.mul_((grad_out[start:stop].float() / scale).unsqueeze(-1))
            if grad_h is not None:
                grad_h[start:stop] = g @ w32
            if grad_w is not None:
                grad_w.add_(g.T @ h)
        return (
            grad_h.to(hidden.dtype) if grad_h is not None else None,
            grad_w.to(weight.dtype) if grad_w is not None else None,
            None,
            None,
            None,
        )


def token_logprobs(
    hidden: Tensor,
    lm_head_weight: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
) -> Tensor:
    """``log softmax((hidden @ W^T) / T)[targets]`` in fp32, ``chunk_tokens`` rows at a time.

    ``hidden``: [T, H]; ``lm_head_weight``: [V, H]; ``targets``: [T] (int64).
    Returns fp32 [T]; differentiable w.r.t. ``hidden`` and ``lm_head_weight``.
    ``temperature <= 0`` means untempered, as in the engine.
    """
    if hidden.dim() != 2 or lm_head_weight.dim() != 2 or targets.dim() != 1:
        raise ValueError("expected hidden [T, H], lm_head_weight [V, H], targets [T]")
    if hidden.shape[0] != targets.shape[0] or hidden.shape[1] != lm_head_weight.shape[1]:
        raise ValueError("shape mismatch between hidden, lm_head_weight and targets")
    if chunk_tokens < 1:
        raise ValueError("chunk_tokens must be >= 1")
    out: Tensor = _ChunkedTokenLogprobs.apply(
        hidden, lm_head_weight, targets.long(), _scale(temperature), chunk_tokens
    )
    return out
