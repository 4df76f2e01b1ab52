"""Engine level: engine A (its own process) prefills a prompt and exports its KV; engine B
loads it and decodes. B's greedy tokens equal one plain engine's, and B computes at most
the prompt's last block."""

from __future__ import annotations

import random

import pytest

from tests.kv_transfer.utils import BLOCK, collect, engine, greedy, hand_off, run, wait_all_free


def storage_cfg(path, role):
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"path": str(path)}, "kv_load_failure_policy": "fail"}


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    eng = engine(tiny_model_dir, core_process=False)
    yield eng
    eng.shutdown()


def prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(length)] for length in
            rng.sample(range(9, 60), n)]


@pytest.fixture(scope="module")
def storage_pair(tiny_model_dir, tmp_path_factory):
    """A producer in its own process and a consumer (engine-core thread) on one folder."""
    path = tmp_path_factory.mktemp("kv-store")
    prod = engine(tiny_model_dir, storage_cfg(path, "kv_producer"))
    cons = engine(tiny_model_dir, storage_cfg(path, "kv_consumer"), core_process=False)
    yield prod, cons
    prod.shutdown()
    cons.shutdown()


def test_shared_storage_hand_off_matches_one_engine(storage_pair, reference):
    prod, cons = storage_pair
    for prompt in prompts(3) + [list(range(5, 5 + 4 * BLOCK))]:  # one prompt of whole blocks
        want, _ = run(collect(reference, prompt, greedy(8)))
        got, final, params = run(hand_off(prod, cons, prompt, 8))
        assert got == want
        full = len(prompt) // BLOCK * BLOCK
        assert params["remote_num_tokens"] == full
        computed = len(prompt) - final.num_cached_tokens
        assert computed <= BLOCK, (len(prompt), final.num_cached_tokens)
        assert final.num_remote_tokens == min(full, len(prompt) - 1)
    wait_all_free(prod)
    wait_all_free(cons)


def test_shared_storage_is_a_prefix_cache_across_engines(tiny_model_dir, tmp_path, reference):
    """kv_both without params: whatever one engine computed, another engine loads."""
    a = engine(tiny_model_dir, storage_cfg(tmp_path, "kv_both"), core_process=False)
    try:
        prompt = prompts(1, seed=5)[0]
        want, _ = run(collect(reference, prompt, greedy(6)))
        got_a, first = run(collect(a, prompt, greedy(6)))
        assert got_a == want and first.num_remote_tokens == 0
        wait_all_free(a)
    finally:
        a.shutdown()
    b = engine(tiny_model_dir, storage_cfg(tmp_path, "kv_both"), core_process=False)  # a restart, or another replica
    try:
        got_b, final = run(collect(b, prompt, greedy(6)))
        assert got_b == want
        assert final.num_remote_tokens >= (len(prompt) - 1) // BLOCK * BLOCK - BLOCK
        wait_all_free(b)
    finally:
        b.shutdown()
