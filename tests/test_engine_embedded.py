"""The embedded engine: continuous batching, log-probs against the trainer's recompute, weights
switched mid-request (what every engine does is in test_engine_contract.py)."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from qwengyre.apps.serve import model_engine
from qwengyre.config import EngineConfig
from qwengyre.engines import embedded
from qwengyre.engines.base import GenerateRequest, WeightsInMemory, WeightsOnDisk
from qwengyre.engines.decode_graphs import GraphCaptureFailed
from qwengyre.engines.embedded import EmbeddedEngine, behaviour_logprobs, prefill_batches
from qwengyre.engines.kv_slots import MIN_COLUMNS
from qwengyre.types import SamplingParams


async def running(engine: EmbeddedEngine, timeout_s: float = 30.0) -> None:
    """Wait until a request is in the batch (bounded: a broken engine fails, not hangs)."""

    async def poll() -> None:
        while engine.running == 0:
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), timeout_s)


@pytest.fixture
def engine(tiny_model_dir: Path) -> Iterator[EmbeddedEngine]:
    engine = EmbeddedEngine(tiny_model_dir, capacity=4, max_context=256)
    yield engine
    engine.close()


def request(
    i: int, prompt: int, max_tokens: int, temperature: float = 1.0, **kw
) -> GenerateRequest:
    ids = tuple((7 * i + 3 * j) % 900 + 20 for j in range(prompt))
    return GenerateRequest(
        f"r{i}", ids, SamplingParams(max_tokens=max_tokens, temperature=temperature, **kw)
    )


def recomputed(
    engine: EmbeddedEngine, req: GenerateRequest, output: tuple[int, ...]
) -> torch.Tensor:
    """What the trainer computes: one full forward over prompt + output, no cache."""
    ids = torch.tensor([list(req.input_ids) + list(output)], device=engine.device)
    with torch.inference_mode():
        logits = engine.model(input_ids=ids).logits[0]
    n = len(req.input_ids)
    return behaviour_logprobs(logits[n - 1 : -1], ids[0, n:], req.sampling.temperature).cpu()


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_behaviour_logprobs_match_the_trainers_recompute(engine: EmbeddedEngine, temperature):
    # More requests than capacity, mixed lengths: rows join and leave between steps.
    reqs = [request(i, 3 + 11 * i, 5 + 7 * i, temperature) for i in range(7)]

    async def run():  # type: ignore[no-untyped-def]
        return await asyncio.gather(*(engine.generate(r) for r in reqs))

    results = asyncio.run(run())
    for req, result in zip(reqs, results, strict=True):
        assert len(result.output_ids) == req.sampling.max_tokens or result.finish_reason == "stop"
        ref = recomputed(engine, req, result.output_ids)
        assert torch.allclose(torch.tensor(result.logprobs), ref, atol=1e-4)


class NoHostSync(TorchDispatchMode):
    """Fails on any op that would wait for the device or read host data: neither may run
    inside a captured CUDA graph."""

    SYNCING = frozenset(
        {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "masked_select"}
        | {"lift_fresh", "lift_fresh_copy", "_unique2", "unique_consecutive"}
    )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket.__name__ in self.SYNCING:
            raise AssertionError(f"{func} would sync with the host inside a CUDA graph")
        return func(*args, **(kwargs or {}))


class CheckedSteps:
    """Stands in for the CUDA graphs on the CPU: the engine buckets its decode steps as it
    does for graphs, and each runs eagerly under :class:`NoHostSync`."""

    def __init__(self, forward: Any) -> None:
        self.forward = forward
        self.buckets: list[tuple[int, int]] = []
        self.cleared = 0

    def __call__(self, rows: int, columns: int) -> torch.Tensor:
        with NoHostSync():
            logits = self.forward(rows, columns)
        self.buckets.append((rows, columns))
        return logits

    def clear(self) -> None:
        self.cleared += 1


@pytest.mark.parametrize("steps", ["eager", "bucketed"])
def test_rows_joining_leaving_and_outgrowing_the_cache_keep_exact_logprobs(
    tiny_model_dir: Path, steps: str
):
    engine = EmbeddedEngine(tiny_model_dir, capacity=4, max_context=1024)
    checked = CheckedSteps(engine._decode_forward)
    if steps == "bucketed":
        engine._graphs = checked  # type: ignore[assignment]
    short = [request(i, 5 + 4 * i, 30 + 9 * i, ignore_eos=True) for i in range(3)]
    # Joins mid-run with a prompt past the first allocation (256 columns): the running rows
    # shift right and the buffers grow; it leaves early, and the padding it leaves behind
    # is dropped and the buffers shrink.
    long = request(3, 300, 6, ignore_eos=True)
    late = [request(4 + i, 7 + i, 25, ignore_eos=True) for i in range(3)]

    async def run():  # type: ignore[no-untyped-def]
        first = [asyncio.ensure_future(engine.generate(r)) for r in short]
        await running(engine)
        second = [asyncio.ensure_future(engine.generate(r)) for r in [long, *late]]
        return await asyncio.gather(*first, *second)

    try:
        results = asyncio.run(run())
        for req, result in zip([*short, long, *late], results, strict=True):
            assert len(result.output_ids) == req.sampling.max_tokens
            ref = recomputed(engine, req, result.output_ids)
            assert torch.allclose(torch.tensor(result.logprobs), ref, atol=1e-4)
        assert engine._slots().columns == MIN_COLUMNS and engine.load == 0  # shrunk back
    finally:
        engine.close()
    if steps == "bucketed":
        assert checked.cleared >= 2  # growing and shrinking moved the buffers: stale graphs
        rows = {r for r, _ in checked.buckets}
        columns = [c for _, c in checked.buckets]
        assert rows <= {1, 2, 4} and {2, 4} <= rows
        assert set(columns) <= {1, 2, 4, 8, 16, 32, 64, 128, 256, 512}
        assert 512 in columns and min(columns[columns.index(512) :]) < 512


def test_a_failed_graph_capture_turns_graphs_off_and_decodes_eagerly(
    engine: EmbeddedEngine, caplog: pytest.LogCaptureFixture
):
    class Uncapturable(CheckedSteps):
        def __call__(self, rows: int, columns: int) -> torch.Tensor:
            raise GraphCaptureFailed(f"capturing the decode step ({rows} rows) failed: test")

    engine._graphs = Uncapturable(engine._decode_forward)  # type: ignore[assignment]
    reqs = [request(i, 4 + 5 * i, 10) for i in range(3)]

    async def run():  # type: ignore[no-untyped-def]
        return await asyncio.gather(*(engine.generate(r) for r in reqs))

    with caplog.at_level("WARNING", logger="qwengyre.engines.embedded"):
        results = asyncio.run(run())
    for req, result in zip(reqs, results, strict=True):
        ref = recomputed(engine, req, result.output_ids)
        assert torch.allclose(torch.tensor(result.logprobs), ref, atol=1e-4)
    assert engine._graphs is None
    assert "failed: test; decoding eagerly from now on" in caplog.text


def test_a_sliding_window_model_keeps_exact_logprobs(tiny_model_dir: Path, tmp_path: Path):
    model_dir = tmp_path / "sliding"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    layers = config["num_hidden_layers"]
    config |= {"layer_types": ["sliding_attention"] + ["full_attention"] * (layers - 1)}
    config |= {"sliding_window": 8, "use_sliding_window": True}
    (model_dir / "config.json").write_text(json.dumps(config))
    engine = EmbeddedEngine(model_dir, capacity=4, max_context=256)
    reqs = [request(i, 5 + 9 * i, 20, ignore_eos=True) for i in range(5)]
    lone = request(9, 40, 10, ignore_eos=True)  # HF masks its prefill, the engine its steps

    async def run():  # type: ignore[no-untyped-def]
        return [
            *await asyncio.gather(*(engine.generate(r) for r in reqs)),
            await engine.generate(lone),
        ]

    try:
        assert engine.model.model.has_sliding_layers
        for req, result in zip([*reqs, lone], asyncio.run(run()), strict=True):
            ref = recomputed(engine, req, result.output_ids)
            assert torch.allclose(torch.tensor(result.logprobs), ref, atol=1e-4)
    finally:
        engine.close()


def test_a_moe_model_is_served_with_the_logprobs_of_a_plain_hf_forward(tiny_moe_model_dir: Path):
    # Decode steps bucketed as for CUDA graphs, each checked free of host syncs: the
    # routed experts (grouped matmuls) never read back which experts a token chose.
    engine = EmbeddedEngine(tiny_moe_model_dir, capacity=4, max_context=256)
    checked = CheckedSteps(engine._decode_forward)
    engine._graphs = checked  # type: ignore[assignment]
    reqs = [request(i, 3 + 11 * i, 6 + 5 * i, 0.7, ignore_eos=True) for i in range(6)]

    async def run():  # type: ignore[no-untyped-def]
        return await asyncio.gather(*(engine.generate(r) for r in reqs))

    try:
        results = asyncio.run(run())
    finally:
        engine.close()
    assert checked.buckets  # the decode steps ran through the checked path
    plain = AutoModelForCausalLM.from_pretrained(tiny_moe_model_dir, dtype=torch.float32).eval()
    assert type(plain).__name__ == "Qwen3MoeForCausalLM"
    for req, result in zip(reqs, results, strict=True):
        assert len(result.output_ids) == req.sampling.max_tokens
        ids = torch.tensor([list(req.input_ids) + list(result.output_ids)])
        with torch.no_grad():
            logits = plain(input_ids=ids).logits[0]
        n = len(req.input_ids)
        ref = torch.log_softmax(logits[n - 1 : -1].double() / 0.7, dim=-1)
        ref = ref.gather(-1, ids[0, n:, None]).squeeze(-1).float()
        torch.testing.assert_close(torch.tensor(result.logprobs), ref, rtol=0, atol=1e-4)


def test_prompts_are_prefilled_apart_when_their_padded_mask_would_be_large(
    engine: EmbeddedEngine, monkeypatch: pytest.MonkeyPatch
):
    assert prefill_batches([5, 5, 5]) == [slice(0, 3)]
    assert prefill_batches([100] * 50 + [90]) == [slice(0, 51)]  # 51 x 100 x 100: small
    assert prefill_batches([3, 4000, 3]) == [slice(0, 1), slice(1, 2), slice(2, 3)]
    assert prefill_batches([3, 4000, 4000]) == [slice(0, 1), slice(1, 3)]
    monkeypatch.setattr(embedded, "PREFILL_MASK_ELEMENTS", 1000)  # 2 x 30 x 30 is over
    masks: list[tuple[int, ...]] = []

    def recorded(lengths: torch.Tensor, prompt: int) -> torch.Tensor:
        masks.append(tuple(lengths.tolist()))
        return prefill_mask(lengths, prompt)

    prefill_mask = embedded.prefill_mask
    monkeypatch.setattr(embedded, "prefill_mask", recorded)
    reqs = [request(0, 30, 6), request(1, 4, 6), request(2, 7, 6), request(3, 30, 6)]

    async def run():  # type: ignore[no-untyped-def]
        return await asyncio.gather(*(engine.generate(r) for r in reqs))

    for req, result in zip(reqs, asyncio.run(run()), strict=True):
        ref = recomputed(engine, req, result.output_ids)
        assert torch.allclose(torch.tensor(result.logprobs), ref, atol=1e-4)
    # However the worker admits them, no padded mask holds a 30-token prompt (2 x 30 x 30
    # is over); 4 and 7 may share one.
    assert set(masks) <= {(4, 7)}


def test_batched_greedy_decoding_equals_decoding_alone(engine: EmbeddedEngine):
    reqs = [request(i, 4 + 9 * i, 12, 0.0) for i in range(4)]

    async def together():  # type: ignore[no-untyped-def]
        return await asyncio.gather(*(engine.generate(r) for r in reqs))

    async def alone(r: GenerateRequest):  # type: ignore[no-untyped-def]
        return await engine.generate(r)

    batched = asyncio.run(together())
    for req, result in zip(reqs, batched, strict=True):
        assert asyncio.run(alone(req)).output_ids == result.output_ids


def test_weights_update_between_steps_and_tokens_carry_their_version(
    engine: EmbeddedEngine, tmp_path: Path
):
    old = {k: v.clone() for k, v in engine.model.state_dict().items()}
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in old.items()}
    req = request(0, 6, 240, ignore_eos=True)

    async def run():  # type: ignore[no-untyped-def]
        task = asyncio.ensure_future(engine.generate(req))
        await running(engine)  # update while it runs
        await engine.update_weights(WeightsInMemory(new), version=1)
        return await task

    result = asyncio.run(run())  # the request was not dropped
    assert result.versions[0] == 0 and result.versions[-1] == 1
    assert list(result.versions) == sorted(result.versions)  # no going back
    switch = result.versions.index(1)
    # A request after the update samples from the new weights.
    fresh_req = request(1, 5, 8)
    fresh = asyncio.run(engine.generate(fresh_req))
    assert fresh.versions == (1,) * 8
    ref = recomputed(engine, fresh_req, fresh.output_ids)
    assert torch.allclose(torch.tensor(fresh.logprobs), ref, atol=1e-4)
    # Tokens before the switch came from the old weights.
    asyncio.run(engine.update_weights(WeightsInMemory(old), version=2))
    ref = recomputed(engine, req, result.output_ids)
    assert torch.allclose(torch.tensor(result.logprobs[:switch]), ref[:switch], atol=1e-4)
    # From disk too: a checkpoint written with save_pretrained.
    engine.model.save_pretrained(tmp_path / "ckpt")
    asyncio.run(engine.update_weights(WeightsOnDisk(str(tmp_path / "ckpt")), version=3))
    assert asyncio.run(engine.generate(request(1, 4, 3))).versions == (3, 3, 3)
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        asyncio.run(engine.update_weights(WeightsOnDisk(str(tmp_path)), version=4))
    assert engine.version == 3


def test_release_is_refused_while_a_request_is_being_admitted(
    engine: EmbeddedEngine, monkeypatch: pytest.MonkeyPatch
):
    admitting, go_on = threading.Event(), threading.Event()
    fit = engine._fit

    def slow_fit(*args: Any, **kwargs: Any) -> None:
        admitting.set()
        go_on.wait(30)
        fit(*args, **kwargs)

    monkeypatch.setattr(engine, "_fit", slow_fit)

    async def run():  # type: ignore[no-untyped-def]
        task = asyncio.ensure_future(engine.generate(request(0, 4, 3)))
        await asyncio.to_thread(admitting.wait, 30)  # the worker holds it, not yet in the batch
        with pytest.raises(RuntimeError, match="drain in-flight requests first"):
            await engine.release_memory()
        go_on.set()
        return await task

    assert len(asyncio.run(run()).output_ids) == 3
    assert asyncio.run(engine.health())


def test_stop_token_ids_end_a_request(engine: EmbeddedEngine):
    first = asyncio.run(engine.generate(request(0, 5, 10, 0.0)))
    stop_at = first.output_ids[3]
    req = request(0, 5, 10, 0.0, stop_token_ids=(stop_at,))
    stopped = asyncio.run(engine.generate(req))
    cut = first.output_ids.index(stop_at) + 1
    assert stopped.output_ids == first.output_ids[:cut] and stopped.finish_reason == "stop"


@pytest.mark.parametrize(
    ("req", "message"),
    [
        (GenerateRequest("x", (1, 99999), SamplingParams(max_tokens=5)), "out of vocabulary"),
        (
            GenerateRequest("x", tuple(range(300)), SamplingParams(max_tokens=5)),
            "no room in the context",
        ),
        (GenerateRequest("x", (1, 2), SamplingParams(max_tokens=0)), "max_tokens must be > 0"),
        (
            GenerateRequest("x", (1, 2), SamplingParams(max_tokens=5, top_p=0)),
            "sampling out of range",
        ),
        (GenerateRequest("x", (), SamplingParams(max_tokens=5)), "input_ids is empty"),
    ],
)
def test_bad_requests_are_refused_and_the_engine_keeps_serving(engine, req, message):
    with pytest.raises(ValueError, match=message):
        asyncio.run(engine.generate(req))
    assert len(asyncio.run(engine.generate(request(0, 4, 2))).output_ids) == 2


def test_a_failed_forward_fails_its_batch_and_the_engine_keeps_serving(
    engine: EmbeddedEngine, monkeypatch: pytest.MonkeyPatch
):
    forward = engine._forward

    def fail_once(*args: Any) -> torch.Tensor:
        monkeypatch.setattr(engine, "_forward", forward)
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(engine, "_forward", fail_once)
    with pytest.raises(RuntimeError, match="simulated"):  # the joining request hears of it
        asyncio.run(asyncio.wait_for(engine.generate(request(0, 4, 3)), 30))
    assert engine.load == 0
    assert len(asyncio.run(engine.generate(request(1, 4, 3))).output_ids) == 3


def test_the_proxy_serves_the_embedded_engine_and_records_its_logprobs(
    tmp_path: Path, tiny_model_dir: Path
):
    import anthropic
    from tests.test_proxy_server import start

    engine = EmbeddedEngine(tiny_model_dir, capacity=4)
    try:
        for running in start(tmp_path, tiny_model_dir, engines=[engine]):
            ex = running.new_execution()
            client = anthropic.Anthropic(api_key=ex["key"], base_url=running.url, max_retries=0)
            reply = client.messages.create(
                model="tiny", max_tokens=16, messages=[{"role": "user", "content": "2+2="}]
            )
            (node,) = running.tree(ex["id"])
            assert reply.usage.output_tokens == len(node["output_ids"]) <= 16
            req = GenerateRequest(
                "n", tuple(node["input_ids"]), SamplingParams(max_tokens=16, temperature=1.0)
            )
            ref = recomputed(engine, req, tuple(node["output_ids"]))
            assert torch.allclose(torch.tensor(node["logprobs"]), ref, atol=1e-4)
            assert node["engine"] == "embedded" and node["versions"] == [0] * len(ref)
    finally:
        engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: CUDA graphs need one")
def test_cuda_graph_steps_keep_exact_logprobs_and_survive_release(
    tiny_model_dir: Path,
):  # pragma: no cover - runs where a GPU is
    engine = EmbeddedEngine(tiny_model_dir, capacity=8, device="cuda", max_context=1024)
    reqs = [request(i, 5 + 37 * i, 20 + 11 * i, ignore_eos=True) for i in range(10)]

    async def run():  # type: ignore[no-untyped-def]
        results = await asyncio.gather(*(engine.generate(r) for r in reqs))
        await engine.release_memory()  # the graphs captured freed buffers: recaptured
        await engine.resume_memory()
        return [*results, await engine.generate(reqs[0])]

    try:
        results = asyncio.run(run())
        assert engine._graphs is not None and len(engine._graphs) > 0
        for req, result in zip([*reqs, reqs[0]], results, strict=True):
            ref = recomputed(engine, req, result.output_ids)
            assert torch.allclose(torch.tensor(result.logprobs), ref, atol=1e-4)
    finally:
        engine.close()


def slow_and_counted(engine: EmbeddedEngine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Decode steps take at least 5 ms; the returned list counts the tokens sampled."""
    sampled: list[int] = []
    decode, advance = engine._decode, engine._advance

    def slow_decode(n: int) -> torch.Tensor:
        threading.Event().wait(0.005)
        return decode(n)

    def counted(sequence: Any, token: int) -> Any:
        sampled.append(token)
        return advance(sequence, token)

    monkeypatch.setattr(engine, "_decode", slow_decode)
    monkeypatch.setattr(engine, "_advance", counted)
    return sampled


