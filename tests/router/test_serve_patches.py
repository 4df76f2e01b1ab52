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


@pytest.mark.parametrize("host,expected", [("127.0.0.1", "127.0.0.1:9000"), ("0.0.0.0", "0.0.0.0:9000"),
                                           ("::", "[::]:9000"), ("::1", "[::1]:9000"),
                                           ("localhost", "localhost:9000")])
def test_grpc_address_takes_the_configured_host(host, expected):
    assert serve_patches._grpc_address(host, "[::]:9000") == expected
    assert serve_patches._grpc_address(host, "10.0.0.1:9000") == "10.0.0.1:9000"
