"""One cell's trainer: micro-steps in, one optimizer update per batch (PAPER: streaming
training; DESIGN.md §3 training).

A cell in training claims micro-steps and, for each, runs forward and backward with
gradient accumulation: :meth:`Trainer.train_micro_step` adds the gradient of the
micro-step's *summed* objective (``normaliser=1``) to ``param.grad``. Once the batch's
stream is closed and drained, every participating cell calls
:meth:`Trainer.finish_batch` with the same prefix size ``k``:

1. the gradients are summed over cells ``0..k-1`` into the core (one reduce);
2. the core divides by the batch's normaliser (its number of executions ``N``, or its
   target tokens for ``token_sum``: see :mod:`qwengyre.training.objective`), clips the
   global norm and makes the single optimizer update (version + 1), at the learning
   rate :meth:`~qwengyre.config.TrainerConfig.lr_at` gives for that update;
3. the core broadcasts the new parameters to the satellites and writes them to its
   weights board (:class:`~qwengyre.cluster.weights.WeightsBoard`), where a satellite
   joining a later batch (:meth:`Trainer.pull_weights`) and the rollout engines read them.

Since the update is a sum over micro-steps, who trained which micro-step changes the
result only by float rounding: one cell and three cells give the same update.

The current log-probs ``l_t`` are computed exactly as the engine computed ``b_t``:
``log softmax(z / T)[y]`` in fp32 (:func:`qwengyre.training.logprobs.token_logprobs`,
chunked so memory does not grow with rows x vocabulary); ``T`` is the rollout
temperature. Rows are packed documents (``position_ids`` restart at every trajectory);
:func:`qwengyre.training.packed.packed_hidden_states` attends within each document
only, with memory linear in the row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedModel

from qwengyre.cluster.weights import WeightsBoard
from qwengyre.config import TrainerConfig
from qwengyre.training.buffers import BatchSummary, MicroStep
from qwengyre.training.distributed import PrefixGroups, flatten, unflatten_into
from qwengyre.training.logprobs import token_logprobs
from qwengyre.training.objective import execution_gspo_loss
from qwengyre.training.packed import packed_hidden_states

__all__ = ["MicroStepResult", "StepResult", "Trainer"]


@dataclass(frozen=True)
class MicroStepResult:
    """What one micro-step contributed (``loss`` is its summed, unnormalised objective)."""

    step: int
    index: int
    cell: int
    tokens: int
    targets: int
    loss: float
    clipped: int  # executions clipped in it
    executions: int
    seconds: float


@dataclass(frozen=True)
class StepResult:
    """The update of one batch, as the core saw it."""

    step: int
    version: int  # policy version after the update
    cells: int
    grad_norm: float  # before clipping, of the normalised gradient
    seconds: float


class Trainer:
    """The trainer shard of cell ``comm.rank``; cell 0 (the core) owns the optimizer."""

    def __init__(
        self,
        model: PreTrainedModel,
        config: TrainerConfig,
        comm: PrefixGroups,
        *,
        version: int = 0,
        board: WeightsBoard | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.comm = comm
        self.version = version
        self.board = board
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(self.params, lr=config.lr) if self.is_core else None
        self._lm_head = model.get_output_embeddings()
        if self._lm_head is None:
            raise ValueError("the model has no output embeddings (lm_head)")

    @property
    def is_core(self) -> bool:
        return self.comm.rank == 0

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    # ------------------------------------------------------------- micro-steps

    def current_logprobs(self, ms: MicroStep) -> Tensor:
        """``l_t`` at the micro-step's target tokens, in row order (fp32, differentiable)."""
        ids = ms.input_ids.to(self.device)
        hidden = packed_hidden_states(self.model.model, ids, ms.position_ids.to(self.device))
        # The token at position p is predicted from the hidden state at p - 1.
        mask = ms.target_mask[:, 1:].to(self.device)
        return token_logprobs(
            hidden[:, :-1][mask],
            self._lm_head.weight,
            ids[:, 1:][mask],
            temperature=self.config.temperature,
            chunk_tokens=self.config.logprob_chunk_tokens,
        )

    def train_micro_step(self, ms: MicroStep) -> MicroStepResult:
        """Forward and backward of one micro-step; its gradient is added to ``.grad``."""
        start = time.perf_counter()
        self.model.train()
        logprobs = self.current_logprobs(ms)
        mask = ms.target_mask[:, 1:]
        out = execution_gspo_loss(
            logprobs,
            ms.behaviour_logprobs[:, 1:][mask],
            ms.execution_index[:, 1:][mask],
            ms.advantages,
            token_weight_cap=self.config.token_weight_cap,
            clip_low=self.config.clip_low,
            clip_high=self.config.clip_high,
            variant=self.config.variant,
            trajectory_index=ms.trajectory_index[:, 1:][mask],
            normaliser=1.0,
        )
        out.loss.backward()
        units = int(ms.advantages.numel())
        return MicroStepResult(
            step=ms.step,
            index=ms.index,
            cell=self.comm.rank,
            tokens=ms.num_tokens,
            targets=int(logprobs.numel()),
            loss=float(out.loss.detach()),
            clipped=round(float(out.clipped_fraction) * units),
            executions=units,
            seconds=time.perf_counter() - start,
        )

    # ------------------------------------------------------------------ update

    def _grads(self) -> list[Tensor]:
        """Every parameter's gradient (zeros where no micro-step reached it)."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [p.grad for p in self.params if p.grad is not None]

    def finish_batch(self, summary: BatchSummary, cells: int) -> StepResult:
        """Reduce over the prefix of ``cells``, update on the core, share the result.

        Every one of the ``cells`` participants calls this once per batch, also those
        that claimed no micro-step. Returns the same result on every participant.
        """
        start = time.perf_counter()
        token_sum = self.config.variant == "token_sum"
        normaliser = summary.num_target_tokens if token_sum else summary.num_executions
        flat = flatten(self._grads())
        self.comm.reduce_to_core(flat, cells)
        stats = torch.zeros(2)  # grad norm, new version: broadcast with the parameters
        if self.optimizer is not None:
            flat /= max(normaliser, 1)
            unflatten_into(flat, self._grads())
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.config.grad_clip)
            for group in self.optimizer.param_groups:
                group["lr"] = self.config.lr_at(self.version)
            self.optimizer.step()
            self.version += 1
            stats = torch.tensor([float(norm), float(self.version)])
        self._zero_grads()
        params = torch.cat([flatten(self.params), stats])
        self.comm.broadcast_from_core(params, cells)
        if not self.is_core:
            unflatten_into(params[:-2], self.params)
            self.version = int(params[-1])
        elif self.board is not None:
            self.board.write(self.model.named_parameters(), self.version)
        return StepResult(
            step=summary.step,
            version=self.version,
            cells=cells,
            grad_norm=float(params[-2]),
            seconds=time.perf_counter() - start,
        )

    def _zero_grads(self) -> None:
        for p in self.params:
            p.grad = None

    # ----------------------------------------------------------------- joining

    def publish_weights(self) -> None:
        """The core writes its current parameters to the board (e.g. at start-up)."""
        if self.board is None:
            raise RuntimeError("this trainer has no shared weights board")
        self.board.write(self.model.named_parameters(), self.version)

    def pull_weights(self) -> int:
        """A satellite joining training takes the core's current weights; returns the version."""
        if self.board is None:
            raise RuntimeError("this trainer has no shared weights board")
        version, tensors = self.board.read()
        if version < 0:
            raise RuntimeError("the core has not written its weights yet")
        named = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in tensors.items():
                named[name].copy_(tensor)
        self.version = version
        self._zero_grads()
        return version
