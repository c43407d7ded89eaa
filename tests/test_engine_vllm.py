"""VLLMEngine against a real vLLM CPU server (one for the module) with a tiny
mixture-of-experts model (Qwen3-MoE) with tied embeddings. The dense tiny model is served
by vLLM in tests/test_engine_contract.py, tests/test_cluster_vllm_host.py (untied) and
tests/test_runtime_train.py.

The server runs from the Python named by ``QWENGYRE_VLLM_PYTHON`` (a vLLM venv:
``scripts/vllm_venv.sh``); without it the server tests skip. Run this module without
xdist (``-p no:xdist`` or a plain ``pytest``): every xdist worker would start its own
server. The model is the "demo" tiny MoE: vLLM's CPU attention has no kernel for the
"test" model's head size (16; it supports 32 and up). The server reports no routed
experts: vLLM 0.32 captures them with Model Runner V2 only
(``VllmConfig._verify_aux_output_compatibility``), which needs Triton, absent from its
CPU build, so :class:`VLLMBackend` gives the flag on a GPU only (tested without a server
below).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import io
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from aiohttp import web
from tests.test_engine_sglang import placed

from qwengyre.engines.base import GenerateRequest, WeightsOnDisk, collect
from qwengyre.engines.launch import launch, wait_until_healthy
from qwengyre.engines.vllm import VLLMBackend, VLLMEngine, VLLMServerSpec, vllm_available
from qwengyre.models import cached_tiny_model
from qwengyre.proxy.routing import Router
from qwengyre.types import SamplingParams

PYTHON = os.environ.get("QWENGYRE_VLLM_PYTHON")
PROMPT = [39, 1018, 379, 278, 273, 75, 67, 11, 436, 337]  # "Hello world, this is"
"""After which the demo model, greedy, repeats " is" (337)."""


def req(rid: str, ids: list[int] = PROMPT, **sampling: Any) -> GenerateRequest:
    sampling.setdefault("max_tokens", 16)
    return GenerateRequest(rid, ids, SamplingParams(**sampling))


@dataclass(frozen=True)
class Server:
    base_url: str
    api_key: str
    model: Path
    log: Path


@contextlib.contextmanager
def serving(tmp_path_factory: pytest.TempPathFactory, moe: bool = False) -> Iterator[Server]:
    """A vLLM CPU server of the demo tiny model (or tiny MoE), healthy until exit."""
    if not PYTHON:
        pytest.skip("QWENGYRE_VLLM_PYTHON is not set (the python of a vLLM venv)")
    if not vllm_available(PYTHON):
        pytest.skip(f"QWENGYRE_VLLM_PYTHON={PYTHON} cannot import vllm")
    env = os.environ.get("QWENGYRE_CACHE")
    cache = Path(env) if env else tmp_path_factory.getbasetemp().parent / "qwengyre-models"
    model = cached_tiny_model("demo", cache_dir=cache, moe=moe)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    key = secrets.token_hex(16)
    spec = VLLMServerSpec(
        model=str(model),
        port=port,
        api_key=key,
        dtype="float32",
        max_context=2048,
        python=PYTHON,
        extra_args=("--enforce-eager",),
        extra_env={"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"},
    )
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with log.open("wb") as out:
        proc = launch(spec, stdout=out, stderr=subprocess.STDOUT)
    try:

        async def healthy() -> None:
            async with VLLMEngine(spec.base_url, "vllm", api_key=spec.api_key) as engine:
                await wait_until_healthy(engine, timeout_s=180, process=proc)

        started = time.monotonic()
        asyncio.run(healthy())
        print(f"vLLM server healthy after {time.monotonic() - started:.1f}s", file=sys.stderr)
        yield Server(spec.base_url, key, model, log)
    except BaseException:
        print(log.read_text(errors="replace")[-5000:], file=sys.stderr)
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(tmp_path_factory, moe=True) as started:
        yield started


def run(server: Server, test: Callable[[VLLMEngine], Awaitable[None]], timeout: float = 60) -> None:
    async def main() -> None:
        async with VLLMEngine(server.base_url, "vllm0", api_key=server.api_key) as engine:
            await asyncio.wait_for(test(engine), timeout)

    try:
        asyncio.run(main())
    except BaseException:
        print(server.log.read_text(errors="replace")[-3000:], file=sys.stderr)
        raise


@functools.cache
def hf_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logprobs(
    path: Path,
    prompt: list[int],
    output: tuple[int, ...],
    temperature: float = 1.0,
    top_k: int = -1,
) -> list[float]:
    """Log-probs of ``output`` after ``prompt`` under the distribution sampled from."""
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([[*prompt, *output]])).logits[0].float()
    scaled = logits[len(prompt) - 1 : -1] / (temperature if temperature > 0 else 1.0)
    if top_k > 0:
        scaled = scaled.masked_fill(scaled < scaled.topk(top_k).values[:, -1:], float("-inf"))
    picked = torch.log_softmax(scaled, -1).gather(1, torch.tensor(output)[:, None])
    return picked[:, 0].tolist()


def assert_close(got: tuple[float, ...], expected: list[float], tol: float = 1e-4) -> None:
    assert len(got) == len(expected)
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < tol


# -- with a server ---------------------------------------------------------------------


@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, -1), (0.7, 50)])
def test_sampled_logprobs_match_hf(server: Server, temperature: float, top_k: int) -> None:
    run(server, functools.partial(_sampled_logprobs_match_hf, server, temperature, top_k))


async def _sampled_logprobs_match_hf(
    server: Server, temperature: float, top_k: int, engine: VLLMEngine
) -> None:
    result = await engine.generate(
        req("lp", max_tokens=48, temperature=temperature, top_k=top_k, ignore_eos=True)
    )
    assert len(result.output_ids) == 48 and result.finish_reason == "length"
    assert result.versions == (0,) * 48
    expected = hf_logprobs(server.model, PROMPT, result.output_ids, temperature, top_k)
    assert_close(result.logprobs, expected)


def test_greedy_output_is_hf_greedy(server: Server) -> None:
    run(server, functools.partial(_greedy_output_is_hf_greedy, server))


async def _greedy_output_is_hf_greedy(server: Server, engine: VLLMEngine) -> None:
    result = await engine.generate(req("greedy", max_tokens=24, temperature=0))
    with torch.no_grad():
        hf = hf_model(server.model).generate(
            torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False
        )
    assert result.output_ids == tuple(hf[0, len(PROMPT) :].tolist())
    assert_close(result.logprobs, hf_logprobs(server.model, PROMPT, result.output_ids))


async def _replay(items: list[Any]) -> Any:
    for item in items:
        yield item


def test_stop_strings_and_stop_token_ids(server: Server) -> None:
    async def t(engine: VLLMEngine) -> None:
        free = await engine.generate(req("free", temperature=0))
        assert free.finish_reason == "length" and free.output_ids[:3] == (337, 337, 337)
        # " is is is": the third token completes the stop string " is is"
        stopped = await engine.generate(req("stop", temperature=0, stop=("s is",)))
        assert stopped.output_ids == (337, 337) and stopped.finish_reason == "stop"
        assert len(stopped.logprobs) == len(stopped.versions) == 2
        # sampled: stops at the first sampled id of the set, which the output keeps
        stop_ids = tuple(range(0, 4096, 2))
        for i in range(3):
            got = await engine.generate(
                req(f"ids{i}", max_tokens=64, ignore_eos=True, stop_token_ids=stop_ids)
            )
            assert got.finish_reason == "stop" and got.output_ids[-1] in stop_ids
            assert not set(got.output_ids[:-1]) & set(stop_ids)

    run(server, t)


def test_bad_requests_raise_value_error(server: Server) -> None:
    async def t(engine: VLLMEngine) -> None:
        with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
            await engine.generate(req("p", top_p=1.5))  # refused before streaming
        with pytest.raises(ValueError, match="longer than the maximum model length"):
            await engine.generate(req("long", ids=[5] * 3000))  # an error chunk
        with pytest.raises(ValueError, match="at least 1 item"):
            await engine.generate(req("empty", ids=[]))
        assert engine.load == 0

    run(server, t)


def test_a_call_drained_mid_generation_continues_on_another_engine(server: Server) -> None:
    """A reroute: the call starts on engine "a", which is drained
    after some tokens (its cell moves to training); "b" (a second client of the same
    server: to the router, another engine) continues from the prompt plus those tokens.
    One reply, the budget spent once, every log-prob that of the whole context."""

    async def t(a: VLLMEngine) -> None:
        async with VLLMEngine(server.base_url, "b", api_key=server.api_key) as b:
            a.name = "a"
            router = Router()
            router.register(b, preference=0)
            router.register(a, preference=1)
            call = req("moved", max_tokens=64, ignore_eos=True)
            got: list[tuple[str, Any]] = []
            moves = []
            async for name, delta in router.stream("ex", call):
                got.append((name, delta))
                if name == "a" and sum(len(d.output_ids) for _, d in got) >= 4 and not moves:
                    moves.append(asyncio.create_task(router.drain("a")))  # beside the call
            await asyncio.gather(*moves)
        tokens = tuple(t for _, d in got for t in d.output_ids)
        logprobs = tuple(lp for _, d in got for lp in d.logprobs)
        assert len(tokens) == 64 and got[-1][1].finish_reason == "length"
        assert {name for name, _ in got} == {"a", "b"}  # moved mid-generation
        assert {v for _, d in got for v in d.versions} == {0}
        assert_close(logprobs, hf_logprobs(server.model, PROMPT, tokens))

    run(server, t)


def test_a_consumer_that_leaves_frees_the_server(server: Server) -> None:
    async def running(engine: VLLMEngine) -> float:
        async with engine._get_session().get(f"{engine.base_url}/metrics") as resp:
            text = await resp.text()
        found = re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M)
        assert found, text[:500]
        return float(found.group(1))

    async def t(engine: VLLMEngine) -> None:
        stream = engine.stream(req("gone", max_tokens=1500, ignore_eos=True))
        assert (await anext(stream)).output_ids
        await stream.aclose()
        assert engine.load == 0
        deadline = time.monotonic() + 3
        while await running(engine) > 0:
            assert time.monotonic() < deadline, "the server still runs the abandoned request"
            await asyncio.sleep(0.1)

    run(server, t)


def perturbed_copy(model: Path, out: Path, seed: int = 1) -> Path:
    """``model`` with noise drawn from ``seed`` on every parameter (far from their old
    values: std 0.05 against 0.02)."""
    perturbed = type(hf_model(model)).from_pretrained(model, dtype=torch.float32)
    noise = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn(p.shape, generator=noise) * 0.05)
    perturbed.save_pretrained(out)
    return out


def test_weight_update_mid_request(server: Server, tmp_path: Path) -> None:
    """Tokens after the update carry version 1 and match the new weights given the whole
    context (vLLM recomputes the request's KV cache), those before match the old ones.
    The experts too: vLLM's CPU MoE kernel needs them repacked after a reload (the
    module docstring of :mod:`qwengyre.engines.vllm`)."""
    assert hf_model(server.model).config.tie_word_embeddings
    run(server, functools.partial(_update_mid_request, server, tmp_path / "v1"))


async def _update_mid_request(server: Server, out: Path, engine: VLLMEngine) -> None:
    """An update to a perturbed copy of the server's model, written to ``out``, while a
    request runs; then a fresh request on it; then back to the model as version 2."""
    new = perturbed_copy(server.model, out)

    deltas = []
    updated_at = None
    try:
        async for delta in engine.stream(req("upd", max_tokens=800, ignore_eos=True)):
            deltas.append(delta)
            received = sum(len(d.output_ids) for d in deltas)
            if updated_at is None and received >= 20:
                updated_at = received
                await engine.update_weights(WeightsOnDisk(str(new)), version=1)
        result = await collect(_replay(deltas))
        assert engine.policy_version == 1
        k = result.versions.index(1)
        assert updated_at is not None and updated_at <= k < 800
        assert result.versions == (0,) * k + (1,) * (800 - k)
        # the tokens of unknown version waited for the last chunk's spans
        assert all(set(d.versions) == {0} for d in deltas[:-1])
        old = hf_logprobs(server.model, PROMPT, result.output_ids[:k])
        assert_close(result.logprobs[:k], old)
        after = hf_logprobs(new, [*PROMPT, *result.output_ids[:k]], result.output_ids[k:])
        assert_close(result.logprobs[k:], after)

        fresh = await engine.generate(req("fresh", max_tokens=32, ignore_eos=True))
        assert fresh.versions == (1,) * 32
        assert_close(fresh.logprobs, hf_logprobs(new, PROMPT, fresh.output_ids))
    finally:
        await engine.update_weights(WeightsOnDisk(str(server.model)), version=2)
    back = await engine.generate(req("back", max_tokens=32, ignore_eos=True))
    assert back.versions == (2,) * 32
    assert_close(back.logprobs, hf_logprobs(server.model, PROMPT, back.output_ids))


def test_failed_weight_update_keeps_serving_the_old_weights(server: Server) -> None:
    async def t(engine: VLLMEngine) -> None:
        before = await engine.generate(req("before", max_tokens=1, ignore_eos=True))
        with pytest.raises(RuntimeError, match=r"no \*\.safetensors"):
            await engine.update_weights(WeightsOnDisk("/nonexistent/ckpt"), version=8)
        assert engine.policy_version == 0
        result = await engine.generate(req("after", max_tokens=16, ignore_eos=True))
        assert result.versions == before.versions * 16  # the server's label did not move
        assert_close(result.logprobs, hf_logprobs(server.model, PROMPT, result.output_ids))

    run(server, t)


def test_a_wrong_api_key_is_refused_on_every_path(server: Server) -> None:
    async def t(engine: VLLMEngine) -> None:
        for key in ("wrong", None):
            async with VLLMEngine(server.base_url, "intruder", api_key=key) as intruder:
                with pytest.raises(ValueError, match="Unauthorized"):
                    await intruder.generate(req("k"))
                with pytest.raises(ValueError, match="Unauthorized"):
                    await intruder._json("POST", "/pause", params={"mode": "keep"})
                with pytest.raises(ValueError, match="Unauthorized"):
                    await intruder._json("POST", "/collective_rpc", {"method": "sleep"})
                assert not await intruder.health()
        assert (await engine.generate(req("owner"))).finish_reason == "length"  # not paused

    run(server, t)


# -- without a server --------------------------------------------------------------------


def test_server_spec_command_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QWENGYRE_VLLM_PYTHON", "/venvs/vllm/bin/python")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    spec = VLLMServerSpec(
        model="/ckpt/qwen",
        port=8011,
        host="0.0.0.0",
        api_key="s3cret",
        max_context=4096,
        tp_size=2,
        extra_args=("--enforce-eager",),
        extra_env={"VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    argv = spec.command()
    assert argv[:3] == ["/venvs/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]

    def flag(name: str) -> str:
        return argv[argv.index(name) + 1]

    assert flag("--model") == "/ckpt/qwen" and flag("--port") == "8011"
    assert flag("--host") == "0.0.0.0" and flag("--max-model-len") == "4096"
    assert flag("--logprobs-mode") == "processed_logprobs"
    assert "--enable-scale-out" in argv and "s3cret" not in argv  # the key goes by env
    assert flag("--tensor-parallel-size") == "2" and argv[-1] == "--enforce-eager"
    env = spec.env()
    assert env["VLLM_API_KEY"] == "s3cret" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    src = str(Path(__file__).resolve().parents[1] / "src")
    assert env["PYTHONPATH"] == os.pathsep.join([src, "/elsewhere"])
    assert spec.base_url == "http://0.0.0.0:8011"
    monkeypatch.delenv("QWENGYRE_VLLM_PYTHON")
    assert VLLMServerSpec(model="/m", port=1).python == sys.executable


def test_span_versions_and_request_body() -> None:
    spans = [{"version": "default", "start": 0, "end": 2}, {"version": "3", "start": 2, "end": 5}]
    assert VLLMEngine._versions(spans, 5, 1) == (1, 1, 3, 3, 3)
    assert VLLMEngine._versions(None, 2, 4) == (4, 4)
    with pytest.raises(ConnectionError, match="span"):
        VLLMEngine._versions([{"version": "1", "start": 0, "end": 6}], 5, 0)
    body = VLLMEngine.request_body(req("r9", max_tokens=5, top_k=20, stop=("x",)))
    assert body["request_id"] == "r9" and body["token_ids"] == PROMPT and body["stream"]
    assert body["sampling_params"] == {
        "max_tokens": 5,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 20,
        "logprobs": 0,
        "stop": ["x"],
    }


# -- routed experts (an MoE's; vLLM sends them on a request's last chunk) ---------------


def npy_base64(array: np.ndarray) -> str:
    """As vLLM's ``numpy2base64`` (``vllm/utils/serial_utils.py``) encodes an array."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


