"""A policy model sharded over its cell's ranks with FSDP2.

:func:`shard_policy` is the whole parallelisation, block by block as in torchtitan:
``fully_shard`` on every decoder layer, then on the root, a :class:`PolicyScorer` that
owns what is left (embeddings, final norm, ``lm_head``, tied or not) and computes the
current log-probs ``l_t`` of a packed row. Each rank then keeps ~1/G of every
parameter (dim-0 chunks, ``torch.chunk`` order), its gradient and, on the core, its
optimizer state; a layer's full parameters exist only while it runs.

Mixture-of-experts layers need nothing of their own. transformers (5.x) keeps a
Qwen3-MoE layer's experts as two fused 3-D parameters, ``mlp.experts.gate_up_proj``
``[E, 2I, H]`` (each expert's gate rows, then its up rows) and ``mlp.experts.down_proj``
``[E, H, I]``, next to the router ``mlp.gate.weight`` ``[E, H]``; their dim 0 is the
expert, so the dim-0 cut gives rank ``r`` experts ``shard_rows(E, G, r)`` whole (with
their router rows, gradients and moments). Where ``G`` does not divide ``E`` the cut is
uneven (4 experts on 3 ranks: 2, 2, 0): correct, only less balanced. A dim-1 cut would
balance it but is not made: dim 0 is the one layout the weights boards, the engines'
shard readers and the checkpoint export read for every parameter. Every rank computes
every expert its tokens chose, after the layer's all-gather (no expert parallelism;
docs/design.md §3, MoE). The fused tensors also mean every expert tensor gets a gradient
whenever the layer runs (zero rows for experts nobody chose), so the ranks' reductions
always match, whichever experts each rank's part reached.

Precision (``trainer.dtype``): parameters, gradients and optimizer state stay fp32
(master weights); ``bfloat16`` computes forward and backward in bf16 and reduces
gradients in fp32. Gradients are *summed* over the cell's ranks (each rank trains a
different part of a micro-step, and the objective is a sum).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from qwengyre.models.experts import RoutingReplay, routers
from qwengyre.training.logprobs import token_logprobs
from qwengyre.training.packed import packed_hidden_states

__all__ = [
    "PolicyScorer",
    "full_tensor",
    "local",
    "local_shards",
    "shard_policy",
    "shard_rows",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class PolicyScorer(nn.Module):
    """The root FSDP unit: ``l_t`` of a packed row's target tokens (fp32, in row order).

    With ``routing_replay`` and an MoE policy, a row's recorded routing (``routing``,
    by position; see :class:`~qwengyre.training.buffers.MicroStep`) fixes the experts of
    every position it covers (:class:`~qwengyre.models.experts.RoutingReplay`)."""

    def __init__(
        self,
        policy: PreTrainedModel,
        *,
        temperature: float,
        chunk_tokens: int,
        routing_replay: bool = False,
    ):
        super().__init__()
        self.policy = policy
        self.temperature = temperature
        self.chunk_tokens = chunk_tokens
        self.replay = RoutingReplay(policy) if routing_replay and routers(policy) else None

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        target_mask: Tensor,
        routing: Tensor | None = None,
    ) -> Tensor:
        hidden = packed_hidden_states(
            self.policy.model, input_ids, position_ids, self.replay, routing
        )
        # The token at position p is predicted from the hidden state at p - 1.
        mask = target_mask[:, 1:]
        head = self.policy.get_output_embeddings()
        assert head is not None  # checked by shard_policy
        return token_logprobs(
            hidden[:, :-1][mask],
            head.weight,
            input_ids[:, 1:][mask],
            temperature=self.temperature,
            chunk_tokens=self.chunk_tokens,
        )


def shard_policy(
    policy: PreTrainedModel,
    mesh: DeviceMesh,
    *,
    dtype: str = "float32",
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    activation_checkpointing: bool = False,
    cpu_offload: bool = False,
    routing_replay: bool = False,
) -> PolicyScorer:
    """Shard ``policy`` (fp32, on this rank's device) over ``mesh`` in place; returns
    the root module to call. ``cpu_offload`` keeps the shards, their gradients and the
    optimizer state in host memory (the optimizer then steps on the CPU);
    ``routing_replay`` replays an MoE's recorded routing (:class:`PolicyScorer`)."""
    if policy.get_output_embeddings() is None:
        raise ValueError("the model has no output embeddings (lm_head)")
    if dtype not in DTYPES:
        raise ValueError(f"trainer.dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if activation_checkpointing:
        policy.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    precision = MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=torch.float32)
    pinned = mesh.device_type == "cuda"  # pinned host memory needs an accelerator
    offload = CPUOffloadPolicy(pin_memory=pinned) if cpu_offload else OffloadPolicy()
    for layer in policy.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=precision, offload_policy=offload)
    scorer = PolicyScorer(
        policy,
        temperature=temperature,
        chunk_tokens=chunk_tokens,
        routing_replay=routing_replay,
    )
    fully_shard(scorer, mesh=mesh, mp_policy=precision, offload_policy=offload)
    for module in scorer.modules():
        if isinstance(module, FSDPModule):  # sum, not average, over the cell's ranks
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return scorer


def local(tensor: Tensor) -> Tensor:
    """This rank's shard of a DTensor (a view of its storage), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_shards(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``(name, this rank's shard)`` of every parameter, in ``named_parameters`` order."""
    for name, param in model.named_parameters():
        yield name, local(param)


def full_tensor(tensor: Tensor) -> Tensor:
    """The whole tensor of a (possibly) sharded one (collective over its mesh)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def shard_rows(rows: int, shards: int, shard: int) -> tuple[int, int]:
    """``(first row, row count)`` of ``shard``'s dim-0 chunk of a ``rows``-row tensor,
    as FSDP2 cuts it (``torch.chunk``: ceil-sized chunks, the last ones may be empty)."""
    size = -(-rows // shards)
    start = min(rows, shard * size)
    return start, min(rows, start + size) - start
