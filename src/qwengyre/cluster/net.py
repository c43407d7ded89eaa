"""Addresses and ports of the servers a run starts (engines, rendezvous)."""

from __future__ import annotations

import socket

__all__ = ["advertised", "free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (another process may take it before it is used)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def advertised(host: str) -> str:
    """The address to reach a server bound to ``host``: this node's own address for
    the wildcard (``0.0.0.0``, ``::``), else ``host`` itself (IPv6 in brackets)."""
    if host in ("0.0.0.0", "::", ""):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:  # no packet is sent: connecting a UDP socket only picks the route
                probe.connect(("10.255.255.255", 1))
                return str(probe.getsockname()[0])
            except OSError:
                return socket.gethostbyname(socket.gethostname())
    return f"[{host}]" if ":" in host else host
