"""Cluster-wide prefix reuse under failure, in one process on real engines and the Ray object
store connector (tests/pd/local_pools.py): a stream whose chosen replica dies mid-stream goes on
on another replica with no token repeated or lost, and a holder that dies before its export
costs only the recompute. Each test checks what the client got, that the cluster serves
afterwards, and that no KV block or export is left held."""

from __future__ import annotations

import asyncio
import time

import pytest

from fleetserve.router.routing.prefix_reuse import PrefixReuse, ReuseSettings
from tests.pd.local_pools import (
    ListRouter,
    LocalPool,
    kill_core,
    make_replica,
    open_call,
    read_all,
    register,
    wait_free,
)
from tests.pd.test_pd_pressure import PROMPT, body, ray_kv, reference, wait_no_exports

BLOCKS = len(PROMPT) // 4  # the prompt's blocks the holder caches


def reuse_flow(chosen, holder) -> tuple[PrefixReuse, LocalPool]:
    pool = LocalPool("reuse", {chosen.replica_id: chosen, holder.replica_id: holder})
    register(pool, ListRouter([chosen.replica_id, holder.replica_id], {holder.replica_id: BLOCKS}))
    return PrefixReuse(pool, ReuseSettings(min_tokens=8, export_timeout_s=30), block_size=4, max_migrations=2), pool


async def plain(pool):
    async def go(b):
        stream = open_call(pool.generate, b)
        return stream, await stream.__anext__()

    return go


@pytest.fixture(scope="module")
def holder(tiny_model_dir, local_ray):
    r = make_replica(tiny_model_dir, "H", ray_kv("kv_both"))
    yield r
    r.engine.shutdown()


def test_chosen_replica_killed_mid_stream_the_reuse_stream_goes_on_elsewhere(tiny_model_dir, local_ray, holder):
    chosen = make_replica(tiny_model_dir, "C", ray_kv("kv_both"))
    try:

        async def go():
            want = await reference(holder, 24)  # the holder now caches the prompt's blocks
            flow, pool = reuse_flow(chosen, holder)
            stream, first = await flow.open_stream(body("reuse-mid", 24), open_call, await plain(pool))
            assert first.get("replica") == "C", first
            assert any(b.get("kv_transfer_params") for b in pool.calls)  # the reuse path ran
            got = [t for o in first["outputs"] for t in o["token_ids"]]
            while len(got) < 4:
                item = await stream.__anext__()
                got += [t for o in item["outputs"] for t in o["token_ids"]]
            kill_core(chosen)
            rest, items = await read_all(stream, await stream.__anext__())
            assert got + rest == want  # none repeated, none lost
            assert items[-1]["finished"] and items[-1]["outputs"][0]["finish_reason"] == "length"
            assert items[-1]["replica"] == "H"
            wait_no_exports(local_ray)
            # Still serves (the dead replica gone from the pool, as Serve's router drops it).
            stream = open_call(LocalPool("after", {"H": holder}).generate, body("after", 8))
            tokens, _ = await read_all(stream, await stream.__anext__())
            assert tokens == want[:8]

        asyncio.run(go())
        wait_no_exports(local_ray)
        wait_free(holder)
    finally:
        chosen.engine.shutdown()


def test_holder_killed_before_its_export_the_chosen_replica_computes(tiny_model_dir, local_ray, holder):
    lost = make_replica(tiny_model_dir, "H2", ray_kv("kv_both"))
    try:

        async def go():
            want = await reference(holder, 8)
            await reference(lost, 8)  # H2 caches the prompt: the flow picks it as the holder
            flow, pool = reuse_flow(holder, lost)
            kill_core(lost)
            t0 = time.monotonic()
            stream, first = await flow.open_stream(body("reuse-lost"), open_call, await plain(pool))
            tokens, items = await read_all(stream, first)
            assert tokens == want and items[-1]["replica"] == holder.replica_id
            assert items[-1]["num_remote_tokens"] == 0  # computed, nothing loaded
            assert time.monotonic() - t0 < 20
            wait_no_exports(local_ray)

        asyncio.run(go())
        wait_free(holder)
    finally:
        lost.engine.shutdown()


def test_the_flows_migrate_at_most_the_ingress_max_migrations():
    """`max_migrations` (0: never) bounds P/D and reuse streams as it does plain ones."""
    from fleetserve.router.engine_pools import EnginePools
    from fleetserve.router.routing.pd import PDSettings
    from fleetserve.router.settings import IngressSettings

    class Handle:
        app_name, deployment_name = "app", "engine"

        def options(self, **kwargs):
            return self

        def __getattr__(self, method):
            return self

    pd = EnginePools(Handle(), IngressSettings(served_model_name="m", max_migrations=0, pd=PDSettings()), Handle())
    reuse = EnginePools(Handle(), IngressSettings(served_model_name="m", max_migrations=1, reuse=ReuseSettings()))
    assert pd.pd is not None and pd.pd.max_migrations == 0
    assert reuse.reuse is not None and reuse.reuse.max_migrations == 1
