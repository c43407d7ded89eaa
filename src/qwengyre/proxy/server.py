"""The proxy's HTTP server (aiohttp): every API dialect, per-execution credentials.

Routes (also under a base-URL prefix ``/x/{execution_id}``, which some harnesses need
because they cannot send custom headers):

- each dialect of :data:`DIALECTS` (:mod:`qwengyre.proxy.dialect`): ``POST`` on its
  call path (Anthropic: ``/v1/messages``, ``?beta=true`` too; OpenAI:
  ``/v1/chat/completions`` and ``/v1/responses``) and on its token-count path if it
  has one (Anthropic: ``/v1/messages/count_tokens``)
- all: ``GET /v1/models`` (in the dialect whose clients' header the call carries,
  else OpenAI's), ``HEAD /`` and ``HEAD`` on an execution's base URL
- admin (:mod:`qwengyre.proxy.admin`): ``/admin/executions...``
- harness: ``POST /x/{id}/assess`` (:mod:`qwengyre.proxy.assessors`)

Every client error is a 4xx in the error shape of the dialect whose path it is on (an
unknown path under an API's own, e.g. ``/v1/responses/x``, too; the admin API and other
unknown routes answer in Anthropic's, ``{"type": "error", "error": {"type",
"message"}}``), logged as one line; an unknown route's 404 lists the routes served; a
5xx means no engine could take the call (529/503, retry) or the proxy failed, and only
the latter is logged with a traceback.
Bodies may be sent gzip or deflate (``Content-Encoding``); the bearer scheme is read in
any case.

A call runs the same whatever its dialect: authenticate (unknown or revoked key: 401,
nothing recorded) -> load the execution's recorder if it left memory
(:mod:`qwengyre.proxy.residency`) -> parse (only past what a recent body of the
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
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass

from aiohttp import web

from qwengyre.durable import DiskFullError
from qwengyre.engines.base import GenerateRequest, GenerateResult, Joined, TokenDelta
from qwengyre.hangups import HangUps
from qwengyre.proxy.admin import AdminApi
from qwengyre.proxy.anthropic_api import AnthropicMessages
from qwengyre.proxy.assessors import Assessor, Assessors
from qwengyre.proxy.body import BodyMemo, SplitBody, split_whole
from qwengyre.proxy.dialect import Dialect, ParseWhole
from qwengyre.proxy.incoming import presented_key, read_body
from qwengyre.proxy.openai_api import OpenAIChat
from qwengyre.proxy.render import ChatRenderer, IncrementalDecoder
from qwengyre.proxy.residency import ExecutionState, Residency
from qwengyre.proxy.responses_api import OpenAIResponses
from qwengyre.proxy.routing import NoEngineAvailable, Router
from qwengyre.proxy.sse import SseWriter
from qwengyre.proxy.store import ProxyStore, hash_key
from qwengyre.proxy.tito import (
    ContextTooLong,
    ExecutionRecorder,
    PreparedCall,
    Recorded,
    Reuse,
    new_id,
)
from qwengyre.proxy.types import ApiError, ChatRequest, KnownMessages, Message, TokenLogprob
from qwengyre.trajectories.classes import RuleSet
from qwengyre.trajectories.tree import TrajectoryTree
from qwengyre.types import SamplingParams

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

ANTHROPIC = AnthropicMessages()
OPENAI = OpenAIChat()
RESPONSES = OpenAIResponses()
DIALECTS: tuple[Dialect, ...] = (ANTHROPIC, OPENAI, RESPONSES)
"""The APIs the proxy serves: serving one more is its :class:`Dialect` added here."""
PLAIN_ERRORS = ANTHROPIC
"""The error shape of the routes no dialect owns (the admin API, unknown routes)."""
PLAIN_MODELS = OPENAI
"""The models listing for a client no dialect recognises by its headers."""


class ProxyServer:
    """Holds the router, the store and the executions (:class:`Residency`); runs the
    model calls of every dialect; builds the aiohttp app."""

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
        classes: RuleSet | None = None,
        max_reply_tokens: int | None = None,
    ) -> None:
        """``force_sampling`` (the default): every call samples at ``temperature`` with
        no top-k / top-p truncation, whatever the harness asks, so the recorded
        behaviour log-probs are those of the distribution the trainer computes (a
        harness that sets ``top_p`` would otherwise bias the importance ratios). Off,
        the harness's parameters are honoured and the engine records the log-probs of
        the truncated distribution it sampled from.

        At most ``max_resident`` executions keep their trees in memory; one idle for
        ``idle_s`` seconds, or revoked, leaves memory and is loaded from the store
        when it is next used (:class:`Residency`). A streamed answer sends a ``ping``
        whenever nothing else was sent for ``ping_s`` seconds (a long prefill must not
        trip a client's read timeout). ``classes``: the harness's request-class rules
        (None: the default rule set, ``proxy.classes``'s default). A reply takes at most
        what the call asks, ``max_reply_tokens`` and the rest of ``max_context``."""
        self.admin = AdminApi(admin_token, self)
        self.renderer = renderer
        self.router = router
        self.store = store
        self.model = model
        self.max_context = max_context
        self.max_reply_tokens = max_reply_tokens
        self.max_body_bytes = max_body_bytes
        self.temperature = temperature
        self.force_sampling = force_sampling
        self.ping_s = ping_s
        self.residency = Residency(
            store,
            renderer,
            max_context,
            max_resident=max_resident,
            idle_s=idle_s,
            classes=classes,
        )
        self.assessors = Assessors(self.residency)
        self._hang_ups = HangUps()
        self.base_url = ""

    # ------------------------------------------------------------ executions

    async def create_execution(self) -> dict[str, str]:
        """A new execution with its own key, durable before it is returned: ``id``,
        ``key``, ``base_url`` (Anthropic) and ``openai_base_url``."""
        execution_id = new_id("ex_", 16)
        key = "qg-" + secrets.token_urlsafe(32)
        await asyncio.to_thread(self.store.add_execution, execution_id, hash_key(key), time.time())
        self.residency.add(execution_id, hash_key(key))
        prefix = f"{self.base_url}/x/{execution_id}"
        return {
            "id": execution_id,
            "key": key,
            "base_url": prefix,
            "openai_base_url": prefix + "/v1",
        }

    async def revoke_execution(self, execution_id: str) -> None:
        """The execution's key stops working and its route is forgotten."""
        state = self.residency.executions[execution_id]
        await asyncio.to_thread(self.store.revoke, state.id)
        state.revoked = True
        self.router.forget(state.id)
        self.residency.release(state)

    async def tree(self, execution_id: str) -> TrajectoryTree:
        """An execution's trajectory tree (:meth:`Residency.tree`)."""
        return await self.residency.tree(execution_id)

    def register_assessor(self, execution_id: str, assessor: Assessor) -> None:
        """Serve ``POST /x/{execution_id}/assess`` with ``assessor`` (replacing one)."""
        self.assessors.register(execution_id, assessor)

    def unregister_assessor(self, execution_id: str) -> None:
        """Stop serving the execution's assessments (404 from now on)."""
        self.assessors.unregister(execution_id)

    # ------------------------------------------------------------ the app

    def app(self) -> web.Application:
        # Bodies are decoded in read_body (auto_decompress off): a Content-Encoding that
        # does not decode then answers an API error instead of failing inside aiohttp.
        app = web.Application(
            client_max_size=self.max_body_bytes,
            middlewares=[_api_errors],
            handler_args={"auto_decompress": False},
        )
        app.cleanup_ctx.append(self._background)
        routes: list[tuple[str, str, Handler]] = [("GET", "/v1/models", self._models)]
        for dialect in DIALECTS:
            routes.append(("POST", dialect.call_path, self._calls(dialect)))
            if dialect.count_tokens_path is not None:
                routes.append(("POST", dialect.count_tokens_path, self._counts(dialect)))
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
            app.router.add_route(method, "/x/{execution_id}" + path, handler)
            # and without /v1: an execution's base_url is the base of both SDKs (the
            # Anthropic SDK adds /v1/messages, the OpenAI SDK only /chat/completions)
            app.router.add_route(method, "/x/{execution_id}" + path.removeprefix("/v1"), handler)
        app.router.add_route("HEAD", "/", self._root)
        for base in ("/x/{execution_id}", "/x/{execution_id}/"):  # Claude Code's start-up probe
            app.router.add_route("HEAD", base, self._root)
        app.router.add_route("GET", "/", self._root)
        self.admin.add_routes(app)
        self.assessors.add_routes(app)
        return app

    async def _background(self, app: web.Application) -> AsyncIterator[None]:
        """While the app runs: :meth:`Residency.sweep`, and the engines' health checks
        (:meth:`~qwengyre.proxy.routing.Router.check`): a serving engine that fails one
        is drained, one that failed is taken back once it passes again."""
        tasks = [
            asyncio.ensure_future(self.residency.sweep()),
            asyncio.ensure_future(self.router.keep_checking()),
        ]
        yield
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _root(self, request: web.Request) -> web.Response:
        return web.Response(text="qwengyre proxy\n")

    def _authenticate(self, request: web.Request) -> ExecutionState:
        """The live execution whose key the call presents (``x-api-key``, else
        ``Authorization: Bearer``, the scheme in any case) and, under a ``/x/{id}``
        prefix, whose id it names; any other key, including one that is not UTF-8, is
        an ``authentication_error`` (401)."""
        state = self.residency.holder(presented_key(request.headers))
        prefixed = request.match_info.get("execution_id")
        if state is None or (prefixed is not None and prefixed != state.id):
            raise ApiError("authentication_error", "invalid x-api-key or bearer token")
        return state

    # ------------------------------------------------------------ model calls

    def _calls(self, dialect: Dialect) -> Handler:
        async def handler(http: web.Request) -> web.StreamResponse:
            return await self._call(http, dialect)

        return handler

    def _counts(self, dialect: Dialect) -> Handler:
        async def handler(http: web.Request) -> web.StreamResponse:
            return await self._count_tokens(http, dialect)

        return handler

    async def _call(self, http: web.Request, dialect: Dialect) -> web.StreamResponse:
        try:
            state = self._authenticate(http)
            body = await read_body(http, self.max_body_bytes)
            recorder = await self.residency.recorder(state)
            chat, split, reuse = _parse(dialect, body, http.headers, state.bodies)
            prepared = _prepare(dialect, recorder, chat, reuse)
        except ApiError as error:
            return _error_response(dialect, error)
        if split is not None:  # the next body of this client can reuse this one's work
            earlier = _Earlier(
                KnownMessages(prepared.messages[chat.lead :], chat.last_user_texts),
                prepared.messages[: chat.lead],
                prepared.parent,
            )
            state.bodies.remember(body, split, earlier)
        call = _Call(
            http=http, dialect=dialect, state=state, recorder=recorder, chat=chat, prepared=prepared
        )
        state.busy += 1
        try:
            if chat.stream:
                return await self._stream(call)
            return await self._reply(call)
        finally:
            state.busy -= 1
            state.used_s = time.monotonic()

    def _request(self, call: _Call) -> GenerateRequest:
        room = self.max_context - len(call.prepared.prompt_ids)
        asked = call.chat.sampling
        limits = [asked.max_tokens, room, self.max_reply_tokens or room]
        sampling = SamplingParams(
            max_tokens=min(limits),
            temperature=self.temperature if self.force_sampling else asked.temperature,
            top_p=1.0 if self.force_sampling else asked.top_p,
            top_k=-1 if self.force_sampling else asked.top_k,
            stop=asked.stop,
        )
        return GenerateRequest(
            new_id("req_", 12),
            call.prepared.prompt_ids,
            sampling,
            {"execution": call.state.id, "class": call.prepared.request_class.name},
        )

    async def _generate(
        self, call: _Call, on_delta: Callable[[TokenDelta], Awaitable[None]] | None = None
    ) -> tuple[str, GenerateResult, bool]:
        """Run ``call`` through the router, handing each delta to ``on_delta``;
        (engine, result, whether the client went away). A client that hangs up (or a
        failed write to it) aborts the engine request at once; the result then holds
        what was generated so far, with finish reason ``abort``."""
        engine = ""
        joined = Joined()

        async def consume() -> None:
            nonlocal engine
            deltas = self.router.stream(call.state.id, self._request(call))
            try:
                async for name, delta in deltas:
                    engine = name
                    joined.add(delta)
                    if on_delta is not None:
                        await on_delta(delta)
            finally:
                await deltas.aclose()

        work = asyncio.ensure_future(consume())
        gone = self._hang_ups.watch(call.http)
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
        return engine, joined.result(otherwise="abort"), client_gone

    async def _commit(
        self,
        call: _Call,
        engine: str,
        result: GenerateResult,
        started_s: float,
        completion_id: str | None = None,
    ) -> Recorded:
        """Record the call durably, undelivered until :meth:`_delivered`; it enters the
        tree only once committed, and commits of one execution are in node order."""
        state, recorder = call.state, call.recorder
        async with state.lock:
            recorded = recorder.build(
                call.prepared,
                result,
                id_prefix=call.dialect.id_prefix,
                tool_id_prefix=call.dialect.tool_id_prefix,
                model=call.chat.model or self.model,
                engine=engine,
                started_s=started_s,
                finished_s=time.time(),
                delivered=False,
                completion_id=completion_id,
            )
            try:
                await asyncio.to_thread(self.store.add_call, state.id, recorded.node, recorded.turn)
            except Exception as exc:
                if isinstance(exc, DiskFullError):  # one line that says it all
                    log.error("could not record a call of %s: %s", state.id, exc)
                else:
                    log.exception("could not record a call of %s", state.id)
                raise ApiError(
                    "api_error", "the call could not be recorded; nothing was recorded for it"
                ) from None
            recorder.add(recorded.node, recorded.turn, call.prepared.prompt_ids)
        return recorded

    async def _delivered(self, call: _Call, node: int) -> None:
        await asyncio.to_thread(self.store.set_delivered, call.state.id, node, True)
        call.recorder.mark_delivered(node, True)

    async def _reply(self, call: _Call) -> web.StreamResponse:
        """A non-streaming answer: generate, commit, write, mark delivered."""
        started = time.time()
        try:
            engine, result, gone = await self._generate(call)
            recorded = await self._commit(call, engine, result, started)
        except ApiError as error:
            return _error_response(call.dialect, error)
        response = web.StreamResponse(headers={"content-type": "application/json"})
        if gone:
            return response  # nobody to answer; the node stays undelivered
        data = json.dumps(call.dialect.answer(recorded.completion, call.chat)).encode()
        response.content_length = len(data)
        try:
            await response.prepare(call.http)
            await response.write(data)
            await response.write_eof()
        except ConnectionError:
            return response
        await self._delivered(call, recorded.node.id)
        return response

    async def _stream(self, call: _Call) -> web.StreamResponse:
        """A streamed answer: the opening event with the first token (or the first
        ping: one is sent whenever nothing else was for ``ping_s``, e.g. during a long
        prefill), text as the engine produces it, then the commit and the closing
        events. An error before anything was sent is a plain API error (a client
        retries a 529 it sees before the stream), after that an error event."""
        started = time.time()
        dialect, chat = call.dialect, call.chat
        completion_id = new_id(dialect.id_prefix)
        events = dialect.events(
            completion_id,
            chat.model or self.model,
            chat,
            created=int(started),
            input_tokens=len(call.prepared.prompt_ids),
        )
        response = web.StreamResponse(
            headers={"content-type": "text/event-stream", "cache-control": "no-cache"}
        )
        writer = SseWriter(call.http, response, events.start())
        decoder = IncrementalDecoder(self.renderer.tokenizer)
        prepared = call.prepared
        reply = self.renderer.replies.stream(
            prepared.stop, prepared.tools, self.renderer.prompt_tail(prepared.prompt_ids)
        )
        eos = self.renderer.tokenizer.eos_token_id

        async def on_delta(delta: TokenDelta) -> None:
            ids = [t for t in delta.output_ids if t != eos]
            shown = reply.feed(decoder.push(ids))
            # Each token's log-prob rides on the next content delta (the rest on the
            # final chunk), as the recorded completion lists them.
            logprobs = _token_logprobs(self.renderer, delta) if chat.logprobs else None
            data = events.reasoning(shown.reasoning) + events.text(shown.text, logprobs)
            if data:
                await writer.write(data)

        try:
            pings = asyncio.ensure_future(writer.ping_every(self.ping_s, events.ping))
            try:
                engine, result, gone = await self._generate(call, on_delta)
            finally:
                pings.cancel()
            recorded = await self._commit(call, engine, result, started, completion_id)
        except ApiError as error:
            if not writer.started:
                return _error_response(dialect, error)
            with contextlib.suppress(ConnectionError):
                await writer.write(events.error(error))
                await response.write_eof()
            return response
        if gone or writer.broken:
            return response  # the node stays undelivered
        try:
            flushed, (last, _) = reply.feed(decoder.flush()), reply.finish()
            data = events.reasoning(flushed.reasoning + last.reasoning)
            data += events.text(flushed.text + last.text)
            if data:
                await writer.write(data)
            await writer.write(events.finish(recorded.completion))
            await response.write_eof()
        except ConnectionError:
            return response
        await self._delivered(call, recorded.node.id)
        return response

    async def _count_tokens(self, http: web.Request, dialect: Dialect) -> web.Response:
        try:
            state = self._authenticate(http)
            chat = dialect.parse_count_tokens(
                await read_body(http, self.max_body_bytes), http.headers
            )
            count = (await self.residency.recorder(state)).count_tokens(chat)
        except ApiError as error:
            return _error_response(dialect, error)
        return web.json_response(dialect.count_tokens_body(count))

    async def _models(self, http: web.Request) -> web.Response:
        dialect = next((d for d in DIALECTS if d.owns_headers(http.headers)), PLAIN_MODELS)
        try:
            self._authenticate(http)
        except ApiError as error:
            return _error_response(dialect, error)
        return web.json_response(dialect.models_body(self.model))


def _dialect_of(path: str) -> Dialect:
    """Whose error shape a path answers in: the dialect that owns it, else
    :data:`PLAIN_ERRORS`."""
    return next((d for d in DIALECTS if d.owns_path(path)), PLAIN_ERRORS)


@web.middleware
async def _api_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Errors answer in the path's error shape (:func:`_dialect_of`): an :class:`ApiError`
    a handler raises (the admin API's 401 and 404), unknown routes and methods (404),
    and unexpected failures (500, the only ones logged with a traceback)."""
    try:
        return await handler(request)
    except ApiError as exc:
        error = exc
    except web.HTTPNotFound:
        error = ApiError(
            "not_found_error",
            f"no route {request.method} {request.path[:200]!r}; served: {_served()}",
        )
    except web.HTTPMethodNotAllowed as exc:
        error = ApiError(
            "not_found_error",
            f"{request.method} is not allowed on {request.path[:200]!r} (only "
            f"{', '.join(sorted(exc.allowed_methods))}); served: {_served()}",
        )
    except web.HTTPException:
        raise
    except Exception:
        log.exception("proxy failure on %s %r", request.method, request.path[:200])
        error = ApiError("api_error", "internal proxy error; nothing was recorded for this call")
    return _error_response(_dialect_of(request.path), error)


def _served() -> str:
    """The model routes, as an unknown route's 404 lists them."""
    routes = ["GET /v1/models"]
    for dialect in DIALECTS:
        routes.append(f"POST {dialect.call_path}")
        if dialect.count_tokens_path is not None:
            routes.append(f"POST {dialect.count_tokens_path}")
    return ", ".join(routes) + " (each also under /x/{execution_id}, the /v1 optional there)"


def _error_response(dialect: Dialect, error: ApiError) -> web.Response:
    """``error`` in ``dialect``'s shape, logged as one line (no traceback: a client
    error is not the proxy's failure)."""
    log.log(
        logging.WARNING if error.status >= 500 else logging.INFO,
        "answered %s %d %s: %r",
        dialect.name,
        error.status,
        error.kind,
        error.message[:300],
    )
    answer = dialect.error(error)
    return web.json_response(answer.body, status=answer.status, headers=answer.headers)


@dataclass(kw_only=True, frozen=True)
class _Call:
    """A model call once parsed and prepared, on its way to the engine and back."""

    http: web.Request
    dialect: Dialect
    state: ExecutionState
    recorder: ExecutionRecorder
    chat: ChatRequest
    prepared: PreparedCall  # the prompt, built from the execution's recorded calls


@dataclass(frozen=True)
class _Earlier:
    """What a body's messages were made into, for the next body that repeats them."""

    known: KnownMessages  # converted and normalised
    lead: tuple[Message, ...]  # the messages before them (Anthropic's system)
    parent: int | None  # the recorded call that body's request extended


def _parse(
    dialect: Dialect, body: bytes, headers: Mapping[str, str], bodies: BodyMemo
) -> tuple[ChatRequest, SplitBody | None, Reuse | None]:
    """Parse a call's body, converting only the messages an earlier body of the same
    execution did not hold (:mod:`qwengyre.proxy.body`); (the request, the split to
    remember, what the recorder may reuse). Errors come from a whole parse, so their
    paths and messages never depend on what was remembered."""
    split = bodies.split(body, dialect.messages_key)
    earlier: _Earlier | None = split.known.state if split and split.known else None
    try:
        if split is not None and earlier is not None:
            try:
                chat = dialect.parse_doc(split.doc, headers, earlier.known)
            except ParseWhole:  # the new messages join the known ones: convert them all
                split, earlier = split_whole(body, dialect.messages_key), None
        if split is not None and earlier is None:
            chat = dialect.parse_doc(split.doc, headers, None)
    except ApiError:
        split = None  # reported by the whole parse below
    if split is None:
        return dialect.parse(body, headers), None, None
    if earlier is None:
        return chat, split, None
    same_lead = chat.messages[: chat.lead] == earlier.lead
    known = chat.lead + len(earlier.known.messages)
    return chat, split, Reuse(known, earlier.parent if same_lead else None)


def _prepare(
    dialect: Dialect, recorder: ExecutionRecorder, chat: ChatRequest, reuse: Reuse | None
) -> PreparedCall:
    try:
        return recorder.prepare(chat, reuse)
    except ContextTooLong as exc:
        raise dialect.context_too_long(exc.tokens, exc.limit) from None


def _token_logprobs(renderer: ChatRenderer, delta: TokenDelta) -> list[TokenLogprob]:
    tokens = renderer.tokenizer.convert_ids_to_tokens(list(delta.output_ids))
    return [TokenLogprob(str(t), lp) for t, lp in zip(tokens, delta.logprobs, strict=True)]
