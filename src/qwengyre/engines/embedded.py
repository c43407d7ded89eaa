"""The embedded engine: any HF causal LM, continuous batching over a KV cache, in PyTorch.

Requests join and leave the running batch between decode steps. Joining requests are
prefilled together straight into free rows of the slot KV cache
(:mod:`qwengyre.engines.kv_slots`: written in place, sized to what is running); a
finished or aborted row is freed by moving the last running row into it. On CUDA each
decode step replays a captured graph (:mod:`qwengyre.engines.decode_graphs`;
``cuda_graphs=False``, or a failed capture, runs it eagerly). Compute runs in a worker
thread so the event loop (the proxy) stays responsive; only that thread touches the
model. Every decode step hands each sequence's new token to its consumer's event loop
(:meth:`EmbeddedEngine.stream`); a consumer that leaves early aborts its sequence.

Behaviour log-probs (what the trainer must reproduce): for a sampled token ``y`` with
logits ``z`` at its position, ``log softmax(z' / T)[y]`` in fp32, where ``z'`` is ``z``
with the logits that top-k / top-p truncate set to ``-inf``: the log-prob under the
distribution actually sampled from. With the RL defaults top_k=-1, top_p=1 nothing is
truncated and it is :func:`behaviour_logprobs` (the trainer's function). With ``T = 0``
(greedy) ``T`` is taken as 1.

Stop strings (:mod:`qwengyre.engines.stops`) are looked for in the decoded output after
every token; the model's tokenizer is loaded from ``model_dir`` the first time a request
has any.

Weight updates are applied between decode steps without dropping requests; every
token records the version of the weights that produced it. Tokens sampled after a
mid-request update use the new weights over a KV cache the old weights partly computed
(as SGLang's in-place updates do); their recorded version says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import inspect
import logging
import threading
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor

from qwengyre.engines.base import (
    EngineAborted,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    TokenDelta,
    WeightsInMemory,
    WeightsInShards,
    WeightsOnDisk,
    WeightSource,
    collect,
)
from qwengyre.engines.decode_graphs import DecodeGraphs, GraphCaptureFailed
from qwengyre.engines.kv_slots import (
    SlotCache,
    SlotKV,
    decode_mask,
    power_of_two_at_least,
    prefill_mask,
    sliding,
)
from qwengyre.engines.stops import StopStrings
from qwengyre.models.experts import RoutingRecorder, routers
from qwengyre.models.tiny import quiet_progress_bars
from qwengyre.trajectories import routed_experts
from qwengyre.types import SamplingParams

log = logging.getLogger(__name__)


def behaviour_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float
) -> torch.Tensor:
    """``log softmax(logits / T)`` at ``tokens`` in fp32 (``T = 0``: untempered).

    ``logits``: [..., V]; ``tokens``: [...]. The trainer uses this same function.
    """
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


_Token = tuple[int, float, int, FinishReason | None, np.ndarray | None]
"""A sampled token as the worker hands it over: id, log-prob, version, finish reason,
and (an MoE's) the routed experts of the positions that predicted it (by position: the
whole prompt for the first token, then one)."""


@dataclass(kw_only=True)
class _Sequence:
    request: GenerateRequest
    queue: asyncio.Queue[_Token | BaseException]  # read by the consumer's event loop
    loop: asyncio.AbstractEventLoop
    stops: StopStrings | None = None
    length: int = 0  # tokens in the KV cache for this row
    generated: int = 0  # tokens sampled
    next_token: int = -1
    aborted: bool = False

    def push(self, item: _Token | BaseException) -> None:
        """Hand a token, or the exception that ends the sequence, to its consumer."""
        with contextlib.suppress(RuntimeError):  # its event loop is closed: nobody listens
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass
class _WeightUpdate:
    source: WeightSource
    version: int
    done: threading.Event = field(default_factory=threading.Event)
    error: Exception | None = None


class EmbeddedEngine:
    """Implements :class:`qwengyre.engines.base.InferenceEngine` in-process; an MoE's
    reports the experts of every position (``routed_experts``; see ``_record``)."""

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
        cuda_graphs: bool = True,
        routed_experts: bool = True,
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
        self._layers = int(config.num_hidden_layers)
        self._sliding_window = _sliding_window(config)
        self._last_logits_only = {"logits_to_keep": 1} if "logits_to_keep" in forward else {}
        self._kv: SlotKV | None = None  # allocated at the first admission, freed on release
        # Decode inputs, fixed tensors a captured graph reads: ids, lengths, write column.
        self._step_inputs = torch.zeros(2 * capacity + 1, dtype=torch.long, device=self.device)
        use_graphs = cuda_graphs and self.device.type == "cuda"
        self._graphs = DecodeGraphs(self._decode_forward) if use_graphs else None
        self._update: _WeightUpdate | None = None
        # An MoE's routers record the experts of every position (into a fixed tensor
        # in a decode step, which a captured graph writes too).
        moe = routed_experts and bool(routers(self.model))
        self._recorder = RoutingRecorder(self.model) if moe else None
        if self._recorder is not None:
            shape = (capacity, self._recorder.layers, self._recorder.k)
            self._decode_routing = torch.zeros(shape, dtype=torch.int16, device=self.device)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._released = False
        self._worker = threading.Thread(target=self._run, name=f"{name}-engine", daemon=True)
        self._stopping = False
        self._worker.start()

    # ------------------------------------------------------------ the interface

    @property
    def routed_experts(self) -> tuple[int, int] | None:
        """``(MoE layers, k)`` of the routed experts it reports (None: it reports none)."""
        recorder = self._recorder
        return None if recorder is None else (recorder.layers, recorder.k)

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
        return await collect(self.stream(request))

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[TokenDelta, None]:
        """Deltas of the tokens the worker sampled since the consumer last looked (one
        per decode step when it keeps up). A consumer that stops early aborts the
        sequence: its row is freed at the next decode step."""
        self._validate(request)
        stops = None
        if request.sampling.stop:
            tokenizer = await asyncio.to_thread(lambda: self.tokenizer)
            stops = StopStrings(tokenizer, request.sampling.stop)
        loop = asyncio.get_running_loop()
        sequence = _Sequence(request=request, queue=asyncio.Queue(), loop=loop, stops=stops)
        with self._lock:
            if self._released:
                raise EngineAborted(f"{self.name} has released its memory")
            self._pending.append(sequence)
        self._wake.set()
        finished = False
        try:
            while not finished:
                items = [await sequence.queue.get()]
                while not sequence.queue.empty():
                    items.append(sequence.queue.get_nowait())
                tokens: list[_Token] = []
                for item in items:
                    if isinstance(item, BaseException):
                        raise item
                    tokens.append(item)
                finish = tokens[-1][3]
                finished = finish is not None
                rows = [t[4] for t in tokens if t[4] is not None]
                yield TokenDelta(
                    tuple(t[0] for t in tokens),
                    tuple(t[1] for t in tokens),
                    tuple(t[2] for t in tokens),
                    finish,
                    routed_experts.compact(np.concatenate(rows)) if rows else None,
                )
        finally:
            if not finished:  # aborted, failed, or the consumer left: free the row
                sequence.aborted = True
                self._wake.set()

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The model's tokenizer, loaded on first use (stop strings need it)."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_dir)

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
            self._kv = None
            if self._graphs is not None:
                self._graphs.clear()
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
                    failed, self._active = self._active, []  # free before they hear of it
                    if self._graphs is not None:
                        self._graphs.clear()
                    for sequence in failed:
                        sequence.push(exc)
                if self._active or self._pending:
                    self._wake.set()

    def _apply_update(self) -> None:
        with self._lock:
            update, self._update = self._update, None
        if update is None:
            return
        try:
            state = self.model.state_dict()
            if isinstance(update.source, WeightsInShards):
                _copy_shards(update.source, state)
            else:
                if isinstance(update.source, WeightsOnDisk):
                    tensors = _load_safetensors(Path(update.source.path))
                else:
                    assert isinstance(update.source, WeightsInMemory)
                    tensors = dict(update.source.tensors)
                _check_names(tensors, state, lambda k, t: tuple(t.shape) == tuple(state[k].shape))
                for key, tensor in tensors.items():  # checked first: never a partial update
                    state[key].copy_(tensor.to(state[key].device, state[key].dtype))
            self.version = update.version
        except Exception as exc:  # the caller gets it; whole tensors are unchanged
            update.error = exc
        finally:
            update.done.set()

    def _admit(self) -> None:
        """Prefill the joining requests into the next free rows (batched by
        :func:`prefill_batches`) and sample their first tokens."""
        with self._lock:
            for sequence in [s for s in self._pending if s.aborted]:
                self._pending.remove(sequence)
                sequence.push(EngineAborted(sequence.request.request_id))
            # Only this thread removes from the queue: the joining stay counted as pending
            # (so the engine is never seen idle) until they are in the batch.
            joining = self._pending[: self.capacity - len(self._active)]
        if not joining:
            return
        lengths = [len(s.request.input_ids) for s in joining]
        self._fit(least_width=max(lengths), joining=len(joining))
        for sequence, length in zip(joining, lengths, strict=True):
            sequence.length = length
        first = len(self._active)
        with self._lock:  # from here a failure fails them with the batch
            del self._pending[: len(joining)]
            self._active.extend(joining)
        prefilled = [
            self._prefill([s.request.input_ids for s in joining[batch]], first + batch.start)
            for batch in prefill_batches(lengths)
        ]
        logits = torch.cat([batch_logits for batch_logits, _ in prefilled])
        routing = [rows for _, batch_routing in prefilled for rows in batch_routing]
        self._hand_over(first, joining, logits, routing)

    def _prefill(
        self, prompts: list[Sequence[int]], first_row: int
    ) -> tuple[torch.Tensor, list[np.ndarray | None]]:
        """Prefill ``prompts``, left-padded, into rows from ``first_row``, ending at the
        write column; their last logits and (an MoE's) each prompt's routed experts.
        Prompts of one length need no mask: HF then lets SDPA's causal kernel run
        without a ``prompt x prompt`` mask."""
        width = max(len(prompt) for prompt in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(list(prompt))
        lengths = torch.tensor([len(prompt) for prompt in prompts], device=self.device)
        columns = torch.arange(width, device=self.device).unsqueeze(1)  # one per query
        positions = (columns.T - (width - lengths).unsqueeze(1)).clamp(min=0)
        rows = slice(first_row, first_row + len(prompts))
        cache = SlotCache.prefill(self._slots(), self._layers, rows, width)
        routing = self._record(len(prompts) * width)
        if all(len(prompt) == width for prompt in prompts):
            logits = self._forward(ids, positions, None, cache)
        else:
            logits = self._forward(ids, positions, prefill_mask(lengths, width), cache, columns)
        if routing is None:
            return logits, [None] * len(prompts)
        routed = routing.view(len(prompts), width, *routing.shape[1:]).cpu().numpy()
        return logits, [routed[row, width - len(p) :] for row, p in enumerate(prompts)]

    def _record(self, tokens: int | None) -> torch.Tensor | None:
        """Where an MoE's routers record the next forward's ``tokens`` (None: a decode
        step's, into the fixed tensor its graphs write); None for a dense model."""
        if self._recorder is None:
            return None
        if tokens is None:
            self._recorder.out = self._decode_routing
        else:
            shape = (tokens, self._recorder.layers, self._recorder.k)
            self._recorder.out = torch.zeros(shape, dtype=torch.int16, device=self.device)
        return self._recorder.out

    def _decode_step(self) -> None:
        aborted = [i for i, s in enumerate(self._active) if s.aborted]
        if aborted:
            gone = [self._active[i] for i in aborted]
            self._remove(aborted)  # the slot is free before the caller hears of it
            for sequence in gone:
                sequence.push(EngineAborted(sequence.request.request_id))
            if not self._active:
                return
        kv = self._slots()
        self._fit()
        n = len(self._active)
        padding = [0] * (self.capacity - n)
        self._step_inputs.copy_(
            torch.tensor(
                [s.next_token for s in self._active]
                + padding
                + [s.length for s in self._active]
                + padding
                + [kv.width]
            )
        )
        routing = self._record(None)
        logits = self._decode(n)
        kv.width += 1
        for sequence in self._active:
            sequence.length += 1
        # A copy: the next step writes the same tensor (and on the CPU .numpy() shares it).
        routed = None if routing is None else list(routing[:n, None].cpu().numpy().copy())
        self._hand_over(0, list(self._active), logits, routed)

    def _decode(self, n: int) -> torch.Tensor:
        """The logits of a decode step of the first ``n`` rows, through a CUDA graph of
        its bucket where graphs are on; a failed capture turns them off, with a warning."""
        kv = self._slots()
        if self._graphs is not None:
            rows = power_of_two_at_least(n, self.capacity)
            columns = power_of_two_at_least(kv.width + 1, kv.columns)
            try:
                return self._graphs(rows, columns)[:n]
            except GraphCaptureFailed as exc:
                log.warning("%s: %s; decoding eagerly from now on", self.name, exc)
                self._graphs = None
        return self._decode_forward(n, kv.width + 1)

    def _decode_forward(self, rows: int, columns: int) -> torch.Tensor:
        """One decode step of the first ``rows`` rows over ``columns`` KV columns.

        Reads its inputs only from ``self._step_inputs`` (next ids, cached lengths, the
        write column) and makes no host sync, so it can be captured as a CUDA graph.
        """
        kv = self._slots()
        ids = self._step_inputs[:rows].unsqueeze(1)
        lengths = self._step_inputs[self.capacity : self.capacity + rows]
        width = self._step_inputs[-1:]
        cache = SlotCache.decode(kv, self._layers, rows, columns, width)
        mask = decode_mask(lengths, width, columns)
        return self._forward(ids, lengths.unsqueeze(1), mask, cache, width)

    def _forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        cache: SlotCache,
        query_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The model's last-position logits ``[rows, vocab]`` under a prepared mask (its
        queries at columns ``query_at``, for sliding windows), or HF's causal one."""
        masks: torch.Tensor | dict[str, torch.Tensor] | None = mask
        if mask is not None and self._sliding_window is not None:
            assert query_at is not None
            masks = {
                "full_attention": mask,
                "sliding_attention": sliding(mask, self._sliding_window, query_at),
            }
        out = self.model(
            input_ids=ids.to(self.device),
            position_ids=positions.to(self.device),
            attention_mask=masks,
            use_cache=True,
            **{self._cache_kw: cache},
            **self._last_logits_only,
        )
        return out.logits[:, -1]

    def _slots(self) -> SlotKV:
        if self._kv is None:
            self._kv = SlotKV(self.capacity, self.max_context, self.device)
        return self._kv

    def _fit(self, least_width: int = 0, joining: int = 0) -> None:
        """Size the KV cache for the next forward (graphs go stale if its buffers move)."""
        longest = max((s.length for s in self._active), default=0)
        moved = self._slots().fit(len(self._active), longest, least_width, joining)
        if moved and self._graphs is not None:
            self._graphs.clear()

    def _hand_over(
        self,
        first: int,
        sequences: list[_Sequence],
        logits: torch.Tensor,
        routing: Sequence[np.ndarray | None] | None,
    ) -> None:
        """Sample the next token of ``sequences`` (rows from ``first``) and hand each to
        its consumer with the routing of the positions that predicted it; finished rows
        are freed before their consumers hear of it."""
        tokens, logprobs = self._sample(logits, [s.request.sampling for s in sequences])
        routing = routing or [None] * len(sequences)
        items = [
            (sequence, (token, logprob, self.version, self._advance(sequence, token), rows))
            for sequence, token, logprob, rows in zip(
                sequences, tokens, logprobs, routing, strict=True
            )
        ]
        finished = [first + row for row, (_, item) in enumerate(items) if item[3] is not None]
        if finished:
            self._remove(finished)
        for sequence, item in items:
            sequence.push(item)

    def _advance(self, sequence: _Sequence, token: int) -> FinishReason | None:
        """Record a sampled token; why the sequence ends with it, if it does."""
        s = sequence.request.sampling
        sequence.generated += 1
        sequence.next_token = token
        if (token in self.eos_ids and not s.ignore_eos) or token in s.stop_token_ids:
            return "stop"
        if sequence.stops is not None and sequence.stops.add(token) is not None:
            return "stop"
        if sequence.generated >= s.max_tokens or (
            len(sequence.request.input_ids) + sequence.generated >= self.max_context
        ):
            return "length"
        return None

    def _sample(
        self, logits: torch.Tensor, params: list[SamplingParams]
    ) -> tuple[list[int], list[float]]:
        """One token per row of ``logits`` [B, V], with each row's own sampling params.

        Vectorised on the logits' device with one host sync per step. The returned
        log-probs are those of the sampled tokens under the tempered, truncated
        distribution they were drawn from (see the module docstring).
        """
        logits = logits.float()
        vocab = logits.shape[-1]
        temperature = torch.tensor([p.temperature for p in params], device=logits.device)
        greedy = temperature == 0
        scaled = logits / torch.where(greedy, 1.0, temperature).unsqueeze(1)
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
        logprobs = torch.log_softmax(masked, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
        return tokens.tolist(), logprobs.tolist()

    def _remove(self, rows: list[int]) -> None:
        """Drop finished or aborted rows; the last running rows move into the holes."""
        gone = set(rows)
        kept = len(self._active) - len(gone)
        holes = [i for i in range(kept) if i in gone]
        movers = [i for i in range(kept, len(self._active)) if i not in gone]
        for source, target in zip(movers, holes, strict=True):
            sequence = self._active[source]
            self._slots().move_row(source, target, sequence.length)
            self._active[target] = sequence
        del self._active[kept:]

    def _move_model(self, device: torch.device) -> None:
        self.model.to(device)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


PREFILL_MASK_ELEMENTS = 1 << 24
"""Prompts of different lengths are prefilled together while their padded mask
(``rows x width x width``) stays under this; else apart."""


def prefill_batches(lengths: Sequence[int]) -> list[slice]:
    """Consecutive batches of joining prompts (by their ``lengths``) to prefill together:
    padded ones while the mask stays under ``PREFILL_MASK_ELEMENTS``, or any number of
    one length (they need no mask)."""
    batches: list[slice] = []
    start = 0
    for end in range(1, len(lengths) + 1):
        batch = lengths[start:end]
        padded = min(batch) != max(batch)
        if end - start > 1 and padded and len(batch) * max(batch) ** 2 > PREFILL_MASK_ELEMENTS:
            batches.append(slice(start, end - 1))
            start = end - 1
    batches.append(slice(start, len(lengths)))
    return batches


def _sliding_window(config: Any) -> int | None:
    """The window of the model's sliding-attention layers; None when every layer attends fully."""
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    unsupported = kinds - {"full_attention", "sliding_attention"}
    if unsupported:
        raise ValueError(
            f"the embedded engine runs full_attention and sliding_attention layers;"
            f" this model also has {sorted(unsupported)}"
        )
    return int(config.sliding_window) if "sliding_attention" in kinds else None


def _check_names(
    tensors: Mapping[str, Tensor], state: Mapping[str, Tensor], fits: Callable[[str, Tensor], bool]
) -> None:
    unknown = sorted(set(tensors) - set(state))
    if unknown:
        raise ValueError(f"unknown weight names: {unknown[:3]}")
    wrong = [k for k, t in tensors.items() if not fits(k, t)]
    if wrong:
        raise ValueError(f"weights of the wrong shape: {wrong[:3]}")


def _copy_shards(source: WeightsInShards, state: Mapping[str, Tensor]) -> None:
    """Copy each part's dim-0 rows into ``state`` in order, part by part (each part is
    checked before any of it is copied; a part of another version raises
    :class:`~qwengyre.engines.base.StaleWeights` and leaves the earlier parts loaded)."""
    filled: dict[str, int] = {}
    for r in range(source.count):
        part = source.read(r)

        def fits(key: str, t: Tensor) -> bool:
            full = state[key]
            return (
                t.dim() == full.dim()
                and tuple(t.shape[1:]) == tuple(full.shape[1:])
                and filled.get(key, 0) + t.shape[0] <= full.shape[0]
            )

        _check_names(part, state, fits)
        for key, tensor in part.items():
            start = filled.get(key, 0)
            dst = state[key].narrow(0, start, tensor.shape[0])
            dst.copy_(tensor.to(dst.device, dst.dtype))
            filled[key] = start + tensor.shape[0]
    short = [k for k, rows in filled.items() if rows != state[k].shape[0]]
    if short:
        raise ValueError(f"shards do not cover these weights: {short[:3]}")


def _load_safetensors(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path}")
    tensors: dict[str, Any] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors
