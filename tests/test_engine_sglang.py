"""SGLangEngine against the contract fake of SGLang's HTTP API (tests/sglang_fake.py)
and a recorder of its tensor route, plus one real-server test where sglang and a GPU
are present."""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import socket
import stat
import subprocess
import sys
from collections.abc import Awaitable, Callable, Sequence
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from aiohttp import web

sys.path.insert(0, str(Path(__file__).parent))

from qwengyre.engines.base import (
    EngineAborted,
    GenerateRequest,
    TokenDelta,
    WeightsByName,
    WeightsInMemory,
    WeightsOnDisk,
    collect,
)
from qwengyre.engines.http_client import sse_data
from qwengyre.engines.launch import (
    ServerPlacement,
    launch,
    routed_experts_shape,
    wait_until_healthy,
    write_private,
)
from qwengyre.engines.sglang import (
    SGLangBackend,
    SGLangEngine,
    SGLangNotInstalled,
    SGLangServerSpec,
    TensorRoute,
    TensorRouteUnavailable,
    serialize_tensors,
    tensor_buckets,
)
from qwengyre.proxy.routing import Router
from qwengyre.types import SamplingParams
from sglang_fake import FakeSGLang, logprob, reply, routed, token_text

PROMPT = [101, 7, 42, 9]


def req(rid: str, ids: list[int] = PROMPT, **sampling: Any) -> GenerateRequest:
    sampling.setdefault("max_tokens", 64)
    return GenerateRequest(rid, ids, SamplingParams(**sampling))


def run_with_fake(
    test: Callable[[FakeSGLang, SGLangEngine], Awaitable[None]],
    *,
    shape: tuple[int, int] | None = None,
    **fake_kwargs: Any,
) -> None:
    """``test`` against the fake made with ``fake_kwargs``, its client asking for
    routed experts of ``shape`` (None: not asked)."""

    async def main() -> None:
        fake = FakeSGLang(**fake_kwargs)
        await fake.start()
        engine = SGLangEngine(fake.base_url, "sg0", api_key=fake.api_key, routed_experts=shape)
        try:
            await asyncio.wait_for(test(fake, engine), timeout=10)
        finally:
            await engine.close()
            await fake.stop()

    asyncio.run(main())


def test_generate_maps_ids_logprobs_and_stop() -> None:
    async def t(fake: FakeSGLang, engine: SGLangEngine) -> None:
        result = await engine.generate(req("r1"))
        expected = reply(PROMPT)
        assert result.output_ids == tuple(expected)
        assert result.output_ids[-1] == fake.eos_token_id
        assert result.logprobs == tuple(logprob(t, i) for i, t in enumerate(expected))
        assert result.finish_reason == "stop"
        assert result.versions == (0,) * len(expected)
        assert engine.load == 0

    run_with_fake(t)


def test_generate_length_and_stop_string() -> None:
    async def t(fake: FakeSGLang, engine: SGLangEngine) -> None:
        expected = reply(PROMPT)
        short = await engine.generate(req("r1", max_tokens=2))
        assert short.finish_reason == "length"
        assert short.output_ids == tuple(expected[:2])
        # a stop string that the second token completes
        stop = token_text(expected[1]).strip()
        stopped = await engine.generate(req("r2", stop=(stop,)))
        assert stopped.finish_reason == "stop"
        assert stopped.output_ids == tuple(expected[:2])
        assert len(stopped.logprobs) == 2

    run_with_fake(t)


@pytest.mark.parametrize("incremental", [False, True])
def test_stream_yields_each_chunk_s_new_tokens(incremental: bool) -> None:
    """SGLang's chunks repeat all the output by default, or hold only the new tokens."""

    async def t(fake: FakeSGLang, engine: SGLangEngine) -> None:
        expected = reply(PROMPT)
        seen = []
        async for delta in engine.stream(req("s1")):
            seen.append(delta)
            assert engine.load == 1 and (delta.finish_reason or fake._running)  # still running
        assert [d.output_ids for d in seen] == [(t,) for t in expected]  # one per chunk
        assert [d.finish_reason for d in seen] == [None] * (len(expected) - 1) + ["stop"]
        logprobs = [lp for d in seen for lp in d.logprobs]
        assert logprobs == [logprob(t, i) for i, t in enumerate(expected)]
        assert engine.load == 0

    run_with_fake(t, token_delay_s=0.01, incremental_streaming_output=incremental)


