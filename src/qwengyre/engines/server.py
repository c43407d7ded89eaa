"""An engine as its own process: SGLang's HTTP API in front of an :class:`EmbeddedEngine`.

A cell hosts its engine here and everything else drives it with
:class:`qwengyre.engines.sglang.SGLangEngine`, the same client that drives real SGLang
servers: ``/generate`` (``input_ids``, ``sampling_params``, ``return_logprob``, ``rid``),
``/abort_request``, ``/update_weights_from_disk``, ``/release_memory_occupation``,
``/resume_memory_occupation``, ``/flush_cache``, ``/health``. One addition to SGLang's
answer: ``meta_info.output_token_versions``, the policy version of every output token.
Binds 127.0.0.1 by default and requires ``Authorization: Bearer <api key>``.
"""

from __future__ import annotations

import secrets
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from qwengyre.engines.base import EngineAborted, GenerateRequest, WeightsOnDisk
from qwengyre.engines.embedded import EmbeddedEngine
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


class _UpdateFromDisk(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model_path: str
    weight_version: str | None = None


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def engine_app(engine: EmbeddedEngine, api_key: str) -> web.Application:
    """The aiohttp application serving ``engine``."""

    @web.middleware
    async def authenticate(request: web.Request, handler: Any) -> web.StreamResponse:
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            return web.json_response({"error": "Unauthorized"}, status=401)
        response: web.StreamResponse = await handler(request)
        return response

    async def generate(request: web.Request) -> web.Response:
        try:
            body = _Generate.model_validate_json(await request.read())
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            return _error(400, f"{where}: {first['msg']}")
        if body.stream:
            return _error(400, "stream: streaming is not supported by this engine server")
        s = body.sampling_params
        stop = [s.stop] if isinstance(s.stop, str) else (s.stop or [])
        rid = body.rid or secrets.token_hex(8)
        sampling = SamplingParams(
            s.max_new_tokens,
            s.temperature,
            s.top_p,
            s.top_k,
            tuple(stop),
            tuple(s.stop_token_ids or ()),
        )
        try:
            result = await engine.generate(GenerateRequest(rid, tuple(body.input_ids), sampling))
        except ValueError as exc:
            return _error(400, str(exc))
        except EngineAborted as exc:
            finish: dict[str, Any] = {"type": "abort", "message": str(exc)}
            return web.json_response(
                {
                    "text": "",
                    "output_ids": [],
                    "meta_info": {
                        "id": rid,
                        "finish_reason": finish,
                        "prompt_tokens": len(body.input_ids),
                        "completion_tokens": 0,
                        "output_token_logprobs": [],
                    },
                }
            )
        finish = {"type": result.finish_reason}
        if result.finish_reason == "length":
            finish["length"] = len(result.output_ids)
        meta = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(body.input_ids),
            "completion_tokens": len(result.output_ids),
            "weight_version": str(result.policy_version),
            "output_token_versions": list(result.versions),
        }
        if body.return_logprob:
            meta["output_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(result.logprobs, result.output_ids, strict=True)
            ]
        return web.json_response(
            {"text": "", "output_ids": list(result.output_ids), "meta_info": meta}
        )

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

    async def flush(request: web.Request) -> web.Response:
        return web.Response(text="Cache flushed.")

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200 if await engine.health() else 503)

    app = web.Application(middlewares=[authenticate])
    app.router.add_post("/generate", generate)
    app.router.add_post("/abort_request", abort)
    app.router.add_post("/update_weights_from_disk", update_from_disk)
    app.router.add_post("/release_memory_occupation", release)
    app.router.add_post("/resume_memory_occupation", resume)
    app.router.add_post("/flush_cache", flush)
    app.router.add_get("/health", health)
    return app
