"""P/D under pressure, in one process on real engines and the Ray object store connector
(tests/pd/local_pools.py): the decode replica admits a request before its prefill runs, an
export nobody will read is released at once, and a P/D stream whose decode replica dies
(mid-stream, or while loading) goes on on another decode replica with no token repeated or
lost. Every test checks what the client got, that the cluster serves afterwards, and that no
KV block, reservation or export is left held."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetserve.router.api.protocol import sampling_dict
from fleetserve.router.routing.pd import PDRouter, PDSettings
from fleetserve.scheduler import SamplingParams
from tests.pd.local_pools import (
    ListRouter,
    LocalPool,
    feed_open_call,
    kill_core,
    make_replica,
    open_call,
    read_all,
    register,
    wait_free,
)

LEASE_S = 30.0  # an export left to its lease would be held well past every wait here
PROMPT = [(7 * i) % 300 + 3 for i in range(40)]  # 10 blocks of 4


def ray_kv(role: str, faults: dict | None = None) -> dict:
    cfg = {
        "kv_connector": "RayObjectStoreConnector",
        "kv_role": role,
        "kv_lease_s": LEASE_S,
        "kv_load_timeout_s": 20.0,
        "kv_load_failure_policy": "fail",
    }
    if faults:
        cfg = {
            **cfg,
            "kv_connector": "FaultInjectionConnector",
            "kv_connector_extra_config": {"inner": "RayObjectStoreConnector", "faults": faults},
        }
    return cfg


@pytest.fixture(scope="module")
def prefill(tiny_model_dir, local_ray):
    r = make_replica(tiny_model_dir, "P", ray_kv("kv_producer"))
    yield r
    r.engine.shutdown()


@pytest.fixture(scope="module")
def spare(tiny_model_dir, local_ray):
    """The decode replica a failed one's streams continue on."""
    r = make_replica(tiny_model_dir, "D2", ray_kv("kv_consumer"))
    yield r
    r.engine.shutdown()


def held_exports(ray) -> int:
    from fleetserve.kv_transfer.connectors.ray_owner import get_owner

    return ray.get(get_owner(ray, "fleetserve-kv-owner", "fleetserve").stats.remote())["held"]


