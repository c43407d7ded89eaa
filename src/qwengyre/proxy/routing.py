"""Engines, sticky per-execution routes, and rerouting for role transitions (docs/design.md §3).

An execution keeps its engine (its KV cache is there) until that engine stops
accepting. Draining an engine — the first step of a cell's move to training —
stops it accepting, moves the routes of its executions to other engines (standalone
first, then rollout cells in descending index, as the scheduler orders them), and
aborts its in-flight requests; each aborted call is retried transparently at its new
engine, so the harness sees one successful answer and the tree gets one record.
An engine that fails a call, or whose server is found gone while it serves
(:meth:`Router.check`, which the proxy runs every :data:`RECOVER_S`), is drained the same way
(:meth:`Router.fail`), and taken back once its health check passes again
(:meth:`Router.recover`): a timeout or a restarted server does not cost an engine for
the rest of the run. An engine drained for a move is never taken back that way. A call
that finds no engine accepting waits up to ``engine_wait_s`` for one to accept again (a
cell on its way back to rollout after the last serving one was lost, a crashed server
starting again) before it is answered :class:`NoEngineAvailable` (529, which clients
retry).

A call streams (:meth:`Router.stream`): tokens reach the harness as they are sampled,
so a call moved after it produced some continues at its new engine from where it
stopped rather than starting over, which would contradict what the harness has
already been sent. How the new engine gets the state the old one built is a
:class:`Handoff`: :class:`Recompute` (the default, the recompute form of the paper's KV
handoff) sends it the prompt plus the tokens so far, whose KV it computes again; a
KV-transfer engine plugs in its own handoff (e.g. attaching the source's transfer
handle to the continued request) and touches nothing else here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from qwengyre.engines.base import (
    EngineAborted,
    GenerateRequest,
    GenerateResult,
    InferenceEngine,
    TokenDelta,
    collect,
)

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 60.0
"""How long a drain waits for its aborted calls to end at the engine."""

RECOVER_S = 2.0
"""How often the proxy checks its engines' health (:meth:`Router.check`)."""


async def _healthy(engine: InferenceEngine) -> bool:
    """``engine``'s health check; one that raises counts as failed."""
    try:
        return await engine.health() is True
    except Exception:
        return False


class Handoff(Protocol):
    """How a call moved from one engine to another continues there."""

    async def continuation(
        self,
        source: InferenceEngine,
        source_request_id: str,
        request: GenerateRequest,
        produced: Sequence[int],
    ) -> GenerateRequest:
        """The request the destination runs. ``request`` is the original call with a
        fresh id and what is left of the token budget; ``produced`` are the tokens the
        harness already has (their log-probs and versions are recorded), which the
        destination must continue after and never generate again. ``source`` and
        ``source_request_id`` name the attempt that was moved (aborted or failed)."""
        ...


class Recompute:
    """The destination recomputes: its input is the prompt followed by the tokens
    already produced."""

    async def continuation(
        self,
        source: InferenceEngine,
        source_request_id: str,
        request: GenerateRequest,
        produced: Sequence[int],
    ) -> GenerateRequest:
        return dataclasses.replace(request, input_ids=[*request.input_ids, *produced])


class NoEngineAvailable(Exception):
    """No engine accepts requests right now (the caller answers 529 overloaded)."""


@dataclass(kw_only=True)
class _Slot:
    engine: InferenceEngine
    preference: int  # higher is tried first: standalone pools high, cell i gets i
    accepting: bool = True
    failed: bool = False  # drained because it failed, not for a move: recover() may resume
    inflight: dict[str, str] = field(default_factory=dict)  # request id -> execution
    emptied: asyncio.Event = field(default_factory=asyncio.Event)  # set when inflight empties