@pytest.mark.parametrize("leave", ["aclose", "cancel"])
def test_a_consumer_that_leaves_the_stream_aborts_on_the_server(leave: str) -> None:
    async def t(fake: FakeSGLang, engine: SGLangEngine) -> None:
        stream = engine.stream(req("gone", max_tokens=500, ignore_eos=True))
        if leave == "aclose":
            assert (await anext(stream)).output_ids
            await stream.aclose()
        else:
            task = asyncio.ensure_future(collect(stream))
            while not fake._running:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert engine.load == 0
        started = asyncio.get_running_loop().time()
        while fake._running or not fake.bodies("/abort_request"):
            await asyncio.sleep(0.01)
        # Aborted, not finished: 500 tokens take 5 s (the bound is loose for a busy machine).
        assert asyncio.get_running_loop().time() - started < 2.5
        assert fake.bodies("/abort_request") == [{"rid": "gone"}]

    run_with_fake(t, token_delay_s=0.01)


def test_stream_chunks_of_errors_and_aborts_map_as_without_streaming() -> None:
    engine = SGLangEngine("http://127.0.0.1:1", "sg")

    def meta(finish: Any, triples: list[Any], total: int) -> dict[str, Any]:
        return {
            "meta_info": {
                "finish_reason": finish,
                "output_token_logprobs": triples,
                "completion_tokens": total,
            }
        }

    with pytest.raises(ValueError, match="top_p must be"):
        engine._delta("r", {"error": {"message": "top_p must be in (0, 1], got 2."}}, 0, 4)
    with pytest.raises(ValueError, match="too long"):
        engine._delta(
            "r", meta({"type": "abort", "status_code": 400, "message": "too long"}, [], 0), 0, 4
        )
    with pytest.raises(EngineAborted, match="Aborted"):
        engine._delta("r", meta({"type": "abort", "message": "Aborted"}, [], 0), 0, 4)
    with pytest.raises(ConnectionError, match="3 tokens and 1 log-probs after 0"):
        engine._delta("r", meta(None, [[-0.1, 5, None]], 3), 0, 4)
    cumulative = engine._delta("r", meta(None, [[-0.1, 5, None], [-0.2, 6, None]], 2), 1, 4)
    incremental = engine._delta("r", meta(None, [[-0.2, 6, None]], 2), 1, 4)
    assert cumulative == incremental == TokenDelta((6,), (-0.2,), (0,))


def test_sse_lines_of_any_length_are_read() -> None:
    class Content:
        def __init__(self, *blocks: bytes) -> None:
            self.blocks = blocks

        async def iter_any(self) -> Any:
            for block in self.blocks:
                yield block

    long = "x" * 1_000_000  # past aiohttp's line buffer (2 x 64 KiB)
    body = f'data: {{"a": "{long}"}}\n\n: comment\ndata: [DONE]\n\n'.encode()
    blocks = [body[i : i + 65536] for i in range(0, len(body), 65536)]

    async def read() -> list[str]:
        return [data async for data in sse_data(Content(*blocks))]

    assert asyncio.run(read()) == [f'{{"a": "{long}"}}', "[DONE]"]


