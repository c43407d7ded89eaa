"""A contract fake of SGLang's native HTTP server (aiohttp), for engine tests without a GPU.

Schema source: sgl-project/sglang, ``python/sglang/srt/entrypoints/http_server.py`` at
commit 0025436eab0556737d615b36a4dd3e1e26e82f3d, ``python/sglang/srt/managers/io_struct.py``
at commit 001067fffe33427bee0ed2f007fb7551a1d76b44 and ``tokenizer_manager.py``
(``_handle_batch_output``, ``_wait_one_response``, ``update_weights_from_disk``) of the
same period (SGLang 0.5.x, 2025-2026). Reproduced:

``POST /generate`` (``GenerateReqInput``; unknown top-level fields are ignored as a
pydantic dataclass does, wrong types answer 400 in ``ErrorResponse`` form)::

    {"input_ids": [int, ...], "sampling_params": {"max_new_tokens", "temperature",
     "top_p", "top_k", "stop", "stop_token_ids", ...}, "return_logprob": bool,
     "logprob_start_len": int, "rid": str, "stream": bool}
    -> 200 {"text": str, "output_ids": [int, ...],
            "meta_info": {"id", "finish_reason", "prompt_tokens", "weight_version",
                          "num_retractions", "input_token_logprobs",
                          "output_token_logprobs": [[logprob, token_id, null], ...],
                          "reasoning_tokens", "completion_tokens", "cached_tokens",
                          "e2e_latency"}}
    finish_reason: {"type": "stop", "matched": int|str} | {"type": "length", "length": n}
                   | {"type": "abort", "message": "Aborted", "status_code": null,
                      "err_type": null}
    -> 400 {"error": {"message": ...}} for the ValueErrors of request normalisation and
       ``SamplingParams.verify`` (messages as SGLang words them)

With ``"stream": true`` (``generate_request``'s ``stream_results``): 200
``text/event-stream``, one ``data: {chunk}\n\n`` per sampled token (``stream_interval``
1), the last with ``finish_reason`` set (earlier ones null), then ``data: [DONE]\n\n``.
Chunks are cumulative (``text``, ``output_ids``, ``output_token_logprobs`` hold all the
output so far), or hold only the new token with ``incremental_streaming_output``
(``--incremental-streaming-output``); ``completion_tokens`` counts all. The ValueErrors
above arrive as 200 with a chunk ``{"error": {"message": ...}}`` and ``[DONE]``, as they
are raised once the stream has begun. A client that hangs up cancels the request.

With ``"return_routed_experts": true`` on a fake started with ``routed_experts=(layers,
k)`` (``--enable-return-routed-experts`` for an MoE), the last answer or chunk only (the
scheduler collects them when the request finishes; an abort has none) carries
``meta_info.routed_experts``: the base64 of an ``int32`` array ``[seqlen - 1, layers,
k]`` (detokenizer ``_extract_routed_experts``), ``seqlen`` = prompt + output (sglang
``routed_experts_capturer.py``, ``get_routed_experts``); the fake's rows are
:func:`routed`. Without the server flag or the request field: no key.

``POST /abort_request`` ``{"rid", "abort_all"}`` -> 200, empty body; running requests
whose rid *starts with* ``rid`` finish with the abort reason above (as the scheduler's
prefix match does). ``POST /update_weights_from_disk`` ``{"model_path", "load_format",
"abort_all_requests", "weight_version", ...}`` -> ``{"success", "message",
"num_paused_requests"}`` (200, or 400 when ``success`` is false); like SGLang's
model-update writer lock it waits for requests in flight and holds new ones back.
``/release_memory_occupation`` and ``/resume_memory_occupation`` (``{"tags"}``) -> 200
``null``; ``GET /health`` -> 200 or 503, empty; ``GET /get_weight_version``; ``--api-key`` -> 401
``{"error": "Unauthorized"}``.

Not verified against a running SGLang, so chosen here (keep the engine tolerant):
unknown ``sampling_params`` keys (real SGLang raises ``TypeError`` in
``SamplingParams(**...)``; the fake answers 400 with that message); ``/generate`` while
released (real behaviour undefined; the fake answers 503); ``/release_memory_occupation``
with requests in flight (real: a scheduler assertion; the fake answers 400 with its
message); the text of a failed weight load.

The model is fake: token ``t`` decodes to ``" t<t>"``; a reply is a pseudo-random
sequence seeded by the input ids and the number of weight loads, ended by ``eos_token_id``;
log-probs are a deterministic function of token, position and loads (see :func:`reply`).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiohttp import web

SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "n",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "custom_params",
        "stream_interval",
        "logit_bias",
        "sampling_seed",
    }
)

GENERATE_TYPES: dict[str, tuple[type, ...]] = {
    "text": (str, list),
    "input_ids": (list,),
    "sampling_params": (dict, list),
    "return_logprob": (bool, list),
    "logprob_start_len": (int, list),
    "top_logprobs_num": (int, list),
    "return_text_in_logprobs": (bool,),
    "rid": (str, list),
    "stream": (bool,),
    "return_routed_experts": (bool,),
}


def token_text(token: int) -> str:
    return f" t{token}"


def reply(input_ids: list[int], loads: int = 0, eos_token_id: int = 2) -> list[int]:
    """The fake model's full answer (ending with EOS) to ``input_ids`` after ``loads`` loads."""
    rng = random.Random(hash((tuple(input_ids), loads)) & 0xFFFFFFFF)
    length = rng.randint(3, 10)
    return [rng.randint(10, 999) for _ in range(length)] + [eos_token_id]


