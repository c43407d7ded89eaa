"""An engine as its own process: SGLang's HTTP API in front of an :class:`EmbeddedEngine`.

A cell hosts its engine here and everything else drives it with
:class:`qwengyre.engines.sglang.SGLangEngine`, the same client that drives real SGLang
servers: ``/generate`` (``input_ids``, ``sampling_params``, ``return_logprob``, ``rid``),
``/abort_request``, ``/update_weights_from_disk``, ``/release_memory_occupation``,
``/resume_memory_occupation``, ``/health``. One addition to SGLang's
answer: ``meta_info.output_token_versions``, the policy version of every output token.
Binds 127.0.0.1 by default and requires ``Authorization: Bearer <api key>``.

``/generate`` with ``stream: true`` answers server-sent events as SGLang does with
``--incremental-streaming-output``: a ``data: {chunk}`` per engine delta, holding its
new tokens (``output_ids``, ``output_token_logprobs``, ``output_token_versions``;
``completion_tokens`` counts all so far), the last with ``finish_reason``, then
``data: [DONE]``. A client that hangs up, streaming or not, aborts its engine request.

``return_routed_experts: true`` (an MoE; SGLang's ``GenerateReqInput`` field): the last
answer, streaming or not, carries ``meta_info.routed_experts`` as SGLang sends it: the
base64 of an ``int32`` array ``[len(input_ids) + len(output) - 1, layers, k]`` (C order),
the experts the engine routed every position to (the engine's deltas' rows, joined;
:mod:`qwengyre.engines.sglang` says more). No key when not asked, or when the engine
reports none (a dense model), as SGLang without ``--enable-return-routed-experts``.
An aborted request's last answer carries them too, for the positions before the tokens
it answered (``len(input_ids) + answered - 1`` rows): a continuation elsewhere keeps
the routing those tokens were sampled under (:meth:`~qwengyre.proxy.routing.Router.stream`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from qwengyre.engines.base import (
    EngineAborted,
    GenerateRequest,
    GenerateResult,
    Joined,
    TokenDelta,
    WeightsOnDisk,
    collect,
)
from qwengyre.engines.embedded import EmbeddedEngine
from qwengyre.hangups import HangUps
from qwengyre.types import SamplingParams


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False


class _Generate(BaseModel):
    model_config = ConfigDict(extra="ignore")  # SGLang accepts many fields we do not use

    input_ids: list[int] = Field(min_length=1)
    sampling_params: _Sampling = Field(default_factory=_Sampling)
    return_logprob: bool = False
    logprob_start_len: int = -1
    rid: str | None = None
    stream: bool = False
    return_routed_experts: bool = False


class _UpdateFromDisk(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model_path: str
    weight_version: str | None = None


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


async def _abort_when(gone: asyncio.Future[None], engine: EmbeddedEngine, rid: str) -> None:
    await gone
    await engine.abort(rid)


class _Answers:
    """SGLang's answers (or stream chunks) to one ``/generate`` request."""

    def __init__(
        self, rid: str, prompt_tokens: int, logprobs: bool, version: int, routing: bool = False
    ) -> None:
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self.logprobs = logprobs
        self.version = version  # for an answer without tokens
        self.tokens = 0  # output tokens answered so far
        self.routing = Joined() if routing else None  # the deltas so far, if asked

    def of(self, part: TokenDelta | GenerateResult) -> dict[str, Any]:
        """The answer carrying ``part``'s tokens, the next of the output."""
        self.tokens += len(part.output_ids)
        routing: np.ndarray | None = None
        if self.routing is not None:
            if isinstance(part, GenerateResult):
                routing = part.routing
            else:
                self.routing.add(part)
                if part.finish_reason is not None:
                    routing = self.routing.result().routing
        finish: dict[str, Any] | None = None
        if part.finish_reason is not None:
            finish = {"type": part.finish_reason}
            if part.finish_reason == "length":
                finish["length"] = self.tokens
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": finish,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.tokens,
            "weight_version": str(max(part.versions, default=self.version)),
            "output_token_versions": list(part.versions),
        }
        if self.logprobs:
            meta["output_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(part.logprobs, part.output_ids, strict=True)
            ]
        _add_routing(meta, routing)
        return {"text": "", "output_ids": list(part.output_ids), "meta_info": meta}

    def aborted(self, message: str) -> dict[str, Any]:
        """The last answer of a request aborted after the tokens answered so far (with
        their routed experts, if asked and streamed)."""
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": {"type": "abort", "message": message},
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.tokens,
            "output_token_logprobs": [],
        }
        if self.routing is not None:
            _add_routing(meta, self.routing.result(otherwise="abort").routing)
        return {"text": "", "output_ids": [], "meta_info": meta}


