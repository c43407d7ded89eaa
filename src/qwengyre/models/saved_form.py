"""The form a model's checkpoint stores its tensors in, where transformers holds them
otherwise in memory.

transformers (5.x) converts some checkpoints on load: a Qwen3-MoE layer's experts, stored
one by one (``mlp.experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``), become two
fused 3-D parameters (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj``
``[E, H, I]``), and ``save_pretrained`` reverses it. Trainers, checkpoints and weights
boards hold the in-memory names; what is written for ``from_pretrained``, vLLM or SGLang
to load (an export, a server engine's weights directory) goes through
:func:`saved_form`, which applies transformers' own reversal.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.core_model_loading import revert_weight_conversion

__all__ = ["ToSaved", "saved_form"]

ToSaved = Callable[[Mapping[str, Tensor]], dict[str, Tensor]]
"""In-memory tensors (whole) to the checkpoint's names and tensors."""


def saved_form(model: str | Path | PretrainedConfig) -> ToSaved | None:
    """The conversion of ``model``'s in-memory tensors to its checkpoint form, or None
    where the two are the same (every dense model here).

    The conversion takes whole tensors and works tensor by tensor: each in-memory tensor
    becomes one or more saved ones (an expert stack splits into its experts), never
    several into one, so any subset of the names converts alone; it also takes meta
    tensors, giving the saved names and shapes without data.
    """
    config = model if isinstance(model, PretrainedConfig) else AutoConfig.from_pretrained(model)
    with torch.device("meta"):  # the architecture only, no weights
        skeleton = AutoModelForCausalLM.from_config(config)

    def to_saved(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return dict(revert_weight_conversion(skeleton, dict(tensors)))

    state = dict(skeleton.state_dict())
    saved = to_saved(state)
    same = saved.keys() == state.keys() and all(saved[k].shape == state[k].shape for k in state)
    return None if same else to_saved
