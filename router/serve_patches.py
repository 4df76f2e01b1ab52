"""Three fixes to how Ray Serve 2.60's direct ingress binds its servers, applied in the
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

3. A replacement waits for its port. When Serve replaces an ingress that failed its
   health checks, it starts the new replica while the old one still listens (it is
   given `graceful_shutdown_timeout_s` to drain); the new one's bind fails, Serve
   blocks that port for good, and with a one-port range no ingress can ever start
   again ("No available ports on node ... for HTTP"). `wait_for_pinned_ports`, called
   from the ingress constructor, waits (with a deadline) until no live listener holds
   a pinned port, so the first bind succeeds.

1 and 2 replace a module attribute Serve looks up at call time; nothing else changes.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Optional

logger = logging.getLogger("ray.serve")

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
    # Serve's internals on purpose: Ray 2.60 has no public option for either fix.
    from ray.serve._private import default_impl, http_util

    if not isinstance(http_util.socket, _ReuseAddrSockets):
        # a stand-in for the module, answering every other name from it
        http_util.socket = _ReuseAddrSockets()  # type: ignore[assignment]
    if bind_host is None or _applied_host is not None:
        return
    original = default_impl.add_grpc_address
    default_impl.add_grpc_address = lambda grpc_server, server_address: original(
        grpc_server, _grpc_address(bind_host, server_address)
    )
    _applied_host = bind_host


def pinned_ports() -> list[int]:
    """The direct-ingress ports pinned to one value each (cluster/deploy.py pins the
    configured HTTP and gRPC ports: a range of exactly one port), when this process is a
    Serve replica that will bind them; none otherwise (an Ingress built outside Serve, as
    the unit tests do, binds nothing and must not wait for the live server's ports)."""
    if os.environ.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") != "1" or not _in_serve_replica():
        return []
    ports = []
    for proto in ("HTTP", "GRPC"):
        low = os.environ.get(f"RAY_SERVE_DIRECT_INGRESS_MIN_{proto}_PORT", "")
        high = os.environ.get(f"RAY_SERVE_DIRECT_INGRESS_MAX_{proto}_PORT", "")
        if low.isdigit() and high.isdigit() and int(high) - int(low) == 1:
            ports.append(int(low))
    return ports


def _in_serve_replica() -> bool:
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        serve.get_replica_context()
    except RayServeException:
        return False
    return True


def _listened(host: str, port: int) -> bool:
    """Whether a live listener holds `port` (a bind as Serve's, with SO_REUSEADDR, fails)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def wait_for_pinned_ports(
    host: Optional[str], timeout_s: float, ports: Optional[list[int]] = None, poll_s: float = 0.25
) -> bool:
    """Block until no live listener holds any of `ports` (default: `pinned_ports()`) on
    `host`, or `timeout_s` passed (then log which, and let Serve's bind report it). True
    when every port is free."""
    ports = pinned_ports() if ports is None else ports
    host = host or "0.0.0.0"
    deadline = time.monotonic() + timeout_s
    waited = False
    for port in ports:
        while _listened(host, port):
            if time.monotonic() >= deadline:
                logger.warning(
                    "ingress: port %s:%d is still held by another listener after %.0f s "
                    "(the ingress this one replaces?); starting anyway",
                    host,
                    port,
                    timeout_s,
                )
                return False
            if not waited:
                logger.info(
                    "ingress: waiting for %s:%d to be released (the ingress this one replaces is still stopping)",
                    host,
                    port,
                )
                waited = True
            time.sleep(poll_s)
    return True