def test_request_body_uses_sglang_field_names() -> None:
    async def t(fake: FakeSGLang, engine: SGLangEngine) -> None:
        await engine.generate(
            req("rid-7", max_tokens=5, temperature=0.5, top_p=0.9, top_k=20, stop=("x",))
        )
        (body,) = fake.bodies("/generate")
        assert body["input_ids"] == PROMPT
        assert body["rid"] == "rid-7"
        assert body["return_logprob"] is True
        assert body["logprob_start_len"] == -1
        assert body["stream"] is True
        sp = body["sampling_params"]
        assert sp["max_new_tokens"] == 5
        assert "max_tokens" not in sp
        assert (sp["temperature"], sp["top_p"], sp["top_k"], sp["stop"]) == (0.5, 0.9, 20, ["x"])

    run_with_fake(t)


@pytest.mark.parametrize("incremental", [False, True])
def test_routed_experts_come_by_position_with_the_last_chunk(incremental: bool) -> None:
    """SGLang sends them once, on its last chunk: the earlier deltas carry zero rows, the
    last all ``len(prompt) + len(output) - 1``; streamed or not, they join alike."""

    async def t(fake: FakeSGLang, engine: SGLangEngine) -> None:
        deltas = [d async for d in engine.stream(req("r1", max_tokens=5, ignore_eos=True))]
        (body,) = fake.bodies("/generate")
        assert body["return_routed_experts"] is True
        out = [t for d in deltas for t in d.output_ids]
        # the fake's "length" chunk has no token: the last delta carries rows only
        assert len(out) == 5 and len(deltas) == 6 and not deltas[-1].output_ids
        assert [d.routing.shape for d in deltas[:-1] if d.routing is not None] == [(0, 3, 2)] * 5
        expected = routed(PROMPT + out, 3, 2)[: len(PROMPT) + 4]
        last = deltas[-1].routing
        assert last is not None and last.dtype == np.int8 and np.array_equal(last, expected)
        result = await engine.generate(req("r2", max_tokens=5, ignore_eos=True))
        assert result.output_ids == tuple(out)
        assert result.routing is not None and np.array_equal(result.routing, expected)

    run_with_fake(t, shape=(3, 2), routed_experts=(3, 2), incremental_streaming_output=incremental)


def test_routed_experts_not_asked_or_not_sent_are_none() -> None:
    async def unasked(fake: FakeSGLang, engine: SGLangEngine) -> None:
        deltas = [d async for d in engine.stream(req("u", max_tokens=3, ignore_eos=True))]
        assert "return_routed_experts" not in fake.bodies("/generate")[0]
        assert deltas and all(d.routing is None for d in deltas)

    async def unsent(fake: FakeSGLang, engine: SGLangEngine) -> None:
        # a server without --enable-return-routed-experts sends no key
        result = await engine.generate(req("n", max_tokens=3, ignore_eos=True))
        assert fake.bodies("/generate")[0]["return_routed_experts"] is True
        assert len(result.output_ids) == 3 and result.routing is None

    run_with_fake(unasked, routed_experts=(3, 2))
    run_with_fake(unsent, shape=(3, 2))


def test_routed_experts_of_another_shape_are_a_connection_error() -> None:
    async def t(fake: FakeSGLang, engine: SGLangEngine) -> None:
        with pytest.raises(ConnectionError, match="routed experts"):
            await engine.generate(req("w", max_tokens=3, ignore_eos=True))

    run_with_fake(t, shape=(4, 2), routed_experts=(3, 2))


def write_config(directory: Path, **config: Any) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def placed(model: Path, work: Path, routed_experts: bool, device: str) -> ServerPlacement:
    """A server of ``model`` on ``device`` (one GPU, or the CPU), asked for routed
    experts or not."""
    return ServerPlacement(
        model=str(model),
        host="127.0.0.1",
        port=1,
        api_key="k",
        device=device,
        gpus=("0",) if device != "cpu" else (),
        max_context=None,
        version=-1,
        work=work,
        routed_experts=routed_experts,
    )


