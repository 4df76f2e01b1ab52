"""Precise prefix routing when the engines hash their KV blocks with sha256 and a block size
other than the default: the router hashes prompts as the engines do (block size and hash
function from the engines' info), so a prompt whose prefix one replica caches is routed to
it by the KV index alone, and hits that replica's cache.

Each second request comes after the router's in-flight hints have lapsed (they are hashed
by the router itself, so they match whatever it hashes with): only a router whose hashes
equal the engines' finds the holder in the index. Its own app (`fleetserve serve` in a
subprocess, as tests/pd does), so the router suite's app keeps its defaults.
"""

from __future__ import annotations

import random
import time

import httpx
import pytest

from tests.pd.conftest import start_server, stop_server

SHA_BLOCK = 8
LINGER_S = 1.0  # PrefixAwarePolicy.linger_s: how long a finished request's hint counts


@pytest.fixture(scope="module")
def sha_server(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("sha-app")
    proc, server = start_server(tmp, tiny_model_dir, {"enabled": False}, name="fleetserve-sha",
                                num_replicas=2,
                                engine={"prefix_caching_hash_algo": "sha256",
                                        "block_size": SHA_BLOCK})
    yield server
    stop_server(proc)


def complete(server, prompt: str) -> dict:
    r = httpx.post(server.base_url + "/v1/completions", timeout=120,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 1, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def routed(server) -> dict[str, float]:
    return {s.labels["prefix_match"]: s.value
            for s in server.samples("fleetserve:router_prefix_routed_requests")
            if s.name.endswith("_total")}


def index_blocks(server) -> float:
    return sum(s.value for s in server.samples("fleetserve:router_kv_index_blocks"))


def test_precise_routing_hits_with_sha256_block_hashes(sha_server):
    s = sha_server
    rng = random.Random(13)
    for i in range(4):
        prefix = f"topic {i}: " + " ".join(f"w{rng.randrange(1000)}" for _ in range(30))
        blocks = index_blocks(s)
        complete(s, prefix + " warm")
        deadline = time.time() + 30
        while index_blocks(s) <= blocks:  # the holder's KV events reached the router's index
            assert time.time() < deadline, "the router's index never saw the warm request"
            time.sleep(0.1)
        time.sleep(LINGER_S + 0.5)
        before = routed(s)
        out = complete(s, prefix + " again")
        after = routed(s)
        assert after.get("true", 0) - before.get("true", 0) == 1, \
            f"prefix {i}: routed without a match in the index ({before} -> {after})"
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 2 * SHA_BLOCK, out["usage"]
