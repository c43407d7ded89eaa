"""A call moved mid-generation between two real embedded engines:
one continuous reply, every token generated once, each log-prob that of the whole
context it was sampled in. (The same against a vLLM server: tests/test_engine_vllm.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import torch

from qwengyre.engines.base import GenerateRequest, InferenceEngine
from qwengyre.engines.embedded import EmbeddedEngine, behaviour_logprobs
from qwengyre.proxy.routing import Recompute, Router
from qwengyre.types import SamplingParams

PROMPT = tuple(range(40, 52))


class Recorded(Recompute):
    """The default handoff, remembering the requests it made."""

    def __init__(self) -> None:
        self.made: list[GenerateRequest] = []

    async def continuation(
        self,
        source: InferenceEngine,
        source_request_id: str,
        request: GenerateRequest,
        produced: Sequence[int],
    ) -> GenerateRequest:
        made = await super().continuation(source, source_request_id, request, produced)
        self.made.append(made)
        return made


def test_a_call_drained_mid_generation_continues_at_the_other_engine(tiny_model_dir: Path):
    a = EmbeddedEngine(tiny_model_dir, name="a", capacity=2, max_context=256, seed=1)
    b = EmbeddedEngine(tiny_model_dir, name="b", capacity=2, max_context=256, seed=2)
    router = Router(handoff=(handoff := Recorded()))
    router.register(b, preference=0)
    router.register(a, preference=1)  # preferred: the call starts there
    call = GenerateRequest("req", PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))

    async def run() -> list[tuple[str, tuple[int, ...], tuple[float, ...]]]:
        got = []
        moves = []
        async for name, delta in router.stream("ex", call):
            got.append((name, delta.output_ids, delta.logprobs))
            if sum(len(ids) for _, ids, _ in got) >= 8 and name == "a" and not moves:
                moves.append(asyncio.create_task(router.drain("a")))  # its cell moves
        await asyncio.gather(*moves)
        return got

    try:
        got = asyncio.run(run())
    finally:
        a.close()
        b.close()
    tokens = [t for _, ids, _ in got for t in ids]
    logprobs = [lp for _, _, lps in got for lp in lps]
    from_a = [t for name, ids, _ in got if name == "a" for t in ids]
    assert len(tokens) == 40  # the budget, spent once over both engines
    assert 8 <= len(from_a) < 40 and {name for name, _, _ in got} == {"a", "b"}
    (continued,) = handoff.made
    assert tuple(continued.input_ids) == (*PROMPT, *from_a)  # b continued, nothing repeated
    assert continued.sampling.max_tokens == 40 - len(from_a)
    # Every token's log-prob is the one of the whole context before it: what the
    # trainer recomputes for the reply the harness received.
    ids = torch.tensor([[*PROMPT, *tokens]])
    with torch.inference_mode():
        logits = a.model(input_ids=ids).logits[0]
    expected = behaviour_logprobs(logits[len(PROMPT) - 1 : -1], ids[0, len(PROMPT) :], 1.0)
    assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4)
