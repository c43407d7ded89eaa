"""An engine backed by an SGLang server, over SGLang's native HTTP API.

Endpoints used (``sglang/srt/entrypoints/http_server.py``; the request bodies are the
dataclasses of ``sglang/srt/managers/io_struct.py``):

- ``POST /generate`` with ``GenerateReqInput``: ``input_ids``, ``sampling_params``
  (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop``,
  ``stop_token_ids``), ``return_logprob``, ``logprob_start_len=-1`` (log-probs of the
  output tokens only), ``rid``, ``stream=false``. The answer is
  ``{"text", "output_ids", "meta_info"}`` where ``meta_info`` holds ``id``,
  ``finish_reason`` (``{"type": "stop"|"length"|"abort", ...}``), ``prompt_tokens``,
  ``completion_tokens``, ``output_token_logprobs`` (``[logprob, token_id, text]``
  triples, ``text`` null unless asked for) and, in recent SGLang, ``weight_version``.
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from qwengyre.engines.base import (
    EngineAborted,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    WeightsInMemory,
    WeightsOnDisk,
    WeightSource,
)

log = logging.getLogger(__name__)

_FINISH_TYPES: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


class SGLangNotInstalled(RuntimeError):
    """``sglang`` cannot be imported in this environment."""


def _error_message(status: int, text: str) -> str:
    """The message of an SGLang error answer, whatever of its shapes it has.

    ``{"error": {"message": ...}}`` (``_create_error_response``),
    ``{"object": "error", "message": ...}`` (``ErrorResponse``, validation errors and
    HTTPException), ``{"message": ...}`` (weight updates), ``{"detail": ...}``
    (plain FastAPI) or a plain-text body.
    """
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip() or f"HTTP {status}"
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str) and err:
            return err
        for key in ("message", "detail"):
            if body.get(key):
                return str(body[key])
    return text.strip() or f"HTTP {status}"


class SGLangEngine:
    """:class:`~qwengyre.engines.base.InferenceEngine` over one SGLang server.

    Errors: HTTP 4xx raises ``ValueError`` with SGLang's message (a bad request, not
    an engine failure); a connection that cannot be made or is lost raises an
    ``OSError`` (``ConnectionError`` wrapping aiohttp's errors that are not already
    ``OSError``), HTTP 5xx raises ``ConnectionError`` too, and a request that the
    server aborted raises :class:`EngineAborted`; the router reroutes on all three.
    """

    def __init__(
        self,
        base_url: str,
        name: str,
        capacity: int = 128,
        api_key: str | None = None,
        timeout_s: float = 3600,
        policy_version: int = 0,
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.base_url = base_url.rstrip("/")
        self.name = name
        self.capacity = capacity
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.policy_version = policy_version
        self.released = False
        self._session: aiohttp.ClientSession | None = None
        self._inflight: set[str] = set()
        self._background: set[asyncio.Task[None]] = set()

    # -- plumbing ------------------------------------------------------------------

    @property
    def load(self) -> int:
        return len(self._inflight)

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
            self._session = aiohttp.ClientSession(
                headers=headers, timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            )
        return self._session

    async def close(self) -> None:
        for task in list(self._background):
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> SGLangEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> tuple[int, str]:
        """(status, body text); raises on 4xx (ValueError), 5xx and lost connections."""
        timeout = aiohttp.ClientTimeout(
            total=timeout_s if timeout_s is not None else self.timeout_s
        )
        try:
            async with self._get_session().request(
                method, f"{self.base_url}{path}", json=body, timeout=timeout
            ) as resp:
                text = await resp.text()
                status = resp.status
        except OSError:
            raise  # includes aiohttp.ClientOSError / ClientConnectorError / timeouts
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            raise ConnectionError(f"SGLang {self.name} at {self.base_url}: {exc!r}") from exc
        if 400 <= status < 500:
            raise ValueError(f"SGLang {path} ({status}): {_error_message(status, text)}")
        if status >= 500:
            message = _error_message(status, text)
            if status == 503 and "abort" in message.lower():
                # a running request aborted with status 503 (e.g. timeout) comes back this way
                raise EngineAborted(message)
            raise ConnectionError(f"SGLang {self.name} {path} ({status}): {message}")
        return status, text

    async def _post_json(self, path: str, body: Mapping[str, Any]) -> Any:
        _, text = await self._call("POST", path, body)
        try:
            return json.loads(text) if text else None
        except ValueError as exc:
            raise ConnectionError(f"SGLang {path} answered non-JSON: {text[:200]!r}") from exc

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
            "stream": False,
        }

    def _parse(self, request_id: str, payload: Any) -> GenerateResult:
        if not isinstance(payload, dict) or not isinstance(payload.get("meta_info"), dict):
            raise ConnectionError(f"SGLang /generate answered without meta_info: {payload!r:.200}")
        meta = payload["meta_info"]
        finish = meta.get("finish_reason")
        kind = finish.get("type") if isinstance(finish, dict) else finish
        if kind == "abort":
            message = finish.get("message") if isinstance(finish, dict) else None
            raise EngineAborted(f"{request_id} aborted on {self.name}: {message or 'aborted'}")
        if kind not in _FINISH_TYPES:
            raise ConnectionError(f"SGLang returned an unknown finish reason {finish!r}")
        triples = meta.get("output_token_logprobs")
        if not isinstance(triples, list):
            raise ConnectionError("SGLang answered without output_token_logprobs")
        ids = tuple(int(t[1]) for t in triples)
        logprobs = tuple(float(t[0]) for t in triples)
        output_ids = payload.get("output_ids")
        if output_ids is not None and list(output_ids) != list(ids):
            raise ConnectionError(
                f"SGLang output_ids ({len(output_ids)}) disagree with its logprobs ({len(ids)})"
            )
        per_token = meta.get("output_token_versions")  # qwengyre's engine server only
        if isinstance(per_token, list) and len(per_token) == len(ids):
            return GenerateResult(
                ids, logprobs, tuple(int(v) for v in per_token), _FINISH_TYPES[kind]
            )
        version = self.policy_version
        reported = meta.get("weight_version")
        if isinstance(reported, str) and reported.lstrip("-").isdigit():
            version = int(reported)
        return GenerateResult(ids, logprobs, (version,) * len(ids), _FINISH_TYPES[kind])

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        rid = request.request_id
        if rid in self._inflight:
            raise ValueError(f"request id {rid!r} is already in flight on {self.name}")
        if self.released:
            # not an abort to retry here: the router drains an engine that fails this way
            raise ConnectionError(f"SGLang {self.name} has released its memory (training)")
        self._inflight.add(rid)
        try:
            payload = await self._post_json("/generate", self.request_body(request))
        except asyncio.CancelledError:
            # the caller gave up: free the server's slot too (SGLang also notices the
            # closed connection, but only at its next wake-up)
            self._spawn(self.abort(rid))
            raise
        finally:
            self._inflight.discard(rid)
        return self._parse(rid, payload)

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def abort(self, request_id: str) -> None:
        """Abort ``request_id``; its :meth:`generate` raises :class:`EngineAborted`."""
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
        await self._post_json("/release_memory_occupation", {})
        self.released = True

    async def resume_memory(self) -> None:
        await self._post_json("/resume_memory_occupation", {})
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


async def wait_until_healthy(
    engine: SGLangEngine,
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
                f"SGLang server {engine.name} exited with code {process.returncode} "
                "before becoming healthy"
            )
        if await engine.health():
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"SGLang server {engine.name} at {engine.base_url} was not healthy "
                f"within {timeout_s:.0f}s"
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
