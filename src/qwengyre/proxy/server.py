"""The proxy's HTTP server (aiohttp): both APIs, per-execution credentials, the admin API.

Routes (also under a base-URL prefix ``/x/{execution_id}``, which some harnesses need
because they cannot send custom headers):

- Anthropic: ``POST /v1/messages`` (``?beta=true`` too), ``POST /v1/messages/count_tokens``
- OpenAI: ``POST /v1/chat/completions``
- both: ``GET /v1/models``, ``HEAD /``
- admin (``Authorization: Bearer <admin token>``): ``POST /admin/executions``,
  ``DELETE /admin/executions/{id}``, ``GET /admin/executions/{id}/tree``

A call runs: authenticate (unknown or revoked key: 401, nothing recorded) -> parse ->
:meth:`ExecutionRecorder.prepare` -> engine through the :class:`Router` (reroutes are
retried inside) -> :meth:`ExecutionRecorder.record` -> durable commit -> answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from aiohttp import web

from qwengyre.engines.base import GenerateRequest
from qwengyre.proxy import anthropic_api, openai_api
from qwengyre.proxy.render import ChatRenderer
from qwengyre.proxy.routing import NoEngineAvailable, Router
from qwengyre.proxy.store import ProxyStore, hash_key
from qwengyre.proxy.tito import ContextTooLong, ExecutionRecorder, new_id
from qwengyre.proxy.types import ApiError, ChatRequest, Completion
from qwengyre.types import SamplingParams

log = logging.getLogger(__name__)
Api = Literal["anthropic", "openai"]
_EXECUTION_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class ExecutionState:
    id: str
    key_hash: str
    recorder: ExecutionRecorder
    revoked: bool = False


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
        temperature: float | None = None,
    ) -> None:
        """``temperature``: if set, every call samples at it whatever the harness asks
        (training: the trainer computes its log-probs at the rollout temperature)."""
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
        self.executions: dict[str, ExecutionState] = {}
        self._by_key: dict[str, str] = {}
        self.base_url = ""
        self._restore()

    def _restore(self) -> None:
        """Rebuild every execution, tree and tool-call cache from the store."""
        for stored in self.store.load():
            state = self._new_state(stored.id, stored.key_hash)
            state.revoked = stored.revoked
            for node, turn in stored.calls:
                tree = state.recorder.tree
                tree.add(
                    node.parent,
                    node.input_ids,
                    node.output_ids,
                    node.logprobs,
                    node.versions,
                    node.meta,
                )
                state.recorder.add_turn(turn)

    def _new_state(self, execution_id: str, key_hash: str) -> ExecutionState:
        state = ExecutionState(
            execution_id, key_hash, ExecutionRecorder(self.renderer, self.max_context)
        )
        self.executions[execution_id] = state
        self._by_key[key_hash] = execution_id
        return state

    # ------------------------------------------------------------ the app

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[_api_errors])
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
        app.router.add_route("GET", "/", self._root)
        app.router.add_route("POST", "/admin/executions", self._admin_create)
        app.router.add_route("DELETE", "/admin/executions/{execution_id}", self._admin_delete)
        app.router.add_route("GET", "/admin/executions/{execution_id}/tree", self._admin_tree)
        return app

    async def _root(self, request: web.Request) -> web.Response:
        return web.Response(text="qwengyre proxy\n")

    # ------------------------------------------------------------ credentials

    def _authenticate(self, request: web.Request) -> ExecutionState:
        key = request.headers.get("x-api-key", "")
        bearer = request.headers.get("authorization", "")
        if not key and bearer.lower().startswith("bearer "):
            key = bearer[7:].strip()
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
            if api == "anthropic":
                chat = anthropic_api.parse_messages_request(body, http.headers)
            else:
                chat = openai_api.parse_chat_request(body, http.headers)
            completion = await self._complete(state, chat)
        except ApiError as error:
            return _error_response(api, error)
        return await self._answer(http, api, chat, completion)

    async def _body(self, http: web.Request) -> bytes:
        try:
            return await http.read()
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(
                "request_too_large",
                f"request body exceeds the maximum of {self.max_body_bytes} bytes",
            ) from None

    async def _complete(self, state: ExecutionState, chat: ChatRequest) -> Completion:
        recorder = state.recorder
        try:
            call = recorder.prepare(chat)
        except ContextTooLong as exc:
            if chat.api == "anthropic":
                raise anthropic_api.prompt_too_long(exc.tokens, exc.limit) from None
            raise openai_api.context_length_exceeded(exc.tokens, exc.limit) from None
        room = self.max_context - len(call.prompt_ids)
        sampling = SamplingParams(
            max_tokens=min(chat.sampling.max_tokens, room),
            temperature=(
                chat.sampling.temperature if self.temperature is None else self.temperature
            ),
            top_p=chat.sampling.top_p,
            top_k=chat.sampling.top_k,
            stop=chat.sampling.stop,
        )
        request = GenerateRequest(
            new_id("req_", 12),
            call.prompt_ids,
            sampling,
            {"execution": state.id, "class": call.request_class.name},
        )
        started = time.time()
        try:
            engine, result = await self.router.generate(state.id, request)
        except NoEngineAvailable as exc:
            raise ApiError("overloaded_error", str(exc), retry_after_s=1.0) from None
        node, completion = recorder.record(
            call,
            result,
            api=chat.api,
            model=chat.model or self.model,
            engine=engine,
            started_s=started,
            finished_s=time.time(),
        )
        await asyncio.to_thread(self.store.add_call, state.id, node, recorder.turns[node.id])
        return completion

    async def _answer(
        self, http: web.Request, api: Api, chat: ChatRequest, completion: Completion
    ) -> web.StreamResponse:
        created = int(time.time())
        if not chat.stream:
            if api == "anthropic":
                return web.json_response(anthropic_api.message_body(completion))
            return web.json_response(
                openai_api.completion_body(completion, created, logprobs=chat.logprobs)
            )
        chunks: Iterator[bytes]
        if api == "anthropic":
            chunks = anthropic_api.stream_events(completion)
        else:
            chunks = openai_api.stream_chunks(
                completion, created, logprobs=chat.logprobs, include_usage=chat.include_usage
            )
        response = web.StreamResponse(
            headers={"content-type": "text/event-stream", "cache-control": "no-cache"}
        )
        await response.prepare(http)
        for chunk in chunks:
            await response.write(chunk)
        await response.write_eof()
        return response

    async def _anthropic_count_tokens(self, http: web.Request) -> web.Response:
        try:
            state = self._authenticate(http)
            chat = anthropic_api.parse_count_tokens_request(await self._body(http), http.headers)
            count = state.recorder.count_tokens(chat)
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

    # ------------------------------------------------------------ admin

    def _admin(self, http: web.Request) -> None:
        given = http.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {self.admin_token}".encode()):
            raise web.HTTPUnauthorized(
                text=json.dumps({"error": "admin token required (Authorization: Bearer T)"}),
                content_type="application/json",
            )

    def _execution(self, http: web.Request) -> ExecutionState:
        execution_id = http.match_info["execution_id"]
        state = self.executions.get(execution_id) if _EXECUTION_ID.match(execution_id) else None
        if state is None:
            raise web.HTTPNotFound(
                text=json.dumps({"error": f"no execution {execution_id[:64]!r}"}),
                content_type="application/json",
            )
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
        return web.json_response({"id": state.id, **state.recorder.tree.to_json()})


def _api_of(path: str) -> Api:
    return "openai" if "/chat/" in path else "anthropic"


@web.middleware
async def _api_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Unknown routes and unexpected failures answer in the API's own error shape."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        error = ApiError("not_found_error", f"no route {request.method} {request.path[:200]}")
    except web.HTTPMethodNotAllowed:
        error = ApiError("not_found_error", f"{request.method} is not allowed on this route")
    except web.HTTPException:
        raise
    except Exception:
        log.exception("proxy failure on %s %s", request.method, request.path)
        error = ApiError("api_error", "internal proxy error; nothing was recorded for this call")
    return _error_response(_api_of(request.path), error)


def _error_response(api: Api, error: ApiError) -> web.Response:
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
