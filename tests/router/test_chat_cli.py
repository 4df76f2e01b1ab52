"""`fleetserve chat` / `fleetserve complete` (cluster/client.py) against the router suite's
server, run as a user runs them: a subprocess, stdin piped. Their streamed text equals what
the API answers to the same request (greedy); chat resends the conversation; a failed turn
is one line and the session goes on; Ctrl-C cancels a reply and the server aborts it."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import httpx

from tests.router.test_routing_e2e import aborted_requests


def run_cli(server, *args: str, stdin: str = "", key: bool = True, timeout: float = 120):
    env = {k: v for k, v in os.environ.items() if k not in ("FLEETSERVE_API_KEY", "OPENAI_API_KEY")}
    if key:
        env["FLEETSERVE_API_KEY"] = server.api_key
    return subprocess.run(
        [sys.executable, "-m", "fleetserve.cluster.cli", *args, "--url", server.base_url + "/v1"],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def api(server, path: str, **body) -> str:
    r = httpx.post(
        server.base_url + path,
        headers=server.headers(),
        timeout=120,
        json={"model": server.model, "temperature": 0, **body},
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def test_chat_streams_what_the_api_answers_and_resends_the_conversation(server):
    quick = run_cli(server, "chat", "-q", "hello there", "--temperature", "0", "--max-tokens", "12")
    assert quick.returncode == 0, quick.stderr
    one = [{"role": "user", "content": "hello there"}]
    assert quick.stdout == api(server, "/v1/chat/completions", messages=one, max_tokens=12) + "\n"

    system = {"role": "system", "content": "Be brief."}
    piped = run_cli(
        server,
        "chat",
        "--system-prompt",
        "Be brief.",
        "--temperature",
        "0",
        "--max-tokens",
        "10",
        stdin="first question\n\nsecond question\n",
    )
    assert piped.returncode == 0, piped.stderr
    turn1 = [system, {"role": "user", "content": "first question"}]
    reply1 = api(server, "/v1/chat/completions", messages=turn1, max_tokens=10)
    turn2 = turn1 + [{"role": "assistant", "content": reply1}, {"role": "user", "content": "second question"}]
    reply2 = api(server, "/v1/chat/completions", messages=turn2, max_tokens=10)
    assert piped.stdout == reply1 + "\n" + reply2 + "\n"  # (the blank line is no turn)
    server.wait_idle()


def test_thinking_goes_to_stderr_and_is_not_resent(server):
    """With the suite's --reasoning-parser qwen3, a regex (sent with --extra-body) makes the
    tiny model think first: the thinking streams to stderr, stdout holds the answer alone, and
    the next turn resends only the answer, as the chat API's message content."""
    regex = "<think>[a-z]{3,6}</think>[a-z]{3,6}"
    extra = f'{{"structured_outputs": {{"regex": "{regex}"}}}}'
    out = run_cli(
        server,
        "chat",
        "--extra-body",
        extra,
        "--temperature",
        "0",
        "--max-tokens",
        "40",
        stdin="Think, then answer.\nAgain.\n",
    )
    assert out.returncode == 0, out.stderr
    first = [{"role": "user", "content": "Think, then answer."}]
    body = {"max_tokens": 40, "temperature": 0, "structured_outputs": {"regex": regex}}
    r = httpx.post(
        server.base_url + "/v1/chat/completions",
        headers=server.headers(),
        timeout=120,
        json={"model": server.model, "messages": first, **body},
    ).json()["choices"][0]["message"]
    assert r["reasoning_content"] and r["content"]
    second = first + [{"role": "assistant", "content": r["content"]}, {"role": "user", "content": "Again."}]
    r2 = httpx.post(
        server.base_url + "/v1/chat/completions",
        headers=server.headers(),
        timeout=120,
        json={"model": server.model, "messages": second, **body},
    ).json()["choices"][0]["message"]
    assert out.stdout == r["content"] + "\n" + r2["content"] + "\n"
    assert out.stderr == r["reasoning_content"] + "\n" + r2["reasoning_content"] + "\n"
    bad = run_cli(server, "chat", "-q", "hi", "--extra-body", "[1]")
    assert bad.returncode == 2 and "--extra-body must be a JSON object" in bad.stderr, bad.stderr
    server.wait_idle()


