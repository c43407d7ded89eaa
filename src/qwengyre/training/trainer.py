"""One rank of a cell's trainer: micro-steps in, one optimizer update per batch
(the paper: streaming training; docs/design.md §3 training).

A cell of ``G`` ranks holds one policy sharded with FSDP2
(:func:`qwengyre.training.sharding.shard_policy`): each rank keeps ~1/G of every
parameter, its gradient and, in the core (cell 0), its optimizer state. Every rank of
a cell in training gets every micro-step the cell claimed; each trains its own part
(:func:`~qwengyre.training.buffers.split_micro_step`: whole executions, balanced by
tokens) and FSDP2 sums the parts' gradients over the cell. :meth:`Trainer.train_micro_step`
adds the gradient of the micro-step's *summed* objective (``normaliser=1``) to the
sharded ``.grad``. Once the batch's stream is closed and drained, every rank of every
participating cell calls :meth:`Trainer.finish_batch` with the same prefix size ``k``:

1. the gradient shards are summed over cells ``0..k-1`` into the core, between ranks
   holding the same shard, in buckets (:class:`~qwengyre.training.distributed.CellComm`);
2. the core's ranks divide by the batch's normaliser (its number of executions ``N``,
   or its target tokens for ``token_sum``: see :mod:`qwengyre.training.objective`), clip
   the global norm and make the single optimizer update (version + 1) on their shards,
   at the learning rate :meth:`~qwengyre.config.TrainerConfig.lr_at` gives for it;
3. the core's ranks write the new shards to their weights boards
   (:class:`~qwengyre.training.backend.WeightsBoard`, one per shard index), where a
   satellite rank joining a later batch (:meth:`Trainer.pull_weights`), the rollout
   engines and a replacement of the core read them, then broadcast them to their
   satellite peers. (Board first: an update whose broadcast a satellite's death broke
   still happened, whoever holds the core's weights.)

Since the update is a sum over micro-steps, who trained which micro-step changes the
result only by float rounding: one cell of one rank and three cells of two give the
same update.

The current log-probs ``l_t`` are computed exactly as the engine computed ``b_t``:
``log softmax(z / T)[y]`` in fp32 (:func:`qwengyre.training.logprobs.token_logprobs`);
rows are packed documents, each attending only to itself
(:func:`qwengyre.training.packed.packed_hidden_states`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel

from qwengyre.config import TrainerConfig
from qwengyre.training.backend import MicroStepResult, StepResult, WeightsBoard
from qwengyre.training.buffers import BatchSummary, MicroStep, split_micro_step
from qwengyre.training.checkpoint import load_sharded, save_sharded_checkpoint
from qwengyre.training.distributed import CellComm
from qwengyre.training.objective import execution_gspo_loss
from qwengyre.training.offload import Offloaded
from qwengyre.training.sharding import full_tensor, local, local_shards, shard_policy

__all__ = ["Trainer"]


class Trainer:
    """Shard ``comm.shard`` of cell ``comm.cell``'s trainer; the core's ranks own the
    optimizer. ``model`` (fp32, on this rank's device) is sharded in place. The
    ``fsdp2`` :class:`~qwengyre.training.backend.TrainerBackend`."""

    def __init__(
        self,
        model: PreTrainedModel,
        config: TrainerConfig,
        comm: CellComm,
        *,
        version: int = 0,
        board: WeightsBoard | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.comm = comm
        self.version = version
        self.board = board
        self.scorer = shard_policy(
            model,
            comm.mesh,
            dtype=config.dtype,
            temperature=config.temperature,
            chunk_tokens=config.logprob_chunk_tokens,
            activation_checkpointing=config.activation_checkpointing,
            cpu_offload=config.cpu_offload,
            routing_replay=config.routing_replay,
        )
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(self.params, lr=config.lr) if self.is_core else None
        self._offloaded: Offloaded | None = None

    @property
    def is_core(self) -> bool:
        return self.comm.is_core

    @property
    def device(self) -> torch.device:
        return self.comm.device

    def local_shards(self) -> list[tuple[str, Tensor]]:
        """This rank's shard of every parameter (what its weights board holds)."""
        return list(local_shards(self.model))

    def shard_numels(self) -> dict[str, int]:
        """Elements this rank holds of the parameters, their gradients and the
        optimizer state (~1/G of the model's each)."""
        grads = [local(p.grad) for p in self.params if p.grad is not None]
        state = self._optimizer_state()
        return {
            "parameters": sum(local(p).numel() for p in self.params),
            "gradients": sum(g.numel() for g in grads),
            "optimizer": sum(t.numel() for t in state),
        }

    def _optimizer_state(self) -> list[Tensor]:
        """Local shards of Adam's moments (its step counts are host scalars)."""
        if self.optimizer is None:
            return []
        return [
            local(v)
            for state in self.optimizer.state.values()
            for v in state.values()
            if isinstance(v, Tensor) and v.dim() > 0
        ]

    # ------------------------------------------------------------- micro-steps

    def current_logprobs(self, ms: MicroStep) -> Tensor:
        """``l_t`` at ``ms``'s target tokens, in row order (fp32, differentiable).
        Collective over the cell: its ranks call it together."""
        device = self.device
        return self.scorer(
            ms.input_ids.to(device),
            ms.position_ids.to(device),
            ms.target_mask.to(device),
            None if ms.routing is None else ms.routing.to(device),
        )

    def train_micro_step(self, ms: MicroStep) -> MicroStepResult:
        """Forward and backward of this rank's part of ``ms``; the cell's parts'
        gradients are summed into the sharded ``.grad``. Every rank of the cell calls it
        with the same ``ms`` and gets the whole micro-step's result."""
        start = time.perf_counter()
        self.scorer.train()
        parts = split_micro_step(ms, self.comm.shards)
        part = parts[self.comm.shard]
        # A rank with no execution of its own still takes part in FSDP's collectives:
        # it runs the smallest part with its loss scaled to zero (an exactly zero gradient).
        mine = part or min((p for p in parts if p is not None), key=lambda p: p.num_tokens)
        logprobs = self.current_logprobs(mine)
        replay = self.scorer.replay
        routed, drifted = replay.counts() if replay is not None and part is not None else (0, 0)
        mask = mine.target_mask[:, 1:]
        out = execution_gspo_loss(
            logprobs,
            mine.behaviour_logprobs[:, 1:][mask].to(logprobs.device),
            mine.execution_index[:, 1:][mask].to(logprobs.device),
            mine.advantages.to(logprobs.device),
            token_weight_cap=self.config.token_weight_cap,
            clip_low=self.config.clip_low,
            clip_high=self.config.clip_high,
            variant=self.config.variant,
            trajectory_index=mine.trajectory_index[:, 1:][mask].to(logprobs.device),
            normaliser=1.0,
        )
        (out.loss if part is not None else out.loss * 0.0).backward()
        units = int(mine.advantages.numel()) if part is not None else 0
        stats = torch.tensor(
            [
                float(out.loss.detach()) if part is not None else 0.0,
                round(float(out.clipped_fraction) * units),
                units,
                int(logprobs.numel()) if part is not None else 0,
                float(out.mean_ratio) * units,
                float(out.kl_sum) if part is not None else 0.0,
                routed,
                drifted,
            ],
            dtype=torch.float64,
        )
        summed = self.comm.cell_sum(stats).tolist()
        loss, clipped, executions, targets, ratios, kl, routed, drifted = summed
        return MicroStepResult(
            step=ms.step,
            index=ms.index,
            cell=self.comm.cell,
            tokens=ms.num_tokens,
            targets=int(targets),
            loss=loss,
            clipped=int(clipped),
            executions=int(executions),
            seconds=time.perf_counter() - start,
            ratio_sum=ratios,
            kl_sum=kl,
            routed=int(routed),
            drifted=int(drifted),
        )

    # ------------------------------------------------------------------ update

    def _grads(self) -> list[Tensor]:
        """This rank's shard of every gradient (zeros where no micro-step reached it)."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [local(p.grad) for p in self.params if p.grad is not None]

    def finish_batch(self, summary: BatchSummary, cells: int) -> StepResult:
        """Reduce over the prefix of ``cells``, update on the core, share the result.

        Every rank of the ``cells`` participants calls this once per batch, also those
        that claimed no micro-step. Returns the same result on every participant.
        """
        start = time.perf_counter()
        token_sum = self.config.variant == "token_sum"
        normaliser = summary.num_target_tokens if token_sum else summary.num_executions
        grads = self._grads()
        self.comm.reduce_to_core(grads, cells)
        stats = torch.zeros(2, device=grads[0].device)  # grad norm, new version
        if self.optimizer is not None:
            with torch.no_grad():
                for g in grads:
                    g /= max(normaliser, 1)
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.config.grad_clip)
            for group in self.optimizer.param_groups:
                group["lr"] = self.config.lr_at(self.version)
            self.optimizer.step()
            self.version += 1
            stats = torch.tensor(
                [float(full_tensor(norm)), float(self.version)], device=stats.device
            )
        self._zero_grads()
        if self.is_core and self.board is not None:  # first: the update outlives a
            self.board.write(self.local_shards(), self.version)  # satellite's death
        shards = [local(p) for p in self.params]
        self.comm.broadcast_from_core([stats, *shards], cells)
        if not self.is_core:
            self.version = int(stats[1])
        return StepResult(
            step=summary.step,
            version=self.version,
            cells=cells,
            grad_norm=float(stats[0]),
            seconds=time.perf_counter() - start,
        )

    def _zero_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def discard_gradient(self) -> None:
        """Drop the gradient accumulated since the last update (the cell left the step)."""
        self._zero_grads()

    # ----------------------------------------------------------------- joining

    def publish_weights(self) -> None:
        """The core writes its current shards to the board (e.g. at start-up)."""
        if self.board is None:
            raise RuntimeError("this trainer has no shared weights board")
        self.board.write(self.local_shards(), self.version)

    def join_training(self) -> int:
        """Enter training: a satellite takes the core's current weights
        (:meth:`pull_weights`); the core has them. Returns the version."""
        return self.version if self.is_core else self.pull_weights()

    def pull_weights(self) -> int:
        """Take this rank's shard of the newest weights from the board (a satellite
        joining training, or the core's replacement); returns their version."""
        if self.board is None:
            raise RuntimeError("this trainer has no shared weights board")
        version, tensors = self.board.read()
        if version < 0:
            raise RuntimeError("the core has not written its weights yet")
        shards = dict(self.local_shards())
        with torch.no_grad():
            for name, tensor in tensors.items():
                shards[name].copy_(tensor)
        self.version = version
        self._zero_grads()
        return version

    # ------------------------------------------------------------- role switches

    def offload(self) -> int:
        """Free this rank's trainer state from device memory (the cell goes to rollout):
        the core keeps a host copy of its shards and optimizer state; a satellite's
        shards are dropped (it pulls the core's on joining). Returns the bytes freed."""
        if self._offloaded is not None:
            raise RuntimeError("the trainer state is already offloaded")
        self._zero_grads()
        tensors = [local(p) for p in self.params] + self._optimizer_state()
        self._offloaded = Offloaded(tensors, keep=self.is_core)
        return self._offloaded.nbytes

    @property
    def offloaded(self) -> bool:
        return self._offloaded is not None

    def restore(self) -> None:
        """Bring the state :meth:`offload` freed back into device memory."""
        if self._offloaded is None:
            raise RuntimeError("the trainer state is not offloaded")
        self._offloaded.restore()
        self._offloaded = None

    # ------------------------------------------------------------------ state

    def save_checkpoint(
        self, root: str, step: int, state: Mapping[str, Any], keep: int, model_dir: str
    ) -> str:
        """The core's ranks write weights and optimizer (DCP, sharded), shard 0 the
        caller's state and the architecture from ``model_dir``, atomically
        (:func:`~qwengyre.training.checkpoint.save_sharded_checkpoint`)."""
        if not self.is_core:
            raise RuntimeError("only the core holds the optimizer")
        return save_sharded_checkpoint(
            root, step=step, trainer=self, state=state, keep=keep, model_dir=model_dir
        )

    def load_checkpoint(self, path: str) -> None:
        """The core's ranks resume from ``path`` (any ``G`` reads any other)."""
        load_sharded(path, self)

    def parameters(self) -> dict[str, Tensor]:
        """A copy of the whole current parameters (collective over the cell)."""
        return {k: full_tensor(v.detach()).clone() for k, v in self.model.named_parameters()}