async def idle(engine: EmbeddedEngine, timeout_s: float = 10.0) -> None:
    async def poll() -> None:
        while engine.load:
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), timeout_s)


@pytest.mark.parametrize("leave", ["aclose", "cancel"])
def test_a_consumer_that_leaves_aborts_its_request(
    engine: EmbeddedEngine, monkeypatch: pytest.MonkeyPatch, leave: str
):
    sampled = slow_and_counted(engine, monkeypatch)

    async def run() -> None:
        stream = engine.stream(request(0, 8, 240, ignore_eos=True))
        if leave == "aclose":
            await asyncio.wait_for(anext(stream), 30)
            await stream.aclose()
        else:
            got = asyncio.Event()

            async def consume() -> None:
                async for _ in stream:
                    got.set()

            task = asyncio.ensure_future(consume())
            await asyncio.wait_for(got.wait(), 30)
            task.cancel()
        await idle(engine)

    asyncio.run(run())
    assert 0 < len(sampled) < 240  # it stopped generating early
    # the engine serves on
    assert len(asyncio.run(engine.generate(request(1, 4, 3))).output_ids) == 3


def test_stop_strings_end_a_request_at_the_token_completing_one(
    engine: EmbeddedEngine, tiny_model_dir: Path
):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def run(*stop: str) -> Any:
        engine._generator.manual_seed(0)  # the same draws each time
        return asyncio.run(engine.generate(request(0, 8, 40, stop=stop, ignore_eos=True)))

    plain = run()
    text = tokenizer.decode(plain.output_ids[20:22], skip_special_tokens=True)
    stop = text.replace("\ufffd", "").strip() or text
    # where the first occurrence of the stop string is complete
    end = next(
        i + 1
        for i in range(len(plain.output_ids))
        if stop in tokenizer.decode(plain.output_ids[: i + 1], skip_special_tokens=True)
    )
    assert "tokenizer" not in engine.__dict__  # loaded only once a request has stops
    stopped = run(stop)
    assert stopped.finish_reason == "stop" and end <= 22 < 40
    assert stopped.output_ids == plain.output_ids[:end]
    assert stopped.logprobs == plain.logprobs[:end]
    assert stop in tokenizer.decode(stopped.output_ids, skip_special_tokens=True)
    assert stop not in tokenizer.decode(stopped.output_ids[:-1], skip_special_tokens=True)
    assert run("never in this reply") == plain and plain.finish_reason == "length"


