"""The proxy's HTTP server (aiohttp): both APIs, per-execution credentials, the admin API.

Routes (also under a base-URL prefix ``/x/{execution_id}``, which some harnesses need
because they cannot send custom headers):

- Anthropic: ``POST /v1/messages`` (``?beta=true`` too), ``POST /v1/messages/count_tokens``
- OpenAI: ``POST /v1/chat/completions``
- both: ``GET /v1/models``, ``HEAD /`` and ``HEAD`` on an execution's base URL
- admin (``Authorization: Bearer <admin token>``): ``POST /admin/executions``,
  ``DELETE /admin/executions/{id}``, ``GET /admin/executions/{id}/tree``
- harness (the execution's own key): ``POST /x/{id}/assess`` asks the execution's
  runner to assess its workspace now (an intermediate assessment) through the callback
  the runner registered (:meth:`ProxyServer.register_assessor`); the answer is the
  callback's JSON object (``score``, ``valid``, ``critique``, ``artifact_version``,
  ``digest``, ...). Another execution's key is a ``permission_error`` (403), an unknown
  execution or one with no callback (its harness is not running) a ``not_found_error``
  (404), as is a callback's ``LookupError`` (it cannot assess now: its message)

Every client error is a 4xx in the API's own error shape (the admin API answers in
Anthropic's, ``{"type": "error", "error": {"type", "message"}}``), logged as one line;
a 5xx means no engine could take the call (529/503, retry) or the proxy failed, and
only the latter is logged with a traceback. Bodies may be sent gzip or deflate
(``Content-Encoding``); the bearer scheme is read in any case.

A call runs: authenticate (unknown or revoked key: 401, nothing recorded) -> load the
execution's recorder if it left memory -> parse (only past what a recent body of the
execution held) -> :meth:`ExecutionRecorder.prepare` -> the engine through the
:class:`Router` (reroutes continue a partial output; a streamed answer's text goes out as
it comes; a client that hangs up aborts it) -> under the execution's lock,
:meth:`ExecutionRecorder.build`, a durable commit marked undelivered, then
:meth:`ExecutionRecorder.add` -> the answer's last bytes -> marked delivered.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
import time
import zlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

from qwengyre.engines.base import FinishReason, GenerateRequest, GenerateResult, TokenDelta
from qwengyre.hangups import HangUps
from qwengyre.proxy import anthropic_api, openai_api
from qwengyre.proxy.body import BodyMemo, SplitBody
from qwengyre.proxy.render import ChatRenderer, IncrementalDecoder, ReplyStream
from qwengyre.proxy.routing import NoEngineAvailable, Router
from qwengyre.proxy.store import DamagedRecord, ProxyStore, hash_key
from qwengyre.proxy.tito import (
    ContextTooLong,
    ExecutionRecorder,
    PreparedCall,
    Recorded,
    Reuse,
    new_id,
)
from qwengyre.proxy.types import ApiError, ChatRequest, KnownMessages, Message, TokenLogprob
from qwengyre.trajectories.tree import TrajectoryTree
from qwengyre.types import SamplingParams

log = logging.getLogger(__name__)
Api = Literal["anthropic", "openai"]
_EXECUTION_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Assessor = Callable[[int | None], Awaitable[Mapping[str, Any]]]
"""An execution's intermediate-assessment callback: the branch reference (the id of its
latest recorded call, None before any) -> a JSON-ready answer; raises ``LookupError``
when it cannot assess now."""


@dataclass
class ExecutionState:
    """An execution's credentials and, while it is in use, its recorder."""

    id: str
    key_hash: str
    revoked: bool = False
    recorder: ExecutionRecorder | None = None  # None: not in memory, loaded on demand
    damaged: str | None = None  # why its stored calls do not load (quarantined)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # orders its commits
    busy: int = 0  # calls in flight
    used_s: float = 0.0  # time.monotonic() of its last use
    bodies: BodyMemo = field(default_factory=BodyMemo)  # its recent request bodies