def _add_routing(meta: dict[str, Any], routing: np.ndarray | None) -> None:
    """``meta_info.routed_experts`` in SGLang's form (base64 of int32 ``[rows, layers,
    k]``), if there are any."""
    if routing is not None:
        flat = np.ascontiguousarray(routing, dtype=np.int32).tobytes()
        meta["routed_experts"] = base64.b64encode(flat).decode()


async def _plain_answer(deltas: AsyncIterator[TokenDelta], answers: _Answers) -> web.Response:
    try:
        result = await collect(deltas)
    except ValueError as exc:
        return _error(400, str(exc))
    except EngineAborted as exc:
        return web.json_response(answers.aborted(str(exc)))
    return web.json_response(answers.of(result))


async def _event_stream(
    request: web.Request, deltas: AsyncIterator[TokenDelta], answers: _Answers
) -> web.StreamResponse:
    """The deltas as SGLang's stream chunks; a request refused before it starts is
    answered 400, as without streaming."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    last: dict[str, Any] | None = None
    try:
        async for delta in deltas:
            if not response.prepared:
                await response.prepare(request)
            await response.write(f"data: {json.dumps(answers.of(delta))}\n\n".encode())
    except ValueError as exc:
        if not response.prepared:
            return _error(400, str(exc))
        last = {"error": {"message": str(exc)}}
    except EngineAborted as exc:
        last = answers.aborted(str(exc))
    except ConnectionError:  # the client hung up: the handler closes the engine's stream
        return response
    with contextlib.suppress(ConnectionError):
        if not response.prepared:
            await response.prepare(request)
        if last is not None:
            await response.write(f"data: {json.dumps(last)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
    return response


def engine_app(engine: EmbeddedEngine, api_key: str) -> web.Application:
    """The aiohttp application serving ``engine``."""
    hang_ups = HangUps()

    @web.middleware
    async def authenticate(request: web.Request, handler: Any) -> web.StreamResponse:
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            return web.json_response({"error": "Unauthorized"}, status=401)
        response: web.StreamResponse = await handler(request)
        return response

    async def generate(request: web.Request) -> web.StreamResponse:
        try:
            body = _Generate.model_validate_json(await request.read())
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            return _error(400, f"{where}: {first['msg']}")
        s = body.sampling_params
        stop = [s.stop] if isinstance(s.stop, str) else (s.stop or [])
        rid = body.rid or secrets.token_hex(8)
        sampling = SamplingParams(
            max_tokens=s.max_new_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            stop=tuple(stop),
            stop_token_ids=tuple(s.stop_token_ids or ()),
            ignore_eos=s.ignore_eos,
        )
        answers = _Answers(
            rid,
            len(body.input_ids),
            body.return_logprob,
            engine.version,
            routing=body.return_routed_experts,
        )
        gone = hang_ups.watch(request)
        hangup = asyncio.ensure_future(_abort_when(gone, engine, rid))
        async with contextlib.aclosing(
            engine.stream(GenerateRequest(rid, tuple(body.input_ids), sampling))
        ) as deltas:
            try:
                if body.stream:
                    return await _event_stream(request, deltas, answers)
                return await _plain_answer(deltas, answers)
            finally:
                hang_ups.forget(gone)
                hangup.cancel()

    async def abort(request: web.Request) -> web.Response:
        body = await request.json()
        await engine.abort(str(body.get("rid", "")))
        return web.Response(status=200)

    async def update_from_disk(request: web.Request) -> web.Response:
        try:
            body = _UpdateFromDisk.model_validate_json(await request.read())
            version = int(body.weight_version) if body.weight_version else engine.version + 1
            await engine.update_weights(WeightsOnDisk(body.model_path), version)
        except (ValidationError, ValueError, OSError) as exc:
            return web.json_response({"success": False, "message": str(exc)}, status=400)
        return web.json_response(
            {
                "success": True,
                "message": "Succeeded to update model weights.",
                "num_paused_requests": 0,
            }
        )

    async def release(request: web.Request) -> web.Response:
        try:
            await engine.release_memory()
        except RuntimeError as exc:
            return _error(400, str(exc))
        return web.json_response(None)

    async def resume(request: web.Request) -> web.Response:
        await engine.resume_memory()
        return web.json_response(None)

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200 if await engine.health() else 503)

    app = web.Application(middlewares=[authenticate])
    app.router.add_post("/generate", generate)
    app.router.add_post("/abort_request", abort)
    app.router.add_post("/update_weights_from_disk", update_from_disk)
    app.router.add_post("/release_memory_occupation", release)
    app.router.add_post("/resume_memory_occupation", resume)
    app.router.add_get("/health", health)
    return app
