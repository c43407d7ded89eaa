"""Router.stream: one token stream per call across aborts, failures and reroutes."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from qwengyre.engines.base import (
    EngineAborted,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    TokenDelta,
)
from qwengyre.proxy.routing import NoEngineAvailable, Router
from qwengyre.types import SamplingParams

PROMPT = (11, 12, 13)
WAIT = "wait"  # a plan step: block until the request is aborted, then raise EngineAborted

Step = tuple[tuple[int, ...], FinishReason | None] | TokenDelta | BaseException | str


def delta(ids: tuple[int, ...], finish: FinishReason | None = None) -> TokenDelta:
    return TokenDelta(ids, tuple(-0.5 for _ in ids), tuple(7 for _ in ids), finish)


@dataclass
class FakeEngine:
    """Streams one plan per request: (ids, finish) deltas, an exception to raise, or
    WAIT. Records the requests, the aborts, and which streams were closed early."""

    name: str
    plans: list[list[Step]]
    capacity: int = 8
    requests: list[GenerateRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    _inflight: dict[str, asyncio.Event] = field(default_factory=dict)

    @property
    def load(self) -> int:
        return len(self._inflight)

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[TokenDelta, None]:
        rid = request.request_id
        self.requests.append(request)
        plan = self.plans.pop(0)
        aborted = self._inflight[rid] = asyncio.Event()
        try:
            for step in plan:
                await asyncio.sleep(0)
                if aborted.is_set():
                    raise EngineAborted(rid)
                if step == WAIT:
                    await aborted.wait()
                    raise EngineAborted(rid)
                if isinstance(step, BaseException):
                    raise step
                yield step if isinstance(step, TokenDelta) else delta(*step)
        except GeneratorExit:
            self.closed.append(rid)
            raise
        finally:
            del self._inflight[rid]

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        raise AssertionError("the router streams")

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        if request_id in self._inflight:
            self._inflight[request_id].set()

    async def update_weights(self, source: Any, version: int) -> None: ...
    async def release_memory(self) -> None: ...
    async def resume_memory(self) -> None: ...

    healthy: bool = True
    gone: bool = False  # its server: nothing answers at its address

    async def health(self) -> bool:
        if self.gone:
            raise ConnectionRefusedError(f"nothing answers for {self.name}")
        return self.healthy


def router_with(*engines: FakeEngine, max_attempts: int = 5) -> Router:
    """The first engine is the preferred one."""
    router = Router(max_attempts=max_attempts)
    for preference, engine in enumerate(reversed(engines)):
        router.register(engine, preference)
    return router


def request(max_tokens: int = 20) -> GenerateRequest:
    return GenerateRequest("req_x", PROMPT, SamplingParams(max_tokens=max_tokens), {"a": "b"})


async def consume(
    router: Router,
    max_tokens: int = 20,
    after_first: Callable[[], Awaitable[None]] | None = None,
) -> list[tuple[str, TokenDelta]]:
    """Every (engine, delta) of a call; ``after_first`` starts once the first delta is in,
    beside the call (as a cell's move runs beside the calls it drains)."""
    out: list[tuple[str, TokenDelta]] = []
    beside = None
    async for item in router.stream("ex", request(max_tokens)):
        out.append(item)
        if len(out) == 1 and after_first is not None:
            beside = asyncio.create_task(after_first())
    if beside is not None:
        await beside
    return out


def ids_of(items: list[tuple[str, TokenDelta]]) -> list[int]:
    return [t for _, d in items for t in d.output_ids]


def test_a_call_drained_mid_stream_continues_at_the_new_engine() -> None:
    a = FakeEngine("a", [[((1, 2), None), WAIT]])
    b = FakeEngine("b", [[((3, 4), None), ((5,), "stop")]])
    router = router_with(a, b)

    async def drain() -> None:
        assert await router.drain("a") == ["ex"]
        assert a.load == 0  # the drain returns once the aborted call has ended there

    items = asyncio.run(consume(router, 20, after_first=drain))

    assert [e for e, _ in items] == ["a", "b", "b"]
    assert ids_of(items) == [1, 2, 3, 4, 5]
    assert [d.finish_reason for _, d in items] == [None, None, "stop"]
    (first,) = a.requests
    (second,) = b.requests
    assert tuple(first.input_ids) == PROMPT and first.sampling.max_tokens == 20
    assert tuple(second.input_ids) == (*PROMPT, 1, 2)
    assert second.sampling.max_tokens == 18 and second.tags == {"a": "b"}
    assert a.aborted == [first.request_id]
    assert router.route_of("ex") == "b"
    # fixed width request ids, distinct per attempt
    for r in (first, second):
        assert re.fullmatch(r"req_x-\d{10}", r.request_id)
    assert first.request_id != second.request_id


def test_a_failure_mid_stream_drains_the_engine_and_continues() -> None:
    a = FakeEngine("a", [[((1,), None), ConnectionResetError("gone")]])
    b = FakeEngine("b", [[((2, 3), "length")]])
    router = router_with(a, b)

    items = asyncio.run(consume(router, 3))

    assert ids_of(items) == [1, 2, 3] and items[-1] == ("b", delta((2, 3), "length"))
    assert tuple(b.requests[0].input_ids) == (*PROMPT, 1)
    assert b.requests[0].sampling.max_tokens == 2
    assert router.route_of("ex") == "b"
    assert router.route("other") == "b"  # "a" no longer accepts


def test_an_engine_that_failed_is_taken_back_once_its_health_check_passes() -> None:
    a = FakeEngine("a", [[ConnectionResetError("gone")], [((9,), "stop")]], healthy=False)
    b = FakeEngine("b", [[((2, 3), "length")]])
    router = router_with(a, b)

    async def scenario() -> tuple[list[str], list[str], str]:
        await consume(router, 2)  # "a" fails, the call ends at "b"
        assert router.failed() == ["a"]
        still_down = await router.recover()
        a.healthy = True
        back = await router.recover()
        return still_down, back, router.route("new")

    still_down, back, route = asyncio.run(scenario())
    assert still_down == [] and back == ["a"] and route == "a"  # preferred again
    assert asyncio.run(router.recover()) == [] and router.failed() == []


def test_an_engine_drained_for_a_move_is_not_taken_back_even_if_a_call_then_fails() -> None:
    a = FakeEngine("a", [[((1,), None), WAIT]])
    b = FakeEngine("b", [[((2,), "stop")]])
    router = router_with(a, b)

    async def scenario() -> list[str]:
        await consume(router, 5, after_first=lambda: router.drain("a"))  # its cell moves
        await router.fail("a")  # a call it aborted ended in a connection error after all
        return await router.recover()

    assert asyncio.run(scenario()) == []
    assert router.route("new") == "b"
    router.resume("a")  # the cell is back from training
    assert router.route("newer") == "a"


def test_a_replacement_takes_a_drained_engines_place_and_preference() -> None:
    """A dead cell's replacement serves under its name: calls go to it, as preferred
    as its predecessor; an engine still accepting cannot be replaced."""
    a = FakeEngine("a", [[ConnectionResetError("gone")]])
    b = FakeEngine("b", [[((2, 3), "length")]])
    router = router_with(a, b)
    again = FakeEngine("a", [[((4,), "stop")]])

    async def scenario() -> list[tuple[str, TokenDelta]]:
        await consume(router, 2)  # "a" fails: drained, the call ends at "b"
        with pytest.raises(ValueError, match="must be drained"):
            await router.replace(FakeEngine("b", []))
        await router.replace(again)
        assert router.failed() == []  # nothing left to revive
        return [item async for item in router.stream("new", request(1))]

    assert asyncio.run(scenario()) == [("a", delta((4,), "stop"))]  # preferred, as "a" was


def test_keep_checking_takes_an_engine_back_on_its_own() -> None:
    a = FakeEngine("a", [[ConnectionResetError("gone")]], healthy=True)
    b = FakeEngine("b", [[((2,), "stop")]])
    router = router_with(a, b)

    async def scenario() -> str:
        await consume(router, 2)
        assert router.route("x") == "b"
        task = asyncio.ensure_future(router.keep_checking(every_s=0.01))
        await asyncio.sleep(0.1)
        task.cancel()
        return router.route("y")

    assert asyncio.run(scenario()) == "a"


def test_a_serving_engine_whose_server_is_gone_is_drained_without_a_failed_call() -> None:
    """A crashed server that gets no call is still noticed (and so started again): its
    calls in flight continue elsewhere, and it is taken back once its check passes."""
    a = FakeEngine("a", [[((1,), None), WAIT]])
    b = FakeEngine("b", [[((2,), "stop")]])
    router = router_with(a, b)

    async def crash() -> None:
        a.gone = True
        assert await router.check() == ["a"]
        assert router.failed() == ["a"] and router.route("new") == "b"
        assert await router.check() == []  # failed already: still down, not failed again

    items = asyncio.run(consume(router, 2, after_first=crash))
    assert [(engine, d.output_ids) for engine, d in items] == [("a", (1,)), ("b", (2,))]
    a.gone = False
    assert asyncio.run(router.check()) == [] and router.failed() == []
    assert router.route("newer") == "a"


def test_a_serving_engine_that_answers_unhealthy_keeps_its_calls() -> None:
    """A server that answers its health check unhealthy (SGLang's check times out while
    it loads a publication's weights) is no crashed one: nothing is drained."""
    a = FakeEngine("a", [[((1,), None), ((2,), "stop")]], healthy=False)
    router = router_with(a, FakeEngine("b", []))

    async def check() -> None:
        assert await router.check() == []

    items = asyncio.run(consume(router, 2, after_first=check))
    assert [engine for engine, _ in items] == ["a", "a"] and a.aborted == []
    assert router.failed() == [] and router.route("new") == "a"


def test_an_engine_drained_for_a_move_is_not_failed_by_its_health_check() -> None:
    """A cell that moved to training released its engine (or stopped its server): that
    is no failure, and nothing starts it again."""
    a = FakeEngine("a", [], gone=True)
    router = router_with(a, FakeEngine("b", []))

    async def scenario() -> list[str]:
        await router.drain("a")
        return await router.check()

    assert asyncio.run(scenario()) == [] and router.failed() == []
    router.resume("a")
    assert router.route("new") == "a"


@dataclass
class DyingEngine(FakeEngine):
    """Its health check finds the server gone, once ``answer`` is set."""

    gone: bool = True
    asked: asyncio.Event = field(default_factory=asyncio.Event)
    answer: asyncio.Event = field(default_factory=asyncio.Event)

    async def health(self) -> bool:
        self.asked.set()
        await self.answer.wait()
        return await super().health()


def test_a_health_check_that_hangs_delays_no_other_engines_check() -> None:
    slow = DyingEngine("slow", [])  # never answers: a server stuck on a long prefill
    down = FakeEngine("down", [], gone=True)
    router = router_with(down, slow)  # the slow one is asked first

    async def scenario() -> list[str]:
        check = asyncio.ensure_future(router.check())
        await slow.asked.wait()
        while not router.failed():
            await asyncio.sleep(0)
        assert not check.done()
        check.cancel()
        return router.failed()

    assert asyncio.run(asyncio.wait_for(scenario(), 10)) == ["down"]


def test_a_replacement_that_takes_the_place_during_a_check_is_not_failed_for_the_old() -> None:
    """The old server's check ends in a refused connection after its cell's replacement
    took its place (a dead cell's): the replacement keeps serving."""
    old = DyingEngine("a", [])
    router = router_with(old, FakeEngine("b", []))

    async def scenario() -> list[str]:
        check = asyncio.ensure_future(router.check())
        await old.asked.wait()  # the check is asking the old server
        await router.drain("a")
        await router.replace(FakeEngine("a", []))
        old.answer.set()
        return await check

    assert asyncio.run(scenario()) == [] and router.failed() == []
    assert router.route("new") == "a"


@pytest.mark.parametrize(
    ("failure", "retried_at"), [(EngineAborted("aborted"), "a"), (TimeoutError("slow"), "b")]
)
def test_a_call_that_produced_nothing_restarts_from_the_prompt(
    failure: Exception, retried_at: str
) -> None:
    answer: list[Step] = [((4,), None), ((5,), "stop")]
    a = FakeEngine("a", [[failure], list(answer)])
    b = FakeEngine("b", [list(answer)])
    router = router_with(a, b)

    items = asyncio.run(consume(router, 9))

    assert ids_of(items) == [4, 5] and {e for e, _ in items} == {retried_at}
    (retry,) = [*a.requests[1:], *b.requests]  # an abort keeps the route, a failure drains
    assert tuple(retry.input_ids) == PROMPT
    assert retry.sampling == SamplingParams(max_tokens=9)


@pytest.mark.parametrize("max_attempts", [1, 5])
def test_a_budget_spent_before_the_abort_finishes_with_length(max_attempts: int) -> None:
    a = FakeEngine("a", [[((1, 2), None), EngineAborted("drained")]])
    b = FakeEngine("b", [])
    router = router_with(a, b, max_attempts=max_attempts)

    items = asyncio.run(consume(router, 2))

    assert items == [("a", delta((1, 2))), ("a", delta((), "length"))]
    assert b.requests == []


def test_max_attempts_bounds_the_retries_and_each_continues_the_last() -> None:
    a = FakeEngine("a", [[((7,), None), EngineAborted("again")] for _ in range(5)])
    router = router_with(a, max_attempts=3)
    items: list[tuple[str, TokenDelta]] = []

    async def run() -> None:
        async for item in router.stream("ex", request()):
            items.append(item)

    with pytest.raises(NoEngineAvailable, match="gave up after 3 attempts: again"):
        asyncio.run(run())
    assert ids_of(items) == [7, 7, 7]
    assert [tuple(r.input_ids) for r in a.requests] == [PROMPT, (*PROMPT, 7), (*PROMPT, 7, 7)]
    assert [r.sampling.max_tokens for r in a.requests] == [20, 19, 18]
    assert len(a.plans) == 2


def test_closing_the_stream_early_closes_the_engines_stream() -> None:
    a = FakeEngine("a", [[((1,), None), ((2,), None), ((3,), "stop")]])
    router = router_with(a)

    async def run() -> None:
        stream = router.stream("ex", request())
        assert await anext(stream) == ("a", delta((1,)))
        await stream.aclose()
        assert a.closed == [a.requests[0].request_id] and a.load == 0
        # nothing is left in flight: draining aborts no request
        await router.drain("a")
        assert a.aborted == []

    asyncio.run(run())


def test_cancelling_the_consumer_leaves_nothing_in_flight() -> None:
    a = FakeEngine("a", [[((1,), None), WAIT]])
    router = router_with(a)

    async def run() -> None:
        got = asyncio.Event()

        async def consumer() -> None:
            async for _ in router.stream("ex", request()):
                got.set()

        task = asyncio.create_task(consumer())
        await got.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert a.load == 0
        await router.drain("a")
        assert a.aborted == []

    asyncio.run(run())


def test_generate_collects_the_stream_and_names_the_finishing_engine() -> None:
    a = FakeEngine("a", [[((1, 2), None), ConnectionError("reset")]])
    b = FakeEngine("b", [[((3,), None), ((), "stop")]])
    router = router_with(a, b)

    engine, result = asyncio.run(router.generate("ex", request()))

    assert engine == "b"
    assert result == GenerateResult((1, 2, 3), (-0.5,) * 3, (7,) * 3, "stop")


def test_a_continuation_keeps_the_routing_the_tokens_were_sampled_with() -> None:
    # An MoE's routing by position: engine a routes the prompt and samples two tokens,
    # then fails; b recomputes the prompt and both tokens, and samples two more. The
    # result keeps a's rows for the positions a computed (they gave its tokens'
    # log-probs) and b's for the rest: one row per position, none twice.
    def routed(ids: tuple[int, ...], rows: int, expert: int, finish: Any = None) -> TokenDelta:
        routing = np.full((rows, 1, 2), expert, dtype=np.int8)
        return TokenDelta(ids, (-0.5,) * len(ids), (7,) * len(ids), finish, routing)

    prompt = len(PROMPT)
    a = FakeEngine("a", [[routed((1,), prompt, 3), routed((2,), 1, 3), ConnectionError("x")]])
    b = FakeEngine("b", [[routed((3,), prompt + 2, 5), routed((4,), 1, 5, "stop")]])
    engine, result = asyncio.run(router_with(a, b).generate("ex", request()))
    assert engine == "b" and tuple(b.requests[0].input_ids) == (*PROMPT, 1, 2)
    assert result.output_ids == (1, 2, 3, 4)
    assert result.routing is not None
    assert result.routing[:, 0, 0].tolist() == [3] * (prompt + 1) + [5] * 2


@dataclass
class TransferHandoff:
    """A KV-transfer engine's handoff: the destination gets the prompt alone plus a
    handle to the source's state (a tag here), never the produced tokens to recompute."""

    calls: list[tuple[str, str, tuple[int, ...]]] = field(default_factory=list)

    async def continuation(
        self, source: Any, source_request_id: str, request: GenerateRequest, produced: Any
    ) -> GenerateRequest:
        self.calls.append((source.name, source_request_id, tuple(produced)))
        tags = {**request.tags, "kv_from": f"{source.name}/{source_request_id}"}
        return GenerateRequest(request.request_id, request.input_ids, request.sampling, tags)


def test_a_plugged_in_handoff_decides_what_the_destination_runs() -> None:
    a = FakeEngine("a", [[((1, 2), None), WAIT]])
    b = FakeEngine("b", [[((3,), "stop")]])
    router = router_with(a, b)
    router.handoff = handoff = TransferHandoff()

    async def drain() -> None:
        await router.drain("a")

    items = asyncio.run(consume(router, 20, after_first=drain))

    assert ids_of(items) == [1, 2, 3]
    (first,) = a.requests
    (second,) = b.requests
    assert handoff.calls == [("a", first.request_id, (1, 2))]
    assert tuple(second.input_ids) == PROMPT  # the handoff's request, as it made it
    assert second.tags == {"a": "b", "kv_from": f"a/{first.request_id}"}
    assert second.sampling.max_tokens == 18  # the budget is still the router's


def test_no_handoff_for_a_call_that_produced_nothing() -> None:
    a = FakeEngine("a", [[ConnectionResetError("gone")]])
    b = FakeEngine("b", [[((3,), "stop")]])
    router = router_with(a, b)
    router.handoff = handoff = TransferHandoff()

    assert ids_of(asyncio.run(consume(router))) == [3]
    assert handoff.calls == [] and tuple(b.requests[0].input_ids) == PROMPT


def test_a_call_waits_for_an_engine_to_accept_again_within_engine_wait_s() -> None:
    async def main() -> None:
        engine = FakeEngine("cell-1", [[((1,), None), WAIT], [((2,), "stop")]])
        router = router_with(engine)
        router.engine_wait_s = 3600.0  # a cell on its way back to rollout
        call = asyncio.create_task(consume(router, after_first=lambda: router.drain("cell-1")))
        while not engine.aborted:  # the only engine is drained mid-call
            await asyncio.sleep(0)
        for _ in range(20):
            await asyncio.sleep(0)
        assert not call.done() and len(engine.requests) == 1  # held, not answered 529
        router.resume("cell-1")
        out = await call
        assert [d.output_ids for _, d in out] == [(1,), (2,)]  # continued after it
        router.engine_wait_s = 0.0  # at once: 529
        await router.drain("cell-1")
        with pytest.raises(NoEngineAvailable, match="no inference engine is accepting"):
            await consume(router)

    asyncio.run(main())


def test_a_call_that_came_before_any_engine_goes_on_once_one_registers() -> None:
    """A restarted run's proxy is back before its engines: the harnesses' calls wait for
    the first engine to register, not for ``engine_wait_s`` to run out."""

    async def main() -> None:
        router = Router(engine_wait_s=3600.0)
        call = asyncio.create_task(consume(router))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not call.done()
        router.register(FakeEngine("cell-0", [[((7,), "stop")]]), 0)
        out = await asyncio.wait_for(call, 10)
        assert [d.output_ids for _, d in out] == [(7,)]

    asyncio.run(main())
