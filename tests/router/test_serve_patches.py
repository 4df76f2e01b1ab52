"""router/serve_patches.py: the direct-ingress HTTP socket binds over TIME-WAIT (a restart
right after a stop), never over a live listener; gRPC binds the configured host."""

from __future__ import annotations

import errno
import socket

import pytest

from fleetserve.router import serve_patches
from tests.cluster.serve_process import leave_time_wait


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_http_socket_binds_over_time_wait_but_not_over_a_listener():
    from ray.serve._private import http_util

    port = free_port()
    leave_time_wait(port)
    with socket.socket() as plain, pytest.raises(OSError) as err:
        plain.bind(("127.0.0.1", port))  # what Ray Serve 2.60 did: the restart failed
    assert err.value.errno == errno.EADDRINUSE
    serve_patches.apply(None)
    with http_util.socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
        with http_util.socket.socket(socket.AF_INET, socket.SOCK_STREAM) as second:
            with pytest.raises(OSError):
                second.bind(("127.0.0.1", port))  # a live server keeps its port


@pytest.mark.parametrize(
    "host,expected",
    [
        ("127.0.0.1", "127.0.0.1:9000"),
        ("0.0.0.0", "0.0.0.0:9000"),
        ("::", "[::]:9000"),
        ("::1", "[::1]:9000"),
        ("localhost", "localhost:9000"),
    ],
)
def test_grpc_address_takes_the_configured_host(host, expected):
    assert serve_patches._grpc_address(host, "[::]:9000") == expected
    assert serve_patches._grpc_address(host, "10.0.0.1:9000") == "10.0.0.1:9000"


def test_a_replacement_waits_for_its_pinned_port_to_be_released(monkeypatch):
    """An ingress that replaces one still draining waits until the old listener is gone
    (then Serve's bind succeeds and the port is never blocked), within its deadline."""
    import threading
    import time

    port = free_port()
    monkeypatch.setenv("RAY_SERVE_ENABLE_DIRECT_INGRESS", "1")
    monkeypatch.setenv("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", str(port))
    monkeypatch.setenv("RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT", str(port + 1))
    monkeypatch.delenv("RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT", raising=False)
    assert serve_patches.pinned_ports() == []  # not in a Serve replica: nothing to bind
    monkeypatch.setattr(serve_patches, "_in_serve_replica", lambda: True)
    assert serve_patches.pinned_ports() == [port]
    old = socket.socket()
    old.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    old.bind(("127.0.0.1", port))
    old.listen()
    started = time.monotonic()
    threading.Timer(1.0, old.close).start()  # the old ingress stops after a second
    assert serve_patches.wait_for_pinned_ports("127.0.0.1", timeout_s=30, poll_s=0.05)
    assert 0.9 <= time.monotonic() - started < 10
    with socket.socket() as new:  # what Serve's bind then does
        new.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        new.bind(("127.0.0.1", port))
    # A listener that never goes: the wait ends at its deadline and says so.
    with socket.socket() as stuck:
        stuck.bind(("127.0.0.1", port))
        stuck.listen()
        started = time.monotonic()
        assert not serve_patches.wait_for_pinned_ports("127.0.0.1", timeout_s=0.5, poll_s=0.05)
        assert time.monotonic() - started < 5
    monkeypatch.setenv("RAY_SERVE_ENABLE_DIRECT_INGRESS", "0")
    assert serve_patches.pinned_ports() == []
