"""The engine interface's contract (:class:`~qwengyre.engines.base.InferenceEngine`),
asserted of every implementation:

- ``scripted``: :class:`~qwengyre.engines.scripted.ScriptedEngine`;
- ``embedded``: :class:`~qwengyre.engines.embedded.EmbeddedEngine` in this process;
- ``served``: the SGLang client (:class:`~qwengyre.engines.sglang.SGLangEngine`) of an
  embedded engine behind its server (:func:`~qwengyre.engines.server.engine_app`), as
  a cell's engine is driven;
- ``sglang-fake``: the SGLang client against the contract fake of SGLang's HTTP API
  (tests/sglang_fake.py);
- ``vllm``: :class:`~qwengyre.engines.vllm.VLLMEngine` against a real vLLM CPU server
  (skipped unless ``QWENGYRE_VLLM_PYTHON`` names a vLLM venv's python; see
  tests/test_engine_vllm.py).

A case an implementation cannot meet is marked in its parametrisation with the reason.
What is particular to one engine (log-probs against a recompute, wire formats, crash
handling) stays in that engine's own tests.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from tests.contracts import implementations
from tests.sglang_fake import FakeSGLang
from tests.test_engine_vllm import Server, perturbed_copy, serving
from transformers import AutoTokenizer

from qwengyre.engines.base import (
    EngineAborted,
    GenerateRequest,
    GenerateResult,
    InferenceEngine,
    WeightsOnDisk,
    WeightSource,
    collect,
)
from qwengyre.engines.embedded import EmbeddedEngine
from qwengyre.engines.scripted import ScriptedEngine
from qwengyre.engines.server import engine_app
from qwengyre.engines.sglang import SGLangEngine
from qwengyre.engines.vllm import VLLMEngine
from qwengyre.types import SamplingParams

PROMPT = tuple(range(30, 36))
REPLY = "Hello world, this is a test of the scripted engine: its reply streams in parts."
KEY = "engine-key-0123456789"


@dataclass
class Subject:
    """An engine under contract, and what driving it needs: ``long_tokens`` makes a
    request still running when its first tokens come; ``new_weights`` writes weights
    other than the served ones into a directory and returns them."""

    engine: InferenceEngine
    long_tokens: int
    new_weights: Callable[[Path], WeightSource]


@dataclass(frozen=True)
class Setting:
    """What the implementations are built from."""

    model_dir: Path
    tmp_path: Path
    vllm: Server | None  # the module's vLLM server, for the vllm implementation only


def greedy(rid: str) -> GenerateRequest:
    return GenerateRequest(
        rid, PROMPT, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    )


def long(subject: Subject, rid: str) -> GenerateRequest:
    sampling = SamplingParams(max_tokens=subject.long_tokens, temperature=1.0, ignore_eos=True)
    return GenerateRequest(rid, PROMPT, sampling)


_NOISE_SEEDS = itertools.count(1)
"""Every moved copy differs from the others: tests that share a server must not load
the weights an earlier test left it with (an update would then change nothing)."""


def moved(model: Path) -> Callable[[Path], WeightSource]:
    """Writes ``model``'s weights, moved by noise, into a directory."""
    return lambda out: WeightsOnDisk(str(perturbed_copy(model, out, next(_NOISE_SEEDS))))


@asynccontextmanager
async def scripted(setting: Setting) -> AsyncIterator[Subject]:
    tokenizer = AutoTokenizer.from_pretrained(setting.model_dir)
    engine = ScriptedEngine(tokenizer, {"default": [REPLY]}, delay_s=0.4)
    yield Subject(engine, 64, lambda out: WeightsOnDisk(str(out)))  # a reply takes delay_s


@asynccontextmanager
async def embedded(setting: Setting) -> AsyncIterator[Subject]:
    engine = EmbeddedEngine(setting.model_dir, capacity=4, max_context=256)
    try:
        yield Subject(engine, 240, moved(setting.model_dir))
    finally:
        engine.close()


@asynccontextmanager
async def served(setting: Setting) -> AsyncIterator[Subject]:
    engine = EmbeddedEngine(setting.model_dir, capacity=4, max_context=256)
    runner = web.AppRunner(engine_app(engine, KEY))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with SGLangEngine(url, "served", api_key=KEY) as client:
            yield Subject(client, 240, moved(setting.model_dir))
    finally:
        await runner.cleanup()
        engine.close()


@asynccontextmanager
async def sglang_fake(setting: Setting) -> AsyncIterator[Subject]:
    fake = FakeSGLang(token_delay_s=0.01, api_key=KEY)
    await fake.start()
    try:
        async with SGLangEngine(fake.base_url, "sg0", api_key=KEY) as engine:
            # the fake's model changes with every load, whatever the directory holds
            yield Subject(engine, 100, lambda out: WeightsOnDisk(str(setting.tmp_path)))
    finally:
        await fake.stop()


@asynccontextmanager
async def vllm(setting: Setting) -> AsyncIterator[Subject]:
    server = setting.vllm
    assert server is not None
    try:
        async with VLLMEngine(server.base_url, "vllm0", api_key=server.api_key) as engine:
            yield Subject(engine, 1500, moved(server.model))
    except BaseException:
        print(server.log.read_text(errors="replace")[-3000:], file=sys.stderr)
        raise


Build = Callable[[Setting], AbstractAsyncContextManager[Subject]]
IMPLEMENTATIONS: dict[str, Build] = {
    "scripted": scripted,
    "embedded": embedded,
    "served": served,
    "sglang-fake": sglang_fake,
    "vllm": vllm,
}


