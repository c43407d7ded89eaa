"""The streaming interface (TokenDelta, collect), stop strings, and the scripted engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from qwengyre.engines.base import EngineAborted, GenerateRequest, TokenDelta, collect
from qwengyre.engines.scripted import STREAM_PARTS, ScriptedEngine
from qwengyre.engines.stops import StopStrings
from qwengyre.types import SamplingParams

REPLY = "Hello world, this is a test. STOP here and more text after."


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def req(rid: str = "r", max_tokens: int = 64, stop: tuple[str, ...] = ()) -> GenerateRequest:
    return GenerateRequest(rid, (1, 2, 3), SamplingParams(max_tokens=max_tokens, stop=stop))


async def deltas(*parts: TokenDelta) -> AsyncIterator[TokenDelta]:
    for part in parts:
        yield part


def test_collect_joins_deltas_and_needs_a_finish_reason():
    result = asyncio.run(
        collect(
            deltas(
                TokenDelta((5, 6), (-0.1, -0.2), (0, 0)),
                TokenDelta((7,), (-0.3,), (1,)),
                TokenDelta((), (), (), "length"),
            )
        )
    )
    assert result.output_ids == (5, 6, 7) and result.logprobs == (-0.1, -0.2, -0.3)
    assert result.versions == (0, 0, 1) and result.finish_reason == "length"
    with pytest.raises(RuntimeError, match="without a finish reason"):
        asyncio.run(collect(deltas(TokenDelta((5,), (-0.1,), (0,)))))
    with pytest.raises(ValueError, match="one entry per token"):
        TokenDelta((5, 6), (-0.1,), (0, 0))


class CountingTokenizer:
    """Records the longest id list each decode was given."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.longest = 0

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.longest = max(self.longest, len(ids))
        return str(self.tokenizer.decode(ids, **kwargs))


@pytest.mark.parametrize("stop", ["STOP", " test.", "is a"])
def test_stop_strings_stop_at_the_token_completing_the_first_occurrence(tokenizer, stop):
    ids = tokenizer.encode(REPLY, add_special_tokens=False)
    counting = CountingTokenizer(tokenizer)
    stops = StopStrings(counting, ["never there", stop])
    found = [stops.add(t) for t in ids]
    end = next(i for i, match in enumerate(found) if match is not None)
    assert found[end] == stop
    text = tokenizer.decode(ids[: end + 1])
    assert stop in text and stop not in tokenizer.decode(ids[:end])
    # only a tail of the output is decoded: as many ids as the longest stop's bytes, + 1
    assert counting.longest == stops.window == len(b"never there") + 1 < len(ids)


def test_absent_or_empty_stop_strings_never_match(tokenizer):
    ids = tokenizer.encode(REPLY, add_special_tokens=False)
    for stops in (StopStrings(tokenizer, ["never there"]), StopStrings(tokenizer, ["", ""])):
        assert [stops.add(t) for t in ids] == [None] * len(ids)


def scripted(tokenizer: Any, **kwargs: Any) -> ScriptedEngine:
    return ScriptedEngine(tokenizer, {"default": [REPLY]}, **kwargs)


def test_scripted_engine_streams_its_reply_over_delay_s(tokenizer):
    engine = scripted(tokenizer, delay_s=0.4)

    async def run() -> list[tuple[float, TokenDelta]]:
        start = time.monotonic()
        return [(time.monotonic() - start, d) async for d in engine.stream(req("a"))]

    seen = asyncio.run(run())
    assert len(seen) == STREAM_PARTS
    (first_at, first), (last_at, last) = seen[0], seen[-1]
    assert first.output_ids and first.finish_reason is None
    assert last_at - first_at > 0.25  # the first tokens come 3/4 of delay_s before the end
    assert last.finish_reason == "stop" and last.output_ids[-1] == tokenizer.eos_token_id


def test_scripted_engine_prefill_gives_no_token_and_an_abort_takes_no_turn(tokenizer):
    engine = ScriptedEngine(tokenizer, {"default": ["first", "second"]}, prefill_s=10)

    async def run() -> None:
        task = asyncio.ensure_future(anext(engine.stream(req("a"))))
        await asyncio.sleep(0.2)
        assert not task.done() and engine.load == 1  # no first token yet
        await engine.abort("a")
        with pytest.raises(EngineAborted):
            await asyncio.wait_for(task, 1)
        engine.prefill_s = 0
        result = await engine.generate(req("b"))
        assert tokenizer.decode(result.output_ids, skip_special_tokens=True) == "first"

    asyncio.run(run())


def test_scripted_engine_honours_stop_strings(tokenizer):
    ids = tokenizer.encode(REPLY, add_special_tokens=False)
    stopped = asyncio.run(scripted(tokenizer).generate(req(stop=("STOP",))))
    assert stopped.finish_reason == "stop"
    assert tokenizer.decode(stopped.output_ids).endswith("STOP")
    assert stopped.output_ids == tuple(ids[: len(stopped.output_ids)]) and len(ids) > len(
        stopped.output_ids
    )
    plain = asyncio.run(scripted(tokenizer).generate(req()))
    absent = asyncio.run(scripted(tokenizer).generate(req(stop=("never there",))))
    assert absent == plain and plain.output_ids == (*ids, tokenizer.eos_token_id)
    # max_tokens before the stop string: the length ends it
    short = asyncio.run(scripted(tokenizer).generate(req(max_tokens=3, stop=("STOP",))))
    assert short.finish_reason == "length" and short.output_ids == tuple(ids[:3])
