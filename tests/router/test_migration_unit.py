"""The continuation a migrated request is resumed with (router.migration) produces the
tokens the uninterrupted request would have, on a real engine: greedy, and seeded sampling
(the seed shift must match the model runner's reseeding). No Ray needed."""

from __future__ import annotations

import asyncio

import pytest

from fleetserve.router.migration import continuation_body, continued_seed
from fleetserve.scheduler import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from fleetserve.replica.engine.async_engine import AsyncEngine

    e = AsyncEngine(model=str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=64,
                    core_process=False, num_threads=1)
    yield e
    e.shutdown()


def _tokens(engine, prompt_ids, sp_dict, rid):
    async def go():
        ids = []
        async for out in engine.generate(list(prompt_ids), SamplingParams(**sp_dict), rid):
            ids += out.outputs[0].token_ids
        return ids
    return asyncio.run(go())


@pytest.mark.parametrize("sampling", [
    {"temperature": 0.0},
    {"temperature": 1.0, "seed": 1234},
    {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 7, "repetition_penalty": 1.2},
], ids=["greedy", "seeded", "seeded-top-p-k-repetition"])
def test_continuation_equals_uninterrupted_run(engine, sampling):
    prompt = [5, 17, 42, 99, 3, 250, 77]
    sp = {"max_tokens": 24, "ignore_eos": True, "min_tokens": 10, **sampling}
    body = {"request_id": f"orig-{sampling.get('seed')}", "prompt_token_ids": prompt,
            "sampling_params": sp}
    full = _tokens(engine, prompt, sp, body["request_id"])
    assert len(full) == 24
    for cut in (1, 9, 23):
        cont = continuation_body(body, full[:cut], attempt=1, avoid=["dead-replica"])
        assert cont["sampling_params"]["max_tokens"] == 24 - cut
        assert cont["sampling_params"]["min_tokens"] == max(0, 10 - cut)
        assert cont["_fleetserve_avoid_replicas"] == ["dead-replica"]
        rest = _tokens(engine, cont["prompt_token_ids"], cont["sampling_params"],
                       f"{cont['request_id']}-{cut}")
        assert full[:cut] + rest == full, (cut, full, rest)
    load = engine.get_load()
    assert load["num_running"] == 0 and load["num_free_blocks"] == load["num_blocks"]


def test_continued_seed_inverts_the_reseeding_stride():
    for seed in (0, 1, 1234, (1 << 63) - 1):
        for k in (0, 1, 5, 1000):
            assert (continued_seed(seed, k) * 1_000_003) % (1 << 63) == (seed * 1_000_003 + k) % (1 << 63)
