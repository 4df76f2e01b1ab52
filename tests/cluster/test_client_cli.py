"""`fleetserve chat` / `complete` (cluster/client.py) against servers that misbehave: a
stream cut short, a stream ended by an error event, a server that never answers. Each is
one line on stderr and exit status 1, never a traceback. (Against the real server:
tests/router/test_chat_cli.py.)"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import pytest


def fake_server(chunks: list[bytes], close: bool = True):
    """Answers every request with an SSE response made of `chunks`, then closes (or hangs)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    hold = []

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            for data in chunks:
                conn.sendall(hex(len(data))[2:].encode() + b"\r\n" + data + b"\r\n")
            if close:
                conn.close()
            else:
                hold.append(conn)

    threading.Thread(target=serve, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.getsockname()[1]}/v1"


def run(url: str, *args: str):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "fleetserve.cluster.cli",
            "complete",
            "-q",
            "x",
            "--model-name",
            "m",
            "--url",
            url,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


PART = b'data: {"choices": [{"index": 0, "text": "part"}]}\n\n'


@pytest.mark.parametrize(
    "chunks, close, args, says",
    [
        ([PART], True, (), "the server closed the stream before it ended"),
        (
            [PART, b'data: {"error": {"message": "engine died", "code": 503}}\n\n'],
            True,
            (),
            "the server ended the reply with an error: engine died",
        ),
        ([PART, b"data: {not json\n\n"], True, (), "unreadable event in the stream: '{not json'"),
        ([PART], False, ("--timeout", "1"), "no reply for 1 s (--timeout); gave up"),
    ],
)
def test_a_broken_reply_is_one_line_and_status_1(chunks, close, args, says):
    srv, url = fake_server(chunks, close)
    try:
        out = run(url, *args)
    finally:
        srv.close()
    assert out.returncode == 1, out
    assert out.stdout == "part\n" and out.stderr == f"fleetserve complete: {says}\n", out