class _FakeGenerate:
    """``/inference/v1/generate`` as vLLM streams it, a chunk per token, the last with
    ``weight_versions`` and ``routed_experts`` (``routing``'s rows, or none)."""

    def __init__(self, output: list[int], routing: np.ndarray | None) -> None:
        self.output, self.routing = output, routing

    async def weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": "0"})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i, token in enumerate(self.output):
            last = i == len(self.output) - 1
            choice: dict[str, Any] = {
                "index": 0,
                "token_ids": [token],
                "logprobs": {"content": [{"token_id": token, "logprob": -0.5}]},
                "finish_reason": "length" if last else None,
                "routed_experts": None,
            }
            if last:
                choice["weight_versions"] = [{"version": "0", "start": 0, "end": i + 1}]
                if self.routing is not None:
                    choice["routed_experts"] = npy_base64(self.routing)
            chunk = {"request_id": "generate-tokens-x", "choices": [choice]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response


def with_fake_vllm(fake: _FakeGenerate, test: Callable[[str], Awaitable[None]]) -> None:
    async def main() -> None:
        app = web.Application()
        app.router.add_get("/weight_info", fake.weight_info)
        app.router.add_post("/inference/v1/generate", fake.generate)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            await asyncio.wait_for(test(f"http://127.0.0.1:{runner.addresses[0][1]}"), 10)
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_routed_experts_are_read_by_position_from_the_last_chunk() -> None:
    output = [5, 6, 7]
    rows = np.arange(len(PROMPT) + 2).reshape(-1, 1, 1) * np.array([1, 2]).reshape(1, 1, 2)
    routing = (rows % 200).repeat(3, axis=1).astype(np.uint8)  # [P + 2, 3 layers, k 2]

    async def t(url: str) -> None:
        async with VLLMEngine(url, "v", routed_experts=(3, 2)) as engine:
            deltas = [d async for d in engine.stream(req("x", max_tokens=3))]
            assert [d.output_ids for d in deltas] == [(5,), (6,), (7,)]
            assert [d.routing.shape for d in deltas[:2] if d.routing is not None] == [(0, 3, 2)] * 2
            last = deltas[-1].routing
            assert last is not None and last.dtype == np.int8
            assert np.array_equal(last, routing.astype(np.int8))
            result = await engine.generate(req("y", max_tokens=3))
            assert result.routing is not None and np.array_equal(result.routing, routing)
        async with VLLMEngine(url, "v") as unasking:
            assert (await unasking.generate(req("z", max_tokens=3))).routing is None
        async with VLLMEngine(url, "v", routed_experts=(4, 2)) as other:
            with pytest.raises(ConnectionError, match="routed experts of shape"):
                await other.generate(req("w", max_tokens=3))

    with_fake_vllm(_FakeGenerate(output, routing), t)

    async def unsent(url: str) -> None:  # a server without the flag: null
        async with VLLMEngine(url, "v", routed_experts=(3, 2)) as engine:
            assert (await engine.generate(req("n", max_tokens=3))).routing is None

    with_fake_vllm(_FakeGenerate(output, None), unsent)


def test_the_routed_experts_flag_goes_to_an_moe_on_a_gpu_only(tmp_path: Path) -> None:
    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_experts_per_tok": 2}))
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))

    def spec(model: Path, asked: bool, device: str) -> VLLMServerSpec:
        return VLLMBackend().spec(placed(model, tmp_path, asked, device))

    flag = "--enable-return-routed-experts"
    on = spec(moe, True, "cuda:0")
    assert flag in on.command() and on.env()["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    for off in (spec(moe, True, "cpu"), spec(moe, False, "cuda:0"), spec(dense, True, "cuda:0")):
        assert flag not in off.command() and "VLLM_USE_V2_MODEL_RUNNER" not in off.env()