class ProxyServer:
    """Holds executions, recorders, the router and the store; builds the aiohttp app."""

    def __init__(
        self,
        renderer: ChatRenderer,
        router: Router,
        store: ProxyStore,
        *,
        model: str,
        max_context: int,
        admin_token: str,
        max_body_bytes: int = 32 * 1024 * 1024,
        temperature: float = 1.0,
        force_sampling: bool = True,
        max_resident: int = 1024,
        idle_s: float = 300.0,
        ping_s: float = 5.0,
    ) -> None:
        """``force_sampling`` (the default): every call samples at ``temperature`` with
        no top-k / top-p truncation, whatever the harness asks, so the recorded
        behaviour log-probs are those of the distribution the trainer computes (a
        harness that sets ``top_p`` would otherwise bias the importance ratios). Off,
        the harness's parameters are honoured and the engine records the log-probs of
        the truncated distribution it sampled from.

        At most ``max_resident`` executions keep their trees in memory; one idle for
        ``idle_s`` seconds, or revoked, leaves memory and is loaded from the store
        when it is next used. A streamed answer sends a ``ping`` whenever nothing else
        was sent for ``ping_s`` seconds (a long prefill must not trip a client's read
        timeout)."""
        if len(admin_token) < 16:
            raise ValueError("the admin token must be at least 16 characters")
        self.renderer = renderer
        self.router = router
        self.store = store
        self.model = model
        self.max_context = max_context
        self.admin_token = admin_token
        self.max_body_bytes = max_body_bytes
        self.temperature = temperature
        self.force_sampling = force_sampling
        self.max_resident = max_resident
        self.idle_s = idle_s
        self.ping_s = ping_s
        self._hang_ups = HangUps()
        self.executions: dict[str, ExecutionState] = {}
        self._by_key: dict[str, str] = {}
        self._resident: OrderedDict[str, ExecutionState] = OrderedDict()  # least recent first
        self.base_url = ""
        self._assessors: dict[str, Assessor] = {}
        for stored in self.store.executions():  # credentials only: trees load on demand
            self._new_state(stored.id, stored.key_hash).revoked = stored.revoked

    def _new_state(self, execution_id: str, key_hash: str) -> ExecutionState:
        state = ExecutionState(execution_id, key_hash)
        self.executions[execution_id] = state
        self._by_key[key_hash] = execution_id
        return state

    # ------------------------------------------------------------ residency

    async def recorder(self, state: ExecutionState) -> ExecutionRecorder:
        """``state``'s recorder, loaded from the store (in a worker thread: other
        executions' calls go on meanwhile) if it is not in memory; an execution whose
        records are damaged answers a ``permission_error``."""
        if state.recorder is None and state.damaged is None:
            async with state.lock:  # one load, however many calls wait for it
                if state.recorder is None and state.damaged is None:
                    try:
                        state.recorder = await asyncio.to_thread(self._load, state.id)
                    except DamagedRecord as exc:
                        log.warning("quarantined %s", exc)
                        state.damaged = exc.reason
        if state.recorder is None:
            raise ApiError(
                "permission_error",
                f"execution {state.id} is quarantined: its stored calls are damaged "
                f"({state.damaged}); nothing more is recorded for it",
            )
        recorder = state.recorder
        self._resident.pop(state.id, None)
        self._evict(room=1)  # the others: this one is in use
        state.used_s = time.monotonic()
        self._resident[state.id] = state
        return recorder

    async def tree(self, execution_id: str) -> TrajectoryTree:
        """An execution's trajectory tree (loaded from the store in a worker thread if
        it is not in memory; it is not kept)."""
        state = self.executions[execution_id]
        if state.recorder is not None:
            return state.recorder.tree
        return (await asyncio.to_thread(self._load, execution_id)).tree

    def _load(self, execution_id: str) -> ExecutionRecorder:
        """A recorder with an execution's stored calls; :class:`DamagedRecord` if they
        do not load."""
        recorder = ExecutionRecorder(self.renderer, self.max_context)
        for node, turn in self.store.calls(execution_id):
            recorder.add(node, turn)
        return recorder

    def _evict(self, room: int = 0) -> None:
        """Drop the recorders of idle or least recently used executions, leaving room
        for ``room`` more."""
        now = time.monotonic()
        for state in list(self._resident.values()):  # least recently used first
            crowded = len(self._resident) + room > self.max_resident
            if not crowded and now - state.used_s <= self.idle_s:
                break  # the rest are newer
            if state.busy == 0:
                del self._resident[state.id]
                state.recorder, state.bodies = None, BodyMemo()

    async def _sweep(self) -> None:
        """Executions idle for ``idle_s`` leave memory even when no other call comes to
        evict them."""
        while True:
            await asyncio.sleep(max(0.05, self.idle_s / 2))
            self._evict()

    async def _background(self, app: web.Application) -> AsyncIterator[None]:
        """While the app runs: :meth:`_sweep`, and an engine that failed a call is taken
        back once it is healthy again (:meth:`~qwengyre.proxy.routing.Router.recover`)."""
        tasks = [
            asyncio.ensure_future(self._sweep()),
            asyncio.ensure_future(self.router.keep_recovering()),
        ]
        yield
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # ------------------------------------------------------------ the app

    def app(self) -> web.Application:
        # Bodies are decoded in _body (auto_decompress off): a Content-Encoding that does not
        # decode then answers an API error instead of failing inside aiohttp.
        app = web.Application(
            client_max_size=self.max_body_bytes,
            middlewares=[_api_errors],
            handler_args={"auto_decompress": False},
        )
        app.cleanup_ctx.append(self._background)
        routes: list[tuple[str, str, Handler]] = [
            ("POST", "/v1/messages", self._anthropic_messages),
            ("POST", "/v1/messages/count_tokens", self._anthropic_count_tokens),
            ("POST", "/v1/chat/completions", self._openai_chat),
            ("GET", "/v1/models", self._models),
        ]
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
            app.router.add_route(method, "/x/{execution_id}" + path, handler)
        app.router.add_route("HEAD", "/", self._root)
        for base in ("/x/{execution_id}", "/x/{execution_id}/"):  # Claude Code's start-up probe
            app.router.add_route("HEAD", base, self._root)
        app.router.add_route("GET", "/", self._root)
        app.router.add_route("POST", "/admin/executions", self._admin_create)
        app.router.add_route("DELETE", "/admin/executions/{execution_id}", self._admin_delete)
        app.router.add_route("GET", "/admin/executions/{execution_id}/tree", self._admin_tree)
        app.router.add_route("POST", "/x/{execution_id}/assess", self._assess)
        return app

    async def _root(self, request: web.Request) -> web.Response:
        return web.Response(text="qwengyre proxy\n")

    # ------------------------------------------------------------ credentials

    def _authenticate(self, request: web.Request) -> ExecutionState:
        """The live execution whose key the call presents (``x-api-key``, else
        ``Authorization: Bearer``, the scheme in any case) and, under a ``/x/{id}``
        prefix, whose id it names; any other key, including one that is not UTF-8, is
        an ``authentication_error`` (401)."""
        key = request.headers.get("x-api-key", "").strip()
        key = key or _bearer(request.headers.get("authorization", ""))
        execution_id = self._by_key.get(hash_key(key)) if key else None
        state = self.executions.get(execution_id) if execution_id else None
        prefixed = request.match_info.get("execution_id")
        if state is None or state.revoked or (prefixed is not None and prefixed != state.id):
            raise ApiError("authentication_error", "invalid x-api-key or bearer token")
        return state

    # ------------------------------------------------------------ model calls

    async def _anthropic_messages(self, request: web.Request) -> web.StreamResponse:
        return await self._call(request, "anthropic")

    async def _openai_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._call(request, "openai")

    async def _call(self, http: web.Request, api: Api) -> web.StreamResponse:
        try:
            state = self._authenticate(http)
            body = await self._body(http)
            recorder = await self.recorder(state)
            chat, split, reuse = _parse(api, body, http.headers, state.bodies)
            call = _prepare(recorder, chat, reuse)
        except ApiError as error:
            return _error_response(api, error)
        if split is not None:  # the next body of this client can reuse this one's work
            earlier = _Earlier(
                KnownMessages(call.messages[chat.lead :], chat.last_user_texts),
                call.messages[: chat.lead],
                call.parent,
            )
            state.bodies.remember(body, split, earlier)
        state.busy += 1
        try:
            if chat.stream:
                return await self._stream(http, state, recorder, chat, call)
            return await self._reply(http, state, recorder, chat, call)
        finally:
            state.busy -= 1
            state.used_s = time.monotonic()

    async def _body(self, http: web.Request) -> bytes:
        """The request body, decoded from its ``Content-Encoding``: none, ``identity``,
        ``gzip`` or ``deflate`` (the zlib format, as HTTP defines it). More than
        ``max_body_bytes``, sent or decoded, is a ``request_too_large`` (413); another
        encoding, or a body that does not decode from its encoding, an
        ``invalid_request_error`` (400)."""
        encoding = http.headers.get("content-encoding", "").strip().lower() or "identity"
        if encoding not in _ENCODINGS:
            raise ApiError(
                "invalid_request_error",
                f"Content-Encoding {encoding[:40]!r} is not supported; send the body "
                "uncompressed, gzip or deflate",
            )
        try:
            sent = await http.read()
        except web.HTTPRequestEntityTooLarge:
            raise self._too_large() from None
        if encoding == "identity":
            return sent
        decoder = zlib.decompressobj(zlib.MAX_WBITS | 32)  # a zlib or gzip header
        try:
            body = decoder.decompress(sent, self.max_body_bytes + 1)
        except zlib.error as exc:
            raise ApiError(
                "invalid_request_error",
                f"the request body is not valid {encoding} data ({exc})",
            ) from None
        if len(body) > self.max_body_bytes:
            raise self._too_large()
        if not decoder.eof or decoder.unused_data:
            raise ApiError(
                "invalid_request_error",
                f"the request body is not valid {encoding} data (truncated, or followed "
                "by other bytes)",
            )
        return body

    def _too_large(self) -> ApiError:
        return ApiError(
            "request_too_large",
            f"request body exceeds the maximum of {self.max_body_bytes} bytes",
        )

    def _request(
        self, state: ExecutionState, chat: ChatRequest, call: PreparedCall
    ) -> GenerateRequest:
        room = self.max_context - len(call.prompt_ids)
        asked = chat.sampling
        sampling = SamplingParams(
            max_tokens=min(asked.max_tokens, room),
            temperature=self.temperature if self.force_sampling else asked.temperature,
            top_p=1.0 if self.force_sampling else asked.top_p,
            top_k=-1 if self.force_sampling else asked.top_k,
            stop=asked.stop,
        )
        return GenerateRequest(
            new_id("req_", 12),
            call.prompt_ids,
            sampling,
            {"execution": state.id, "class": call.request_class.name},
        )

    async def _generate(
        self,
        http: web.Request,
        state: ExecutionState,
        request: GenerateRequest,
        on_delta: Callable[[TokenDelta], Awaitable[None]] | None = None,
    ) -> tuple[str, GenerateResult, bool]:
        """Run ``request`` through the router, handing each delta to ``on_delta``;
        (engine, result, whether the client went away). A client that hangs up (or a
        failed write to it) aborts the engine request at once; the result then holds
        what was generated so far, with finish reason ``abort``."""
        engine = ""
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        finish: FinishReason = "abort"

        async def consume() -> None:
            nonlocal engine, finish
            deltas = self.router.stream(state.id, request)
            try:
                async for name, delta in deltas:
                    engine = name
                    ids.extend(delta.output_ids)
                    logprobs.extend(delta.logprobs)
                    versions.extend(delta.versions)
                    if delta.finish_reason is not None:
                        finish = delta.finish_reason
                    if on_delta is not None:
                        await on_delta(delta)
            finally:
                await deltas.aclose()

        work = asyncio.ensure_future(consume())
        gone = self._hang_ups.watch(http)
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._hang_ups.forget(gone)
            work.cancel()  # the client went away: abort the engine request
            await asyncio.wait({work})
        client_gone = gone.done() and not gone.cancelled()
        error = None if work.cancelled() else work.exception()
        if isinstance(error, ConnectionError):  # a write to the client failed
            client_gone = True
        elif isinstance(error, NoEngineAvailable):
            raise ApiError("overloaded_error", str(error), retry_after_s=1.0) from None
        elif error is not None:
            raise error
        result = GenerateResult(tuple(ids), tuple(logprobs), tuple(versions), finish)
        return engine, result, client_gone

    async def _commit(
        self,
        state: ExecutionState,
        recorder: ExecutionRecorder,
        chat: ChatRequest,
        call: PreparedCall,
        engine: str,
        result: GenerateResult,
        started_s: float,
        completion_id: str | None = None,
    ) -> Recorded:
        """Record the call durably, undelivered until :meth:`_delivered`; it enters the
        tree only once committed, and commits of one execution are in node order."""
        async with state.lock:
            recorded = recorder.build(
                call,
                result,
                api=chat.api,
                model=chat.model or self.model,
                engine=engine,
                started_s=started_s,
                finished_s=time.time(),
                delivered=False,
                completion_id=completion_id,
            )
            try:
                await asyncio.to_thread(self.store.add_call, state.id, recorded.node, recorded.turn)
            except Exception:
                log.exception("could not record a call of %s", state.id)
                raise ApiError(
                    "api_error", "the call could not be recorded; nothing was recorded for it"
                ) from None
            recorder.add(recorded.node, recorded.turn, call.prompt_ids)
        return recorded

    async def _delivered(
        self, state: ExecutionState, recorder: ExecutionRecorder, node: int
    ) -> None:
        await asyncio.to_thread(self.store.set_delivered, state.id, node, True)
        recorder.mark_delivered(node, True)

    async def _reply(
        self,
        http: web.Request,
        state: ExecutionState,
        recorder: ExecutionRecorder,
        chat: ChatRequest,
        call: PreparedCall,
    ) -> web.StreamResponse:
        """A non-streaming answer: generate, commit, write, mark delivered."""
        started = time.time()
        try:
            request = self._request(state, chat, call)
            engine, result, gone = await self._generate(http, state, request)
            recorded = await self._commit(state, recorder, chat, call, engine, result, started)
        except ApiError as error:
            return _error_response(chat.api, error)
        completion = recorded.completion
        if chat.api == "anthropic":
            answer = anthropic_api.message_body(completion)
        else:
            created = int(time.time())
            answer = openai_api.completion_body(completion, created, logprobs=chat.logprobs)
        response = web.StreamResponse(headers={"content-type": "application/json"})
        if gone:
            return response  # nobody to answer; the node stays undelivered
        data = json.dumps(answer).encode()
        response.content_length = len(data)
        try:
            await response.prepare(http)
            await response.write(data)
            await response.write_eof()
        except ConnectionError:
            return response
        await self._delivered(state, recorder, recorded.node.id)
        return response

    async def _stream(
        self,
        http: web.Request,
        state: ExecutionState,
        recorder: ExecutionRecorder,
        chat: ChatRequest,
        call: PreparedCall,
    ) -> web.StreamResponse:
        """A streamed answer: the opening event with the first token (or the first
        ping: one is sent whenever nothing else was for ``ping_s``, e.g. during a long
        prefill), text as the engine produces it, then the commit and the closing
        events. An error before anything was sent is a plain API error (a client
        retries a 529 it sees before the stream), after that an error event."""
        started = time.time()
        completion_id = new_id("msg_" if chat.api == "anthropic" else "chatcmpl-")
        model = chat.model or self.model
        events: anthropic_api.MessageStream | openai_api.ChunkStream
        if chat.api == "anthropic":
            events = anthropic_api.MessageStream(completion_id, model, len(call.prompt_ids))
        else:
            events = openai_api.ChunkStream(
                completion_id,
                int(started),
                model,
                logprobs=chat.logprobs,
                include_usage=chat.include_usage,
            )
        response = web.StreamResponse(
            headers={"content-type": "text/event-stream", "cache-control": "no-cache"}
        )
        writer = _SseWriter(http, response, events.start())
        decoder = IncrementalDecoder(self.renderer.tokenizer)
        reply = ReplyStream(call.stop)
        eos = self.renderer.tokenizer.eos_token_id

        async def on_delta(delta: TokenDelta) -> None:
            ids = [t for t in delta.output_ids if t != eos]
            text = reply.feed(decoder.push(ids))
            if isinstance(events, openai_api.ChunkStream) and chat.logprobs:
                # Each token's log-prob rides on the next content delta (the rest on the
                # final chunk), as the recorded completion lists them.
                data = events.text(text, _token_logprobs(self.renderer, delta))
            else:
                data = events.text(text) if text else b""
            if data:
                await writer.write(data)

        try:
            pings = asyncio.ensure_future(writer.ping_every(self.ping_s, events.ping))
            try:
                engine, result, gone = await self._generate(
                    http, state, self._request(state, chat, call), on_delta
                )
            finally:
                pings.cancel()
            recorded = await self._commit(
                state, recorder, chat, call, engine, result, started, completion_id
            )
        except ApiError as error:
            if not writer.started:
                return _error_response(chat.api, error)
            with contextlib.suppress(ConnectionError):
                await writer.write(_stream_error(chat.api, error))
                await response.write_eof()
            return response
        if gone or writer.broken:
            return response  # the node stays undelivered
        try:
            last = reply.feed(decoder.flush()) + reply.finish()[0]
            if last:
                await writer.write(events.text(last))
            await writer.write(events.finish(recorded.completion))
            await response.write_eof()
        except ConnectionError:
            return response
        await self._delivered(state, recorder, recorded.node.id)
        return response

    async def _anthropic_count_tokens(self, http: web.Request) -> web.Response:
        try:
            state = self._authenticate(http)
            chat = anthropic_api.parse_count_tokens_request(await self._body(http), http.headers)
            count = (await self.recorder(state)).count_tokens(chat)
        except ApiError as error:
            return _error_response("anthropic", error)
        return web.json_response(anthropic_api.count_tokens_body(count))

    async def _models(self, http: web.Request) -> web.Response:
        api: Api = "anthropic" if "anthropic-version" in http.headers else "openai"
        try:
            self._authenticate(http)
        except ApiError as error:
            return _error_response(api, error)
        if api == "openai":
            return web.json_response(openai_api.models_body([self.model], int(time.time())))
        model = {
            "type": "model",
            "id": self.model,
            "display_name": self.model,
            "created_at": "2026-01-01T00:00:00Z",
        }
        return web.json_response(
            {"data": [model], "has_more": False, "first_id": self.model, "last_id": self.model}
        )

    # ------------------------------------------------------------ assessments

    def register_assessor(self, execution_id: str, assessor: Assessor) -> None:
        """Serve ``POST /x/{execution_id}/assess`` with ``assessor`` (replacing one)."""
        self._assessors[execution_id] = assessor

    def unregister_assessor(self, execution_id: str) -> None:
        """Stop serving the execution's assessments (404 from now on)."""
        self._assessors.pop(execution_id, None)

    async def _assess(self, http: web.Request) -> web.Response:
        """An intermediate assessment for the harness that presents the execution's key."""
        key = http.headers.get("x-api-key", "").strip()
        key = key or _bearer(http.headers.get("authorization", ""))
        owner_id = self._by_key.get(hash_key(key)) if key else None
        owner = self.executions.get(owner_id) if owner_id else None
        if owner is None or owner.revoked:
            raise ApiError("authentication_error", "invalid x-api-key or bearer token")
        state = self._execution(http)
        if state.id != owner.id:
            raise ApiError(
                "permission_error",
                f"this key belongs to another execution; it cannot assess {state.id}",
            )
        assessor = self._assessors.get(state.id)
        if assessor is None:
            raise ApiError(
                "not_found_error",
                f"execution {state.id} has no evaluator to ask now (its harness is not "
                "running under a runner that assesses it)",
            )
        try:  # the branch reference: the execution's latest recorded call
            nodes = (await self.tree(state.id)).nodes
            branch = nodes[-1].id if nodes else None
        except DamagedRecord:
            branch = None
        try:
            answer = await assessor(branch)
        except LookupError as exc:
            raise ApiError("not_found_error", f"no assessment of {state.id} now: {exc}") from None
        return web.json_response(dict(answer))

    # ------------------------------------------------------------ admin

    def _admin(self, http: web.Request) -> None:
        """Admin calls carry ``Authorization: Bearer <admin token>`` (the scheme in any
        case); anything else is an ``authentication_error`` (401)."""
        given = _bearer(http.headers.get("authorization", "")).encode("utf-8", "surrogatepass")
        if not secrets.compare_digest(given, self.admin_token.encode()):
            raise ApiError(
                "authentication_error", "admin token required (Authorization: Bearer <token>)"
            )

    def _execution(self, http: web.Request) -> ExecutionState:
        """The execution the admin path names; a ``not_found_error`` (404) if none."""
        execution_id = http.match_info["execution_id"]
        state = self.executions.get(execution_id) if _EXECUTION_ID.match(execution_id) else None
        if state is None:
            raise ApiError("not_found_error", f"no execution {execution_id[:64]!r}")
        return state

    async def create_execution(self) -> dict[str, str]:
        """A new execution with its own key, durable before it is returned: ``id``,
        ``key``, ``base_url`` (Anthropic) and ``openai_base_url``."""
        execution_id = new_id("ex_", 16)
        key = "qg-" + secrets.token_urlsafe(32)
        await asyncio.to_thread(self.store.add_execution, execution_id, hash_key(key), time.time())
        self._new_state(execution_id, hash_key(key))
        prefix = f"{self.base_url}/x/{execution_id}"
        return {
            "id": execution_id,
            "key": key,
            "base_url": prefix,
            "openai_base_url": prefix + "/v1",
        }

    async def revoke_execution(self, execution_id: str) -> None:
        """The execution's key stops working and its route is forgotten."""
        state = self.executions[execution_id]
        await asyncio.to_thread(self.store.revoke, state.id)
        state.revoked = True
        self.router.forget(state.id)
        if state.busy == 0 and self._resident.pop(state.id, None) is not None:
            state.recorder, state.bodies = None, BodyMemo()  # finished: all is in the store

    async def _admin_create(self, http: web.Request) -> web.Response:
        self._admin(http)
        return web.json_response(await self.create_execution(), status=201)

    async def _admin_delete(self, http: web.Request) -> web.Response:
        self._admin(http)
        state = self._execution(http)
        await self.revoke_execution(state.id)
        return web.json_response({"id": state.id, "revoked": True})

    async def _admin_tree(self, http: web.Request) -> web.Response:
        self._admin(http)
        state = self._execution(http)
        return web.json_response({"id": state.id, **(await self.tree(state.id)).to_json()})


