"""P/D faults on the KV hand-off (every decode-side load is held back past its deadline):
a load that times out, the prefill replica killed after its prefill and before the load, and
a client that goes away while its request waits for remote KV. Each ends with the right
tokens or a clean abort, then "the app still serves and every replica has all blocks free"."""

from __future__ import annotations

import random
import threading
import time

import httpx
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
    s = slow_load_server
    body = {"model": "tiny", "prompt": long_prompt(random.Random(13)), "max_tokens": 8,
            "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", s.base_url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            deadline = time.time() + 60
            while not _decode_waiting(s):
                assert time.time() < deadline, "the request never reached decode"
                time.sleep(0.05)
        # leaving the block closes the connection while decode waits for the KV
    s.wait_all_free()
    body = complete(s, "a short prompt")
    assert body["choices"][0]["finish_reason"] == "length"
    s.wait_all_free()


def _decode_waiting(s) -> bool:
    return any(sm.value > 0 for sm in s.samples("vllm:num_requests_waiting"))


def _retries(s) -> float:
    return sum(sm.value for sm in s.samples("fleetserve:pd_retries")
               if sm.name.endswith("_total") and sm.labels.get("stage") == "decode")