def test_routed_experts_shape_and_the_servers_flag(tmp_path: Path) -> None:
    moe = write_config(tmp_path / "moe", num_hidden_layers=48, num_experts_per_tok=8)
    dense = write_config(tmp_path / "dense", num_hidden_layers=4)
    mixed = write_config(
        tmp_path / "mixed", num_hidden_layers=4, num_experts_per_tok=2, mlp_only_layers=[0]
    )
    nested = write_config(
        tmp_path / "vl", text_config={"num_hidden_layers": 2, "num_experts_per_tok": 4}
    )
    assert routed_experts_shape(moe) == (48, 8) and routed_experts_shape(nested) == (2, 4)
    assert routed_experts_shape(dense) is None and routed_experts_shape(mixed) is None
    assert routed_experts_shape(tmp_path / "missing") is None

    def argv(model: Path, asked: bool, device: str = "cuda:0") -> list[str]:
        return SGLangBackend().spec(placed(model, tmp_path, asked, device)).command()

    flag = "--enable-return-routed-experts"
    assert flag in argv(moe, True) and flag in argv(moe, True, "cpu")
    assert flag not in argv(moe, False) and flag not in argv(dense, True)


def test_cancelled_generate_aborts_on_the_server() -> None:
    async def t(fake: FakeSGLang, engine: SGLangEngine) -> None:
        task = asyncio.create_task(engine.generate(req("gone")))
        while not fake._running:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        while not fake.bodies("/abort_request"):
            await asyncio.sleep(0.01)
        assert fake.bodies("/abort_request") == [{"rid": "gone"}]
        assert engine.load == 0

    run_with_fake(t, token_delay_s=0.05)


def test_router_reroutes_an_aborted_sglang_call() -> None:
    """Draining an SGLang engine aborts its call and the router finishes it elsewhere."""

    async def t(fake: FakeSGLang, engine: SGLangEngine) -> None:
        other = FakeSGLang()
        await other.start()
        spare = SGLangEngine(other.base_url, "sg1")
        try:
            router = Router()
            router.register(engine, preference=2)
            router.register(spare, preference=1)
            call = asyncio.create_task(router.generate("exec", req("c1")))
            while not fake._running:
                await asyncio.sleep(0.01)
            await router.drain("sg0")
            name, result = await call
            assert name == "sg1"
            # what sg0 produced before the drain (maybe nothing), continued at sg1
            done = reply(PROMPT)
            assert any(
                result.output_ids == (*done[:k], *reply([*PROMPT, *done[:k]]))
                for k in range(len(done))
            )
            assert fake.bodies("/abort_request")
        finally:
            await spare.close()
            await other.stop()

    run_with_fake(t, token_delay_s=0.05)


def test_update_weights_changes_later_versions(tmp_path: Path) -> None:
    async def t(fake: FakeSGLang, engine: SGLangEngine) -> None:
        before = await engine.generate(req("a"))
        await engine.update_weights(WeightsOnDisk(str(tmp_path)), version=3)
        after = await engine.generate(req("b"))
        assert before.versions == (0,) * len(before.output_ids)
        assert after.versions == (3,) * len(after.output_ids)
        assert after.policy_version == 3
        (body,) = fake.bodies("/update_weights_from_disk")
        assert body == {"model_path": str(tmp_path), "weight_version": "3"}
        assert fake.loads == 1
        # the fake model changed with its weights
        assert after.output_ids == tuple(reply(PROMPT, loads=1))

    run_with_fake(t)


def test_version_falls_back_to_engine_record_when_server_reports_none(tmp_path: Path) -> None:
    async def t(fake: FakeSGLang, engine: SGLangEngine) -> None:
        await engine.update_weights(WeightsOnDisk(str(tmp_path)), version=5)
        fake.weight_version = "default"  # an SGLang that does not keep weight_version
        result = await engine.generate(req("a"))
        assert result.versions == (5,) * len(result.output_ids)

    run_with_fake(t)


