"""Fault injection (kv_transfer.connectors.faults): every broken transfer ends in the right tokens or a
clear error, within its deadline, and both engines end with every block free."""

from __future__ import annotations

import time

import pytest

from tests.kv_transfer.utils import BLOCK, collect, engine, greedy, hand_off, run, wait_all_free

PROMPT = [7 + (i * 13) % 300 for i in range(37)]  # 9 full blocks + 1 token


def faulty(path, role, policy, faults, timeout_s=10.0):
    return {
        "kv_connector": "FaultInjectionConnector",
        "kv_role": role,
        "kv_load_failure_policy": policy,
        "kv_load_timeout_s": timeout_s,
        "kv_connector_extra_config": {
            "inner": "SharedStorageConnector",
            "inner_extra": {"path": str(path)},
            "faults": faults,
        },
    }


@pytest.fixture(scope="module")
def want(tiny_model_dir):
    ref = engine(tiny_model_dir, core_process=False)
    try:
        return run(collect(ref, PROMPT, greedy(6)))[0]
    finally:
        ref.shutdown()


CASES = [
    # (name, producer faults, consumer faults, policy, load timeout, expect)
    ("drop-fail", {}, {"drop": 1.0}, "fail", 10.0, "error"),
    ("drop-recompute", {}, {"drop": 1.0}, "recompute", 10.0, "recomputed"),
    ("late-recompute", {}, {"delay_s": 2.5}, "recompute", 1.0, "recomputed"),
    ("corrupt-fail", {"corrupt": 1.0}, {}, "fail", 1.0, "error"),
    ("stale-recompute", {"stale": 1.0}, {}, "recompute", 1.0, "recomputed"),
    ("duplicate", {"duplicate": 1.0}, {"duplicate": 1.0}, "fail", 10.0, "loaded"),
    ("lost-notice-recompute", {}, {"lose_notice": 1.0}, "recompute", 1.0, "recomputed"),
]


@pytest.mark.parametrize("name,pfaults,cfaults,policy,timeout_s,expect", CASES, ids=[c[0] for c in CASES])
def test_fault_ends_right_or_clearly_and_frees_everything(
    tiny_model_dir, tmp_path, want, name, pfaults, cfaults, policy, timeout_s, expect
):
    prod = engine(tiny_model_dir, faulty(tmp_path, "kv_producer", policy, pfaults), core_process=False)
    cons = engine(tiny_model_dir, faulty(tmp_path, "kv_consumer", policy, cfaults, timeout_s), core_process=False)
    try:
        t0 = time.monotonic()
        tokens, final, _ = run(hand_off(prod, cons, PROMPT, 6))
        elapsed = time.monotonic() - t0
        assert elapsed < timeout_s + 10, elapsed  # deadline + grace + the decode itself
        reason = final.outputs[0].finish_reason
        if expect == "error":
            assert reason == "error" and tokens == []
        else:
            assert tokens == want and reason == "length"
            full = len(PROMPT) // BLOCK * BLOCK
            assert final.num_remote_tokens == (full if expect == "loaded" else 0)
        wait_all_free(prod)
        wait_all_free(cons)
        # Both still serve, and come back clean.
        assert run(collect(cons, PROMPT, greedy(6)))[0] == want
        wait_all_free(cons)
    finally:
        prod.shutdown()
        cons.shutdown()