def engines(**cannot: str) -> pytest.MarkDecorator:
    """Parametrise a case over every engine (see :func:`tests.contracts.implementations`)."""
    return pytest.mark.parametrize("name", implementations(IMPLEMENTATIONS, **cannot))


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(tmp_path_factory) as started:
        yield started


Drive = Callable[[Callable[[Subject], Awaitable[None]]], None]


@pytest.fixture
def drive(request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path: Path) -> Drive:
    """Runs a test's coroutine against the implementation the test is parametrised with."""
    name = request.node.callspec.params["name"]
    server = request.getfixturevalue("vllm_server") if name == "vllm" else None  # or skip
    setting = Setting(tiny_model_dir, tmp_path, server)

    def run(test: Callable[[Subject], Awaitable[None]]) -> None:
        async def main() -> None:
            async with IMPLEMENTATIONS[name](setting) as subject:
                await asyncio.wait_for(test(subject), 120)

        asyncio.run(main())

    return run


async def until_idle(engine: InferenceEngine) -> None:
    """Until no request is in flight (an abort may take a step to land)."""
    while engine.load:
        await asyncio.sleep(0.005)


@engines()
def test_streamed_deltas_collect_to_the_generated_result(name: str, drive: Drive) -> None:
    async def t(subject: Subject) -> None:
        engine = subject.engine
        deltas = []
        async for delta in engine.stream(greedy("s")):
            assert deltas or engine.load == 1  # in flight when its first tokens come
            deltas.append(delta)
        assert engine.load == 0
        assert len(deltas) > 1 and deltas[0].output_ids
        assert [d.finish_reason is None for d in deltas] == [True] * (len(deltas) - 1) + [False]

        async def again() -> AsyncIterator[Any]:
            for delta in deltas:
                yield delta

        streamed = await collect(again())
        assert streamed == await engine.generate(greedy("g"))
        assert len(streamed.output_ids) == len(streamed.versions) == 16

    drive(t)


@engines()
def test_an_abort_stops_its_request_and_the_engine_serves_on(name: str, drive: Drive) -> None:
    async def t(subject: Subject) -> None:
        engine = subject.engine
        victim = engine.stream(long(subject, "victim"))
        other = asyncio.ensure_future(engine.generate(greedy("other")))
        assert (await anext(victim)).finish_reason is None
        await engine.abort("victim")
        await engine.abort("not-in-flight")  # nothing happens
        with pytest.raises(EngineAborted):
            async for _ in victim:
                pass
        assert len((await other).output_ids) == 16  # the request beside it finished
        left = engine.stream(long(subject, "left"))  # a consumer that leaves aborts too
        await anext(left)
        await left.aclose()
        await asyncio.wait_for(until_idle(engine), 10)
        assert len((await engine.generate(greedy("after"))).output_ids) == 16

    drive(t)


async def update_while_streaming(
    subject: Subject, source: WeightSource, version: int
) -> tuple[GenerateResult, GenerateResult]:
    """The result of a request streaming while ``version`` is loaded, and of one after."""
    engine = subject.engine
    stream = engine.stream(greedy("during"))
    first = await anext(stream)
    update = asyncio.ensure_future(engine.update_weights(source, version))

    async def rest() -> AsyncIterator[Any]:
        yield first
        async for delta in stream:
            yield delta

    during = await collect(rest())
    await update
    return during, await engine.generate(greedy("after"))


@engines()
def test_tokens_carry_the_version_of_the_weights_that_sampled_them(
    name: str, drive: Drive, tmp_path: Path
) -> None:
    async def t(subject: Subject) -> None:
        before = await subject.engine.generate(greedy("before"))
        (old,) = set(before.versions)
        new = old + 1
        during, after = await update_while_streaming(
            subject, subject.new_weights(tmp_path / "new"), new
        )
        # the request in flight was not dropped; no token of it goes back to the old weights
        assert len(during.output_ids) == 16 and during.versions[0] == old
        assert list(during.versions) == sorted(during.versions)
        assert set(during.versions) <= {old, new}
        assert after.versions == (new,) * 16 and after.policy_version == new

    drive(t)


@engines(scripted="a script has no weights: an update changes only the version")
def test_new_weights_change_what_is_sampled(name: str, drive: Drive, tmp_path: Path) -> None:
    async def t(subject: Subject) -> None:
        before = await subject.engine.generate(greedy("before"))
        await subject.engine.update_weights(
            subject.new_weights(tmp_path / "new"), max(before.versions) + 1
        )
        after = await subject.engine.generate(greedy("after"))
        assert (after.output_ids, after.logprobs) != (before.output_ids, before.logprobs)

    drive(t)


@engines(scripted="a script holds no memory to release: it replies while released")
def test_released_memory_refuses_requests_and_resumed_serves_as_before(
    name: str, drive: Drive
) -> None:
    async def t(subject: Subject) -> None:
        engine = subject.engine
        before = await engine.generate(greedy("before"))
        await engine.release_memory()
        assert not await engine.health()
        with pytest.raises((EngineAborted, OSError)):  # the router reroutes on both
            await engine.generate(greedy("during"))
        await engine.resume_memory()
        assert await engine.health()
        assert await engine.generate(greedy("after")) == before

    drive(t)


@pytest.mark.parametrize("name", ["scripted"])
def test_the_scripted_engine_is_unhealthy_while_released(name: str, drive: Drive) -> None:
    """What of the release contract a script meets: health follows it."""

    async def t(subject: Subject) -> None:
        await subject.engine.release_memory()
        assert not await subject.engine.health()
        await subject.engine.resume_memory()
        assert await subject.engine.health()

    drive(t)
