"""What an HTTP request presents to the proxy: its credentials and its decoded body."""

from __future__ import annotations

import zlib
from collections.abc import Mapping

from aiohttp import web

from qwengyre.proxy.types import ApiError

_ENCODINGS = frozenset({"identity", "gzip", "x-gzip", "deflate"})


def bearer(authorization: str) -> str:
    """The token of an ``Authorization: Bearer <token>`` value (the scheme in any case);
    empty for any other scheme."""
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def presented_key(headers: Mapping[str, str]) -> str:
    """The API key a harness presents: ``x-api-key``, else ``Authorization: Bearer``;
    empty if none."""
    key = headers.get("x-api-key", "").strip()
    return key or bearer(headers.get("authorization", ""))


async def read_body(http: web.Request, max_bytes: int) -> bytes:
    """The request body, decoded from its ``Content-Encoding``: none, ``identity``,
    ``gzip`` or ``deflate`` (the zlib format, as HTTP defines it). More than
    ``max_bytes``, sent or decoded, is a ``request_too_large`` (413); another encoding,
    or a body that does not decode from its encoding, an ``invalid_request_error``
    (400)."""
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
        raise _too_large(max_bytes) from None
    if encoding == "identity":
        return sent
    decoder = zlib.decompressobj(zlib.MAX_WBITS | 32)  # a zlib or gzip header
    try:
        body = decoder.decompress(sent, max_bytes + 1)
    except zlib.error as exc:
        raise ApiError(
            "invalid_request_error",
            f"the request body is not valid {encoding} data ({exc})",
        ) from None
    if len(body) > max_bytes:
        raise _too_large(max_bytes)
    if not decoder.eof or decoder.unused_data:
        raise ApiError(
            "invalid_request_error",
            f"the request body is not valid {encoding} data (truncated, or followed "
            "by other bytes)",
        )
    return body


def _too_large(max_bytes: int) -> ApiError:
    return ApiError("request_too_large", f"request body exceeds the maximum of {max_bytes} bytes")
