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
- ``POST /update_weights_from_tensor`` with ``UpdateWeightsFromTensorReqInput``
  (``serialized_named_tensors``: one entry per tensor-parallel rank, each the base64
  of a ``ForkingPickler`` dump of ``[(name, tensor), ...]`` as SGLang's
  ``MultiprocessingSerializer`` writes it; ``flush_cache``; ``weight_version``);
  answers ``{"success", "message"}``, 400 when ``success`` is false. CUDA tensors
  travel as CUDA IPC handles, their device named by its UUID (SGLang's
  ``monkey_patch_torch_reductions``: the server sees other device indices), so the
  tensors must stay alive on a GPU of the server's node until the call returns.
- ``POST /pause_generation`` with ``{"mode": "retract"}`` and ``POST
  /continue_generation`` with ``{}`` around a load from tensors (below).
- ``POST /release_memory_occupation`` / ``POST /resume_memory_occupation`` with
  ``{}`` (all tags: weights and KV cache); the server must run with
  ``--enable-memory-saver`` for memory to be actually freed.
- ``GET /health`` (200 healthy, 503 not).

Weight versions: SGLang reports no per-token version. ``update_weights_from_disk``
takes the tokenizer manager's model-update writer lock, so a load waits for the
requests in flight and applies between requests; every token of one answer therefore
comes from one version. Weights from tensors come in buckets of bounded size
(:class:`TensorRoute`), one call each, each bucket read from its source
(:class:`~qwengyre.engines.base.WeightsByName`) only when it is sent, so the engine
holds one bucket at a time. The engine first pauses the server with
``mode=retract`` (the requests in flight go back to the queue and give up their KV
cache; a paused server loads without the lock), loads every bucket, flushes the
prefix cache and sets the version with the last, and continues: a request in flight
recomputes its KV cache with the new weights, and its later tokens carry the new
version. (Older servers pause by aborting the requests in flight, which the router
retries elsewhere.) The engine sends its integer version as SGLang's
``weight_version`` string and reads it back from ``meta_info.weight_version`` when
the server reports it, falling back to the version it recorded itself.

Routed experts (an MoE's, for rollout routing replay; a client made with
``routed_experts``): the body adds ``return_routed_experts=true``
(``GenerateReqInput.return_routed_experts``, sgl-project/sglang#12162; released from
v0.5.7 on, per areal-project/AReaL#884; the server must run with
``--enable-return-routed-experts``, which
:class:`SGLangBackend` adds for an MoE when ``engine.return_routed_experts`` is on).
SGLang collects them when the request finishes (the scheduler's
``maybe_collect_routed_experts``, called only for a finished request), so only the
last chunk carries them, streaming or not: ``meta_info.routed_experts``, the base64
of an ``int32`` array ``[seqlen - 1, num_hidden_layers, num_experts_per_tok]`` in C
order (``RoutedExpertsCapturer.get_routed_experts`` reads the host buffer at the
request's KV-cache slots ``req_to_token[:seqlen - 1]``; the detokenizer encodes it,
``extract_routed_experts_from_meta_info`` decodes it), ``seqlen`` being prompt plus
output. The buffer is indexed by KV slot, so prompt positions served from the prefix
cache carry the routing of the forward that computed them. Its shape is not on the
wire: the client is given ``(num_hidden_layers, num_experts_per_tok)``
(:func:`~qwengyre.engines.launch.routed_experts_shape`). By position, the rows are
``len(input_ids) + len(output) - 1`` as :class:`~qwengyre.engines.base.TokenDelta`
wants; since they come at the end, the earlier deltas carry zero rows and the last
all of them. A last chunk without them (a server without the flag, or a dense
model: SGLang then sends no key) gives that delta no routing, and the result none.
An abort's chunk that carries them (qwengyre's engine server; whether SGLang's does
is not checked) yields, before :class:`EngineAborted`, a delta without tokens whose
rows are the positions before the tokens answered: the router keeps them when it
continues the call elsewhere, so those tokens keep the routing they were sampled under.
Newer SGLang takes ``routed_experts_start_len`` (default 0: every position; never sent
here); a ``meta_info.routed_experts_dtype`` key, which some SGLang code sends beside
a narrower dtype, is honoured (absent: ``int32``).

Caveat: SGLang's scheduler matches ``/abort_request`` rids by *prefix*
(``req.rid.startswith(rid)``), so aborting ``"x-1"`` also aborts a running ``"x-10"``.
The aborted one raises :class:`EngineAborted` and is retried by the router.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import logging
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import numpy as np
import yaml

