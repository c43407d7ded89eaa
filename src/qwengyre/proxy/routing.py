"""Engines, sticky per-execution routes, and rerouting for role transitions (DESIGN.md §3).

An execution keeps its engine (its KV cache is there) until that engine stops
accepting. Draining an engine — the first step of a cell's move to training —
stops it accepting, moves the routes of its executions to other engines (standalone
first, then rollout cells in descending index, as the scheduler orders them), and
aborts its in-flight requests; each aborted call is retried transparently at its new
engine, so the harness sees one successful answer and the tree gets one record.
An engine that fails outright is drained the same way.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

from qwengyre.engines.base import EngineAborted, GenerateRequest, GenerateResult, InferenceEngine

log = logging.getLogger(__name__)


class NoEngineAvailable(Exception):
    """No engine accepts requests right now (the caller answers 529 overloaded)."""


@dataclass
class _Slot:
    engine: InferenceEngine
    preference: int  # higher is tried first: standalone pools high, cell i gets i
    accepting: bool = True
    inflight: dict[str, str] = field(default_factory=dict)  # request id -> execution


class Router:
    """Routes every call of an execution to one engine, and moves them when asked."""

    def __init__(self, max_attempts: int = 5) -> None:
        self.max_attempts = max_attempts
        self._slots: dict[str, _Slot] = {}
        self._routes: dict[str, str] = {}
        self._ids = itertools.count()

    def register(self, engine: InferenceEngine, preference: int) -> None:
        if engine.name in self._slots:
            raise ValueError(f"engine {engine.name!r} is already registered")
        self._slots[engine.name] = _Slot(engine, preference)

    def route_of(self, execution_id: str) -> str | None:
        return self._routes.get(execution_id)

    def _destination(self, exclude: str | None = None) -> str:
        """The preferred accepting engine with room, else the least loaded accepting one."""
        candidates = [
            (name, slot) for name, slot in self._slots.items() if slot.accepting and name != exclude
        ]
        if not candidates:
            raise NoEngineAvailable("no inference engine is accepting requests")
        routed: dict[str, int] = {}
        for name in self._routes.values():
            routed[name] = routed.get(name, 0) + 1
        with_room = [
            (slot.preference, name)
            for name, slot in candidates
            if routed.get(name, 0) < slot.engine.capacity
        ]
        if with_room:
            return max(with_room)[1]
        return min(candidates, key=lambda c: routed.get(c[0], 0) / c[1].engine.capacity)[0]

    def route(self, execution_id: str) -> str:
        name = self._routes.get(execution_id)
        if name is None or not self._slots[name].accepting:
            name = self._destination()
            self._routes[execution_id] = name
        return name

    def assign(self, execution_id: str, name: str) -> None:
        """Route ``execution_id`` to engine ``name`` (the scheduler's choice at launch or
        reroute); its next call goes there, an in-flight one finishes where it is."""
        if name not in self._slots:
            raise ValueError(f"engine {name!r} is not registered")
        self._routes[execution_id] = name

    def forget(self, execution_id: str) -> None:
        self._routes.pop(execution_id, None)

    async def generate(
        self, execution_id: str, request: GenerateRequest
    ) -> tuple[str, GenerateResult]:
        """Run ``request`` for ``execution_id``, retrying across reroutes; (engine, result)."""
        last: Exception | None = None
        for _ in range(self.max_attempts):
            name = self.route(execution_id)
            slot = self._slots[name]
            # Fixed width: SGLang aborts every rid that starts with the one it is given.
            request_id = f"{request.request_id}-{next(self._ids):010d}"
            slot.inflight[request_id] = execution_id
            try:
                attempt = GenerateRequest(
                    request_id, request.input_ids, request.sampling, request.tags
                )
                return name, await slot.engine.generate(attempt)
            except EngineAborted as exc:
                last = exc  # drained or moved: the route has changed, try again
            except (OSError, ConnectionError, TimeoutError) as exc:
                log.warning("engine %s failed (%s); draining it", name, exc)
                last = exc
                await self.drain(name)
            finally:
                slot.inflight.pop(request_id, None)
        raise NoEngineAvailable(f"gave up after {self.max_attempts} attempts: {last}")

    async def drain(self, name: str) -> list[str]:
        """Stop ``name`` accepting, move its routes, abort its calls; the moved executions."""
        slot = self._slots[name]
        slot.accepting = False
        moved = [e for e, n in self._routes.items() if n == name]
        for execution_id in moved:
            try:
                self._routes[execution_id] = self._destination(exclude=name)
            except NoEngineAvailable:
                del self._routes[execution_id]  # routed again when an engine accepts
        for request_id in list(slot.inflight):
            await slot.engine.abort(request_id)
        return moved

    def resume(self, name: str) -> None:
        """The engine accepts again (a cell back from training)."""
        self._slots[name].accepting = True
