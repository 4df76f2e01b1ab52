"""Overload is refused early and cleanly: KV-aware admission at the replica (429 item),
Retry-After on every 429/503, and nothing leaks. Outside Serve, on a real AsyncEngine."""

from __future__ import annotations

import asyncio
import time

import pytest

from fleetserve.router.api.errors import error_body, to_response
from fleetserve.router.api.protocol import sampling_dict
from fleetserve.router.replica import EngineReplica
from fleetserve.router.routing.admission import admission_refusal
from fleetserve.scheduler import SamplingParams


def test_admission_rule():
    load = {"num_blocks": 10, "num_queued_tokens": 0}
    assert admission_refusal(load, 10_000, 16, 1.0) is None  # an idle replica takes anything
    load["num_queued_tokens"] = 150
    assert admission_refusal(load, 10, 16, 1.0) is None  # 160 <= 1.0 * 160
    assert "overloaded" in admission_refusal(load, 11, 16, 1.0)


def test_429_and_503_carry_retry_after():
    assert to_response(error_body("busy", 429)).headers["retry-after"] == "1"
    assert to_response(error_body("down", 503)).headers["retry-after"] == "1"
    assert "retry-after" not in to_response(error_body("bad", 400)).headers


@pytest.fixture(scope="module")
def replica(tiny_model_dir):
    r = EngineReplica(
        {
            "model": str(tiny_model_dir),
            "max_model_len": 128,
            "max_num_seqs": 1,
            "max_waiting_requests": 16,
            "num_threads": 1,
            "num_gpu_blocks_override": 32,
        },
        "fleetserve.replica.engine.async_engine:AsyncEngine",
        {"max_queued_kv_ratio": 0.5},
    )  # 32 blocks x 16 = 512 tokens: refuse > 256
    yield r
    r.engine.shutdown()


def _body(rid, n, max_tokens):
    return {
        "request_id": rid,
        "prompt_token_ids": [(7 * i + len(rid)) % 300 + 1 for i in range(n)],
        "sampling_params": sampling_dict(SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
        "priority": 0,
    }


def test_queued_tokens_beyond_kv_room_get_429(replica):
    async def go():
        # A short prompt and a long answer (120 of max_model_len 128): "a" keeps the one running
        # slot for ~110 steps while the two waiters are queued behind it. With 100 -> 25 tokens the
        # tiny model once finished "a" before the waiters reached the engine (CI, 2026-11-26), and
        # the wait below timed out with nothing queued.
        running = replica.generate(_body("a", 10, 110))
        assert "outputs" in await running.__anext__()
        waiting = [replica.generate(_body(f"w{i}", 100, 2)) for i in range(2)]
        firsts = [asyncio.ensure_future(w.__anext__()) for w in waiting]
        deadline = time.time() + 10
        while replica.engine.get_load()["num_waiting"] < 2:
            assert time.time() < deadline, replica.engine.get_load()
            await asyncio.sleep(0.01)
        refused = await replica.generate(_body("x", 100, 2)).__anext__()
        assert refused["status"] == 429 and "overloaded" in refused["error"]["message"]
        async for _ in running:
            pass
        for f, w in zip(firsts, waiting):
            assert "outputs" in await f
            async for _ in w:
                pass
        again = [item async for item in replica.generate(_body("y", 100, 2))]
        assert again[-1]["finished"]

    asyncio.run(go())
    load = replica.engine.get_load()
    assert load["num_running"] == 0 and load["num_free_blocks"] == load["num_blocks"]
