"""An engine backed by an SGLang server, over SGLang's native HTTP API.

Endpoints used (``sglang/srt/entrypoints/http_server.py``; the request bodies are the
dataclasses of ``sglang/srt/managers/io_struct.py``):

- ``POST /generate`` with ``GenerateReqInput``: ``input_ids``, ``sampling_params``
  (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop``,
  ``stop_token_ids``), ``return_logprob``, ``logprob_start_len=-1`` (log-probs of the
  output tokens only), ``rid``, ``stream=true``. The answer is a server-sent event
  stream of ``data: {json}`` lines ending with ``data: [DONE]``; each chunk is
  ``{"text", "output_ids", "meta_info"}`` where ``meta_info`` holds ``id``,
  ``finish_reason`` (null until the last chunk, then ``{"type":
  "stop"|"length"|"abort", ...}``), ``prompt_tokens``, ``completion_tokens`` (all the
  tokens so far), ``output_token_logprobs`` (``[logprob, token_id, text]`` triples,
  ``text`` null unless asked for) and, in recent SGLang, ``weight_version``. By default
  every chunk repeats all the output so far (cumulative); with
  ``--incremental-streaming-output`` it holds only the new tokens. The engine takes
  the last ``completion_tokens - (tokens already yielded)`` triples, right in both
  cases, and reads the ids from the triples (``output_ids`` has meant either, across
  versions). Errors raised while the request runs arrive as a chunk
  ``{"error": {"message"}}`` (HTTP 200); an abort with ``status_code`` 400 is a bad
  request.
- ``POST /abort_request`` with ``AbortReq`` (``rid``).
- ``POST /update_weights_from_disk`` with ``UpdateWeightFromDiskReqInput``
  (``model_path``, ``weight_version``); answers ``{"success", "message",
  "num_paused_requests"}``, 400 when ``success`` is false.
- ``POST /release_memory_occupation`` / ``POST /resume_memory_occupation`` with
  ``{}`` (all tags: weights and KV cache); the server must run with
  ``--enable-memory-saver`` for memory to be actually freed.
- ``POST /flush_cache``; ``GET /health`` (200 healthy, 503 not).

Weight versions: SGLang reports no per-token version. ``update_weights_from_disk``
takes the tokenizer manager's model-update writer lock, so (unless the server was put
in a paused state with ``/pause_generation``, which this engine never does) a load
waits for the requests in flight and applies between requests; every token of one
answer therefore comes from one version. The engine sends its integer version as
SGLang's ``weight_version`` string and reads it back from ``meta_info.weight_version``
when the server reports it, falling back to the version it recorded itself.

Caveat: SGLang's scheduler matches ``/abort_request`` rids by *prefix*
(``req.rid.startswith(rid)``), so aborting ``"x-1"`` also aborts a running ``"x-10"``.
The aborted one raises :class:`EngineAborted` and is retried by the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import subprocess
import sys
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from qwengyre.engines.base import (
    EngineAborted,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    TokenDelta,
    WeightsInMemory,
    WeightsOnDisk,
    WeightSource,
    collect,
)
from qwengyre.engines.http_client import HTTPEngineClient, error_message, sse_data

log = logging.getLogger(__name__)

_FINISH_TYPES: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


class SGLangNotInstalled(RuntimeError):
    """``sglang`` cannot be imported in this environment."""


class SGLangEngine(HTTPEngineClient):
    """:class:`~qwengyre.engines.base.InferenceEngine` over one SGLang server.

    Errors: HTTP 4xx raises ``ValueError`` with SGLang's message (a bad request, not
    an engine failure); a connection that cannot be made or is lost raises an
    ``OSError`` (``ConnectionError`` wrapping aiohttp's errors that are not already
    ``OSError``), HTTP 5xx raises ``ConnectionError`` too, and a request that the
    server aborted raises :class:`EngineAborted`; the router reroutes on all three. A
    consumer that leaves a :meth:`stream` early closes its HTTP response and sends
    ``/abort_request``.
    """

    server = "SGLang"

    def _raise_for_status(self, path: str, status: int, text: str) -> None:
        message = error_message(status, text)
        if status == 503 and "abort" in message.lower():
            # a running request aborted with status 503 (e.g. timeout) comes back this way
            raise EngineAborted(message)
        super()._raise_for_status(path, status, text)

    # -- generation ------------------------------------------------------------------

    @staticmethod
    def request_body(request: GenerateRequest) -> dict[str, Any]:
        """The ``/generate`` body (``GenerateReqInput``) for ``request``."""
        sampling = request.sampling
        params: dict[str, Any] = {
            "max_new_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,  # SGLang: -1 disables top-k, as here
        }
        if sampling.stop:
            params["stop"] = list(sampling.stop)
        if sampling.stop_token_ids:
            params["stop_token_ids"] = list(sampling.stop_token_ids)
        if sampling.ignore_eos:
            params["ignore_eos"] = True
        return {
            "input_ids": [int(t) for t in request.input_ids],
            "sampling_params": params,
            "return_logprob": True,
            "logprob_start_len": -1,  # only the output tokens' log-probs
            "rid": request.request_id,
            "stream": True,
        }

    def _delta(self, request_id: str, chunk: Any, yielded: int) -> TokenDelta:
        """The new tokens of a stream chunk, ``yielded`` tokens having come before."""
        if isinstance(chunk, dict) and "error" in chunk:
            raise ValueError(f"SGLang /generate: {error_message(200, json.dumps(chunk))}")
        if not isinstance(chunk, dict) or not isinstance(chunk.get("meta_info"), dict):
            raise ConnectionError(
                f"SGLang /generate sent a chunk without meta_info: {chunk!r:.200}"
            )
        meta = chunk["meta_info"]
        finish = meta.get("finish_reason")
        kind = finish.get("type") if isinstance(finish, dict) else finish
        if kind == "abort":
            message = finish.get("message") if isinstance(finish, dict) else None
            if isinstance(finish, dict) and finish.get("status_code") == 400:
                raise ValueError(f"SGLang /generate: {message}")
            raise EngineAborted(f"{request_id} aborted on {self.name}: {message or 'aborted'}")
        if kind is not None and kind not in _FINISH_TYPES:
            raise ConnectionError(f"SGLang returned an unknown finish reason {finish!r}")
        triples = meta.get("output_token_logprobs")
        if not isinstance(triples, list):
            raise ConnectionError("SGLang answered without output_token_logprobs")
        total = meta.get("completion_tokens")
        fresh = (total if isinstance(total, int) else len(triples)) - yielded
        if not 0 <= fresh <= len(triples):
            raise ConnectionError(
                f"SGLang reported {total} tokens and {len(triples)} log-probs"
                f" after {yielded} tokens"
            )
        new = triples[len(triples) - fresh :]
        ids = tuple(int(t[1]) for t in new)
        logprobs = tuple(float(t[0]) for t in new)
        per_token = meta.get("output_token_versions")  # qwengyre's engine server only
        if isinstance(per_token, list) and len(per_token) == len(triples):
            versions = tuple(int(v) for v in per_token[len(per_token) - fresh :])
        else:
            version = self.policy_version
            reported = meta.get("weight_version")
            if isinstance(reported, str) and reported.lstrip("-").isdigit():
                version = int(reported)
            versions = (version,) * fresh
        return TokenDelta(ids, logprobs, versions, _FINISH_TYPES[kind] if kind else None)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return await collect(self.stream(request))

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[TokenDelta, None]:
        """``/generate`` with ``stream=true``: a delta per chunk with new tokens."""
        rid = request.request_id
        if rid in self._inflight:
            raise ValueError(f"request id {rid!r} is already in flight on {self.name}")
        if self.released:
            # not an abort to retry here: the router drains an engine that fails this way
            raise ConnectionError(f"SGLang {self.name} has released its memory (training)")
        self._inflight.add(rid)
        yielded = 0
        finished = False
        try:
            async with self._get_session().post(
                f"{self.base_url}/generate", json=self.request_body(request)
            ) as resp:
                if resp.status >= 400:
                    self._raise_for_status("/generate", resp.status, await resp.text())
                async with contextlib.aclosing(sse_data(resp.content)) as events:
                    async for data in events:
                        if data == "[DONE]" or finished:
                            break
                        try:
                            chunk = json.loads(data)
                        except ValueError as exc:
                            raise ConnectionError(f"SGLang /generate sent {data[:200]!r}") from exc
                        delta = self._delta(rid, chunk, yielded)
                        yielded += len(delta.output_ids)
                        finished = delta.finish_reason is not None
                        if delta.output_ids or finished:
                            yield delta
            if not finished:
                raise ConnectionError(f"SGLang {self.name} ended the stream of {rid} unfinished")
        except OSError:
            raise  # includes aiohttp.ClientOSError / ClientConnectorError / timeouts
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            raise self._lost(exc) from exc
        except (GeneratorExit, asyncio.CancelledError):
            if not finished:
                # the consumer left: free the server's slot at once (SGLang also notices
                # the closed connection, but only at its next wake-up)
                self._spawn(self.abort(rid))
            raise
        finally:
            self._inflight.discard(rid)

    async def abort(self, request_id: str) -> None:
        """Abort ``request_id``; its :meth:`stream` raises :class:`EngineAborted`."""
        try:
            await self._call("POST", "/abort_request", {"rid": request_id}, timeout_s=30)
        except (OSError, ValueError, EngineAborted) as exc:
            log.warning("abort of %s on %s failed: %s", request_id, self.name, exc)

    # -- weights and memory ------------------------------------------------------------

    async def update_weights(self, source: WeightSource, version: int) -> None:
        if isinstance(source, WeightsInMemory):
            raise NotImplementedError(
                "SGLangEngine cannot take in-process tensors: the SGLang server runs in "
                "another process. Save a HuggingFace checkpoint and pass WeightsOnDisk(path) "
                "(POST /update_weights_from_disk); NCCL broadcast "
                "(/update_weights_from_distributed) is not wired up."
            )
        if not isinstance(source, WeightsOnDisk):
            raise TypeError(f"unknown weight source {source!r}")
        body = {"model_path": source.path, "weight_version": str(version)}
        try:
            _status, text = await self._call("POST", "/update_weights_from_disk", body)
        except ValueError as exc:  # SGLang answers 400 with success=false
            raise RuntimeError(f"SGLang {self.name} could not load {source.path}: {exc}") from exc
        try:
            answer = json.loads(text)
        except ValueError:
            answer = None
        if not isinstance(answer, dict) or not answer.get("success"):
            message = answer.get("message") if isinstance(answer, dict) else text
            raise RuntimeError(f"SGLang {self.name} could not load {source.path}: {message}")
        self.policy_version = version

    async def release_memory(self) -> None:
        """Free weights and KV cache (``--enable-memory-saver``); nothing may be in flight."""
        await self._json("POST", "/release_memory_occupation", {})
        self.released = True

    async def resume_memory(self) -> None:
        await self._json("POST", "/resume_memory_occupation", {})
        self.released = False

    async def flush_cache(self) -> None:
        """Drop the radix (prefix) cache; SGLang refuses while requests run."""
        try:
            await self._call("POST", "/flush_cache")
        except ValueError as exc:
            raise RuntimeError(f"SGLang {self.name} did not flush its cache: {exc}") from exc

    async def health(self) -> bool:
        """``GET /health``; False on errors and while released.

        SGLang's ``/health`` generates one token, which a released server cannot do,
        so a released engine answers False without asking.
        """
        if self.released:
            return False
        try:
            status, _ = await self._call("GET", "/health", timeout_s=30)
        except (TimeoutError, OSError, ValueError, EngineAborted):
            return False
        return status == 200


# -- launching a server ----------------------------------------------------------------


@dataclass(frozen=True)
class SGLangServerSpec:
    """How to start ``python -m sglang.launch_server``.

    ``extra_args`` pass through as given (e.g. ``("--tp", "2", "--mem-fraction-static",
    "0.8")``). ``enable_memory_saver`` adds ``--enable-memory-saver``, without which
    ``/release_memory_occupation`` frees nothing.
    """

    model_path: str
    port: int
    host: str = "127.0.0.1"
    extra_args: tuple[str, ...] = ()
    enable_memory_saver: bool = True
    python: str = sys.executable

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        argv = [
            self.python,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model_path,
            "--host",
            self.host,
            "--port",
            str(self.port),
        ]
        if self.enable_memory_saver and "--enable-memory-saver" not in self.extra_args:
            argv.append("--enable-memory-saver")
        argv.extend(self.extra_args)
        return argv


def sglang_available() -> bool:
    return importlib.util.find_spec("sglang") is not None


def launch_sglang(spec: SGLangServerSpec, **popen_kwargs: Any) -> subprocess.Popen[bytes]:
    """Start an SGLang server; wait for it with :func:`wait_until_healthy`."""
    if not sglang_available():
        raise SGLangNotInstalled(
            "cannot launch an SGLang server: the 'sglang' package is not installed in this "
            "Python environment (pip install 'sglang[all]' on a GPU machine), or use another "
            "engine (scripted, embedded)"
        )
    return subprocess.Popen(spec.command(), **popen_kwargs)


class HealthChecked(Protocol):
    """A server's client that can ask it whether it is healthy."""

    name: str
    base_url: str

    async def health(self) -> bool: ...


async def wait_until_healthy(
    engine: HealthChecked,
    timeout_s: float,
    process: subprocess.Popen[bytes] | None = None,
    poll_s: float = 1.0,
) -> None:
    """Poll ``/health`` until it answers 200; TimeoutError after ``timeout_s``.

    With ``process``, a server that exits while starting raises RuntimeError at once.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(
                f"server {engine.name} exited with code {process.returncode} "
                "before becoming healthy"
            )
        if await engine.health():
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"server {engine.name} at {engine.base_url} was not healthy within {timeout_s:.0f}s"
            )
        await asyncio.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


__all__: Sequence[str] = (
    "SGLangEngine",
    "SGLangNotInstalled",
    "SGLangServerSpec",
    "launch_sglang",
    "sglang_available",
    "wait_until_healthy",
)
