"""A cell's engine host (issue 18, engines across nodes): bound to all interfaces it
advertises this node's address, which serves the engine to a key holder only."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from qwengyre.cluster.engine_host import EngineHost, advertised
from qwengyre.engines.base import GenerateRequest
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
    host = EngineHost(
        str(tiny_model_dir),
        name="cell-1",
        capacity=2,
        device="cpu",
        max_context=128,
        seed=0,
        version=0,
        host="0.0.0.0",
    )
    try:
        endpoint = host.start()
        url, key = endpoint.url, endpoint.api_key
        assert endpoint.api == "sglang"  # the embedded engine speaks SGLang's API
        assert url.startswith(f"http://{advertised('0.0.0.0')}:")
        assert not url.startswith("http://127.")

        async def calls() -> None:
            async with SGLangEngine(url, "cell-1", capacity=2, api_key=key) as engine:
                request = GenerateRequest("r0", (5, 6, 7), SamplingParams(4, 1.0))
                result = await engine.generate(request)
                assert len(result.output_ids) == len(result.logprobs) > 0
            async with (  # no key: refused
                aiohttp.ClientSession() as session,
                session.post(f"{url}/generate", json={"input_ids": [5]}) as answer,
            ):
                assert answer.status == 401

        asyncio.run(calls())
    finally:
        host.close()
