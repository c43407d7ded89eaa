"""The embedded engine: any HF causal LM, continuous batching over a KV cache, in PyTorch.

Requests join and leave the running batch between decode steps. A new request is
prefilled on its own, then its KV cache is merged into the batch's (rows are
left-padded to a common length and masked); finished or aborted rows are dropped and
the common padding trimmed. Compute runs in a worker thread so the event loop (the
proxy) stays responsive; only that thread touches the model.

Behaviour log-probs (what the trainer must reproduce): for a sampled token ``y`` with
logits ``z`` at its position, ``log softmax(z / T)[y]`` in fp32 — the *tempered* full
distribution, before top-k / top-p truncation (with the RL defaults top_k=-1, top_p=1
it is exactly the sampling distribution). With ``T = 0`` (greedy) it is
``log softmax(z)[y]``.

Weight updates are applied between decode steps without dropping requests; every
token records the version of the weights that produced it. Tokens sampled after a
mid-request update use the new weights over a KV cache the old weights partly computed
(as SGLang's in-place updates do); their recorded version says so.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import itertools
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from qwengyre.engines.base import (
    EngineAborted,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    WeightsInMemory,
    WeightsOnDisk,
    WeightSource,
)
from qwengyre.models.tiny import quiet_progress_bars
from qwengyre.types import SamplingParams


def behaviour_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float
) -> torch.Tensor:
    """``log softmax(logits / T)`` at ``tokens`` in fp32 (``T = 0``: untempered).

    ``logits``: [..., V]; ``tokens``: [...]. The trainer uses this same function.
    """
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@dataclass
class _Sequence:
    request: GenerateRequest
    future: asyncio.Future[GenerateResult]
    loop: asyncio.AbstractEventLoop
    length: int = 0  # tokens in the KV cache for this row
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    next_token: int = -1
    aborted: bool = False

    def settle(self, result: GenerateResult | BaseException) -> None:
        def deliver() -> None:
            if self.future.done():
                return
            if isinstance(result, BaseException):
                self.future.set_exception(result)
            else:
                self.future.set_result(result)

        self.loop.call_soon_threadsafe(deliver)


@dataclass
class _WeightUpdate:
    source: WeightSource
    version: int
    done: threading.Event = field(default_factory=threading.Event)
    error: Exception | None = None


class EmbeddedEngine:
    """Implements :class:`qwengyre.engines.base.InferenceEngine` in-process."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        name: str = "embedded",
        capacity: int = 32,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_context: int | None = None,
        seed: int = 0,
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.name = name
        self.capacity = capacity
        self.device = torch.device(device)
        self.model_dir = Path(model_dir)
        with quiet_progress_bars():
            self.model: Any = cast(
                Any, AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype)
            )
        self.model.to(self.device).eval()
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        self.max_context = max_context or int(config.max_position_embeddings)
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.version = 0
        # transformers renamed ``past_key_values`` to ``cache`` (5.x deprecation).
        forward = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in forward else "past_key_values"
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._pending: list[_Sequence] = []
        self._active: list[_Sequence] = []
        self._keys: list[torch.Tensor] = []  # per layer [B, H, L, D], rows left-padded
        self._values: list[torch.Tensor] = []
        self._update: _WeightUpdate | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._released = False
        self._ids = itertools.count()
        self._worker = threading.Thread(target=self._run, name=f"{name}-engine", daemon=True)
        self._stopping = False
        self._worker.start()

    # ------------------------------------------------------------ the interface

    @property
    def load(self) -> int:
        with self._lock:
            return len(self._pending) + len(self._active)

    @property
    def running(self) -> int:
        """Requests admitted to the batch (each has sampled at least one token)."""
        with self._lock:
            return len(self._active)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self._validate(request)
        loop = asyncio.get_running_loop()
        sequence = _Sequence(request, loop.create_future(), loop)
        with self._lock:
            if self._released:
                raise EngineAborted(f"{self.name} has released its memory")
            self._pending.append(sequence)
        self._wake.set()
        return await sequence.future

    async def abort(self, request_id: str) -> None:
        with self._lock:
            for sequence in self._pending + self._active:
                if sequence.request.request_id == request_id:
                    sequence.aborted = True
        self._wake.set()

    async def update_weights(self, source: WeightSource, version: int) -> None:
        """Applied by the worker between decode steps; returns once applied."""
        update = _WeightUpdate(source, version)
        with self._lock:
            self._update = update
        self._wake.set()
        await asyncio.to_thread(update.done.wait)
        if update.error is not None:
            raise update.error

    async def release_memory(self) -> None:
        """Free the KV cache and move the weights off the accelerator (to the CPU).

        In-flight requests must be drained first (the proxy reroutes them).
        """
        with self._lock:
            if self._pending or self._active:
                raise RuntimeError(f"{self.name}: abort or drain in-flight requests first")
            self._released = True
            self._keys, self._values = [], []
        await asyncio.to_thread(self._move_model, torch.device("cpu"))

    async def resume_memory(self) -> None:
        await asyncio.to_thread(self._move_model, self.device)
        with self._lock:
            self._released = False

    async def health(self) -> bool:
        return self._worker.is_alive() and not self._released

    def close(self) -> None:
        self._stopping = True
        self._wake.set()
        self._worker.join(10)

    # ------------------------------------------------------------ validation

    def _validate(self, request: GenerateRequest) -> None:
        ids = request.input_ids
        s: SamplingParams = request.sampling
        if not ids:
            raise ValueError("input_ids is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids out of vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if len(ids) >= self.max_context:
            raise ValueError(
                f"prompt of {len(ids)} tokens leaves no room in the context of {self.max_context}"
            )
        if s.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {s.max_tokens}")
        if s.temperature < 0 or not 0 < s.top_p <= 1 or s.top_k == 0 or s.top_k < -1:
            raise ValueError(
                f"sampling out of range: temperature {s.temperature} (>= 0), top_p {s.top_p}"
                f" (0, 1], top_k {s.top_k} (-1 or >= 1)"
            )

    # ------------------------------------------------------------ the worker

    def _run(self) -> None:
        with torch.inference_mode():
            while not self._stopping:
                self._wake.wait(0.05)
                self._wake.clear()
                try:
                    self._apply_update()
                    self._admit()
                    if self._active:
                        self._decode_step()
                except Exception as exc:  # a bug or OOM: fail the batch, keep serving
                    for sequence in self._active:
                        sequence.settle(exc)
                    self._active, self._keys, self._values = [], [], []
                if self._active or self._pending:
                    self._wake.set()

    def _apply_update(self) -> None:
        with self._lock:
            update, self._update = self._update, None
        if update is None:
            return
        try:
            if isinstance(update.source, WeightsOnDisk):
                tensors = _load_safetensors(Path(update.source.path))
            else:
                assert isinstance(update.source, WeightsInMemory)
                tensors = dict(update.source.tensors)
            state = self.model.state_dict()
            unknown = sorted(set(tensors) - set(state))
            if unknown:
                raise ValueError(f"unknown weight names: {unknown[:3]}")
            wrong = [k for k, t in tensors.items() if tuple(t.shape) != tuple(state[k].shape)]
            if wrong:
                raise ValueError(f"weights of the wrong shape: {wrong[:3]}")
            for key, tensor in tensors.items():  # checked first: never a partial update
                state[key].copy_(tensor.to(state[key].device, state[key].dtype))
            self.version = update.version
        except Exception as exc:  # the caller gets it; the weights are unchanged
            update.error = exc
        finally:
            update.done.set()

    def _admit(self) -> None:
        """Prefill the joining requests in one left-padded batch and merge their caches."""
        with self._lock:
            room = self.capacity - len(self._active)
            joining, self._pending = self._pending[:room], self._pending[room:]
            for sequence in [s for s in self._pending if s.aborted]:
                self._pending.remove(sequence)
                sequence.settle(EngineAborted(sequence.request.request_id))
        for sequence in [s for s in joining if s.aborted]:
            sequence.settle(EngineAborted(sequence.request.request_id))
        joining = [s for s in joining if not s.aborted]
        if not joining:
            return
        width = max(len(s.request.input_ids) for s in joining)
        ids = torch.zeros(len(joining), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, sequence in enumerate(joining):
            prompt = sequence.request.input_ids
            ids[row, width - len(prompt) :] = torch.tensor(list(prompt))
            mask[row, width - len(prompt) :] = 1
            sequence.length = len(prompt)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            use_cache=True,
        )
        self._merge(*_layers(out))
        first = len(self._active)
        self._active.extend(joining)
        tokens, logprobs = self._sample(out.logits[:, -1], [s.request.sampling for s in joining])
        done = []
        for row, sequence in enumerate(joining):
            result = self._take(sequence, tokens[row], logprobs[row])
            if result is not None:
                done.append((first + row, sequence, result))
        if done:
            self._remove([row for row, _, _ in done])
            for _, sequence, result in done:
                sequence.settle(result)

    def _merge(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        if not self._keys:
            self._keys, self._values = keys, values
            return
        width = max(self._keys[0].shape[2], keys[0].shape[2])
        self._keys = [
            torch.cat([_left_pad(a, width), _left_pad(b, width)])
            for a, b in zip(self._keys, keys, strict=True)
        ]
        self._values = [
            torch.cat([_left_pad(a, width), _left_pad(b, width)])
            for a, b in zip(self._values, values, strict=True)
        ]

    def _decode_step(self) -> None:
        from transformers import DynamicCache

        aborted = [i for i, s in enumerate(self._active) if s.aborted]
        if aborted:
            gone = [self._active[i] for i in aborted]
            self._remove(aborted)  # the slot is free before the caller hears of it
            for sequence in gone:
                sequence.settle(EngineAborted(sequence.request.request_id))
            if not self._active:
                return
        width = self._keys[0].shape[2]
        mask = torch.zeros(len(self._active), width + 1, dtype=torch.long, device=self.device)
        for row, sequence in enumerate(self._active):
            mask[row, width - sequence.length :] = 1
        last = torch.tensor([[s.next_token] for s in self._active], device=self.device)
        positions = torch.tensor([[s.length] for s in self._active], device=self.device)
        cache = DynamicCache(ddp_cache_data=list(zip(self._keys, self._values, strict=True)))
        out = self.model(
            input_ids=last,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self._cache_kw: cache},
        )
        self._keys, self._values = _layers(out)
        finished: list[tuple[int, GenerateResult]] = []
        tokens, logprobs = self._sample(
            out.logits[:, -1], [s.request.sampling for s in self._active]
        )
        for row, sequence in enumerate(self._active):
            sequence.length += 1
            result = self._take(sequence, tokens[row], logprobs[row])
            if result is not None:
                finished.append((row, result))
        if finished:
            done = [(self._active[row], result) for row, result in finished]
            self._remove([row for row, _ in finished])
            for sequence, result in done:
                sequence.settle(result)

    def _take(self, sequence: _Sequence, token: int, logprob: float) -> GenerateResult | None:
        """Record a sampled token; the result once the sequence is finished."""
        s = sequence.request.sampling
        sequence.output.append(token)
        sequence.logprobs.append(logprob)
        sequence.versions.append(self.version)
        sequence.next_token = token
        reason: FinishReason | None = None
        if (token in self.eos_ids and not s.ignore_eos) or token in s.stop_token_ids:
            reason = "stop"
        elif len(sequence.output) >= s.max_tokens or (
            len(sequence.request.input_ids) + len(sequence.output) >= self.max_context
        ):
            reason = "length"
        if reason is None:
            return None
        return GenerateResult(
            tuple(sequence.output), tuple(sequence.logprobs), tuple(sequence.versions), reason
        )

    def _sample(
        self, logits: torch.Tensor, params: list[SamplingParams]
    ) -> tuple[list[int], list[float]]:
        """One token per row of ``logits`` [B, V], with each row's own sampling params.

        Vectorised on the logits' device with one host sync per step. The returned
        log-probs are :func:`behaviour_logprobs` of the sampled tokens.
        """
        logits = logits.float()
        vocab = logits.shape[-1]
        temperature = torch.tensor([p.temperature for p in params], device=logits.device)
        greedy = temperature == 0
        scaled = logits / torch.where(greedy, 1.0, temperature).unsqueeze(1)
        behaviour = torch.log_softmax(scaled, dim=-1)
        masked = scaled
        if any(p.top_k > 0 for p in params):
            k = torch.tensor(
                [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params],
                device=logits.device,
            )
            top = torch.topk(scaled, int(k.max())).values
            kth = top.gather(1, (k - 1).unsqueeze(1))
            masked = masked.masked_fill(masked < kth, float("-inf"))
        if any(p.top_p < 1 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=logits.device)
            ordered, order = torch.softmax(masked, dim=-1).sort(dim=-1, descending=True)
            outside = ordered.cumsum(-1) - ordered >= top_p.unsqueeze(1)
            outside = torch.zeros_like(outside).scatter(1, order, outside)  # back to vocab order
            masked = masked.masked_fill(outside, float("-inf"))
        # Gumbel-max: argmax(z + Gumbel noise) is a draw from softmax(z), vectorised.
        uniform = torch.rand(masked.shape, generator=self._generator, device=masked.device)
        sampled = (masked - torch.log(-torch.log(uniform.clamp_(1e-20, 1.0)))).argmax(-1)
        tokens = torch.where(greedy, scaled.argmax(-1), sampled)
        logprobs = behaviour.gather(1, tokens.unsqueeze(1)).squeeze(1)
        return tokens.tolist(), logprobs.tolist()

    def _remove(self, rows: list[int]) -> None:
        keep = [i for i in range(len(self._active)) if i not in set(rows)]
        self._active = [self._active[i] for i in keep]
        if not keep:
            self._keys, self._values = [], []
            return
        index = torch.tensor(keep, device=self.device)
        trim = self._keys[0].shape[2] - max(s.length for s in self._active)
        self._keys = [k.index_select(0, index)[:, :, trim:] for k in self._keys]
        self._values = [v.index_select(0, index)[:, :, trim:] for v in self._values]

    def _move_model(self, device: torch.device) -> None:
        self.model.to(device)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _layers(out: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer key and value tensors of a forward's KV cache."""
    cache = getattr(out, "cache", None) or out.past_key_values
    return [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - t.shape[2]
    if missing == 0:
        return t
    pad = t.new_zeros(t.shape[0], t.shape[1], missing, t.shape[3])
    return torch.cat([pad, t], dim=2)


def _load_safetensors(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path}")
    tensors: dict[str, Any] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors
