"""The embedded engine in its own server, driven by the SGLang client (as a cell's would be)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from aiohttp import web
from tests.test_engine_embedded import idle, running, slow_and_counted

from qwengyre.engines.base import (
    EngineAborted,
    GenerateRequest,
    GenerateResult,
    Joined,
    TokenDelta,
)
from qwengyre.engines.embedded import EmbeddedEngine, behaviour_logprobs
from qwengyre.engines.launch import routed_experts_shape
from qwengyre.engines.server import engine_app
from qwengyre.engines.sglang import SGLangEngine
from qwengyre.proxy.routing import Router
from qwengyre.types import SamplingParams

KEY = "engine-key-0123456789"


@pytest.fixture
def served(tiny_model_dir: Path) -> Iterator[tuple[str, EmbeddedEngine]]:
    with serving(tiny_model_dir) as started:
        yield started


@contextlib.contextmanager
def serving(model_dir: Path) -> Iterator[tuple[str, EmbeddedEngine]]:
    """The embedded engine of ``model_dir`` behind the engine server, on a free port."""
    engine = EmbeddedEngine(model_dir, capacity=4, max_context=512)
    loop = asyncio.new_event_loop()
    box: dict[str, object] = {}
    ready = threading.Event()

    async def boot() -> None:
        runner = web.AppRunner(engine_app(engine, KEY))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        box["runner"], box["url"] = runner, f"http://127.0.0.1:{runner.addresses[0][1]}"
        ready.set()

    threading.Thread(target=loop.run_forever, daemon=True).start()
    asyncio.run_coroutine_threadsafe(boot(), loop)
    assert ready.wait(30)
    yield str(box["url"]), engine
    asyncio.run_coroutine_threadsafe(box["runner"].cleanup(), loop).result(30)  # type: ignore[attr-defined]
    loop.call_soon_threadsafe(loop.stop)
    engine.close()


def req(rid: str, n: int, prompt: int = 6) -> GenerateRequest:
    sampling = SamplingParams(max_tokens=n, temperature=1.0, ignore_eos=True)
    return GenerateRequest(rid, tuple(range(30, 30 + prompt)), sampling)


def test_the_sglang_client_drives_the_embedded_engine_server(served):
    url, engine = served

    async def scenario() -> None:
        async with SGLangEngine(url, "cell-0", api_key=KEY) as client:
            assert await client.health()
            result = await client.generate(req("a", 12))
            assert len(result.output_ids) == 12 and result.finish_reason == "length"
            ids = torch.tensor([list(range(30, 36)) + list(result.output_ids)])
            with torch.inference_mode():
                logits = engine.model(input_ids=ids).logits[0]
            ref = behaviour_logprobs(logits[5:-1], torch.tensor(result.output_ids), 1.0)
            assert torch.allclose(torch.tensor(result.logprobs), ref, atol=1e-4)
            with pytest.raises(ValueError, match="out of vocabulary"):
                await client.generate(
                    GenerateRequest("e", (1, 10**7), SamplingParams(max_tokens=2))
                )
        async with SGLangEngine(url, "cell-0", api_key="wrong") as stranger:
            with pytest.raises(ValueError, match="401"):
                await stranger.generate(req("f", 2))

    asyncio.run(scenario())


def test_unknown_sampling_fields_are_refused(served):
    import httpx2

    url, _ = served
    answer = httpx2.post(
        url + "/generate",
        json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "beam_width": 4}},
        headers={"authorization": f"Bearer {KEY}"},
    )
    assert answer.status_code == 400 and "beam_width" in answer.json()["error"]["message"]


def test_the_server_honours_stop_strings(served, tiny_model_dir: Path):
    from transformers import AutoTokenizer

    url, _ = served
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tuple(range(30, 36))

    def greedy(*stop: str) -> GenerateRequest:
        return GenerateRequest(
            "s", prompt, SamplingParams(max_tokens=16, temperature=0.0, stop=stop, ignore_eos=True)
        )

    async def scenario() -> None:
        async with SGLangEngine(url, "cell-0", api_key=KEY) as client:
            plain = await client.generate(greedy())
            stop = tokenizer.decode(plain.output_ids[:3], skip_special_tokens=True)[-2:]
            stopped = await client.generate(greedy(stop))
            assert stopped.finish_reason == "stop" and len(stopped.output_ids) < 16
            assert stopped.output_ids == plain.output_ids[: len(stopped.output_ids)]
            assert tokenizer.decode(stopped.output_ids, skip_special_tokens=True).endswith(stop)
            absent = await client.generate(greedy("never in this reply"))
            assert (absent.output_ids, absent.finish_reason) == (plain.output_ids, "length")

    asyncio.run(scenario())


def test_a_client_leaving_the_stream_aborts_the_engine_request(served, monkeypatch):
    url, engine = served
    sampled = slow_and_counted(engine, monkeypatch)

    async def scenario() -> None:
        async with SGLangEngine(url, "cell-0", api_key=KEY) as client:
            stream = client.stream(req("long", 400))
            assert (await anext(stream)).output_ids
            await stream.aclose()
            await idle(engine)

    asyncio.run(scenario())
    assert 0 < len(sampled) < 400


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_hanging_up_aborts_the_engine_request(served, monkeypatch, stream):
    """No /abort_request: the server notices the closed connection by itself."""
    import aiohttp

    url, engine = served
    sampled = slow_and_counted(engine, monkeypatch)
    body = SGLangEngine.request_body(req("hangup", 400))
    body["stream"] = stream

    async def scenario() -> None:
        session = aiohttp.ClientSession(headers={"authorization": f"Bearer {KEY}"})
        post = asyncio.ensure_future(session.post(url + "/generate", json=body))
        await running(engine)
        if stream:
            response = await post
            assert (await response.content.readline()).startswith(b"data: ")
        else:
            post.cancel()
        await session.close()
        await idle(engine)

    asyncio.run(scenario())
    assert 0 < len(sampled) < 400


# -- routed experts (an MoE's, SGLang's return_routed_experts) ------------------------------

GREEDY_PROMPT = (30, 31, 32, 33, 34, 35, 36)


def greedy(rid: str, n: int = 6) -> GenerateRequest:
    return GenerateRequest(
        rid, GREEDY_PROMPT, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    )


def sglang_routed_experts(meta_info: dict[str, object], layers: int, k: int) -> np.ndarray:
    """What SGLang's ``extract_routed_experts_from_meta_info`` decodes (int32), shaped."""
    encoded = meta_info["routed_experts"]
    assert isinstance(encoded, str)
    return np.frombuffer(base64.b64decode(encoded), dtype=np.int32).reshape(-1, layers, k)


