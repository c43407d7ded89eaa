"""Clients that hang up while an HTTP server (the proxy, an engine server) works for them."""

from __future__ import annotations

import asyncio

from aiohttp import web


class HangUps:
    """Notices clients whose connection closed while their request runs: aiohttp
    (without handler cancellation) does not tell a running handler. One task polls
    every watched request's transport, so the cost does not grow a task per request."""

    def __init__(self, period_s: float = 0.05) -> None:
        self.period_s = period_s
        self._watched: dict[asyncio.Future[None], web.Request] = {}
        self._task: asyncio.Task[None] | None = None

    def watch(self, http: web.Request) -> asyncio.Future[None]:
        """A future that completes when ``http``'s client has gone."""
        gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._watched[gone] = http
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())
        return gone

    def forget(self, gone: asyncio.Future[None]) -> None:
        self._watched.pop(gone, None)
        if not gone.done():
            gone.cancel()

    async def _run(self) -> None:
        while self._watched:
            await asyncio.sleep(self.period_s)
            for gone, http in list(self._watched.items()):
                transport = http.transport
                if transport is None or transport.is_closing():
                    del self._watched[gone]
                    gone.set_result(None)
