"""A cell's vLLM server (``engine.backend=vllm``; issue 18): it takes the core's
published weights from the boards through disk, and on the CPU a role switch stops and
restarts it, still serving (and labelling its tokens with) the newest version."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch
from tests.core_boards import core_boards
from transformers import AutoModelForCausalLM

from qwengyre.cluster.vllm_host import VLLMHost
from qwengyre.engines.base import GenerateRequest
from qwengyre.engines.vllm import VLLMEngine, vllm_available
from qwengyre.models import cached_tiny_model
from qwengyre.types import SamplingParams


def test_a_stopped_and_restarted_server_serves_the_newest_version(tiny_model_dir: Path) -> None:
    python = os.environ.get("QWENGYRE_VLLM_PYTHON")
    if not python or not vllm_available(python):
        pytest.skip("QWENGYRE_VLLM_PYTHON is not the python of a vLLM venv")
    # The demo model: vLLM's CPU attention has no kernel for the test model's head size.
    model = cached_tiny_model("demo", cache_dir=tiny_model_dir.parent)
    host = VLLMHost(
        str(model),
        name="cell-1",
        device="cpu",
        gpus=(),
        max_context=512,
        host="127.0.0.1",
        version=-1,
    )

    async def sample(url: str, key: str) -> tuple[int, ...]:
        async with VLLMEngine(url, "cell-1", api_key=key) as engine:
            request = GenerateRequest("r", (5, 6, 7), SamplingParams(8, 1.0, ignore_eos=True))
            return (await engine.generate(request)).versions

    with core_boards(model) as (board, boards):
        try:
            weights = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
            board.write(weights.named_parameters(), version=3)  # the core published v3
            endpoint = host.start()
            assert host.load_newest(boards) == 3
            assert asyncio.run(sample(endpoint.url, endpoint.api_key)) == (3,) * 8
            assert host.release() == "stopped"  # on the CPU: vLLM's sleep frees nothing
            with pytest.raises(OSError):
                asyncio.run(sample(endpoint.url, endpoint.api_key))
            assert host.resume(boards) == 3  # restarted from the v3 weights it had loaded
            assert asyncio.run(sample(endpoint.url, endpoint.api_key)) == (3,) * 8
        finally:
            host.close()
