"""The router's prefix index on the running app (prefix_aware, 2 replicas, engines in their
own processes): after a random workload that overflows both KV caches (evictions) and a
replica restart, the index equals what every engine caches, and prefix routing follows it.

Two readers are checked: the ingress's own index (its per-replica sizes in /metrics), and
an index this test feeds through the same subscriber code and replica endpoint, compared
set by set with a snapshot of each engine's cache. (tests/replica/test_kv_events_engine.py
shows that an engine's published cache equals its block pool's.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
import time

import httpx
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from fleetserve.router.routing.kv_index import KVIndex
from fleetserve.router.routing.kv_subscriber import KVEventSubscriber
from fleetserve.router.routing.registry import get_router
from fleetserve.router.routing.request_router import TARGET_KWARG
from tests.router.test_routing_e2e import complete, delta, prompt_tokens_by_replica


class LoopThread:
    """An asyncio loop on a thread of the test process, for the subscriber and handle calls."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, awaitable, timeout_s: float = 60.0):
        async def wait():
            return await awaitable

        return asyncio.run_coroutine_threadsafe(wait(), self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


async def call_info(handle) -> dict:
    return await handle.get_info.remote()


def random_workload(server, rng: random.Random, n: int) -> None:
    heads = [" ".join(f"w{rng.randrange(1000)}" for _ in range(rng.randrange(20, 60))) for _ in range(5)]

    def one(i: int) -> None:
        prompt = f"{rng.choice(heads)} q{i} " + " ".join(str(rng.randrange(99)) for _ in range(8))
        complete(server, prompt, max_tokens=rng.randrange(1, 6))

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(n)))


def index_blocks_in_metrics(server) -> dict[str, float]:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    return {
        s.labels["replica"]: s.value
        for fam in text_string_to_metric_families(text)
        if fam.name == "fleetserve:router_kv_index_blocks"
        for s in fam.samples
    }


def test_index_equals_engine_caches_after_evictions_and_a_restart(server):
    handle = serve.get_deployment_handle("engine", server.app)
    lt = LoopThread()
    try:
        lt.run(call_info(handle))  # builds this process's router for the handle
        router = get_router(server.app, "engine")
        index = KVIndex()
        sub = KVEventSubscriber(handle, router.replica_ids, index, membership_period_s=0.2)
        lt.loop.call_soon_threadsafe(sub.start)

        async def snapshot(rid: str) -> set:
            reply = await handle.kv_events.remote(-1, None, 0.0, **{TARGET_KWARG: rid})
            assert reply["replica"] == rid
            return set(reply["snapshot"][1])

        def check_equal(timeout_s: float = 20.0) -> dict[str, set]:
            deadline = time.time() + timeout_s
            while True:
                ids = sorted(router.replica_ids())
                truth = {rid: lt.run(snapshot(rid)) for rid in ids}
                mine = {rid: index.hashes_of(rid) for rid in ids}
                ingress = index_blocks_in_metrics(server)
                if (
                    len(ids) == 2
                    and mine == truth
                    and sorted(index.replicas()) == ids
                    and ingress == {rid: float(len(h)) for rid, h in truth.items()}
                ):
                    return truth
                if time.time() > deadline:
                    raise AssertionError(
                        f"index != engines: sizes { ({r: len(h) for r, h in mine.items()}) }"
                        f" vs { ({r: len(h) for r, h in truth.items()}) }, ingress {ingress}"
                    )
                time.sleep(0.3)

        server.wait_idle()
        rng = random.Random(7)
        random_workload(server, rng, 40)  # ~40 x 6+ blocks > 2 x 96 blocks: evictions
        truth = check_equal()
        assert all(truth.values())
        assert index.num_resyncs == 2  # one snapshot per replica; the rest were replayed batches
        # The ingress's own index counts its snapshots too (declared as `..._total`, or
        # Prometheus parsers drop the sample).
        text = httpx.get(server.base_url + "/metrics", timeout=30).text
        resyncs = [
            s.value
            for fam in text_string_to_metric_families(text)
            if fam.name == "fleetserve:router_kv_index_resyncs"
            for s in fam.samples
        ]
        assert resyncs and resyncs[0] >= 2, resyncs

        # Restart one replica: Serve replaces it under a new id, with an empty cache.
        victim = sorted(truth)[0]
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{server.app}#engine#{victim}", namespace="serve"), no_restart=True)
        deadline = time.time() + 120
        while victim in router.replica_ids() or len(router.replica_ids()) < 2:
            assert time.time() < deadline, "the killed replica was not replaced"
            time.sleep(0.5)
        server.wait_idle(timeout_s=60)
        random_workload(server, rng, 24)
        truth = check_equal()
        assert victim not in index.replicas()
        assert victim not in index_blocks_in_metrics(server)

        # Routing follows the index: a prompt whose long prefix one replica caches goes there.
        for hashes in truth.values():
            assert hashes
        prefix = " ".join(f"z{i}" for i in range(60))
        complete(server, prefix + " first")
        home = check_equal()
        holders = [rid for rid, h in home.items() if h - truth[rid]]
        before = prompt_tokens_by_replica(server)
        for q in range(3):
            complete(server, f"{prefix} again {q}")
        moved = {k for k, v in delta(before, prompt_tokens_by_replica(server)).items() if v > 0}
        assert moved <= set(holders), (moved, holders)
        lt.run(sub.stop())
        server.wait_idle()
    finally:
        lt.close()
