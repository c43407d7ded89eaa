"""A cell's engine host: bound to all interfaces it
advertises this node's address, which serves the engine to a key holder only; the
factory of rollout hosts; how every host loads the boards' newest weights."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
import torch
from tests.core_boards import core_boards

from qwengyre.cluster.engine_host import EngineHost, rollout_host
from qwengyre.cluster.net import advertised
from qwengyre.engines.base import GenerateRequest, StaleWeights
from qwengyre.engines.sglang import SGLangEngine
from qwengyre.types import SamplingParams


def test_the_advertised_address_is_the_nodes_for_the_wildcard_only() -> None:
    assert advertised("127.0.0.1") == "127.0.0.1"
    assert advertised("::1") == "[::1]"
    node = advertised("0.0.0.0")
    assert node not in ("0.0.0.0", "127.0.0.1", "") and node.count(".") == 3


def test_an_engine_bound_to_all_interfaces_serves_key_holders_at_the_node_address(
    tiny_model_dir: Path,
) -> None:
    host = rollout_host(
        "embedded",
        str(tiny_model_dir),
        name="cell-1",
        capacity=2,
        device="cpu",
        max_context=128,
        seed=0,
        host="0.0.0.0",
        gpus=("3",),  # no tensor parallelism: the embedded engine runs on its device
        version=0,
    )
    assert isinstance(host, EngineHost)
    try:
        endpoint = host.start()
        url, key = endpoint.url, endpoint.api_key
        assert endpoint.api == "sglang"  # the embedded engine speaks SGLang's API
        assert url.startswith(f"http://{advertised('0.0.0.0')}:")
        assert not url.startswith("http://127.")

        async def calls() -> None:
            async with SGLangEngine(url, "cell-1", capacity=2, api_key=key) as engine:
                request = GenerateRequest(
                    "r0", (5, 6, 7), SamplingParams(max_tokens=4, temperature=1.0)
                )
                result = await engine.generate(request)
                assert len(result.output_ids) == len(result.logprobs) > 0
                assert result.versions == (0,) * len(result.output_ids)
            async with (  # no key: refused
                aiohttp.ClientSession() as session,
                session.post(f"{url}/generate", json={"input_ids": [5]}) as answer,
            ):
                assert answer.status == 401

        asyncio.run(calls())
        assert host.release() == "released"
    finally:
        host.close()


def test_an_unknown_backend_is_named_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"'tgi'.*embedded, vllm, sglang"):
        rollout_host(
            "tgi",  # type: ignore[arg-type]
            "/models/none",
            name="cell-1",
            capacity=1,
            device="cpu",
            max_context=None,
            seed=0,
            host="127.0.0.1",
        )


def test_a_load_the_core_overtook_starts_over_with_the_newer_version(
    tiny_model_dir: Path,
) -> None:
    with core_boards(tiny_model_dir) as (board, boards):
        zeros = {name: torch.zeros(shape) for name, shape in boards.shapes.items()}
        board.write(zeros.items(), version=1)
        tried: list[int] = []

        def load(version: int) -> None:
            tried.append(version)
            if version == 1:  # the core published v2 while v1 was read
                board.write(zeros.items(), version=2)
                raise StaleWeights("shard 0 holds version 2, not 1")

        assert boards.load_newest(0, load) == 2
        assert boards.load_newest(2, load) == 2  # nothing newer: nothing loaded
        assert tried == [1, 2]

        def always_stale(version: int) -> None:
            raise StaleWeights("the core keeps writing")

        board.write(zeros.items(), version=3)
        with pytest.raises(StaleWeights, match="keeps writing"):
            boards.load_newest(2, always_stale)
