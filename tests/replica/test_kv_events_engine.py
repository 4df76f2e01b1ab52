"""KV events through a real engine: what the replica's log and the router's index hold
equals what the engine's KV cache holds, after a random workload with evictions, aborts
and an engine restart (a new instance behind the same replica id). The engines run their
core on a thread here, so the test can read the real cache; the core-process path is
covered end to end in tests/router/test_kv_index_e2e.py."""

from __future__ import annotations

import asyncio
import random

from fleetserve.replica.engine.async_engine import AsyncEngine
from fleetserve.router.routing.kv_index import KVIndex
from fleetserve.scheduler import SamplingParams


def make_engine(model_dir, core_process: bool) -> AsyncEngine:
    # 24 blocks of 4 tokens: the workload below overflows it many times (evictions).
    return AsyncEngine(
        model=str(model_dir),
        dtype="float32",
        num_gpu_blocks_override=24,
        block_size=4,
        max_num_seqs=4,
        max_model_len=96,
        num_threads=1,
        enable_kv_cache_events=True,
        core_process=core_process,
    )


async def workload(engine: AsyncEngine, rng: random.Random, n: int) -> None:
    prefixes = [[rng.randrange(10, 300) for _ in range(rng.randrange(8, 30))] for _ in range(4)]

    async def one(i: int) -> None:
        prompt = rng.choice(prefixes) + [rng.randrange(10, 300) for _ in range(rng.randrange(1, 12))]
        params = SamplingParams(max_tokens=rng.randrange(1, 8), ignore_eos=True)
        abort_after = rng.choice([None, None, None, 1])
        seen = 0
        async for _ in engine.generate(prompt, params, f"q{i}"):
            seen += 1
            if abort_after is not None and seen >= abort_after:
                break  # leaving the stream aborts the request

    await asyncio.gather(*(one(i) for i in range(n)))


def sync(index: KVIndex, replica_id: str, engine: AsyncEngine) -> None:
    """What router.routing.kv_subscriber does per poll: read from the cursor, apply."""
    instance, seq = index.cursor(replica_id)
    index.update(replica_id, engine.kv_events.read(seq, instance))


async def wait_idle(engine: AsyncEngine) -> None:
    for _ in range(200):
        load = engine.get_load()
        if load["num_running"] == 0 and load["num_waiting"] == 0 and load["num_free_blocks"] == load["num_blocks"]:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine not idle: {engine.get_load()}")


def test_index_equals_engine_cache_through_evictions_and_a_restart(tiny_model_dir):
    rng = random.Random(0)
    index = KVIndex()

    async def run() -> None:
        engine = make_engine(tiny_model_dir, core_process=False)  # the core is readable here
        try:
            for round_ in range(3):
                await workload(engine, rng, 12)
                if round_ == 1:
                    sync(index, "r1", engine)  # a mid-way read: later ones replay batches
                await wait_idle(engine)
                truth = engine.core.scheduler.kv.cached_block_hashes()
                assert engine.kv_events.mirror.hashes == truth
                sync(index, "r1", engine)
                assert index.hashes_of("r1") == truth
            assert engine.kv_events.seq > 10  # many batches, replayed in order
            stale = engine.kv_events.instance
        finally:
            engine.shutdown()
        # The replica restarts its engine: a new instance, an empty cache, new sequence numbers.
        engine = make_engine(tiny_model_dir, core_process=False)
        try:
            assert engine.kv_events.instance != stale
            await workload(engine, rng, 8)
            await wait_idle(engine)
            resyncs = index.num_resyncs
            sync(index, "r1", engine)  # the old cursor names the old instance: a snapshot
            assert index.num_resyncs == resyncs + 1
            assert index.hashes_of("r1") == engine.kv_events.mirror.hashes
            assert index.hashes_of("r1")  # the new engine cached something
            await workload(engine, rng, 8)
            await wait_idle(engine)
            sync(index, "r1", engine)  # replay from the snapshot's sequence number
            assert index.num_resyncs == resyncs + 1
            assert index.hashes_of("r1") == engine.kv_events.mirror.hashes
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_old_batches_gone_from_the_log_means_a_snapshot(tiny_model_dir):
    engine = make_engine(tiny_model_dir, core_process=False)
    engine.kv_events._batches = type(engine.kv_events._batches)(maxlen=2)  # a short replay buffer
    index = KVIndex()

    async def run() -> None:
        sync(index, "r", engine)  # first contact: snapshot (empty)
        await workload(engine, random.Random(1), 10)
        await wait_idle(engine)
        assert engine.kv_events.seq > 3
        before = index.num_resyncs
        sync(index, "r", engine)  # the batches it lacks were dropped: a snapshot instead
        assert index.num_resyncs == before + 1
        assert index.hashes_of("r") == engine.core.scheduler.kv.cached_block_hashes()

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()


def test_events_off_unless_asked(tiny_model_dir):
    engine = AsyncEngine(
        model=str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=16, num_threads=1, core_process=False
    )
    try:
        assert engine.kv_events is None
    finally:
        engine.shutdown()
