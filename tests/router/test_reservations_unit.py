"""Decode slots reserved before a P/D prefill (router.routing.admission.Reservations) on a real
replica: a reservation counts against admission until its request takes it, its owner releases
it, or its deadline passes; the request that holds one is admitted whatever came since."""

from __future__ import annotations

import asyncio

import pytest

from fleetserve.router.api.protocol import sampling_dict
from fleetserve.router.replica import EngineReplica
from fleetserve.router.routing.admission import RESERVATION_KEY, Reservations
from fleetserve.scheduler import SamplingParams


def test_a_reservation_ends_when_taken_released_or_past_its_deadline():
    now = [0.0]
    r = Reservations(clock=lambda: now[0])
    r.reserve("a", 100, ttl_s=5.0)
    r.reserve("b", 50, ttl_s=1.0)
    assert r.tokens() == 150 and len(r) == 2
    now[0] = 1.0  # b's deadline: gone, nobody needs to say so
    assert r.tokens() == 100 and not r.take("b")
    assert r.take("a") and not r.take("a")  # taken once
    r.reserve("c", 10, ttl_s=5.0)
    assert r.release("c") and not r.release("c") and len(r) == 0


@pytest.fixture(scope="module")
def replica(tiny_model_dir):
    r = EngineReplica(
        {
            "model": str(tiny_model_dir),
            "max_model_len": 128,
            "max_num_seqs": 2,
            "max_waiting_requests": 2,
            "num_threads": 1,
            "num_gpu_blocks_override": 32,
        },
        "fleetserve.replica.engine.async_engine:AsyncEngine",
        {"max_queued_kv_ratio": 0.5},
    )  # 32 blocks x 16 = 512 tokens: more than 256 queued is refused
    yield r
    r.engine.shutdown()


def _body(rid, n, max_tokens=2, **extra):
    return {
        "request_id": rid,
        "prompt_token_ids": [(7 * i + len(rid)) % 300 + 1 for i in range(n)],
        "sampling_params": sampling_dict(SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
        "priority": 0,
        **extra,
    }


async def _run(replica, body) -> list[dict]:
    out = []
    async for item in replica.generate(body):
        out.extend(item if isinstance(item, list) else [item])
    return out


def test_reserved_slots_count_against_admission_and_their_owner_is_admitted(replica):
    async def go():
        first = await replica.control("reserve", owner="pd-1", prompt_len=200, ttl_s=30.0)
        assert first == {"replica": replica.replica_id, "reserved": "pd-1"}
        # 200 reserved + 100 > 256: a plain request and a second reservation are refused now.
        refused = await _run(replica, _body("plain", 100))
        assert refused[0]["status"] == 429 and "overloaded" in refused[0]["error"]["message"]
        second = await replica.control("reserve", owner="pd-2", prompt_len=100, ttl_s=30.0)
        assert second["status"] == 429 and second["error"]
        # The owner's request takes its slot: admitted, and the slot is gone with it.
        done = await _run(replica, _body("pd-1-d", 100, **{RESERVATION_KEY: "pd-1"}))
        assert done[-1]["finished"] and len(replica._reservations) == 0
        # Released by its owner (its prefill failed, its client left): admission is free again.
        await replica.control("reserve", owner="pd-3", prompt_len=200, ttl_s=30.0)
        assert (await replica.control("release_reservation", owner="pd-3"))["released"]
        assert (await _run(replica, _body("plain-2", 100)))[-1]["finished"]
        # Never used: its deadline ends it.
        await replica.control("reserve", owner="pd-4", prompt_len=200, ttl_s=0.2)
        await asyncio.sleep(0.3)
        assert len(replica._reservations) == 0
        assert (await _run(replica, _body("plain-3", 100)))[-1]["finished"]
        # A request naming a reservation it does not hold meets admission as any other.
        await replica.control("reserve", owner="hog", prompt_len=250, ttl_s=30.0)
        stray = await _run(replica, _body("stray", 100, **{RESERVATION_KEY: "pd-1"}))
        assert stray[0]["status"] == 429
        await replica.control("release_reservation", owner="hog")

    asyncio.run(go())
    load = replica.engine.get_load()
    assert load["num_running"] == 0 and load["num_free_blocks"] == load["num_blocks"]
    assert len(replica._reservations) == 0


def test_reservations_count_as_waiting_requests(replica):
    """max_waiting_requests 2: two slots reserved fill the queue for a third and a plain request."""

    async def go():
        for owner in ("w1", "w2"):
            assert "reserved" in await replica.control("reserve", owner=owner, prompt_len=4, ttl_s=30.0)
        third = await replica.control("reserve", owner="w3", prompt_len=4, ttl_s=30.0)
        assert third["status"] == 429 and "waiting queue" in third["error"]
        plain = await _run(replica, _body("plain", 4))
        assert plain[0]["status"] == 429
        for owner in ("w1", "w2"):
            assert (await _run(replica, _body(owner, 4, **{RESERVATION_KEY: owner})))[-1]["finished"]
        assert (await _run(replica, _body("plain-after", 4)))[-1]["finished"]

    asyncio.run(go())
    load = replica.engine.get_load()
    assert load["num_free_blocks"] == load["num_blocks"] and len(replica._reservations) == 0