def test_weight_update_waits_for_request_in_flight(tmp_path: Path) -> None:
    async def t(fake: FakeSGLang, engine: SGLangEngine) -> None:
        running = asyncio.create_task(engine.generate(req("slow")))
        while not fake._running:
            await asyncio.sleep(0.01)
        await engine.update_weights(WeightsOnDisk(str(tmp_path)), version=1)
        result = await running
        assert result.versions == (0,) * len(result.output_ids)  # finished on old weights

    run_with_fake(t, token_delay_s=0.02)


def test_update_weights_failure_raises_runtime_error() -> None:
    async def t(fake: FakeSGLang, engine: SGLangEngine) -> None:
        with pytest.raises(RuntimeError, match="not found"):
            await engine.update_weights(WeightsOnDisk("/nonexistent/ckpt"), version=1)
        result = await engine.generate(req("a"))
        assert result.versions == (0,) * len(result.output_ids)

    run_with_fake(t)


def test_weights_in_memory_need_a_tensor_route() -> None:
    async def t(fake: FakeSGLang, engine: SGLangEngine) -> None:
        with pytest.raises(ValueError, match="tensor_route"):
            await engine.update_weights(WeightsInMemory({"w": torch.ones(2)}), version=1)
        assert fake.bodies("/update_weights_from_disk") == []

    run_with_fake(t)


def test_a_server_without_the_tensor_route_says_so() -> None:
    """An SGLang without /pause_generation or /update_weights_from_tensor (404 here):
    the host falls back to disk on this error."""

    async def t(fake: FakeSGLang, engine: SGLangEngine) -> None:
        engine.tensor_route = TensorRoute("cpu")
        with pytest.raises(TensorRouteUnavailable, match="404"):
            await engine.update_weights(WeightsInMemory({"w": torch.ones(2)}), version=1)
        assert engine.policy_version == 0

    run_with_fake(t)


def test_payload_decodes_as_sglang_decodes_it() -> None:
    named = [("model.embed.weight", torch.randn(4, 3)), ("model.norm.bias", torch.arange(5))]
    payload = serialize_tensors(named)
    decoded = ForkingPickler.loads(base64.b64decode(payload))  # MultiprocessingSerializer
    assert [name for name, _ in decoded] == [name for name, _ in named]
    for (_, got), (_, sent) in zip(decoded, named, strict=True):
        assert got.dtype == sent.dtype and torch.equal(got, sent)


def test_buckets_are_bounded_and_keep_the_order() -> None:
    tensors = {"a": torch.zeros(4), "b": torch.zeros(2), "c": torch.zeros(64), "d": torch.zeros(1)}
    buckets = tensor_buckets(tensors, max_bytes=24)  # float32: 16, 8, 256, 4 bytes
    assert buckets == [["a", "b"], ["c"], ["d"]]
    meta = {name: t.to("meta") for name, t in tensors.items()}  # sized without their data
    assert tensor_buckets(meta, max_bytes=24) == buckets


def test_a_tensor_route_off_the_gpu_reaches_one_process_only() -> None:
    with pytest.raises(ValueError, match="tp_size must be 1"):
        TensorRoute("cpu", tp_size=2)
    assert TensorRoute("cuda:1", tp_size=2).tp_size == 2


