"""Server-sent events as the proxy writes them: a named event, cutting text and event
bytes into pieces, and one response's writer with its keepalive pings."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from aiohttp import web

from qwengyre.proxy import jsonsafe


def named_event(name: str, data: Mapping[str, Any]) -> bytes:
    """One SSE event: ``event: name`` and ``data`` as one line of lossless JSON
    (:func:`~qwengyre.proxy.jsonsafe.dumps`)."""
    return b"event: " + name.encode() + b"\ndata: " + jsonsafe.dumps(data) + b"\n\n"


def pieces(text: str, size: int) -> Iterator[str]:
    """``text`` in consecutive pieces of ``size`` characters (the last may be shorter)."""
    for start in range(0, len(text), size):
        yield text[start : start + size]


def split_events(data: bytes) -> list[bytes]:
    """SSE events one by one (a data line never holds a blank line: JSON escapes it)."""
    return [event + b"\n\n" for event in data.split(b"\n\n")[:-1]]


class SseWriter:
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
