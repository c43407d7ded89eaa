"""A cell's vLLM server (``engine.backend=vllm``): it takes the core's
published weights from the boards through disk (an untied model's own ``lm_head``
included), and on the CPU a role switch stops and restarts it, still serving (and
labelling its tokens with) the newest version."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch
from tests.core_boards import core_boards
from transformers import AutoModelForCausalLM

from qwengyre.cluster.server_host import ServerHost
from qwengyre.engines.base import GenerateRequest, GenerateResult
from qwengyre.engines.vllm import VLLMBackend, VLLMEngine, vllm_available
from qwengyre.models import cached_tiny_model
from qwengyre.types import SamplingParams


def test_a_stopped_and_restarted_server_serves_the_newest_version(tiny_model_dir: Path) -> None:
    python = os.environ.get("QWENGYRE_VLLM_PYTHON")
    if not python or not vllm_available(python):
        pytest.skip("QWENGYRE_VLLM_PYTHON is not the python of a vLLM venv")
    # The demo model: vLLM's CPU attention has no kernel for the test model's head size.
    # Untied: the published head differs from the embedding, and only the head changes.
    model = cached_tiny_model("demo", cache_dir=tiny_model_dir.parent, tie_embeddings=False)
    host = ServerHost(
        VLLMBackend(),
        str(model),
        name="cell-1",
        device="cpu",
        gpus=(),
        max_context=512,
        host="127.0.0.1",
        version=-1,
    )

    prompt = (5, 6, 7)
    weights = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    assert not weights.config.tie_word_embeddings
    with torch.no_grad():
        weights.lm_head.weight.add_(0.05 * torch.randn_like(weights.lm_head.weight))

    def sample(url: str, key: str) -> GenerateResult:
        async def go() -> GenerateResult:
            async with VLLMEngine(url, "cell-1", api_key=key) as engine:
                request = GenerateRequest(
                    "r", prompt, SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
                )
                return await engine.generate(request)

        return asyncio.run(go())

    def served_by_the_published_weights(result: GenerateResult) -> bool:
        ids = torch.tensor([[*prompt, *result.output_ids]])
        with torch.no_grad():
            logits = weights(ids).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None])[:, 0]
        return bool((expected - torch.tensor(result.logprobs)).abs().max() < 1e-4)

    with core_boards(model) as (board, boards):
        try:
            board.write(weights.named_parameters(), version=3)  # the core published v3
            endpoint = host.start()
            assert host.load_newest(boards) == 3
            first = sample(endpoint.url, endpoint.api_key)
            assert first.versions == (3,) * 8 and served_by_the_published_weights(first)
            assert host.release() == "stopped"  # on the CPU: vLLM's sleep frees nothing
            with pytest.raises(OSError):
                sample(endpoint.url, endpoint.api_key)
            assert host.resume(boards) == 3  # restarted from the v3 weights it had loaded
            again = sample(endpoint.url, endpoint.api_key)
            assert again.versions == (3,) * 8 and served_by_the_published_weights(again)
        finally:
            host.close()
