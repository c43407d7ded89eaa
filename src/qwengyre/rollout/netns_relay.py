"""The in-sandbox half of the proxy relay: the first program of a sandbox whose network
is its own (:mod:`qwengyre.rollout.relay` is the outside half).

``python netns_relay.py --listen 127.0.0.1:PORT --to SOCKET -- HARNESS ARGV...`` listens
on ``PORT`` of the sandbox's loopback, carries every connection's bytes both ways to the
Unix socket ``SOCKET`` (bound in from outside), runs the harness as its child and exits
with its status (128 + N when signal N killed it). A SIGTERM is passed on to the harness,
and the relay keeps carrying bytes until the harness has exited.

It runs by its file path with ``python -I -S`` and imports only the standard library's
lightest modules (threads, not asyncio; no argparse, no subprocess): it starts in every
sandbox, so its start-up is on every execution's path.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading

USAGE = "usage: netns_relay.py --listen HOST:PORT --to UNIX_SOCKET -- HARNESS [ARG...]"


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    """Bytes from ``source`` to ``sink`` until ``source`` ends; then ``sink`` ends too."""
    try:
        while chunk := source.recv(65536):
            sink.sendall(chunk)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


def _carry(connection: socket.socket, path: str) -> None:
    """One connection: its bytes to the Unix socket ``path`` and back."""
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(path)
    except OSError:
        connection.close()
        upstream.close()
        return
    back = threading.Thread(target=_pipe, args=(upstream, connection), daemon=True)
    back.start()
    _pipe(connection, upstream)
    back.join()
    connection.close()
    upstream.close()


def _serve(listener: socket.socket, path: str) -> None:
    while True:
        connection, _ = listener.accept()
        # as asyncio does: no Nagle delay on an answer written in pieces
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_carry, args=(connection, path), daemon=True).start()


def _forward(children: list[int]) -> bool:
    """SIGTERM to the harness; False if it is not spawned yet. A harness already reaped
    needs none: a TERM sent to the whole group can end it, and ``waitpid`` reap it,
    before this handler runs."""
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGTERM)
    return bool(children)


def run(listen: str, path: str, argv: list[str]) -> int:
    """Relay while the harness ``argv`` runs; its exit status."""
    host, _, port = listen.rpartition(":")
    listener = socket.create_server((host, int(port)))  # connections wait in its backlog
    children: list[int] = []
    terms: list[int] = []  # a SIGTERM before the harness was spawned, passed on after

    def on_term(*_: object) -> None:
        if not _forward(children):
            terms.append(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
    try:
        children.append(os.posix_spawnp(argv[0], argv, os.environ))
    except OSError as exc:
        print(f"qwengyre sandbox: cannot run {argv[0]!r}: {exc}", file=sys.stderr)
        return 127
    if terms:
        _forward(children)
    threading.Thread(target=_serve, args=(listener, path), daemon=True).start()
    _, status = os.waitpid(children[0], 0)
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def main(args: list[str]) -> int:
    if len(args) < 6 or args[0] != "--listen" or args[2] != "--to" or args[4] != "--":
        print(USAGE, file=sys.stderr)
        return 2
    return run(args[1], args[3], args[5:])


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)  # threads carrying bytes of a harness that has ended end with it
