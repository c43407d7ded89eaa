"""A transformers mixture-of-experts model's routers: record the experts they choose,
or make them choose recorded ones (rollout routing replay; docs/design.md §3, MoE).

Both work by forward hooks on the routers, so the model's own code runs unchanged
(its experts implementation included) and nothing is patched:
:class:`RoutingRecorder` copies each router's chosen indices into a tensor the caller
provides (a copy a CUDA graph captures, so a graphed decode step records too);
:class:`RoutingReplay` replaces each router's output with the recorded experts, their
weights taken from the router's own probabilities, so the router keeps its gradient.

Supported routers: the softmax-top-k ones whose ``forward`` returns ``(router_logits,
router_scores, router_indices)`` (:data:`ROUTERS`: Qwen3-MoE, Qwen2-MoE, OLMoE,
Mixtral). Their scores are ``softmax(logits)`` at the top-k indices, renormalised to sum
to 1 where the router says so (``norm_topk_prob``; Mixtral always).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

__all__ = ["ROUTERS", "RoutingRecorder", "RoutingReplay", "routers"]

ROUTERS = frozenset(
    {"Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "OlmoeTopKRouter", "MixtralTopKRouter"}
)
"""Router classes (transformers 5.x) whose choice can be recorded and replayed."""


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers in layer order (none for a dense model); ValueError
    naming a router of another form."""
    found = [m for m in model.modules() if type(m).__name__.endswith("Router")]
    other = sorted({type(m).__name__ for m in found} - ROUTERS)
    if other:
        raise ValueError(
            f"routed experts are recorded and replayed for routers {sorted(ROUTERS)};"
            f" this model's are {other}"
        )
    return found


class _Hooked:
    """Hooks ``hook(layer, output)`` on every router of ``model``, in layer order."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = routers(model)
        if not self.routers:
            raise ValueError("the model has no mixture-of-experts router")
        self.layers = len(self.routers)
        self.k: int = self.routers[0].top_k  # type: ignore[assignment]
        self._handles: list[RemovableHandle] = [
            router.register_forward_hook(self._hook_of(layer))
            for layer, router in enumerate(self.routers)
        ]

    def _hook_of(self, layer: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            return self.hook(module, layer, output)

        return hook

    def hook(self, router: nn.Module, layer: int, output: Any) -> Any:
        raise NotImplementedError

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class RoutingRecorder(_Hooked):
    """Records the experts every router chooses into :attr:`out` ``[tokens, layers, k]``
    (the caller's tensor; its first rows: the forward's tokens, flattened as the model
    flattens them); nothing while :attr:`out` is None."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.out: Tensor | None = None

    def hook(self, router: nn.Module, layer: int, output: Any) -> Any:
        if self.out is not None:
            indices = output[2]
            self.out[: indices.shape[0], layer].copy_(indices)
        return None


class RoutingReplay(_Hooked):
    """Makes every router choose the experts in :attr:`routing` ``[tokens, layers, k]``
    (long; the next forwards' tokens, flattened as the model flattens them): the
    indices as given, their weights ``softmax(logits)`` there, renormalised as the
    router would, so the router's weight still gets the gradient of the weights it
    gives. A token whose row at a layer holds a negative id keeps the router's own
    choice there. None (the default): the routers choose as they do.

    :meth:`counts` says, for the forward since :attr:`routing` was set, how many
    (token, layer) choices were replayed and how many of them the router would have
    made otherwise (its drift from the behaviour's routing); a recompute of the same
    forward (activation checkpointing) does not count twice."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self._routing: Tensor | None = None
        self._counts: dict[int, tuple[Tensor, Tensor]] = {}

    @property
    def routing(self) -> Tensor | None:
        return self._routing

    @routing.setter
    def routing(self, routing: Tensor | None) -> None:
        self._routing = routing
        self._counts = {}

    def counts(self) -> tuple[int, int]:
        """(choices replayed, those the router would have made otherwise)."""
        if not self._counts:
            return 0, 0
        totals = torch.stack([torch.stack(c) for c in self._counts.values()]).sum(0)
        return int(totals[0]), int(totals[1])

    def hook(self, router: nn.Module, layer: int, output: Any) -> Any:
        if self._routing is None:
            return None
        logits, scores, indices = output
        recorded = self._routing[:, layer].to(indices.device)
        if recorded.shape != indices.shape:
            raise ValueError(
                f"replayed routing of shape {tuple(recorded.shape)} for a router that chose"
                f" {tuple(indices.shape)} experts"
            )
        known = (recorded >= 0).all(-1, keepdim=True)
        other = (recorded.sort(-1).values != indices.sort(-1).values).any(-1, keepdim=True)
        self._counts[layer] = (known.sum(), (known & other).sum())
        chosen = torch.where(known, recorded, indices)
        weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, chosen)
        if getattr(router, "norm_topk_prob", True):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(scores.dtype), chosen
