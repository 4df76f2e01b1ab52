"""The real SmolLM2-135M (3 KV heads): a TP=1 producer hands its KV to a TP=3 consumer (each
rank takes one KV head) and the reverse, through the Ray object store; the decode equals
one TP=1 engine's greedy tokens."""

from __future__ import annotations

import pytest

from fleetserve.replica.engine.async_engine import AsyncEngine
from tests.kv_transfer.utils import collect, greedy, hand_off, run, wait_all_free

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

QUESTION = [
    {
        "role": "user",
        "content": "Explain what a CPU does in two sentences, for a child "
        "who is curious about computers and about how they think.",
    }
]


def smollm(tp: int) -> AsyncEngine:
    kv = {
        "kv_connector": "RayObjectStoreConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "fail",
        "kv_load_timeout_s": 60.0,
    }
    return AsyncEngine(
        model="smollm2-135m",
        dtype="float32",
        block_size=16,
        max_model_len=512,
        num_gpu_blocks_override=64,
        tensor_parallel_size=tp,
        num_threads=1,
        enable_prefix_caching=False,
        kv_transfer_config=kv,
    )


def test_smollm2_tp1_to_tp3_and_back(local_ray):
    tp1 = tp3 = None
    try:
        tp1, tp3 = smollm(1), smollm(3)
        prompt = tp1.tokenizer.encode(tp1.apply_chat_template(QUESTION), add_special_tokens=False)
        assert len(prompt) > 32
        want, _ = run(collect(tp1, prompt, greedy(16)))
        for src, dst in ((tp1, tp3), (tp3, tp1)):
            got, final, params = run(hand_off(src, dst, prompt, 16))
            assert got == want
            assert final.num_remote_tokens == min(len(prompt) // 16 * 16, len(prompt) - 1)
            assert len(prompt) - final.num_cached_tokens <= 16
        wait_all_free(tp1)
        wait_all_free(tp3)
    finally:
        for e in (tp1, tp3):
            if e is not None:
                e.shutdown()