@pytest.mark.parametrize(("top_k", "top_p"), [(1, 1.0), (5, 1.0), (-1, 0.5), (-1, 1.0)])
def test_recorded_logprobs_are_of_the_truncated_distribution_sampled_from(
    engine: EmbeddedEngine, top_k: int, top_p: float
):
    req = request(0, 8, 30, 1.0, top_k=top_k, top_p=top_p, ignore_eos=True)
    result = asyncio.run(engine.generate(req))
    recorded = torch.tensor(result.logprobs)
    ids = torch.tensor([list(req.input_ids) + list(result.output_ids)])
    with torch.inference_mode():
        logits = engine.model(input_ids=ids).logits[0, len(req.input_ids) - 1 : -1].float()
    full = behaviour_logprobs(logits, torch.tensor(result.output_ids), 1.0)
    if top_k == 1:
        assert torch.allclose(recorded, torch.zeros_like(recorded), atol=1e-6)
    elif top_k == 5:  # renormalised over the five kept tokens
        top = logits.topk(5)
        sampled = torch.tensor(result.output_ids).unsqueeze(1)
        assert bool((top.indices == sampled).any(-1).all())  # only kept tokens are drawn
        ref = logits.gather(1, sampled).squeeze(1) - top.values.logsumexp(-1)
        assert torch.allclose(recorded, ref, atol=1e-4)
    elif top_p < 1:  # renormalised: never below the full distribution's, often above
        assert bool((recorded >= full - 1e-4).all()) and bool((recorded > full + 1e-3).any())
    else:  # nothing truncated: the trainer's function, exactly
        assert torch.allclose(recorded, full, atol=1e-4)


def test_a_model_engine_block_stops_its_engine_even_mid_request(tiny_model_dir: Path):
    """``rollout``'s and ``proxy serve``'s embedded engine is stopped when its block
    ends, even while it decodes: a daemon worker left in a torch call when the
    interpreter exits aborts the process ("terminate called without an active
    exception", exit 134; it did in 3 of 6 such exits)."""

    async def run() -> tuple[bool, bool]:
        with model_engine(
            tiny_model_dir, EngineConfig(), device="cpu", capacity=2, max_context=None
        ) as engine:
            stream = engine.stream(request(0, 8, 240, ignore_eos=True))
            await asyncio.wait_for(anext(stream), 30)
            serving = await engine.health()
        stopped = not await engine.health()
        await stream.aclose()
        return serving, stopped

    assert asyncio.run(run()) == (True, True)
