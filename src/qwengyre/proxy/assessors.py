"""Intermediate assessments on a harness's request: ``POST /x/{id}/assess``.

A runner registers, per execution, a callback that assesses the execution's workspace
now (:meth:`Assessors.register`); the harness that presents the execution's own key asks
for it, and the answer is the callback's JSON object (``score``, ``valid``,
``critique``, ``artifact_version``, ``digest``, ...). Another execution's key is a
``permission_error`` (403); an unknown execution, or one with no callback (its harness is
not running), a ``not_found_error`` (404), as is a callback's ``LookupError`` (it cannot
assess now: its message).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from qwengyre.proxy.incoming import presented_key
from qwengyre.proxy.residency import Residency
from qwengyre.proxy.store import DamagedRecord
from qwengyre.proxy.types import ApiError

Assessor = Callable[[int | None], Awaitable[Mapping[str, Any]]]
"""An execution's intermediate-assessment callback: the branch reference (the id of its
latest recorded call, None before any) -> a JSON-ready answer; raises ``LookupError``
when it cannot assess now."""


class Assessors:
    """The executions' assessment callbacks and the route that calls them."""

    def __init__(self, residency: Residency) -> None:
        self.residency = residency
        self._callbacks: dict[str, Assessor] = {}

    def register(self, execution_id: str, assessor: Assessor) -> None:
        """Serve the execution's assessments with ``assessor`` (replacing one)."""
        self._callbacks[execution_id] = assessor

    def unregister(self, execution_id: str) -> None:
        """Stop serving the execution's assessments (404 from now on)."""
        self._callbacks.pop(execution_id, None)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_route("POST", "/x/{execution_id}/assess", self._assess)

    async def _assess(self, http: web.Request) -> web.Response:
        """An intermediate assessment for the harness that presents the execution's key."""
        owner = self.residency.holder(presented_key(http.headers))
        if owner is None:
            raise ApiError("authentication_error", "invalid x-api-key or bearer token")
        state = self.residency.named(http.match_info["execution_id"])
        if state.id != owner.id:
            raise ApiError(
                "permission_error",
                f"this key belongs to another execution; it cannot assess {state.id}",
            )
        assessor = self._callbacks.get(state.id)
        if assessor is None:
            raise ApiError(
                "not_found_error",
                f"execution {state.id} has no evaluator to ask now (its harness is not "
                "running under a runner that assesses it)",
            )
        try:  # the branch reference: the execution's latest recorded call
            nodes = (await self.residency.tree(state.id)).nodes
            branch = nodes[-1].id if nodes else None
        except DamagedRecord:
            branch = None
        try:
            answer = await assessor(branch)
        except LookupError as exc:
            raise ApiError("not_found_error", f"no assessment of {state.id} now: {exc}") from None
        return web.json_response(dict(answer))
