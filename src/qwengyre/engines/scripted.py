"""A scripted engine: replies come from a JSON script, tokenised with the model's tokenizer.

Script format (JSON object): keys are request classes (``main.task``, ``sub.task``,
``main.summary``, ``main.side``, ...) or ``default``; values are lists of reply texts,
used in turn order per execution and class (the last one repeats). A reply may contain
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks. Log-probs are a
deterministic function of the token and its position (a fake but reproducible
behaviour policy). A reply ends at the first of its stop strings (the output keeps the
token that completes it, :mod:`qwengyre.engines.stops`), at ``max_tokens``, or with EOS.

Timing, so tests can abort or reroute calls in flight: nothing comes for ``prefill_s``,
then the reply streams in ``STREAM_PARTS`` deltas spread evenly over ``delay_s`` (the
first after ``delay_s / STREAM_PARTS``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections import defaultdict
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from qwengyre.engines.base import (
    EngineAborted,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    TokenDelta,
    WeightSource,
    collect,
)
from qwengyre.engines.stops import StopStrings

STREAM_PARTS = 4
"""How many deltas a reply streams in (fewer for a reply of fewer tokens)."""


class ScriptedEngine:
    def __init__(
        self,
        tokenizer: Any,
        script: dict[str, list[str]],
        name: str = "scripted",
        capacity: int = 256,
        delay_s: float = 0.0,
        policy_version: int = 0,
        prefill_s: float = 0.0,
    ) -> None:
        if not script or not all(
            isinstance(v, list) and v and all(isinstance(t, str) for t in v)
            for v in script.values()
        ):
            raise ValueError("a script maps request classes to non-empty lists of reply texts")
        self.tokenizer = tokenizer
        self.script = script
        self.name = name
        self.capacity = capacity
        self.delay_s = delay_s
        self.prefill_s = prefill_s
        self.policy_version = policy_version
        self._turns: dict[tuple[str, str], int] = defaultdict(int)
        self._inflight: dict[str, asyncio.Event] = {}
        self.released = False

    @classmethod
    def from_file(cls, tokenizer: Any, path: str | Path, **kwargs: Any) -> ScriptedEngine:
        try:
            script = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read script {path}: {exc}") from exc
        if not isinstance(script, dict):
            raise ValueError(f"script {path} must be a JSON object of class -> replies")
        return cls(tokenizer, script, **kwargs)

    @property
    def load(self) -> int:
        return len(self._inflight)

    def reply_for(self, request: GenerateRequest) -> str:
        klass = request.tags.get("class", "main.task")
        replies = self.script.get(klass) or self.script.get("default")
        if replies is None:
            replies = next(iter(self.script.values()))
        key = (request.tags.get("execution", ""), klass)
        turn = self._turns[key]
        self._turns[key] += 1
        return replies[min(turn, len(replies) - 1)]

    def output_for(self, request: GenerateRequest) -> tuple[list[int], FinishReason]:
        """The ids of the next reply to ``request`` (its turn is taken) and why they end."""
        ids = list(self.tokenizer.encode(self.reply_for(request), add_special_tokens=False))
        stops = StopStrings(self.tokenizer, request.sampling.stop)
        end = next((i + 1 for i, t in enumerate(ids) if stops.add(t) is not None), None)
        limit = request.sampling.max_tokens
        if end is not None and end <= limit:
            return ids[:end], "stop"
        if len(ids) >= limit:
            return ids[:limit], "length"
        return [*ids, self.tokenizer.eos_token_id], "stop"

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return await collect(self.stream(request))

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[TokenDelta, None]:
        """The reply in up to ``STREAM_PARTS`` deltas (see the module docstring). A call
        aborted before its first delta takes no turn of the script."""
        rid = request.request_id
        aborted = asyncio.Event()
        self._inflight[rid] = aborted
        try:
            await _pause(rid, aborted, self.prefill_s + self.delay_s / STREAM_PARTS)
            ids, finish = self.output_for(request)
            sent = 0
            for part in range(1, STREAM_PARTS + 1):
                if part > 1:
                    await _pause(rid, aborted, self.delay_s / STREAM_PARTS)
                end = len(ids) * part // STREAM_PARTS
                if end > sent or part == STREAM_PARTS:
                    yield TokenDelta(
                        tuple(ids[sent:end]),
                        tuple(_logprob(t, i) for i, t in enumerate(ids[sent:end], start=sent)),
                        (self.policy_version,) * (end - sent),
                        finish if part == STREAM_PARTS else None,
                    )
                    sent = end
        finally:
            self._inflight.pop(rid, None)

    async def abort(self, request_id: str) -> None:
        event = self._inflight.get(request_id)
        if event is not None:
            event.set()

    async def update_weights(self, source: WeightSource, version: int) -> None:
        """A script has no weights: only the version changes."""
        self.policy_version = version

    async def release_memory(self) -> None:
        self.released = True

    async def resume_memory(self) -> None:
        self.released = False

    async def health(self) -> bool:
        return not self.released


def _logprob(token: int, position: int) -> float:
    """The fake behaviour log-prob of ``token`` at ``position`` of a reply."""
    return -0.05 - 0.9 * abs(math.sin(token * 0.37 + position))


async def _pause(request_id: str, aborted: asyncio.Event, seconds: float) -> None:
    """Wait ``seconds``; EngineAborted if the call is aborted before or meanwhile."""
    if seconds > 0:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(aborted.wait(), timeout=seconds)
    if aborted.is_set():
        raise EngineAborted(request_id)
