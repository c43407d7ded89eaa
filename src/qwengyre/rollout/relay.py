"""The proxy relay: a sandboxed harness's only way out, and the holder of its key.

A harness in a sandbox with a private network (:mod:`qwengyre.rollout.sandbox`) sees one
service: its execution's proxy, at ``http://127.0.0.1:SANDBOX_PORT/x/<id>``
(:func:`inside_base_url`). Inside the sandbox :mod:`qwengyre.rollout.netns_relay`
carries those bytes to a Unix socket bound in from here; on this side, trusted, a
:class:`ProxyRelay` serves that socket and forwards each HTTP request to the real
proxy's base URL with the execution's real key, replacing whatever credential the
harness sent. So the harness is given only :data:`PLACEHOLDER_KEY` (clients insist on
some key), no sandboxed process holds a real key, and a key stolen from elsewhere is
overwritten on the way out: a call can only ever be its own execution's.

Answers stream back as the proxy produces them (SSE chunk by chunk). A proxy that cannot
be reached answers 502 in the Anthropic error shape, which clients retry.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

__all__ = [
    "PLACEHOLDER_KEY",
    "SANDBOX_PORT",
    "SANDBOX_SOCKET",
    "ProxyRelay",
    "RelayTarget",
    "inside_base_url",
    "new_socket_path",
    "relay",
]

#: The port the in-sandbox relay listens on (each sandbox has a network of its own).
SANDBOX_PORT = 47011
#: Where the relay's Unix socket appears inside the sandbox.
SANDBOX_SOCKET = Path("/run/qwengyre/proxy.sock")
#: The key a sandboxed harness is given; the relay puts the real one in its place.
PLACEHOLDER_KEY = "qwengyre-sandboxed-the-relay-adds-the-key"

# Hop-by-hop headers (RFC 9110 7.6.1), ones aiohttp sets itself, and the credentials.
_DROP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "authorization",
        "x-api-key",
        "api-key",
    }
)


def inside_base_url(base_url: str) -> str:
    """The base URL a sandboxed harness is given for the proxy's ``base_url``: the same
    path on the in-sandbox relay."""
    return f"http://127.0.0.1:{SANDBOX_PORT}{urlsplit(base_url).path}"


class ProxyRelay:
    """Serves one execution's relay socket: every request goes to the origin of
    ``base_url`` (the proxy) with ``api_key`` as its only credential."""

    def __init__(self, base_url: str, api_key: str, socket_path: Path) -> None:
        parts = urlsplit(base_url)
        self.origin = f"{parts.scheme}://{parts.netloc}"
        self.api_key = api_key
        self.socket_path = socket_path
        self._runner: web.AppRunner | None = None
        self._client: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Listen on :attr:`socket_path` (only this user may connect to it)."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
        # bodies pass as they are: no decompression on the way
        self._client = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)
        app = web.Application(client_max_size=1024**3)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        # A harness that hangs up cancels its forward, so the proxy sees the hang-up too
        # (and does not count an answer nobody received as delivered).
        self._runner = web.AppRunner(
            app, access_log=None, handle_signals=False, handler_cancellation=True
        )
        await self._runner.setup()
        await web.UnixSite(self._runner, str(self.socket_path)).start()
        self.socket_path.chmod(0o600)

    async def stop(self) -> None:
        """Stop listening; requests in flight are cut."""
        if self._runner is not None:
            await self._runner.cleanup()
        if self._client is not None:
            await self._client.close()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._client is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP}
        headers["x-api-key"] = self.api_key
        headers["authorization"] = f"Bearer {self.api_key}"
        body = await request.read()
        try:
            upstream = await self._client.request(
                request.method,
                self.origin + request.raw_path,
                headers=headers,
                data=body or None,
                allow_redirects=False,
            )
        except aiohttp.ClientError as exc:
            return web.json_response(
                {
                    "type": "error",
                    "error": {"type": "api_error", "message": f"proxy unreachable: {exc}"},
                },
                status=502,
            )
        async with upstream:
            answer = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for name, value in upstream.headers.items():
                if name.lower() not in _DROP:
                    answer.headers.add(name, value)
            with contextlib.suppress(ConnectionResetError):  # the harness hung up (or died)
                await answer.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await answer.write(chunk)
                await answer.write_eof()
            return answer


@dataclass(kw_only=True, frozen=True)
class RelayTarget:
    """One execution's relay: its socket, the proxy's ``base_url`` and the execution's
    real ``api_key`` (it travels to whoever serves the relay, never to disk)."""

    base_url: str
    api_key: str
    socket: Path

    def to_json(self) -> dict[str, Any]:
        return {"base_url": self.base_url, "api_key": self.api_key, "socket": str(self.socket)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RelayTarget:
        return cls(
            base_url=str(data["base_url"]),
            api_key=str(data["api_key"]),
            socket=Path(data["socket"]),
        )


def new_socket_path() -> Path:
    """A fresh relay socket's path, short enough for a Unix socket (107 bytes), in a
    directory :func:`relay` makes (only this user may enter it) and removes."""
    return Path(tempfile.gettempdir()) / f"qwengyre-relay-{uuid.uuid4().hex[:16]}" / "proxy.sock"


@contextlib.asynccontextmanager
async def relay(target: RelayTarget) -> AsyncIterator[Path]:
    """A :class:`ProxyRelay` for ``target`` while the block runs; yields its socket."""
    target.socket.parent.mkdir(mode=0o700)
    server = ProxyRelay(target.base_url, target.api_key, target.socket)
    try:
        await server.start()
        yield server.socket_path
    finally:
        await server.stop()
        shutil.rmtree(target.socket.parent, ignore_errors=True)
