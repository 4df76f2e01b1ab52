"""The staging pool's cap holds in a real hand-off: a producer whose staging buffers would pass
`staging_max_bytes` drops the save instead (counted), frees the request's blocks, and the
consumer recomputes the prompt: the same greedy tokens, nothing loaded, no block held."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.kv_transfer.utils import collect, engine, greedy, hand_off, run, wait_all_free


def storage_cfg(path, role, **extra):
    return {
        "kv_connector": "SharedStorageConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"path": str(path), **extra},
        "kv_load_failure_policy": "recompute",
        "kv_load_timeout_s": 5.0,
    }


def metric(eng, name: str) -> float:
    for fam in text_string_to_metric_families(eng.metrics_text()):
        for s in fam.samples:
            if s.name == name:
                return s.value
    raise AssertionError(f"no {name} metric")


@pytest.mark.parametrize("cap, refused", [(1024, True), (1 << 24, False)], ids=["over-cap", "within-cap"])
def test_a_save_past_the_staging_cap_is_dropped_and_the_consumer_recomputes(tiny_model_dir, tmp_path, cap, refused):
    prod = engine(tiny_model_dir, storage_cfg(tmp_path, "kv_producer", staging_max_bytes=cap), core_process=False)
    cons = engine(tiny_model_dir, storage_cfg(tmp_path, "kv_consumer"), core_process=False)
    try:
        prompt = list(range(7, 7 + 40))  # 10 blocks of 4: a few KiB of KV per layer
        want, _ = run(collect(cons, prompt, greedy(6)))  # the consumer computing it all itself
        wait_all_free(cons)
        got, final, params = run(hand_off(prod, cons, [*prompt], 6))
        assert got == want
        deadline = time.monotonic() + 10
        while metric(prod, "vllm:kv_transfer_dropped_saves_total") < (1 if refused else 0):
            assert time.monotonic() < deadline, "the dropped save was never counted"
            time.sleep(0.05)
        assert metric(prod, "vllm:kv_transfer_staging_refused_total") == (1 if refused else 0)
        if refused:
            assert final.num_remote_tokens == 0  # recomputed, nothing staged past the cap
        else:
            assert final.num_remote_tokens > 0
        wait_all_free(prod)
        wait_all_free(cons)
        # Still serves afterwards.
        again, _ = run(collect(prod, prompt, greedy(6)))
        assert again == want
        wait_all_free(prod)
    finally:
        prod.shutdown()
        cons.shutdown()
