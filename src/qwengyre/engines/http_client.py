"""What the clients of server engines share (SGLang's, vLLM's): one aiohttp session
carrying the bearer key, the requests in flight, background aborts, and the same
errors for the router: HTTP 4xx raises ``ValueError`` with the server's message (a
bad request, not an engine failure); HTTP 5xx and a connection that cannot be made or
is lost raise an ``OSError`` (``ConnectionError`` wrapping aiohttp's errors that are
not already one), on which the router drains the engine and reroutes.

It imports only the standard library and aiohttp: the vLLM client is imported inside
vLLM's own environment too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Mapping
from typing import Any, ClassVar, Self

import aiohttp

__all__ = ["HTTPEngineClient", "error_message", "sse_data"]


def error_message(status: int, text: str) -> str:
    """The message of a server's error answer, whatever of its shapes it has.

    ``{"error": {"message": ...}}``, ``{"error": "..."}``, ``{"object": "error",
    "message": ...}``, ``{"message": ...}``, ``{"detail": ...}`` (plain FastAPI) or a
    plain-text body.
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


async def sse_data(content: aiohttp.StreamReader) -> AsyncGenerator[str, None]:
    """The ``data:`` payloads of a server-sent event stream, however long a line is
    (cumulative chunks outgrow aiohttp's line buffer)."""
    buffer = b""
    async for block in content.iter_any():
        *lines, buffer = (buffer + block).split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip().decode()


class HTTPEngineClient:
    """The plumbing of one server engine's client; see the module docstring."""

    server: ClassVar[str] = "server"  # the server's kind, in messages
    force_close: ClassVar[bool] = False  # a new connection per request

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

    @property
    def load(self) -> int:
        return len(self._inflight)

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
            self._session = aiohttp.ClientSession(
                # No pool limit (aiohttp's default is 100): a stream holds its connection
                # to the end, and the proxy runs up to `capacity` of them besides short
                # calls; a cap below that would stall the short calls behind the streams.
                connector=aiohttp.TCPConnector(force_close=self.force_close, limit=0),
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            )
        return self._session

    async def close(self) -> None:
        for task in list(self._background):
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _lost(self, exc: Exception) -> ConnectionError:
        return ConnectionError(f"{self.server} {self.name} at {self.base_url}: {exc!r}")

    def _raise_for_status(self, path: str, status: int, text: str) -> None:
        if 400 <= status < 500:
            raise ValueError(f"{self.server} {path} ({status}): {error_message(status, text)}")
        if status >= 500:
            raise ConnectionError(
                f"{self.server} {self.name} {path} ({status}): {error_message(status, text)}"
            )

    async def _call(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        params: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> tuple[int, str]:
        """(status, body text); raises as the module docstring says."""
        timeout = aiohttp.ClientTimeout(
            total=timeout_s if timeout_s is not None else self.timeout_s
        )
        try:
            async with self._get_session().request(
                method, f"{self.base_url}{path}", json=body, params=params, timeout=timeout
            ) as resp:
                text = await resp.text()
                status = resp.status
        except OSError:
            raise  # includes aiohttp.ClientOSError / ClientConnectorError / timeouts
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            raise self._lost(exc) from exc
        self._raise_for_status(path, status, text)
        return status, text

    async def health(self) -> bool:
        """``GET /health``: True on 200; False while released (the server cannot serve
        then: SGLang's check generates a token), on another answer, a timeout or a lost
        connection. Raises ``ConnectionRefusedError`` when no connection can be made:
        nothing listens at ``base_url`` (the server is gone, or not started yet)."""
        if self.released:
            return False
        try:
            status, _ = await self._call("GET", "/health", timeout_s=30)
        except aiohttp.ClientConnectorError as exc:
            raise ConnectionRefusedError(
                f"{self.server} {self.name}: nothing answers at {self.base_url} ({exc})"
            ) from exc
        except (OSError, ValueError):
            return False
        return status == 200

    async def _json(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        params: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """The JSON answer (None if empty) of :meth:`_call`."""
        _, text = await self._call(method, path, body, params=params, timeout_s=timeout_s)
        try:
            return json.loads(text) if text else None
        except ValueError as exc:
            answer = f"{self.server} {path} answered non-JSON: {text[:200]!r}"
            raise ConnectionError(answer) from exc
