"""The replica deployment class outside Serve, on a real AsyncEngine: error items and 429."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.replica import EngineReplica
from router.protocol import sampling_dict
from scheduler import SamplingParams


@pytest.fixture(scope="module")
def replica(tiny_model_dir):
    r = EngineReplica({"model": str(tiny_model_dir), "max_model_len": 128, "max_num_seqs": 1,
                       "max_waiting_requests": 1, "num_threads": 1, "num_gpu_blocks_override": 32},
                      "replica.async_engine:AsyncEngine")
    yield r
    r.engine.shutdown()


def body(rid: str, ids: list[int], **params) -> dict:
    return {"request_id": rid, "prompt_token_ids": ids,
            "sampling_params": sampling_dict(SamplingParams(**params)), "priority": 0}


async def first_item(agen):
    return await agen.__anext__()


def test_queue_full_is_a_429_item_and_nothing_leaks(replica):
    async def go():
        running = replica.generate(body("a", [5, 6, 7], max_tokens=100, ignore_eos=True))
        assert "outputs" in await first_item(running)
        waiting = replica.generate(body("b", [5, 6, 8], max_tokens=4, ignore_eos=True))
        waiter = asyncio.ensure_future(first_item(waiting))
        deadline = time.time() + 10
        while replica.engine.get_load()["num_waiting"] < 1:
            assert time.time() < deadline, replica.engine.get_load()
            await asyncio.sleep(0.01)
        refused = await first_item(replica.generate(body("c", [5, 6, 9], max_tokens=4)))
        assert refused["status"] == 429 and refused["error"]["message"]
        await running.aclose()  # the caller goes away: aborted
        assert "outputs" in await waiter
        async for _ in waiting:
            pass

    asyncio.run(go())
    deadline = time.time() + 10
    while True:
        load = replica.engine.get_load()
        if load["num_running"] == 0 and load["num_free_blocks"] == load["num_blocks"]:
            break
        assert time.time() < deadline, load
        time.sleep(0.05)


def test_bad_params_and_too_long_prompt_are_400_items(replica):
    async def go():
        bad = await first_item(replica.generate({"request_id": "x", "prompt_token_ids": [5],
                                                 "sampling_params": {"max_tokens": 0}}))
        assert bad["status"] == 400 and bad["error"]["param"] == "max_tokens"
        long = await first_item(replica.generate(body("y", [5] * 500, max_tokens=2)))
        assert long["status"] == 400 and long["error"]["message"]

    asyncio.run(go())