def test_an_moes_routed_experts_through_the_server_are_the_engines_own(tiny_moe_model_dir):
    """By position, streamed and not: what the engine reports in
    process, the rows on the last delta (SGLang sends them with its last chunk)."""
    shape = routed_experts_shape(tiny_moe_model_dir)
    assert shape == (2, 2)
    with serving(tiny_moe_model_dir) as (url, engine):

        async def scenario() -> None:
            own = await engine.generate(greedy("own"))
            assert own.routing is not None and own.routing.shape == (7 + 6 - 1, 2, 2)
            async with SGLangEngine(url, "cell-0", api_key=KEY, routed_experts=shape) as client:
                deltas: list[TokenDelta] = [d async for d in client.stream(greedy("streamed"))]
                again = await client.generate(greedy("again"))  # not streamed
            assert [d.output_ids for d in deltas[:1]] and len(deltas) > 1
            assert all(d.routing is not None and d.routing.shape == (0, 2, 2) for d in deltas[:-1])
            last = deltas[-1].routing
            assert last is not None and last.dtype == np.int8
            assert np.array_equal(last, own.routing)
            assert sum(len(d.output_ids) for d in deltas) == 6
            assert again.output_ids == own.output_ids
            assert again.routing is not None and np.array_equal(again.routing, own.routing)

        asyncio.run(scenario())
        expected = asyncio.run(engine.generate(greedy("ref"))).routing
        assert expected is not None

        import httpx2

        body = SGLangEngine.request_body(greedy("wire"), routed_experts=True)
        headers = {"authorization": f"Bearer {KEY}"}
        with httpx2.stream("POST", url + "/generate", json=body, headers=headers) as answer:
            chunks = [
                json.loads(line[5:]) for line in answer.iter_lines() if line.startswith("data: {")
            ]
        assert len(chunks) > 1 and chunks[-1]["meta_info"]["finish_reason"] is not None
        assert [("routed_experts" in c["meta_info"]) for c in chunks[-2:]] == [False, True]
        assert not any("routed_experts" in c["meta_info"] for c in chunks[:-1])
        assert np.array_equal(sglang_routed_experts(chunks[-1]["meta_info"], 2, 2), expected)
        body.update(stream=False, rid="plain")
        plain = httpx2.post(url + "/generate", json=body, headers=headers).json()
        assert np.array_equal(sglang_routed_experts(plain["meta_info"], 2, 2), expected)
        del body["return_routed_experts"]  # not asked: none, streaming or not
        body["rid"] = "unasked"
        unasked = httpx2.post(url + "/generate", json=body, headers=headers).json()
        assert unasked["output_ids"] and "routed_experts" not in unasked["meta_info"]
        body.update(stream=True, rid="unasked-streamed")
        with httpx2.stream("POST", url + "/generate", json=body, headers=headers) as answer:
            lines = [line for line in answer.iter_lines() if line.startswith("data: {")]
        assert len(lines) > 1 and not any("routed_experts" in line for line in lines)


