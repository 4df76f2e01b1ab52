"""P/D faults on the KV hand-off (every decode-side load is held back past its deadline):
a load that times out, the prefill replica killed after its prefill and before the load, and
a client that goes away while its request waits for remote KV. Each ends with the right
tokens or a clean abort, then "the app still serves and every replica has all blocks free"."""

from __future__ import annotations

import json
import random
import socket
import threading
import time

import pytest

from tests.pd.test_pd_e2e import complete, long_prompt, tokenize

pytestmark = pytest.mark.slow


def test_load_timeout_recomputes_on_decode(slow_load_server, colocated):
    s = slow_load_server
    before, retries = s.pd_tokens(), _retries(s)
    prompt = long_prompt(random.Random(10))
    body = complete(s, prompt)
    ids = tokenize(s, prompt=prompt)
    assert body["choices"][0]["text"] == colocated(ids)
    details = body["usage"]["prompt_tokens_details"]
    assert details["remote_tokens"] == 0  # visible: nothing was loaded
    after = s.pd_tokens()
    assert after["recomputed"] - before.get("recomputed", 0) == len(ids)
    assert _retries(s) == retries + 1
    s.wait_all_free()


def test_prefill_killed_after_prefill_before_load(slow_load_server, colocated):
    s = slow_load_server
    prompt = long_prompt(random.Random(11))
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(body=complete(s, prompt)))
    t.start()
    # The prefill is done once the decode replica holds the request (waiting for its KV).
    deadline = time.time() + 60
    while not _decode_waiting(s):
        assert time.time() < deadline and t.is_alive(), "the request never reached decode"
        time.sleep(0.05)
    old = s.kill("prefill")
    t.join(120)
    assert result["body"]["choices"][0]["text"] == colocated(tokenize(s, prompt=prompt))
    s.wait_replaced("prefill", old)
    body = complete(s, long_prompt(random.Random(12)))  # the app still serves
    assert body["choices"][0]["finish_reason"] == "length"
    s.wait_all_free()


def test_client_abort_while_waiting_for_remote_kv(slow_load_server):
    """The response starts with the first token, so the client hangs up before any header:
    a raw socket, closed while the decode replica waits for the KV."""
    s = slow_load_server
    aborted = _aborted(s)
    body = json.dumps(
        {"model": "tiny", "prompt": long_prompt(random.Random(13)), "max_tokens": 8, "stream": True, "ignore_eos": True}
    ).encode()
    host, port = s.base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    try:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        deadline = time.time() + 60
        while not _decode_waiting(s):
            assert time.time() < deadline, "the request never reached decode"
            time.sleep(0.05)
    finally:
        sock.close()
    s.wait_all_free()
    assert _aborted(s) >= aborted + 1  # the engine aborted it rather than finishing it
    body = complete(s, "a short prompt")
    assert body["choices"][0]["finish_reason"] == "length"
    s.wait_all_free()


def _aborted(s) -> float:
    return sum(
        x.value
        for x in s.samples("vllm:request_success")
        if x.name.endswith("_total") and x.labels.get("finished_reason") == "abort"
    )


def _decode_waiting(s) -> bool:
    return any(sm.value > 0 for sm in s.samples("vllm:num_requests_waiting"))


def _retries(s) -> float:
    return sum(
        sm.value
        for sm in s.samples("fleetserve:pd_retries")
        if sm.name.endswith("_total") and sm.labels.get("stage") == "decode"
    )