_ENCODINGS = frozenset({"identity", "gzip", "x-gzip", "deflate"})


def _bearer(authorization: str) -> str:
    """The token of an ``Authorization: Bearer <token>`` value (the scheme in any case);
    empty for any other scheme."""
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _api_of(path: str) -> Api:
    """Whose error shape a path answers in: OpenAI's under ``/chat/``, else Anthropic's
    (the admin API's too: ``{"type": "error", "error": {"type", "message"}}``)."""
    return "openai" if "/chat/" in path else "anthropic"


@web.middleware
async def _api_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Errors answer in the path's API error shape (:func:`_api_of`): an :class:`ApiError`
    a handler raises (the admin API's 401 and 404), unknown routes and methods (404),
    and unexpected failures (500, the only ones logged with a traceback)."""
    try:
        return await handler(request)
    except ApiError as exc:
        error = exc
    except web.HTTPNotFound:
        error = ApiError("not_found_error", f"no route {request.method} {request.path[:200]!r}")
    except web.HTTPMethodNotAllowed:
        error = ApiError("not_found_error", f"{request.method} is not allowed on this route")
    except web.HTTPException:
        raise
    except Exception:
        log.exception("proxy failure on %s %r", request.method, request.path[:200])
        error = ApiError("api_error", "internal proxy error; nothing was recorded for this call")
    return _error_response(_api_of(request.path), error)


def _error_response(api: Api, error: ApiError) -> web.Response:
    """``error`` in ``api``'s shape, logged as one line (no traceback: a client error
    is not the proxy's failure)."""
    log.log(
        logging.WARNING if error.status >= 500 else logging.INFO,
        "answered %s %d %s: %r",
        api,
        error.status,
        error.kind,
        error.message[:300],
    )
    if api == "anthropic":
        body: dict[str, Any] = anthropic_api.error_body(error)
        return web.json_response(
            body, status=error.status, headers=anthropic_api.error_headers(error)
        )
    return web.json_response(
        openai_api.error_body(error),
        status=openai_api.error_status(error),
        headers=openai_api.error_headers(error),
    )


@dataclass(frozen=True)
class _Earlier:
    """What a body's messages were made into, for the next body that repeats them."""

    known: KnownMessages  # converted and normalised
    lead: tuple[Message, ...]  # the messages before them (Anthropic's system)
    parent: int | None  # the recorded call that body's request extended


def _parse(
    api: Api, body: bytes, headers: Mapping[str, str], bodies: BodyMemo
) -> tuple[ChatRequest, SplitBody | None, Reuse | None]:
    """Parse a call's body, converting only the messages an earlier body of the same
    execution did not hold (:mod:`qwengyre.proxy.body`); (the request, the split to
    remember, what the recorder may reuse). Errors come from a whole parse, so their
    paths and messages never depend on what was remembered."""
    split = bodies.split(body)
    if split is not None:
        earlier: _Earlier | None = split.known.state if split.known else None
        before = earlier.known if earlier else None
        try:
            if api == "anthropic":
                chat = anthropic_api.parse_messages_doc(split.doc, headers, before)
            else:
                chat = openai_api.parse_chat_doc(split.doc, headers, before)
        except ApiError:
            pass  # reported by the whole parse below
        else:
            if earlier is None:
                return chat, split, None
            same_lead = chat.messages[: chat.lead] == earlier.lead
            known = chat.lead + len(earlier.known.messages)
            return chat, split, Reuse(known, earlier.parent if same_lead else None)
    if api == "anthropic":
        return anthropic_api.parse_messages_request(body, headers), None, None
    return openai_api.parse_chat_request(body, headers), None, None


def _prepare(recorder: ExecutionRecorder, chat: ChatRequest, reuse: Reuse | None) -> PreparedCall:
    try:
        return recorder.prepare(chat, reuse)
    except ContextTooLong as exc:
        if chat.api == "anthropic":
            raise anthropic_api.prompt_too_long(exc.tokens, exc.limit) from None
        raise openai_api.context_length_exceeded(exc.tokens, exc.limit) from None


def _token_logprobs(renderer: ChatRenderer, delta: TokenDelta) -> list[TokenLogprob]:
    tokens = renderer.tokenizer.convert_ids_to_tokens(list(delta.output_ids))
    return [TokenLogprob(str(t), lp) for t, lp in zip(tokens, delta.logprobs, strict=True)]


def _stream_error(api: Api, error: ApiError) -> bytes:
    """An error after the stream started: Anthropic's ``error`` event; OpenAI's
    clients read an ``error`` object in a data line."""
    if api == "anthropic":
        return anthropic_api.stream_error_event(error)
    return b"data: " + json.dumps(openai_api.error_body(error)).encode() + b"\n\n"


class _SseWriter:
    """Writes whole SSE events to one response, ``opening`` before the first, and notes
    when the client is gone (a failed write raises ``ConnectionError``, sets ``broken``)."""

    def __init__(self, http: web.Request, response: web.StreamResponse, opening: bytes) -> None:
        self.http = http
        self.response = response
        self.opening = opening
        self.started = False
        self.broken = False
        self.written_s = time.monotonic()

    async def write(self, data: bytes) -> None:
        try:
            if not self.started:
                self.started = True
                await self.response.prepare(self.http)
                data = self.opening + data
            self.written_s = time.monotonic()
            await self.response.write(data)
        except ConnectionError:
            self.broken = True
            raise

    async def ping_every(self, seconds: float, ping: Callable[[], bytes]) -> None:
        """Send ``ping()`` whenever nothing was written for ``seconds``."""
        while not self.broken:
            await asyncio.sleep(max(0.0, self.written_s + seconds - time.monotonic()))
            if time.monotonic() - self.written_s >= seconds:
                with contextlib.suppress(ConnectionError):
                    await self.write(ping())
