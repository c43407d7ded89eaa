"""The proxy's admin API: executions created, revoked and their trees read by whoever
holds the admin token (``Authorization: Bearer <admin token>``, the scheme in any case;
anything else is an ``authentication_error``, 401).

- ``POST /admin/executions``: a new execution (201: ``id``, ``key``, ``base_url``,
  ``openai_base_url``);
- ``DELETE /admin/executions/{id}``: its key stops working;
- ``GET /admin/executions/{id}/tree``: its trajectory tree.

An unknown execution is a ``not_found_error`` (404). Errors answer in Anthropic's shape
(the server's error middleware renders what these handlers raise).
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

from aiohttp import web

from qwengyre.proxy.incoming import bearer
from qwengyre.proxy.types import ApiError

if TYPE_CHECKING:
    from qwengyre.proxy.server import ProxyServer


class AdminApi:
    """The admin routes of ``proxy``, guarded by ``token`` (16 characters at least)."""

    def __init__(self, token: str, proxy: ProxyServer) -> None:
        if len(token) < 16:
            raise ValueError("the admin token must be at least 16 characters")
        self.token = token
        self.proxy = proxy

    def add_routes(self, app: web.Application) -> None:
        app.router.add_route("POST", "/admin/executions", self._create)
        app.router.add_route("DELETE", "/admin/executions/{execution_id}", self._delete)
        app.router.add_route("GET", "/admin/executions/{execution_id}/tree", self._tree)

    def _check(self, http: web.Request) -> None:
        given = bearer(http.headers.get("authorization", "")).encode("utf-8", "surrogatepass")
        if not secrets.compare_digest(given, self.token.encode()):
            raise ApiError(
                "authentication_error", "admin token required (Authorization: Bearer <token>)"
            )

    async def _create(self, http: web.Request) -> web.Response:
        self._check(http)
        return web.json_response(await self.proxy.create_execution(), status=201)

    async def _delete(self, http: web.Request) -> web.Response:
        self._check(http)
        state = self.proxy.residency.named(http.match_info["execution_id"])
        await self.proxy.revoke_execution(state.id)
        return web.json_response({"id": state.id, "revoked": True})

    async def _tree(self, http: web.Request) -> web.Response:
        self._check(http)
        state = self.proxy.residency.named(http.match_info["execution_id"])
        tree = await self.proxy.residency.tree(state.id)
        return web.json_response({"id": state.id, **tree.to_json()})