def wait_no_exports(ray, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while held_exports(ray):
        assert time.monotonic() < deadline, f"{held_exports(ray)} exports still held (left to their lease)"
        time.sleep(0.1)


def prompt_tokens_computed(replica) -> float:
    for fam in text_string_to_metric_families(replica.engine.metrics_text()):
        for s in fam.samples:
            if s.name == "vllm:prompt_tokens_total":
                return s.value
    return 0.0


def body(rid: str, max_tokens: int = 8, prompt=PROMPT) -> dict:
    sp = sampling_dict(SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return {"request_id": rid, "prompt_token_ids": list(prompt), "sampling_params": sp, "priority": 0}


def pd_router(decodes: dict, prefill) -> PDRouter:
    decode_pool = LocalPool("decode", decodes)
    register(decode_pool, ListRouter(list(decodes)))
    prefill_pool = LocalPool("prefill", {"P": prefill})
    router = PDRouter(decode_pool, prefill_pool, PDSettings(min_prefill_tokens=8, prefill_timeout_s=30), block_size=4)
    router.max_migrations = 2
    return router


async def reference(replica, max_tokens: int) -> list[int]:
    """Greedy tokens of the prompt computed on one replica, no P/D."""
    stream = open_call(replica_pool(replica).generate, body(f"ref-{time.monotonic_ns()}", max_tokens))
    tokens, items = await read_all(stream, await stream.__anext__())
    assert items[-1].get("finished"), items[-1]
    return tokens


def replica_pool(replica) -> LocalPool:
    return LocalPool("ref", {replica.replica_id: replica})


def test_a_full_decode_replica_refuses_before_the_prefill_runs_and_holds_no_export(
    tiny_model_dir, local_ray, prefill, spare
):
    """Decode replica full (max_num_seqs 1 running, max_waiting_requests 1 waiting): the P/D
    request gets the decode side's 429 without its prompt being prefilled, nothing exported."""
    full = make_replica(tiny_model_dir, "D1", ray_kv("kv_consumer"), max_num_seqs=1, max_waiting_requests=1)
    try:

        async def go():
            want = await reference(spare, 8)
            router = pd_router({"D1": full, "D2": spare}, prefill)
            busy = [open_call(replica_pool(full).generate, body("busy-0", 200))]
            await busy[0].__anext__()  # running (the one slot)
            busy.append(open_call(replica_pool(full).generate, body("busy-1", 200)))
            deadline = time.monotonic() + 20
            while full.engine.get_load()["num_waiting"] < 1:  # waiting (the queue is full)
                assert time.monotonic() < deadline, full.engine.get_load()
                await asyncio.sleep(0.01)
            before = prompt_tokens_computed(prefill)
            stream, first = await router.open_stream(body("refused"), open_call)
            assert first.get("status") == 429, first
            assert "error" in first and first["error"]["message"]
            stream.cancel()
            await asyncio.sleep(0.5)
            assert prompt_tokens_computed(prefill) == before  # no prefill was wasted on it
            assert held_exports(local_ray) == 0
            for b in busy:
                b.cancel()
            await asyncio.sleep(0.2)
            wait_free(full)
            # The cluster still serves, through P/D, the right tokens.
            stream, first = await router.open_stream(body("after"), open_call)
            tokens, items = await read_all(stream, first)
            assert tokens == want and items[-1]["num_remote_tokens"] > 0
            wait_no_exports(local_ray)

        asyncio.run(go())
        for r in (full, spare, prefill):
            wait_free(r)
    finally:
        full.engine.shutdown()


def test_decode_replica_killed_mid_stream_the_stream_goes_on_elsewhere(tiny_model_dir, local_ray, prefill, spare):
    victim = make_replica(tiny_model_dir, "D1", ray_kv("kv_consumer"))
    try:

        async def go():
            want = await reference(spare, 24)
            router = pd_router({"D1": victim, "D2": spare}, prefill)
            stream, first = await router.open_stream(body("mid", 24), open_call)
            assert first.get("replica") == "D1", first
            got = [t for o in first["outputs"] for t in o["token_ids"]]
            while len(got) < 4:
                item = await stream.__anext__()
                got += [t for o in item["outputs"] for t in o["token_ids"]]
            kill_core(victim)
            rest, items = await read_all(stream, await stream.__anext__())
            assert got + rest == want  # none repeated, none lost
            assert items[-1]["finished"] and items[-1]["outputs"][0]["finish_reason"] == "length"
            assert {i.get("replica") for i in items if "outputs" in i} >= {"D2"}
            wait_no_exports(local_ray)
            # Still serves (the dead replica's router entry gone, as Serve's would be).
            router = pd_router({"D2": spare}, prefill)
            stream, first = await router.open_stream(body("after-kill"), open_call)
            tokens, _ = await read_all(stream, first)
            assert tokens == want[:8]

        asyncio.run(go())
        wait_no_exports(local_ray)
        for r in (spare, prefill):
            wait_free(r)
    finally:
        victim.engine.shutdown()


def test_decode_replica_killed_while_loading_recomputes_elsewhere_and_releases_the_export(
    tiny_model_dir, local_ray, prefill, spare
):
    """The decode replica dies before its first token (its KV load held back by the fault
    hook): the request continues on another decode replica, and the export it never read is
    released at once, not at the end of its lease."""
    victim = make_replica(tiny_model_dir, "D1", ray_kv("kv_consumer", {"delay_s": 5.0}))
    try:

        async def go():
            want = await reference(spare, 8)
            router = pd_router({"D1": victim, "D2": spare}, prefill)
            opening = asyncio.ensure_future(router.open_stream(body("loading"), open_call))
            deadline = time.monotonic() + 30
            while victim.engine.get_load()["num_waiting"] + victim.engine.get_load()["num_running"] < 1:
                assert time.monotonic() < deadline, "the decode request never arrived"
                await asyncio.sleep(0.02)
            while held_exports(local_ray) < 1:  # (the producer's export lands after its answer)
                assert time.monotonic() < deadline, "the prefill never exported"
                await asyncio.sleep(0.02)
            kill_core(victim)
            stream, first = await asyncio.wait_for(opening, 60)
            tokens, items = await read_all(stream, first)
            assert tokens == want
            assert items[0]["replica"] == "D2"
            wait_no_exports(local_ray, timeout_s=5.0)

        asyncio.run(go())
        for r in (spare, prefill):
            wait_free(r)
    finally:
        victim.engine.shutdown()


def test_client_gone_during_the_prefill_releases_its_decode_slot_at_once(local_ray, prefill, spare):
    async def go():
        want = await reference(spare, 8)
        router = pd_router({"D2": spare}, prefill)
        long_prompt = [(11 * i) % 300 + 3 for i in range(200)]
        opening = asyncio.ensure_future(router.open_stream(body("gone", prompt=long_prompt), open_call))
        deadline = time.monotonic() + 20
        while len(spare._reservations) == 0:  # reserved: the prefill is under way
            assert time.monotonic() < deadline and not opening.done(), "no decode slot was reserved"
            await asyncio.sleep(0.001)
        opening.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await opening
        deadline = time.monotonic() + 5  # far inside the reservation's own deadline
        while len(spare._reservations):
            assert time.monotonic() < deadline, "the reservation waits for its deadline"
            await asyncio.sleep(0.02)
        wait_no_exports(local_ray, timeout_s=5.0)
        stream, first = await router.open_stream(body("next"), open_call)
        tokens, _ = await read_all(stream, first)
        assert tokens == want

    asyncio.run(go())
    for r in (spare, prefill):
        wait_free(r)


def test_decode_stream_whose_feed_is_lost_goes_on_elsewhere(tiny_model_dir, local_ray, prefill, spare):
    """The per-step feed the decode stream rides ends under it (FeedLost): the stream migrates."""
    from fleetserve.router.feed import FeedHub

    victim = make_replica(tiny_model_dir, "D1", ray_kv("kv_consumer"))
    try:

        async def go():
            want = await reference(spare, 24)
            router = pd_router({"D1": victim, "D2": spare}, prefill)
            hub = FeedHub(router._decode)
            hub.ensure("D1")
            deadline = time.monotonic() + 20
            while not len(victim._feeds):
                assert time.monotonic() < deadline, "the feed never opened"
                await asyncio.sleep(0.02)
            stream, first = await router.open_stream(body("feed", 24), feed_open_call(hub))
            got = [t for o in first["outputs"] for t in o["token_ids"]]
            while len(got) < 4:
                item = await stream.__anext__()
                got += [t for o in item["outputs"] for t in o["token_ids"]]
            await hub.close()  # the feed ends while the request rides it
            rest, items = await read_all(stream, await stream.__anext__())
            assert got + rest == want  # none repeated, none lost
            assert items[-1]["finished"] and items[-1]["replica"] == "D2"
            await hub.close()

        asyncio.run(go())
        wait_no_exports(local_ray)
        for r in (victim, spare, prefill):
            wait_free(r)
    finally:
        victim.engine.shutdown()
