"""Two fixes to how Ray Serve 2.60's direct ingress binds its servers, applied in the
ingress replica's process (the servers start there, after the constructor runs).

1. SO_REUSEADDR on the HTTP socket. Serve binds the direct-ingress HTTP socket
   without it, so after a stop, while a connection to the old server sits in
   TIME-WAIT (60 s on Linux), the bind fails with EADDRINUSE; Serve then blocks
   the port and, the range holding exactly that one port, fails the replica with
   NoAvailablePortError: a restart right after a stop failed. SO_REUSEADDR is what
   uvicorn and most servers set: it allows a bind over TIME-WAIT sockets but never
   over a live listener (that would take SO_REUSEPORT, which stays off).
2. The gRPC host. Serve binds gRPC to `[::]` (every interface) whatever the HTTP
   host is; here it binds the configured host, so `--host` governs both servers.

Both replace a module attribute Serve looks up at call time; nothing else changes.
"""

from __future__ import annotations

import socket
from typing import Optional

_applied_host: Optional[str] = None


class _ReuseAddrSockets:
    """Stands in for the `socket` module inside ray.serve._private.http_util."""

    def __getattr__(self, name: str):
        return getattr(socket, name)

    @staticmethod
    def socket(*args, **kwargs) -> socket.socket:
        sock = socket.socket(*args, **kwargs)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        return sock


def _grpc_address(host: str, address: str) -> str:
    """`[::]:port` -> `host:port` (IPv6 hosts in brackets)."""
    if not address.startswith("[::]:"):
        return address
    port = address.rsplit(":", 1)[1]
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def apply(bind_host: Optional[str]) -> None:
    """Idempotent; `bind_host` None keeps Serve's gRPC address."""
    global _applied_host
    from ray.serve._private import default_impl, http_util

    if not isinstance(http_util.socket, _ReuseAddrSockets):
        http_util.socket = _ReuseAddrSockets()
    if bind_host is None or _applied_host is not None:
        return
    original = default_impl.add_grpc_address
    default_impl.add_grpc_address = lambda server, address: original(
        server, _grpc_address(bind_host, address))
    _applied_host = bind_host
