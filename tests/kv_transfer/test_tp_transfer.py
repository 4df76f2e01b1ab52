"""Tensor parallelism: every rank moves its own KV heads, a transfer is done when every rank
says so, and producer and consumer may run different TP sizes (the consumer's ranks take
the heads they own). Tiny model with 2 KV heads: TP=2 <-> TP=2, TP=1 -> TP=2, TP=2 -> TP=1, over each connector."""

from __future__ import annotations

import random

import pytest

from tests.kv_transfer.utils import BLOCK, collect, engine, greedy, hand_off, run, wait_all_free

pytestmark = pytest.mark.slow  # three engines, four Ray worker actors


# Every connector. P2P: both ranks of a TP=2 consumer pull the one shard of a TP=1 producer
# (streamed, each rank taking its heads from each chunk; the export stays until both pulled
# it: it used to go with the first pull, failing the other rank's load), and a TP=1 consumer
# joins the two shards of a TP=2 producer (whole pulls of streamed exports).
@pytest.fixture(scope="module", params=["RayObjectStoreConnector", "P2PConnector", "SharedStorageConnector"])
def engines(tiny_model_dir, local_ray, request, tmp_path_factory):
    kv = {
        "kv_connector": request.param,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "fail",
        "kv_load_timeout_s": 20.0,
        "kv_connector_extra_config": {
            "P2PConnector": {"host": "127.0.0.1"},
            "SharedStorageConnector": {"path": str(tmp_path_factory.mktemp("kv-tp"))},
        }.get(request.param, {}),
    }
    # No local prefix cache: every hand-off below must come through the connector.
    made = {
        name: engine(tiny_model_dir, kv, tensor_parallel_size=tp, enable_prefix_caching=False, num_threads=1)
        for name, tp in (("tp1", 1), ("tp2a", 2), ("tp2b", 2))
    }
    yield made
    for e in made.values():
        e.shutdown()


@pytest.mark.parametrize("src,dst", [("tp2a", "tp2b"), ("tp1", "tp2a"), ("tp2b", "tp1")])
def test_hand_off_across_tp_sizes_matches_one_engine(engines, src, dst):
    rng = random.Random(hash((src, dst)) & 0xFFFF)
    prompt = [rng.randrange(3, 380) for _ in range(rng.randrange(17, 45))]
    want, _ = run(collect(engines["tp1"], prompt, greedy(6)))  # tp1 alone, no params
    got, final, params = run(hand_off(engines[src], engines[dst], prompt, 6))
    assert params["remote_tp_size"] == (1 if src == "tp1" else 2)
    assert got == want
    assert final.num_remote_tokens == min(len(prompt) // BLOCK * BLOCK, len(prompt) - 1)
    assert len(prompt) - final.num_cached_tokens <= BLOCK
    for e in engines.values():
        wait_all_free(e)