from qwengyre.engines.base import (
    EngineAborted,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    TokenDelta,
    WeightsByName,
    WeightsInMemory,
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
    routed_experts_shape,
)
from qwengyre.trajectories import routed_experts

if TYPE_CHECKING:
    from torch import Tensor

log = logging.getLogger(__name__)

_FINISH_TYPES: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}

_TENSOR_PATHS = ("/pause_generation", "/update_weights_from_tensor", "/continue_generation")
_WEIGHT_PATHS = ("/update_weights_from_disk", *_TENSOR_PATHS)


class SGLangNotInstalled(ServerNotInstalled):
    """``sglang`` cannot be imported in this environment."""


class TensorRouteUnavailable(RuntimeError):
    """The server does not take weights from tensors (an older SGLang): load from disk."""


@dataclass(frozen=True)
class TensorRoute:
    """How in-memory weights reach a server on this node: moved to ``device``, in
    buckets of at most ``bucket_bytes`` (a larger tensor goes alone), each sent once
    per tensor-parallel rank (``tp_size``). On a GPU of the server's node they travel
    by CUDA IPC; on the CPU as shared memory that one process can open (``tp_size``
    1 only)."""

    device: str
    tp_size: int = 1
    bucket_bytes: int = 512 << 20

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.bucket_bytes < 1:
            raise ValueError(
                f"tp_size ({self.tp_size}) and bucket_bytes ({self.bucket_bytes}) must be "
                "at least 1"
            )
        if not self.device.startswith("cuda") and self.tp_size > 1:
            raise ValueError(
                f"tensors on {self.device!r} reach one server process only: tp_size must "
                f"be 1, not {self.tp_size} (or use a GPU, cuda[:N])"
            )


