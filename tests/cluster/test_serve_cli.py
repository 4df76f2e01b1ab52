"""`fleetserve serve` as a user runs it: a subprocess on the real default model."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.router.conftest import free_port  # below the ephemeral range: Ray binds there


@pytest.mark.real_model
@pytest.mark.slow
def test_fleetserve_serve_chat_returns_english(tmp_path):
    pytest.importorskip("gguf")
    port, grpc_port = free_port(), free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    cmd = [
        sys.executable,
        "-c",
        "from fleetserve.cluster.cli import main; raise SystemExit(main())",
        "serve",
        "--port",
        str(port),
        "--grpc-port",
        str(grpc_port),
        "--num-replicas",
        "1",
        "--max-model-len",
        "1024",
        "--num-threads",
        "1",
    ]
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        else:
            pytest.fail("server did not come up:\n" + (tmp_path / "serve.log").read_text()[-3000:])
        # /health can turn green a moment before Serve's deploy call returns and the CLI
        # prints where to reach it: wait for the line (bounded), don't race it.
        url = f"http://127.0.0.1:{port}/v1"
        printed = time.time() + 30
        while url not in (tmp_path / "serve.log").read_text() and time.time() < printed:
            time.sleep(0.2)
        assert url in (tmp_path / "serve.log").read_text(), (tmp_path / "serve.log").read_text()[-3000:]
        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        r = client.chat.completions.create(
            model="smollm2-135m",
            max_tokens=24,
            temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
        text = r.choices[0].message.content
        words = re.findall(r"[A-Za-z]+", text)
        assert len(words) >= 3, text
        assert "Paris" in text or sum(w.lower() in {"the", "is", "of", "a", "capital"} for w in words) >= 1, text
    finally:
        os.kill(proc.pid, signal.SIGINT)  # Ctrl-C: the CLI shuts Serve and Ray down
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert proc.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]