def logprob(token: int, position: int, loads: int = 0) -> float:
    return -0.01 - ((token * 31 + position * 7 + loads * 13) % 97) / 50.0


def routed(ids: list[int], layers: int, k: int) -> np.ndarray:
    """The fake MoE's routed experts of the positions of ``ids``: ``[len(ids), layers,
    k]``, a deterministic function of each position's token and index."""
    rows = [
        [[(7 * t + 3 * p + layer + j) % 128 for j in range(k)] for layer in range(layers)]
        for p, t in enumerate(ids)
    ]
    return np.array(rows, dtype=np.int32).reshape(len(ids), layers, k)


def _validation_error(message: str) -> web.Response:
    return web.json_response(
        {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400},
        status=400,
    )


def _value_error(message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=400)


async def _event_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    return response


async def _send(response: web.StreamResponse, data: str) -> None:
    await response.write(f"data: {data}\n\n".encode())


@dataclass
class _Running:
    rid: str
    aborted: bool = False
    abort_message: str = "Aborted"


@dataclass
class FakeSGLang:
    """An in-process fake SGLang server; ``await start()`` returns its base URL."""

    token_delay_s: float = 0.0
    eos_token_id: int = 2
    context_len: int = 4096
    api_key: str | None = None
    model_path: str = "fake-org/fake-model"
    weight_version: str = "default"
    healthy: bool = True
    released: bool = False
    loads: int = 0  # successful weight loads; changes the fake model's answers
    incremental_streaming_output: bool = False
    routed_experts: tuple[int, int] | None = None  # (layers, k): --enable-return-routed-experts
    requests: list[tuple[str, str, Any]] = field(default_factory=list)  # (method, path, body)

    def __post_init__(self) -> None:
        self._running: dict[str, _Running] = {}
        self._updating = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._runner: web.AppRunner | None = None
        self._sock: socket.socket | None = None
        self._live: dict[int, web.Request] = {}  # id -> request in progress
        self._bodies: dict[int, Any] = {}
        self.crashed = False
        self.port = 0

    # -- lifecycle -------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> str:
        app = web.Application(middlewares=[self._middleware])
        app.router.add_route("*", "/generate", self._generate)
        app.router.add_post("/abort_request", self._abort)
        app.router.add_post("/update_weights_from_disk", self._update_weights)
        app.router.add_route("*", "/release_memory_occupation", self._release)
        app.router.add_route("*", "/resume_memory_occupation", self._resume)
        app.router.add_get("/health", self._health)
        app.router.add_get("/health_generate", self._health)
        app.router.add_get("/get_weight_version", self._weight_version)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5, handler_cancellation=True)
        await self._runner.setup()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        await web.SockSite(self._runner, self._sock).start()
        return self.base_url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def crash(self) -> None:
        """Die like a killed server: drop every open connection and stop listening."""
        self.crashed = True
        for request in list(self._live.values()):
            if request.transport is not None:
                request.transport.close()
        await self.stop()

    # -- helpers ---------------------------------------------------------------------

    def paths(self) -> list[str]:
        return [path for _, path, _ in self.requests]

    def bodies(self, path: str) -> list[Any]:
        return [body for _, p, body in self.requests if p == path]

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        self.requests.append((request.method, request.path, body))
        if (
            self.api_key
            and request.path not in ("/health", "/health_generate")
            and request.headers.get("Authorization") != f"Bearer {self.api_key}"
        ):
            return web.json_response({"error": "Unauthorized"}, status=401)
        if isinstance(body, str):
            return _validation_error(f"JSON decode error: {body[:50]!r}")
        self._live[id(request)] = request
        self._bodies[id(request)] = body
        try:
            response: web.StreamResponse = await handler(request)
            return response
        finally:
            self._live.pop(id(request), None)
            self._bodies.pop(id(request), None)

    # -- /generate -------------------------------------------------------------------

    def _check_types(self, body: Any) -> web.Response | None:
        """What pydantic refuses before the handler runs (400 even when streaming)."""
        if not isinstance(body, dict):
            return _validation_error(
                "Input should be a dictionary or an instance of GenerateReqInput"
            )
        for key, types in GENERATE_TYPES.items():
            value = body.get(key)
            if value is not None and (
                not isinstance(value, types) or (types == (int, list) and isinstance(value, bool))
            ):
                return _validation_error(f"{key}: Input should be a valid {types[0].__name__}")
        ids = body.get("input_ids")
        if ids is not None and not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            return _validation_error("input_ids: Input should be a list of integers")
        return None

    def _check_values(self, body: dict[str, Any]) -> str | None:
        """The message of the ValueError that request normalisation or verify raises."""
        if body.get("text") is None and body.get("input_ids") is None:
            return "Either text, input_ids or input_embeds should be provided."
        if body.get("text") is not None:
            return "the fake SGLang has no tokenizer: send input_ids"
        ids = body["input_ids"]
        if len(ids) == 0:
            return "input_ids cannot be empty."
        if not isinstance(body.get("rid", ""), str):
            return "the fake SGLang serves single requests only"
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            return "the fake SGLang serves single requests only"
        for key in params:
            if key not in SAMPLING_KEYS:
                return f"SamplingParams.__init__() got an unexpected keyword argument '{key}'"
        temperature = params.get("temperature", 1.0)
        top_p = params.get("top_p", 1.0)
        top_k = params.get("top_k", -1)
        max_new = params.get("max_new_tokens", 128)
        if temperature < 0.0:
            return f"temperature must be non-negative, got {temperature}."
        if not 0.0 < top_p <= 1.0:
            return f"top_p must be in (0, 1], got {top_p}."
        if top_k < -1 or top_k == 0:
            return f"top_k must be -1 (disable), or at least 1, got {top_k}."
        if max_new is not None and max_new < 0:
            return f"max_new_tokens must be at least 0, got {max_new}."
        if len(ids) >= self.context_len:
            return (
                f"The input ({len(ids)} tokens) is longer than the model's context length "
                f"({self.context_len} tokens)."
            )
        rid = body.get("rid")
        if rid is not None and rid in self._running:
            return f"Duplicate request ID: {rid}"
        return None

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = self._bodies[id(request)]
        error = self._check_types(body)
        if error is not None:
            return error
        message = self._check_values(body)
        if message is not None:
            if not body.get("stream"):
                return _value_error(message)
            response = await _event_stream(request)
            await _send(response, json.dumps({"error": {"message": message}}))
            await _send(response, "[DONE]")
            return response
        if self.released:
            return web.json_response(
                {"object": "error", "message": "memory released; resume first", "code": 503},
                status=503,
            )
        while self._updating:  # the model-update lock is held by a writer
            await asyncio.sleep(0.005)
        rid = body.get("rid") or os.urandom(16).hex()
        state = _Running(rid)
        self._running[rid] = state
        self._idle.clear()
        started = time.monotonic()
        try:
            if body.get("stream"):
                return await self._stream(request, body, state, started)
            async for out, text, finish in self._decode(body, state):
                if finish is not None:
                    return web.json_response(self._chunk(body, state, out, text, finish, started))
            raise AssertionError("the fake's decode ended unfinished")
        finally:
            self._running.pop(rid, None)
            if not self._running:
                self._idle.set()

    async def _stream(
        self, request: web.Request, body: dict[str, Any], state: _Running, started: float
    ) -> web.StreamResponse:
        response = await _event_stream(request)
        sent, shown = 0, 0  # tokens and characters of text already streamed
        async for out, text, finish in self._decode(body, state):
            if self.incremental_streaming_output:
                chunk = self._chunk(body, state, out, text[shown:], finish, started, sent)
                sent, shown = len(out), max(shown, len(text))
            else:
                chunk = self._chunk(body, state, out, text, finish, started)
            await _send(response, json.dumps(chunk))
        await _send(response, "[DONE]")
        return response

    async def _decode(
        self, body: dict[str, Any], state: _Running
    ) -> AsyncIterator[tuple[list[int], str, dict[str, Any] | None]]:
        """(output so far, its text, finish reason or None) after every step."""
        ids: list[int] = body["input_ids"]
        params = body.get("sampling_params") or {}
        max_new = params.get("max_new_tokens", 128)
        stops = params.get("stop") or []
        stops = [stops] if isinstance(stops, str) else list(stops)
        stop_ids = set(params.get("stop_token_ids") or []) | {self.eos_token_id}
        script = reply(ids, self.loads, self.eos_token_id)
        out: list[int] = []
        text = ""
        finish: dict[str, Any] | None = None
        while finish is None:
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            if self.crashed:
                raise ConnectionResetError("crashed")
            if state.aborted:
                finish = {
                    "type": "abort",
                    "message": state.abort_message,
                    "status_code": None,
                    "err_type": None,
                }
            elif len(out) >= max_new:
                finish = {"type": "length", "length": max_new}
            else:
                token = script[len(out)] if len(out) < len(script) else self.eos_token_id
                out.append(token)
                if token in stop_ids and not params.get("ignore_eos"):
                    finish = {"type": "stop", "matched": token}
                else:
                    text += token_text(token)
                    matched = next((s for s in stops if s and s in text), None)
                    if matched is not None:
                        text = text[: text.index(matched)]  # SGLang trims the stop string
                        finish = {"type": "stop", "matched": matched}
            yield out, text, finish

    def _chunk(
        self,
        body: dict[str, Any],
        state: _Running,
        out: list[int],
        text: str,
        finish: dict[str, Any] | None,
        started: float,
        since: int = 0,
    ) -> dict[str, Any]:
        """An answer (or stream chunk) for the output ``out``, from token ``since`` on."""
        ids: list[int] = body["input_ids"]
        loads = self.loads
        meta: dict[str, Any] = {
            "id": state.rid,
            "finish_reason": finish,
            "prompt_tokens": len(ids),
            "weight_version": self.weight_version,
            "num_retractions": 0,
        }
        if body.get("return_logprob"):
            start = body.get("logprob_start_len")
            start = -1 if start is None else start
            meta["input_token_logprobs"] = (
                []
                if start < 0
                else [
                    [None if i == 0 else logprob(t, i, loads), t, None]
                    for i, t in enumerate(ids)
                    if i >= start
                ]
            )
            meta["output_token_logprobs"] = [
                [logprob(t, i, loads), t, None] for i, t in enumerate(out) if i >= since
            ]
        meta.update(
            {
                "reasoning_tokens": 0,
                "completion_tokens": len(out),
                "cached_tokens": 0,
                "e2e_latency": time.monotonic() - started,
            }
        )
        aborted = finish is not None and finish["type"] == "abort"
        wanted = body.get("return_routed_experts") and self.routed_experts is not None
        if wanted and finish is not None and not aborted:
            assert self.routed_experts is not None
            rows = routed(ids + out, *self.routed_experts)[: len(ids) + len(out) - 1]
            meta["routed_experts"] = base64.b64encode(rows.tobytes()).decode()
        return {"text": text, "output_ids": out[since:], "meta_info": meta}

    # -- control endpoints -----------------------------------------------------------

    async def _abort(self, request: web.Request) -> web.Response:
        body = self._bodies[id(request)] or {}
        if not isinstance(body, dict) or not isinstance(body.get("rid", ""), str):
            return _validation_error("rid: Input should be a valid string")
        rid = body.get("rid") or ""
        for running in self._running.values():
            if body.get("abort_all") or running.rid.startswith(rid):
                running.aborted = True
        return web.Response(status=200)

    async def _update_weights(self, request: web.Request) -> web.Response:
        body = self._bodies[id(request)]
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            return _validation_error("model_path: Field required")
        if body.get("abort_all_requests"):
            for running in self._running.values():
                running.aborted = True
        self._updating = True  # writer lock: hold new requests back, wait for running ones
        try:
            await self._idle.wait()
            path = body["model_path"]
            if not os.path.isdir(path):
                success = False
                message = (
                    f"Failed to get weights iterator: {path} (repo id or local dir) not found."
                )
            else:
                success = True
                message = "Succeeded to update model weights."
                self.loads += 1
                self.model_path = path
                if body.get("weight_version") is not None:
                    self.weight_version = str(body["weight_version"])
                    message += f" Weight version updated to {body['weight_version']}."
        finally:
            self._updating = False
        content = {"success": success, "message": message, "num_paused_requests": 0}
        return web.json_response(content, status=200 if success else 400)

    async def _release(self, request: web.Request) -> web.Response:
        if self._running:
            return _value_error(
                "release_memory_occupation should be called only when server is idle."
            )
        self.released = True
        return web.json_response(None)

    async def _resume(self, request: web.Request) -> web.Response:
        self.released = False
        return web.json_response(None)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy and not self.released else 503)

    async def _weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.weight_version})