class SGLangEngine(HTTPEngineClient):
    """:class:`~qwengyre.engines.base.InferenceEngine` over one SGLang server.

    Errors: HTTP 4xx raises ``ValueError`` with SGLang's message (a bad request, not
    an engine failure; a weight load's 4xx raises RuntimeError, or
    :class:`TensorRouteUnavailable`); a connection that cannot be made or is lost raises an
    ``OSError`` (``ConnectionError`` wrapping aiohttp's errors that are not already
    ``OSError``), HTTP 5xx raises ``ConnectionError`` too, and a request that the
    server aborted raises :class:`EngineAborted`; the router reroutes on all three. A
    consumer that leaves a :meth:`stream` early closes its HTTP response and sends
    ``/abort_request``.
    """

    server = "SGLang"

    def __init__(
        self,
        *args: Any,
        tensor_route: TensorRoute | None = None,
        routed_experts: tuple[int, int] | None = None,
        **kwargs: Any,
    ) -> None:
        """:class:`~qwengyre.engines.http_client.HTTPEngineClient`'s arguments;
        ``tensor_route``: how weights from tensors (``WeightsInMemory``,
        ``WeightsByName``) reach the server (None: this client loads weights from disk
        only). ``routed_experts``: ``(layers, k)`` of the MoE served, to ask for the
        routed experts of every position (module docstring); None: not asked."""
        super().__init__(*args, **kwargs)
        self.tensor_route = tensor_route
        self.routed_experts = routed_experts

    def _raise_for_status(self, path: str, status: int, text: str) -> None:
        message = error_message(status, text)
        if status == 503 and "abort" in message.lower():
            # a running request aborted with status 503 (e.g. timeout) comes back this way
            raise EngineAborted(message)
        if 400 <= status < 500 and path in _WEIGHT_PATHS:
            if path in _TENSOR_PATHS and not _is_load_answer(text):
                raise TensorRouteUnavailable(f"SGLang {self.name} {path} ({status}): {message}")
            raise RuntimeError(f"SGLang {self.name} could not load weights ({path}): {message}")
        super()._raise_for_status(path, status, text)

    # -- generation ------------------------------------------------------------------

    @staticmethod
    def request_body(request: GenerateRequest, routed_experts: bool = False) -> dict[str, Any]:
        """The ``/generate`` body (``GenerateReqInput``) for ``request``, asking for the
        routed experts if ``routed_experts``."""
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
        body: dict[str, Any] = {
            "input_ids": [int(t) for t in request.input_ids],
            "sampling_params": params,
            "return_logprob": True,
            "logprob_start_len": -1,  # only the output tokens' log-probs
            "rid": request.request_id,
            "stream": True,
        }
        if routed_experts:
            body["return_routed_experts"] = True
        return body

    def _sent_routing(self, meta: Mapping[str, Any]) -> np.ndarray | None:
        """Every row of routed experts a chunk's ``meta_info`` carries (None if it has
        none, or none were asked for); ConnectionError if they are not whole rows."""
        encoded = meta.get("routed_experts")
        if self.routed_experts is None or not isinstance(encoded, str):
            return None
        dtype = np.dtype(str(meta.get("routed_experts_dtype") or "int32"))
        flat = np.frombuffer(base64.b64decode(encoded), dtype=dtype)
        layers, k = self.routed_experts
        if flat.size % (layers * k):
            raise ConnectionError(
                f"SGLang sent {flat.size} routed experts: not whole positions of"
                f" {layers} layers x {k}"
            )
        return routed_experts.compact(flat.reshape(-1, layers, k))

    def _routing(self, meta: Mapping[str, Any], rows: int) -> np.ndarray | None:
        """The ``rows`` positions' routed experts of a last chunk's ``meta_info`` (None
        if it has none); ConnectionError if they do not make ``rows`` rows."""
        sent = self._sent_routing(meta)
        if sent is not None and len(sent) != rows:
            layers, k = sent.shape[1:]
            raise ConnectionError(
                f"SGLang sent routed experts for {len(sent)} positions of {layers} layers"
                f" x {k}, not {rows}"
            )
        return sent

    def _routing_before_abort(self, chunk: Any, answered: int, prompt: int) -> np.ndarray | None:
        """The routed experts an abort's chunk carries for the positions before the
        ``answered`` tokens (qwengyre's engine server sends them; an abort's may cover
        tokens never answered), None for any other chunk or if it carries too few: a
        continuation elsewhere then recomputes them."""
        meta = chunk.get("meta_info") if isinstance(chunk, dict) else None
        if not answered or not isinstance(meta, dict):
            return None
        finish = meta.get("finish_reason")
        if not isinstance(finish, dict) or finish.get("type") != "abort":
            return None
        sent = self._sent_routing(meta)
        rows = prompt + answered - 1
        return None if sent is None or len(sent) < rows else sent[:rows]

    def _delta(self, request_id: str, chunk: Any, yielded: int, prompt: int) -> TokenDelta:
        """The new tokens of a stream chunk, ``yielded`` tokens having come before, of a
        request with ``prompt`` input ids."""
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
        routing: np.ndarray | None = None
        if self.routed_experts is not None:
            if kind is None:  # the rows come with the last chunk (module docstring)
                routing = routed_experts.unknown(0, *self.routed_experts)
            elif yielded + fresh:
                routing = self._routing(meta, prompt + yielded + fresh - 1)
        return TokenDelta(ids, logprobs, versions, _FINISH_TYPES[kind] if kind else None, routing)

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
        prompt = len(request.input_ids)
        try:
            async with self._get_session().post(
                f"{self.base_url}/generate",
                json=self.request_body(request, self.routed_experts is not None),
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
                        rows = self._routing_before_abort(chunk, yielded, prompt)
                        if rows is not None:  # kept by the router for a continuation
                            yield TokenDelta((), (), (), None, rows)
                        delta = self._delta(rid, chunk, yielded, prompt)  # an abort raises
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

    async def update_weights(self, source: WeightSource | WeightsByName, version: int) -> None:
        """Load from disk (``WeightsOnDisk``) or from tensors (``WeightsInMemory`` or
        ``WeightsByName``, with a :attr:`tensor_route`); see the module docstring. A load
        the server refuses raises RuntimeError, a server without the tensor route
        :class:`TensorRouteUnavailable`; ``WeightsByName.read``'s errors propagate."""
        if isinstance(source, WeightsInMemory):
            await self._update_from_tensors(WeightsByName.of(source.tensors), version)
        elif isinstance(source, WeightsByName):
            await self._update_from_tensors(source, version)
        elif isinstance(source, WeightsOnDisk):
            body = {"model_path": source.path, "weight_version": str(version)}
            await self._load("/update_weights_from_disk", body)
        else:
            raise TypeError(f"SGLang {self.name} cannot load weights from {source!r}")
        self.policy_version = version

    async def _update_from_tensors(self, source: WeightsByName, version: int) -> None:
        route = self.tensor_route
        if route is None:
            raise ValueError(
                f"SGLang {self.name} takes in-memory weights from a process of its node "
                "only (by CUDA IPC from a GPU): give its client a tensor_route, or load "
                "WeightsOnDisk"
            )
        if not source.meta:
            raise ValueError(f"SGLang {self.name}: no tensors to load")
        buckets = tensor_buckets(source.meta, route.bucket_bytes)
        await self._call("POST", "/pause_generation", {"mode": "retract"})
        try:
            for i, bucket in enumerate(buckets, start=1):
                tensors = source.read(bucket)
                moved = [(name, tensors[name].detach().to(route.device)) for name in bucket]
                body: dict[str, Any] = {
                    "serialized_named_tensors": [serialize_tensors(moved)] * route.tp_size,
                    "flush_cache": i == len(buckets),
                }
                if i == len(buckets):
                    body["weight_version"] = str(version)
                await self._load("/update_weights_from_tensor", body)
                del tensors, moved, body  # before the next bucket is read: one at a time
        finally:
            await self._call("POST", "/continue_generation", {})
            _free_ipc_memory()

    async def _load(self, path: str, body: Mapping[str, Any]) -> None:
        _status, text = await self._call("POST", path, body)
        if not _is_load_answer(text) or not json.loads(text)["success"]:
            raise RuntimeError(f"SGLang {self.name} could not load weights ({path}): {text[:300]}")

    async def release_memory(self) -> None:
        """Free weights and KV cache (``--enable-memory-saver``); nothing may be in flight."""
        await self._json("POST", "/release_memory_occupation", {})
        self.released = True

    async def resume_memory(self) -> None:
        await self._json("POST", "/resume_memory_occupation", {})
        self.released = False


# -- launching a server ----------------------------------------------------------------


@dataclass(kw_only=True, frozen=True)
class SGLangServerSpec(ServerSpec):
    """How to start ``python -m sglang.launch_server`` (flags of SGLang's
    ``server_args.py``).

    ``python`` is the interpreter of SGLang's environment (``$QWENGYRE_SGLANG_PYTHON``,
    else this one). The API key goes in ``key_file``, a private ``--config`` file
    written at each launch (:meth:`key_files`), never on the command line: a key
    needs a key file and a key file a key. ``tp_size`` (``--tp-size``): tensor parallel
    over the GPUs the server sees (``CUDA_VISIBLE_DEVICES`` in ``extra_env``).
    ``max_context`` is ``--context-length``. ``weight_version`` (``--weight-version``)
    labels the weights it starts with (SGLang says ``default`` otherwise).
    ``enable_memory_saver`` adds ``--enable-memory-saver``, without which
    ``/release_memory_occupation`` frees nothing (GPU only).
    ``return_routed_experts`` adds ``--enable-return-routed-experts`` (an MoE only:
    SGLang sizes its capture buffer from ``num_experts_per_tok``). ``extra_args`` pass
    through as given (e.g. ``("--mem-fraction-static", "0.8")``).
    """

    tp_size: int = 1
    weight_version: str | None = None
    enable_memory_saver: bool = True
    return_routed_experts: bool = False
    key_file: str | None = None  # a .yaml or .yml name: SGLang takes only those

    server = "SGLang"
    package = "sglang"
    module = "sglang.launch_server"
    model_flag = "--model-path"
    python_var = "QWENGYRE_SGLANG_PYTHON"
    install_hint = (
        "install 'sglang[all]' into that environment on a GPU machine, point "
        "$QWENGYRE_SGLANG_PYTHON at the python of one that has it, or use another "
        "engine backend: embedded, vllm"
    )
    not_installed = SGLangNotInstalled

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.api_key is None) != (self.key_file is None):
            raise ValueError("an SGLang server takes its api_key in a key_file: give both or none")

    def flags(self) -> list[str]:
        argv = ["--tp-size", str(self.tp_size)]
        if self.max_context is not None:
            argv += ["--context-length", str(self.max_context)]
        if self.weight_version is not None:
            argv += ["--weight-version", self.weight_version]
        if self.enable_memory_saver and "--enable-memory-saver" not in self.extra_args:
            argv.append("--enable-memory-saver")
        if self.return_routed_experts:
            argv.append("--enable-return-routed-experts")
        if self.key_file is not None:
            argv += ["--config", self.key_file]  # two arguments: SGLang matches "--config"
        return argv

    def key_files(self) -> dict[Path, str]:
        """The ``--config`` file holding the key: off the command line, where every local
        user could read it (``ps``). Needs an SGLang with ``--config``
        (sgl-project/sglang#10534, September 2025, on)."""
        if self.api_key is None or self.key_file is None:
            return {}
        return {Path(self.key_file): yaml.safe_dump({"api-key": self.api_key})}


