"""The in-sandbox half of the proxy relay: the first program of a sandbox whose network
is its own (:mod:`qwengyre.rollout.relay` is the outside half).

``python netns_relay.py --listen 127.0.0.1:PORT --to SOCKET -- HARNESS ARGV...`` listens
on ``PORT`` of the sandbox's loopback, carries every connection's bytes both ways to the
Unix socket ``SOCKET`` (bound in from outside), runs the harness as its child and exits
with its status (128 + N when signal N killed it). A SIGTERM is passed on to the harness,
and the relay keeps carrying bytes until the harness has exited.

It runs by its file path with ``python -I`` and imports nothing but the standard
library, so it works whatever the sandbox can import.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        writer.close()


async def _carry(socket: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One connection: its bytes to ``socket`` and back, until both sides are done."""
    try:
        upstream_reader, upstream_writer = await asyncio.open_unix_connection(socket)
    except OSError:
        writer.close()
        return
    await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))
    for w in (writer, upstream_writer):
        w.close()


async def run(listen: str, socket: str, argv: list[str]) -> int:
    """Relay while the harness ``argv`` runs; its exit status."""
    host, _, port = listen.rpartition(":")
    server = await asyncio.start_server(
        lambda r, w: _carry(socket, r, w), host=host, port=int(port)
    )
    try:
        harness = await asyncio.create_subprocess_exec(*argv)
    except OSError as exc:
        print(f"qwengyre sandbox: cannot run {argv[0]!r}: {exc}", file=sys.stderr)
        return 127
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, lambda: harness.send_signal(signal.SIGTERM))
    code = await harness.wait()
    server.close()
    return code if code >= 0 else 128 - code


def main(args: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT inside the sandbox")
    parser.add_argument("--to", required=True, help="the Unix socket of the outside relay")
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="-- the harness command")
    parsed = parser.parse_args(args)
    argv = parsed.argv[1:] if parsed.argv[:1] == ["--"] else parsed.argv
    if not argv:
        parser.error("no harness command after --")
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(run(parsed.listen, parsed.to, argv))
    return 130


if __name__ == "__main__":
    sys.exit(main())