def test_an_aborted_moe_request_sends_the_routing_of_the_tokens_it_answered(
    tiny_moe_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A drain aborts a call mid-stream: before :class:`EngineAborted`, the client yields
    a delta without tokens whose rows are the positions before the tokens answered, the
    engine's own (the router keeps them for the continuation elsewhere)."""
    with serving(tiny_moe_model_dir) as (url, engine):

        async def scenario() -> tuple[list[TokenDelta], np.ndarray]:
            full = await engine.generate(greedy("ref", 200))
            assert full.routing is not None
            slow_and_counted(engine, monkeypatch)
            deltas: list[TokenDelta] = []
            async with SGLangEngine(url, "cell-0", api_key=KEY, routed_experts=(2, 2)) as client:
                with pytest.raises(EngineAborted):
                    async for delta in client.stream(greedy("drained", 200)):
                        deltas.append(delta)
                        if sum(len(d.output_ids) for d in deltas) >= 3:
                            await client.abort("drained")
            return deltas, full.routing

        deltas, reference = asyncio.run(scenario())
    *answered, last = deltas
    tokens = sum(len(d.output_ids) for d in answered)
    assert 3 <= tokens < 200 and not last.output_ids and last.finish_reason is None
    assert last.routing is not None
    np.testing.assert_array_equal(last.routing, reference[: len(GREEDY_PROMPT) + tokens - 1])


def test_a_call_continued_after_a_drain_keeps_the_first_engines_routing(
    tiny_moe_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two cells' servers, the second with other router weights: a call drained from the
    first after a few tokens ends on the second, and its rows before those tokens are
    the first engine's (they were sampled under them), not the second's recompute."""
    with serving(tiny_moe_model_dir) as (url_a, a), serving(tiny_moe_model_dir) as (url_b, b):
        with torch.no_grad():
            for name, weight in b.model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    weight.add_(torch.randn_like(weight), alpha=10.0)

        async def scenario() -> tuple[GenerateResult, int, np.ndarray, np.ndarray]:
            own_a = (await a.generate(greedy("a", 40))).routing
            own_b = (await b.generate(greedy("b", 8))).routing
            assert own_a is not None and own_b is not None
            slow_and_counted(a, monkeypatch)
            joined, by_first, drain = Joined(), 0, None
            async with (
                SGLangEngine(url_a, "cell-0", api_key=KEY, routed_experts=(2, 2)) as first,
                SGLangEngine(url_b, "cell-1", api_key=KEY, routed_experts=(2, 2)) as second,
            ):
                router = Router()
                router.register(first, preference=2)
                router.register(second, preference=1)
                async for name, delta in router.stream("exec", greedy("call", 40)):
                    joined.add(delta)
                    if name == "cell-0":
                        by_first += len(delta.output_ids)
                    if by_first >= 3 and drain is None:  # a task: the drain waits for us
                        drain = asyncio.ensure_future(router.drain("cell-0"))
                assert drain is not None
                await drain
            return joined.result(), by_first, own_a, own_b

        result, by_first, own_a, own_b = asyncio.run(scenario())
    prompt = len(GREEDY_PROMPT)
    assert 3 <= by_first < 40 and len(result.output_ids) == 40
    assert result.routing is not None and len(result.routing) == prompt + 40 - 1
    first = prompt + by_first - 1  # the rows before the first engine's tokens
    np.testing.assert_array_equal(result.routing[:first], own_a[:first])
    assert not np.array_equal(own_a[:prompt], own_b[:prompt])  # the second routes otherwise


def test_a_dense_model_and_an_unasking_client_get_no_routed_experts(served, tiny_moe_model_dir):
    url, _ = served  # the dense tiny model

    async def ask(url: str, shape: tuple[int, int] | None) -> list[TokenDelta]:
        async with SGLangEngine(url, "cell-0", api_key=KEY, routed_experts=shape) as client:
            return [d async for d in client.stream(greedy("r"))]

    dense = asyncio.run(ask(url, (2, 2)))  # asked, but the engine reports none
    assert dense[-1].routing is None and dense[-1].output_ids

    async def generate(url: str) -> GenerateResult:
        async with SGLangEngine(url, "cell-0", api_key=KEY, routed_experts=(2, 2)) as client:
            return await client.generate(greedy("g"))

    assert asyncio.run(generate(url)).routing is None
    with serving(tiny_moe_model_dir) as (moe_url, _):
        unasked = asyncio.run(ask(moe_url, None))
    assert all(d.routing is None for d in unasked)
