"""SIGTERM to `fleetserve serve` while streams run (issue 15): the server stops, but only
after every in-flight stream finished in full (graceful_shutdown_timeout_s, here longer than
the streams; Serve's default of 5 s used to cut them), and then it exits cleanly."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

MAX_TOKENS = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stream(port: int, i: int, progress: dict) -> dict:
    text_chunks, last = 0, None
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=300,
                      json={"prompt": f"story {i}", "max_tokens": MAX_TOKENS, "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            last = line[6:]
            if last == "[DONE]":
                break
            data = json.loads(last)
            assert "error" not in data, data
            if data.get("usage"):
                return {"usage": data["usage"], "done": False, "chunks": text_chunks}
            text_chunks += 1
            progress[i] = text_chunks
    return {"usage": None, "done": last == "[DONE]", "chunks": text_chunks}


@pytest.mark.slow
def test_sigterm_drains_streams_then_exits(tmp_path):
    from fleetserve.replica.testing import make_tiny_llama

    model = make_tiny_llama(tmp_path / "tiny")
    port, grpc_port = free_port(), free_port()
    (tmp_path / "app.yaml").write_text(
        "reliability: {graceful_shutdown_timeout_s: 120, graceful_shutdown_wait_loop_s: 0.5}\n")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    cmd = [sys.executable, "-m", "fleetserve.cluster.cli", "serve", "--model", str(model),
           "--config", str(tmp_path / "app.yaml"), "--port", str(port), "--grpc-port", str(grpc_port),
           "--num-replicas", "1", "--num-threads", "1", "--num-gpu-blocks-override", "256",
           "--num-cpus-per-replica", "0"]
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 240
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(1)
        progress: dict[int, int] = {}
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(_stream, port, i, progress) for i in range(4)]
            while min(progress.get(i, 0) for i in range(4)) < 3:
                time.sleep(0.05)
            sent_at = time.monotonic()
            os.kill(proc.pid, signal.SIGTERM)
            results = [f.result(timeout=300) for f in futures]
        for r in results:
            assert r["usage"] and r["usage"]["completion_tokens"] == MAX_TOKENS, r
        proc.wait(timeout=180)
        assert proc.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]
        print(f"exited {time.monotonic() - sent_at:.1f} s after SIGTERM")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