class _TensorServer:
    """What SGLang's tensor route sees of a load: the paths called, and each
    bucket's bodies with its payloads decoded as SGLang decodes them."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        if request.path == "/update_weights_from_tensor":
            payloads = body.pop("serialized_named_tensors")
            body["tensors"] = [ForkingPickler.loads(base64.b64decode(p)) for p in payloads]
            if self.fail:
                return web.json_response({"success": False, "message": "bad shape"}, status=400)
            self.calls.append((request.path, body))
            return web.json_response({"success": True, "message": "Success"})
        self.calls.append((request.path, body))
        return web.json_response({"message": "ok", "status": "ok"})


async def _serving(server: _TensorServer) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/{path}", server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def test_weights_from_tensors_travel_in_buckets_while_generation_is_paused() -> None:
    tensors = {"a": torch.randn(4), "b": torch.randn(2), "c": torch.randn(64)}

    async def main() -> None:
        server = _TensorServer()
        runner, url = await _serving(server)
        route = TensorRoute("cpu", bucket_bytes=24)
        try:
            async with SGLangEngine(url, "sg0", tensor_route=route) as engine:
                await engine.update_weights(WeightsInMemory(tensors), version=3)
                assert engine.policy_version == 3
        finally:
            await runner.cleanup()
        paths = [path for path, _ in server.calls]
        assert paths == [
            "/pause_generation",
            "/update_weights_from_tensor",
            "/update_weights_from_tensor",
            "/continue_generation",
        ]
        assert server.calls[0][1] == {"mode": "retract"}
        first, last = server.calls[1][1], server.calls[2][1]
        assert first["flush_cache"] is False and "weight_version" not in first
        assert last["flush_cache"] is True and last["weight_version"] == "3"
        (first_rank,), (last_rank,) = first["tensors"], last["tensors"]  # one per TP rank
        sent = first_rank + last_rank
        assert [name for name, _ in sent] == ["a", "b", "c"]
        assert all(torch.equal(got, tensors[name]) for name, got in sent)

    asyncio.run(main())


def test_weights_by_name_are_read_one_bucket_at_a_time_as_each_is_sent() -> None:
    tensors = {"a": torch.randn(4), "b": torch.randn(2), "c": torch.randn(64)}
    server = _TensorServer()
    reads: list[tuple[list[str], int]] = []  # names read, buckets the server had by then

    def read(names: Sequence[str]) -> dict[str, torch.Tensor]:
        reads.append((list(names), len(server.calls) - 1))  # less the pause
        return {name: tensors[name] for name in names}

    async def main() -> None:
        runner, url = await _serving(server)
        route = TensorRoute("cpu", bucket_bytes=24)
        meta = {name: t.to("meta") for name, t in tensors.items()}
        try:
            async with SGLangEngine(url, "sg0", tensor_route=route) as engine:
                await engine.update_weights(WeightsByName(meta, read), version=5)
        finally:
            await runner.cleanup()

    asyncio.run(main())
    assert reads == [(["a", "b"], 0), (["c"], 1)]
    sent = [pair for _, body in server.calls[1:3] for pair in body["tensors"][0]]
    assert all(torch.equal(got, tensors[name]) for name, got in sent)


def test_a_refused_tensor_load_raises_and_generation_continues() -> None:
    async def main() -> None:
        server = _TensorServer(fail=True)
        runner, url = await _serving(server)
        try:
            async with SGLangEngine(url, "sg0", tensor_route=TensorRoute("cpu")) as engine:
                with pytest.raises(RuntimeError, match="bad shape"):
                    await engine.update_weights(WeightsInMemory({"a": torch.ones(2)}), 4)
                assert engine.policy_version == 0
        finally:
            await runner.cleanup()
        assert [path for path, _ in server.calls] == ["/pause_generation", "/continue_generation"]

    asyncio.run(main())


def test_release_and_resume_call_sglangs_memory_routes() -> None:
    """Serving around a role switch is the engine contract's (test_engine_contract.py)."""

    async def t(fake: FakeSGLang, engine: SGLangEngine) -> None:
        await engine.release_memory()
        assert fake.released and engine.released
        with pytest.raises(ConnectionError):  # refused before it reaches the server
            await engine.generate(req("during"))
        await engine.resume_memory()
        assert not fake.released and not engine.released
        assert fake.bodies("/release_memory_occupation") == [{}]
        assert fake.bodies("/resume_memory_occupation") == [{}]

    run_with_fake(t)


def test_fake_refuses_generate_while_released() -> None:
    """The engine's own guard aside, the server side refuses too (and the engine maps it)."""

    async def t(fake: FakeSGLang, engine: SGLangEngine) -> None:
        fake.released = True
        with pytest.raises(ConnectionError, match="503"):
            await engine.generate(req("x"))

    run_with_fake(t)