class Router:
    """Routes every call of an execution to one engine, and moves them when asked."""

    def __init__(
        self, max_attempts: int = 5, handoff: Handoff | None = None, engine_wait_s: float = 0.0
    ) -> None:
        self.max_attempts = max_attempts
        self.handoff: Handoff = handoff or Recompute()
        self.engine_wait_s = engine_wait_s
        self._accepting_again = asyncio.Event()  # replaced once set: one per wake-up
        self._slots: dict[str, _Slot] = {}
        self._routes: dict[str, str] = {}
        self._ids = itertools.count()

    def register(self, engine: InferenceEngine, preference: int) -> None:
        if engine.name in self._slots:
            raise ValueError(f"engine {engine.name!r} is already registered")
        self._slots[engine.name] = _Slot(engine=engine, preference=preference)
        self._wake_waiting()  # a call that came before any engine (a restarted run's)

    async def replace(self, engine: InferenceEngine) -> None:
        """A new server of the drained engine of the same name (its cell's replacement)
        takes its place and accepts calls, with its preference; the old client's
        connections are closed."""
        slot = self._slots[engine.name]
        if slot.accepting:  # calls still in flight there end on the old server's slot
            raise ValueError(f"engine {engine.name!r} must be drained before it is replaced")
        self._slots[engine.name] = _Slot(engine=engine, preference=slot.preference)
        self._wake_waiting()
        if (close := getattr(slot.engine, "close", None)) is not None:  # an HTTP client's
            await close()

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
        """Run ``request`` for ``execution_id`` to its end (:meth:`stream`, collected);
        (the engine that finished it, the whole result)."""
        engine = ""

        async def deltas() -> AsyncIterator[TokenDelta]:
            nonlocal engine
            async for name, delta in self.stream(execution_id, request):
                engine = name
                yield delta

        result = await collect(deltas())
        return engine, result

    async def stream(
        self, execution_id: str, request: GenerateRequest
    ) -> AsyncGenerator[tuple[str, TokenDelta], None]:
        """Run ``request`` for ``execution_id``, yielding (engine, delta) as tokens come.

        The deltas form one token stream, its last delta has the finish reason, whatever
        happened underneath: an attempt that ends in :class:`EngineAborted` (the engine
        is draining) or in a connection failure (the engine is drained here) is retried
        at the execution's route, up to ``max_attempts`` attempts in all, and once tokens
        have been produced the retry continues them (:attr:`handoff`; by default its
        input is the prompt plus those tokens) and its ``max_tokens`` is what is left of
        the budget (none left: a last empty delta finishing with ``"length"``). Raises
        :class:`NoEngineAvailable` when no engine accepts or the attempts run out. The
        deltas' routed experts (an MoE's) continue by position too: of the positions a
        continuation computes again, the earlier attempt's routing is kept.

        Closing the stream early (``aclose()``, or cancelling the consuming task) closes
        the engine's stream, which aborts the request there.
        """
        produced: list[int] = []
        routed = 0  # positions whose routed experts were yielded (an MoE's, if reported)
        engine = ""
        moved: tuple[InferenceEngine, str] | None = None  # the last attempt, once it failed
        last: Exception | None = None
        for tries in itertools.count():
            sampling = request.sampling
            if produced:
                left = sampling.max_tokens - len(produced)
                if left <= 0:
                    yield engine, TokenDelta((), (), (), "length")
                    return
                sampling = dataclasses.replace(sampling, max_tokens=left)
            if tries == self.max_attempts:
                raise NoEngineAvailable(f"gave up after {tries} attempts: {last}")
            # Fixed width: SGLang aborts every rid that starts with the one it is given.
            request_id = f"{request.request_id}-{next(self._ids):010d}"
            attempt = GenerateRequest(request_id, request.input_ids, sampling, request.tags)
            if produced and moved is not None:
                attempt = await self.handoff.continuation(*moved, attempt, tuple(produced))
            await self._until_one_accepts()
            # No await from choosing the engine to registering the request: a drain
            # then either sees the request (and aborts it) or has already moved the route.
            engine = self.route(execution_id)
            slot = self._slots[engine]
            slot.inflight[request_id] = execution_id
            deltas = slot.engine.stream(attempt)
            seen = 0  # positions this attempt reported
            try:
                async for delta in deltas:
                    produced.extend(delta.output_ids)
                    if delta.routing is not None:
                        # A continuation recomputes the positions an earlier attempt
                        # routed; the tokens were sampled under the earlier routing.
                        rows = delta.routing[max(routed - seen, 0) :]
                        seen += len(delta.routing)
                        routed += len(rows)
                        delta = dataclasses.replace(delta, routing=rows)
                    yield engine, delta
                return
            except EngineAborted as exc:
                last = exc  # drained or moved: the route has changed, try again
            except (OSError, ConnectionError, TimeoutError) as exc:
                log.warning("engine %s failed (%s); draining it", engine, exc)
                last = exc
                await self.fail(engine)
            finally:
                await deltas.aclose()  # early (the consumer left): aborts on the engine
                slot.inflight.pop(request_id, None)
                if not slot.inflight:
                    slot.emptied.set()
            moved = (slot.engine, request_id)

    async def drain(self, name: str, *, wait: bool = True) -> list[str]:
        """Stop ``name`` accepting, move its routes, abort its calls; the moved executions.

        ``wait``: return only once every aborted call has ended there (the engine is then
        idle and may free its memory), or after ``DRAIN_TIMEOUT_S`` with a warning. A
        drain for an engine that failed does not wait."""
        slot = self._slots[name]
        slot.accepting = slot.failed = False
        moved = [e for e, n in self._routes.items() if n == name]
        for execution_id in moved:
            try:
                self._routes[execution_id] = self._destination(exclude=name)
            except NoEngineAvailable:
                del self._routes[execution_id]  # routed again when an engine accepts
        for request_id in list(slot.inflight):
            await slot.engine.abort(request_id)
        if wait:
            try:
                while slot.inflight:
                    slot.emptied.clear()
                    await asyncio.wait_for(slot.emptied.wait(), DRAIN_TIMEOUT_S)
            except TimeoutError:
                log.warning(
                    "%s: %d calls still running %.0f s after their abort",
                    name,
                    len(slot.inflight),
                    DRAIN_TIMEOUT_S,
                )
        return moved

    def resume(self, name: str) -> None:
        """The engine accepts again (a cell back from training)."""
        slot = self._slots[name]
        slot.accepting, slot.failed = True, False
        self._wake_waiting()

    def _wake_waiting(self) -> None:
        """An engine accepts again: calls waiting for one go on."""
        self._accepting_again.set()
        self._accepting_again = asyncio.Event()

    async def _until_one_accepts(self) -> None:
        """Return once some engine accepts, waiting up to ``engine_wait_s`` for one
        (then the call's :meth:`route` answers :class:`NoEngineAvailable`)."""
        deadline = asyncio.get_running_loop().time() + self.engine_wait_s
        while not any(slot.accepting for slot in self._slots.values()):
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._accepting_again.wait(), left)

    async def fail(self, name: str) -> None:
        """``name`` failed a call: drain it without waiting. If it was serving (not
        already drained for a move), :meth:`recover` takes it back once it is healthy."""
        slot = self._slots[name]
        serving = slot.accepting or slot.failed
        await self.drain(name, wait=False)
        slot.failed = serving

    def failed(self) -> list[str]:
        """The engines drained because they failed, not yet taken back."""
        return [name for name, slot in self._slots.items() if slot.failed]

    async def recover(self) -> list[str]:
        """Engines that failed and pass their health check now accept again; their
        names. A health check that raises counts as failed."""
        failed = [name for name, slot in self._slots.items() if slot.failed]
        back = await asyncio.gather(*(self._take_back(name) for name in failed))
        return list(itertools.compress(failed, back))

    async def check(self) -> list[str]:
        """Engines that accept calls and whose server is gone (their health check finds
        nothing answering, see :meth:`InferenceEngine.health`) are failed (see
        :meth:`fail`), so a crashed server is noticed, and started again, without waiting
        for a call to fail there (a rollout cell may get none for a long time); their
        names. A server that answers unhealthy (loading weights past its own check) keeps
        its calls. Then :meth:`recover`. Every engine is checked at once: a slow health
        check delays no other engine's."""
        serving = [name for name, slot in self._slots.items() if slot.accepting]
        down, _ = await asyncio.gather(
            asyncio.gather(*(self._fail_if_gone(name) for name in serving)), self.recover()
        )
        return list(itertools.compress(serving, down))

    async def _take_back(self, name: str) -> bool:
        slot = self._slots[name]
        healthy = await _healthy(slot.engine)
        if not healthy or self._slots[name] is not slot or not slot.failed:
            return False  # still down, replaced, or drained for a move meanwhile
        slot.accepting, slot.failed = True, False
        log.info("engine %s is healthy again: it accepts calls", name)
        self._wake_waiting()
        return True

    async def _fail_if_gone(self, name: str) -> bool:
        slot = self._slots[name]
        try:
            await slot.engine.health()
        except ConnectionRefusedError as gone:
            if self._slots[name] is slot and slot.accepting:  # not replaced nor drained
                log.warning("engine %s is gone (%s): draining it", name, gone)
                await self.fail(name)
                return True
        except Exception:
            pass  # not known to be gone: its calls say more
        return False

    async def keep_checking(self, every_s: float = RECOVER_S) -> None:
        """:meth:`check` every ``every_s`` seconds, until cancelled."""
        while True:
            await asyncio.sleep(every_s)
            await self.check()
