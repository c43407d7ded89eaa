"""A scripted engine: replies come from a JSON script, tokenised with the model's tokenizer.

Script format (JSON object): keys are request classes (``main.task``, ``sub.task``,
``main.summary``, ``main.side``, ...) or ``default``; values are lists of reply texts,
used in turn order per execution and class (the last one repeats). A reply may contain
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks. Log-probs are a
deterministic function of the token and its position (a fake but reproducible
behaviour policy). ``delay_s`` makes each call take that long, so tests can abort
or reroute calls in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from qwengyre.engines.base import EngineAborted, GenerateRequest, GenerateResult, WeightSource


class ScriptedEngine:
    def __init__(
        self,
        tokenizer: Any,
        script: dict[str, list[str]],
        name: str = "scripted",
        capacity: int = 256,
        delay_s: float = 0.0,
        policy_version: int = 0,
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

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        aborted = asyncio.Event()
        self._inflight[request.request_id] = aborted
        try:
            if self.delay_s > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(aborted.wait(), timeout=self.delay_s)
            if aborted.is_set():
                raise EngineAborted(request.request_id)
            ids = list(self.tokenizer.encode(self.reply_for(request), add_special_tokens=False))
            limit = request.sampling.max_tokens
            finish = "stop"
            if len(ids) >= limit:
                ids, finish = ids[:limit], "length"
            else:
                ids.append(self.tokenizer.eos_token_id)
            logprobs = tuple(-0.05 - 0.9 * abs(math.sin(t * 0.37 + i)) for i, t in enumerate(ids))
            versions = (self.policy_version,) * len(ids)
            return GenerateResult(tuple(ids), logprobs, versions, finish)  # type: ignore[arg-type]
        finally:
            self._inflight.pop(request.request_id, None)

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