def test_release_with_requests_in_flight_is_refused() -> None:
    async def t(fake: FakeSGLang, engine: SGLangEngine) -> None:
        task = asyncio.create_task(engine.generate(req("busy")))
        while not fake._running:
            await asyncio.sleep(0.01)
        with pytest.raises(ValueError, match="idle"):
            await engine.release_memory()
        assert not engine.released
        await task
        await engine.release_memory()  # idle now
        assert engine.released

    run_with_fake(t, token_delay_s=0.02)


def test_health_false_when_unhealthy_and_refused_when_the_server_is_gone() -> None:
    async def t(fake: FakeSGLang, engine: SGLangEngine) -> None:
        assert await engine.health()
        fake.healthy = False
        assert not await engine.health()
        fake.healthy = True
        await fake.stop()
        with pytest.raises(ConnectionRefusedError, match="nothing answers at"):
            await engine.health()
        engine.released = True  # a released engine does not ask
        assert not await engine.health()

    run_with_fake(t)


def test_crash_mid_request_raises_oserror() -> None:
    async def t(fake: FakeSGLang, engine: SGLangEngine) -> None:
        task = asyncio.create_task(engine.generate(req("doomed")))
        while not fake._running:
            await asyncio.sleep(0.01)
        await fake.crash()
        with pytest.raises(OSError):
            await task
        with pytest.raises(OSError):  # refused afterwards
            await engine.generate(req("next"))
        assert engine.load == 0

    run_with_fake(t, token_delay_s=0.05)


def test_bad_request_surfaces_server_message() -> None:
    async def t(fake: FakeSGLang, engine: SGLangEngine) -> None:
        with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
            await engine.generate(req("bad", top_p=1.5))
        with pytest.raises(ValueError, match="input_ids cannot be empty"):
            await engine.generate(req("empty", ids=[]))
        assert engine.load == 0

    run_with_fake(t)


def test_fake_rejects_unknown_sampling_keys_and_bad_types() -> None:
    async def t(fake: FakeSGLang, engine: SGLangEngine) -> None:
        body = SGLangEngine.request_body(req("x"))
        body["sampling_params"]["max_tokens"] = 3
        body["stream"] = False  # a plain answer (streamed, the error is a chunk: below)
        with pytest.raises(ValueError, match="unexpected keyword argument 'max_tokens'"):
            await engine._json("POST", "/generate", body)
        body = SGLangEngine.request_body(req("y"))
        body["return_logprob"] = "yes"
        with pytest.raises(ValueError, match="return_logprob"):
            await engine._json("POST", "/generate", body)

    run_with_fake(t)


def test_api_key_is_sent() -> None:
    async def t(fake: FakeSGLang, engine: SGLangEngine) -> None:
        assert (await engine.generate(req("k"))).finish_reason == "stop"
        anonymous = SGLangEngine(fake.base_url, "anon")
        try:
            with pytest.raises(ValueError, match="Unauthorized"):
                await anonymous.generate(req("k2"))
        finally:
            await anonymous.close()

    run_with_fake(t, api_key="s3cret")