class SGLangBackend(ServerBackend[SGLangEngine]):
    """SGLang as a cell's rollout server (``engine.backend=sglang``).

    ``--tp-size`` over the cell's GPUs, ``--context-length`` (the cell's max context),
    ``--weight-version`` when it starts from a published version, on a GPU
    ``--enable-memory-saver``, and its key in a private ``--config`` file in the host's
    working directory (mode 0700), written for each launch (mode 0600). This needs an
    SGLang that reads ``--config``: sgl-project/sglang#10534 (September 2025) or later.

    Weights: on a GPU they travel as tensors, in buckets of bounded size, each read from
    its source only when it is sent (:class:`TensorRoute`), through CUDA IPC: the host
    runs on the node and the devices of its server, so no NCCL group between trainer
    and server (``/update_weights_from_distributed``) is needed. A server that does not
    take tensors (an older SGLang answers 4xx) gets its weights through disk from then
    on, as on the CPU (``/update_weights_from_disk``). Its sleep
    (``/release_memory_occupation``) frees the weights and KV cache. An MoE's server
    runs with ``--enable-return-routed-experts`` when the placement asks for routed
    experts, and its clients made with their shape ask for them.
    """

    api = "sglang"
    spec_type = SGLangServerSpec

    def spec(self, place: ServerPlacement) -> SGLangServerSpec:
        return SGLangServerSpec(
            model=place.model,
            host=place.host,
            port=place.port,
            api_key=place.api_key,
            key_file=str(place.work / "server.yaml"),
            max_context=place.max_context,
            tp_size=place.tp_size,
            weight_version=str(place.version) if place.version >= 0 else None,
            enable_memory_saver=place.device != "cpu",
            return_routed_experts=place.routed_experts
            and routed_experts_shape(place.model) is not None,
            extra_env=place.gpu_env(),
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
    ) -> SGLangEngine:
        return SGLangEngine(
            url,
            name,
            capacity=capacity,
            api_key=api_key,
            policy_version=version,
            routed_experts=routed_experts,
        )

    def host_client(self, url: str, name: str, place: ServerPlacement) -> SGLangEngine:
        client = super().host_client(url, name, place)
        if place.on_gpu:
            client.tensor_route = TensorRoute(place.device, place.tp_size)
        return client

    async def load_from_memory(
        self, client: SGLangEngine, weights: WeightsByName, version: int
    ) -> bool:
        if client.tensor_route is None:
            return False
        try:
            await client.update_weights(weights, version)
        except TensorRouteUnavailable as exc:
            log.warning("%s: %s; loading weights from disk from now on", client.name, exc)
            client.tensor_route = None
            return False
        return True