def test_complete_sends_each_line_as_a_prompt(server):
    out = run_cli(
        server,
        "complete",
        "--temperature",
        "0",
        "--max-tokens",
        "7",
        "--model-name",
        server.model,
        stdin="The capital of France is\nOnce upon a time\n",
    )
    assert out.returncode == 0, out.stderr
    expected = [
        api(server, "/v1/completions", prompt=p, max_tokens=7) for p in ("The capital of France is", "Once upon a time")
    ]
    assert out.stdout == "".join(text + "\n" for text in expected)


def test_mistakes_are_one_line_and_the_server_still_serves(server):
    cases = [  # (args, stdin, key, exit code, what stderr says)
        (("chat", "-q", "hi"), "", False, 1, ["HTTP 401", "--api-key"]),
        (("chat", "-q", "hi", "--model-name", "no-such-model"), "", True, 1, ["HTTP 404", "no-such-model"]),
        (("chat", "-q", "hi", "--max-tokens", "100000"), "", True, 1, ["HTTP 400", "maximum context length"]),
        (("complete", "-q", "hi", "--temperature", "-1"), "", True, 1, ["HTTP 400", "temperature"]),
        (("chat", "-q", "hi", "--timeout", "0"), "", True, 2, ["--timeout must be positive"]),
    ]
    for args, stdin, key, code, says in cases:
        out = run_cli(server, *args, stdin=stdin, key=key)
        assert out.returncode == code, (args, out.returncode, out.stderr)
        assert all(s in out.stderr for s in says), (args, out.stderr)
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    gone = subprocess.run(
        [sys.executable, "-m", "fleetserve.cluster.cli", "chat", "-q", "hi", "--url", "http://127.0.0.1:9/v1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert gone.returncode == 1 and "cannot reach http://127.0.0.1:9/v1" in gone.stderr, gone.stderr
    bad_url = subprocess.run(
        [sys.executable, "-m", "fleetserve.cluster.cli", "complete", "--url", "localhost:8000"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad_url.returncode == 2 and "--url must start with http://" in bad_url.stderr, bad_url.stderr

    # A turn the server refuses (longer than the context) is reported and forgotten: the
    # next turn's conversation does not carry it, and the session ends with status 1.
    out = run_cli(server, "chat", "--temperature", "0", "--max-tokens", "8", stdin="word " * 3000 + "\nhello\n")
    assert out.returncode == 1, out.stderr
    assert "HTTP 400" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert (
        out.stdout
        == api(server, "/v1/chat/completions", max_tokens=8, messages=[{"role": "user", "content": "hello"}]) + "\n"
    )
    server.wait_idle()


def test_ctrl_c_cancels_the_reply_and_the_server_aborts_it(server):
    prompt = "Once upon a time"
    r = httpx.post(
        server.base_url + "/v1/completions",
        headers=server.headers(),
        timeout=120,
        json={"model": server.model, "prompt": prompt, "temperature": 0, "max_tokens": 1500},
    )
    assert r.json()["choices"][0]["finish_reason"] == "length", r.json()  # a long greedy reply
    aborted = aborted_requests(server)
    env = {**os.environ, "FLEETSERVE_API_KEY": server.api_key}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fleetserve.cluster.cli",
            "complete",
            "--temperature",
            "0",
            "--max-tokens",
            "1500",
            "--url",
            server.base_url + "/v1",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        # Ctrl-C as in a terminal, even when this run started with SIGINT ignored
        # (a shell's background job), which the child would inherit
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        proc.stdin.write(prompt.encode() + b"\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "no streamed output within 60 s"
        first = os.read(proc.stdout.fileno(), 65536)
        assert first
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends: the reply stops, the session goes on
        time.sleep(0.5)
        rest, err = proc.communicate(b"The capital of France is\n", timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert b"[cancelled]" in err and b"Traceback" not in err, err
    out = (first + rest).decode("utf-8", "replace")
    assert out.endswith(
        api(server, "/v1/completions", prompt="The capital of France is", max_tokens=1500)
        .encode()
        .decode("utf-8", "replace")
        + "\n"
    )
    deadline = time.time() + 30
    while aborted_requests(server) < aborted + 1:
        assert time.time() < deadline, "the cancelled request was not aborted on the server"
        time.sleep(0.2)
    server.wait_idle()