def test_server_spec_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QWENGYRE_SGLANG_PYTHON", raising=False)
    spec = SGLangServerSpec(
        model="/ckpt/qwen",
        port=30001,
        host="0.0.0.0",
        tp_size=2,
        max_context=4096,
        weight_version="7",
        extra_args=("--mem-fraction-static", "0.8"),
        extra_env={"CUDA_VISIBLE_DEVICES": "2,3"},
    )
    argv = spec.command()
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    flags = {
        "--model-path": "/ckpt/qwen",
        "--host": "0.0.0.0",
        "--port": "30001",
        "--tp-size": "2",
        "--context-length": "4096",
        "--weight-version": "7",
    }
    for flag, value in flags.items():
        assert argv[argv.index(flag) + 1] == value
    assert "--enable-memory-saver" in argv
    assert argv[-2:] == ["--mem-fraction-static", "0.8"]
    assert spec.env()["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert spec.base_url == "http://0.0.0.0:30001"
    plain = SGLangServerSpec(model="/m", port=1, enable_memory_saver=False).command()
    assert not {"--enable-memory-saver", "--weight-version"} & set(plain)
    assert not any(arg.startswith("--api-key") for arg in argv + plain)
    monkeypatch.setenv("QWENGYRE_SGLANG_PYTHON", "/opt/sglang/bin/python")
    assert SGLangServerSpec(model="/m", port=1).command()[0] == "/opt/sglang/bin/python"


def test_the_key_goes_in_a_private_config_file_not_on_the_command_line(tmp_path: Path) -> None:
    key_file = tmp_path / "server.yaml"
    spec = SGLangServerSpec(model="/m", port=1, api_key="k3y", key_file=str(key_file))
    argv = spec.command()
    assert argv[argv.index("--config") + 1] == str(key_file) and "k3y" not in argv
    assert "k3y" not in repr(spec)
    ((path, text),) = spec.key_files().items()
    write_private(path, text)
    assert yaml.safe_load(key_file.read_text()) == {"api-key": "k3y"}
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    link = tmp_path / "link.yaml"
    link.symlink_to(key_file)
    with pytest.raises(OSError):  # a link there is refused
        write_private(link, text)
    with pytest.raises(ValueError, match="key_file"):
        SGLangServerSpec(model="/m", port=1, api_key="k3y")


def test_launch_errors_clearly_without_sglang(tmp_path: Path) -> None:
    python = str(tmp_path / "no-python")
    with pytest.raises(SGLangNotInstalled, match=f"{python} cannot import 'sglang'"):
        launch(SGLangServerSpec(model="/m", port=1, python=python))


def test_wait_until_healthy_times_out() -> None:
    async def t(fake: FakeSGLang, engine: SGLangEngine) -> None:
        await wait_until_healthy(engine, timeout_s=2, poll_s=0.05)
        fake.healthy = False
        with pytest.raises(TimeoutError):
            await wait_until_healthy(engine, timeout_s=0.3, poll_s=0.05)

    run_with_fake(t)


def _real_server_skip_reason() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed"
    try:
        import torch

        if not torch.cuda.is_available():
            return "no CUDA GPU"
    except Exception as exc:
        return f"torch cannot check for a GPU: {exc}"
    return None


_SKIP_REAL = _real_server_skip_reason()


@pytest.mark.slow
@pytest.mark.skipif(_SKIP_REAL is not None, reason=_SKIP_REAL or "")
def test_real_sglang_server(tiny_model_dir: Path, tmp_path: Path) -> None:  # pragma: no cover
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = SGLangServerSpec(
        model=str(tiny_model_dir), port=port, extra_args=("--mem-fraction-static", "0.3")
    )
    log_path = tmp_path / "sglang.log"
    log = log_path.open("wb")
    proc = launch(spec, stdout=log, stderr=subprocess.STDOUT)

    async def main() -> None:
        engine = SGLangEngine(spec.base_url, "real")
        try:
            await wait_until_healthy(engine, timeout_s=600, process=proc)
            result = await engine.generate(req("real-1", ids=[1, 2, 3], max_tokens=8))
            assert 0 < len(result.output_ids) <= 8
            assert all(lp <= 0.0 for lp in result.logprobs)
            assert result.finish_reason in ("stop", "length")
            await engine.update_weights(WeightsOnDisk(str(tiny_model_dir)), version=1)
            again = await engine.generate(req("real-2", ids=[1, 2, 3], max_tokens=8))
            assert again.versions == (1,) * len(again.output_ids)
            await engine.release_memory()
            await engine.resume_memory()
            assert (await engine.generate(req("real-3", ids=[4, 5], max_tokens=4))).output_ids
        finally:
            await engine.close()

    try:
        asyncio.run(main())
    except BaseException:
        print(log_path.read_text(errors="replace")[-5000:])
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