# -- weights as tensors ----------------------------------------------------------------


def _is_load_answer(text: str) -> bool:
    """Whether ``text`` is a weight load's answer (``{"success", "message"}``)."""
    try:
        answer = json.loads(text)
    except ValueError:
        return False
    return isinstance(answer, dict) and isinstance(answer.get("success"), bool)


def tensor_buckets(tensors: Mapping[str, Tensor], max_bytes: int) -> list[list[str]]:
    """The names of ``tensors`` (real or meta) in order, cut into buckets of at most
    ``max_bytes`` (a larger tensor in a bucket of its own)."""
    buckets: list[list[str]] = []
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if not buckets or size + nbytes > max_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += nbytes
    return buckets


_DEVICE_ARG = 6
"""Where ``torch.multiprocessing.reductions.reduce_tensor`` puts a CUDA tensor's device
in its rebuild arguments (SGLang's ``patch_torch`` relies on the same place)."""


def _reduce_naming_device_uuid(tensor: Tensor) -> tuple[Any, tuple[Any, ...]]:
    """torch's reduction of ``tensor``, with a CUDA device given by its UUID: the
    server's rebuild (patched by SGLang) finds the device whatever it numbers it."""
    import torch
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda and isinstance(args[_DEVICE_ARG], int):
        uuid = str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid)
        args = (*args[:_DEVICE_ARG], uuid, *args[_DEVICE_ARG + 1 :])
    return rebuild, args


def serialize_tensors(named: Sequence[tuple[str, Tensor]]) -> str:
    """``named`` as SGLang's ``MultiprocessingSerializer.serialize(..., output_str=True)``
    writes it: a ``ForkingPickler`` dump (CUDA tensors as IPC handles, CPU tensors in
    shared memory), base64. The tensors must stay alive until the server loaded them."""
    import torch

    buffer = io.BytesIO()
    pickler = ForkingPickler(buffer)
    pickler.dispatch_table[torch.Tensor] = _reduce_naming_device_uuid
    pickler.dump(list(named))
    return base64.b64encode(buffer.getvalue()).decode()


def _free_ipc_memory() -> None:
    """Hand back to the device the buckets the server has released (CUDA only)."""
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()


__all__: Sequence[str] = (
    "SGLangBackend",
    "SGLangEngine",
    "SGLangNotInstalled",
    "SGLangServerSpec",
    "TensorRoute",
    "TensorRouteUnavailable",
    "serialize_tensors",
    "tensor_buckets",
)
