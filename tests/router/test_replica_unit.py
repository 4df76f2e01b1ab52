"""The replica deployment class outside Serve, on a real AsyncEngine: error items and 429."""

from __future__ import annotations

import asyncio
import time

import pytest

from fleetserve.router.api.protocol import sampling_dict
from fleetserve.router.replica import EngineReplica
from fleetserve.router.routing.migration import MIGRATED_KEY
from fleetserve.scheduler import SamplingParams


@pytest.fixture(scope="module")
def replica(tiny_model_dir):
    r = EngineReplica(
        {
            "model": str(tiny_model_dir),
            "max_model_len": 128,
            "max_num_seqs": 1,
            "max_waiting_requests": 1,
            "num_threads": 1,
            "num_gpu_blocks_override": 32,
        },
        "fleetserve.replica.engine.async_engine:AsyncEngine",
    )
    yield r
    r.engine.shutdown()


def body(rid: str, ids: list[int], **params) -> dict:
    return {
        "request_id": rid,
        "prompt_token_ids": ids,
        "sampling_params": sampling_dict(SamplingParams(**params)),
        "priority": 0,
    }


async def first_item(agen):
    """The first item; the replica yields a list when several outputs were ready at once."""
    item = await agen.__anext__()
    return item[0] if isinstance(item, list) else item


def items_of(item) -> list[dict]:
    return item if isinstance(item, list) else [item]


def num_tokens(item) -> int:
    return sum(len(o["token_ids"]) for i in items_of(item) for o in i["outputs"])


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
        # A migrated request's continuation was admitted once: it queues past the bound.
        migrated = replica.generate({**body("c-m1", [5, 6, 9, 11], max_tokens=4, ignore_eos=True), MIGRATED_KEY: 1})
        migrated_first = asyncio.ensure_future(migrated.__anext__())
        await running.aclose()  # the caller goes away: aborted
        assert "outputs" in await waiter
        async for _ in waiting:
            pass
        first = await migrated_first
        assert all("outputs" in i for i in items_of(first)), first
        tokens = num_tokens(first)
        async for item in migrated:
            tokens += num_tokens(item)
        assert tokens == 4

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
        bad = await first_item(
            replica.generate({"request_id": "x", "prompt_token_ids": [5], "sampling_params": {"max_tokens": 0}})
        )
        assert bad["status"] == 400 and bad["error"]["param"] == "max_tokens"
        long = await first_item(replica.generate(body("y", [5] * 500, max_tokens=2)))
        assert long["status"] == 400 and long["error"]["message"]

    asyncio.run(go())


class _Out:
    def __init__(self, i: int, finished: bool = False) -> None:
        self.i, self.finished = i, finished


def test_ready_batches_sends_at_once_and_groups_only_what_is_queued():
    from fleetserve.router.replica import ready_batches

    closed = []

    async def engine(queue):
        try:
            while True:
                out = await queue.get()
                yield out
                if out.finished:
                    return
        finally:
            closed.append(True)  # the real engine aborts the request here

    async def go():
        queue: asyncio.Queue = asyncio.Queue()
        got = []

        async def slow_consumer():
            async for batch in ready_batches(engine(queue)):
                got.append([o.i for o in batch])
                await asyncio.sleep(0.02)

        task = asyncio.create_task(slow_consumer())
        for i in range(10):
            queue.put_nowait(_Out(i, finished=i == 9))
            await asyncio.sleep(0.005)
        await task
        assert [i for b in got for i in b] == list(range(10))
        assert got[0] == [0] and len(got) < 10  # first alone (TTFT), later ones grouped
        assert closed

        # A caller that goes away closes the engine's stream (abort).
        closed.clear()
        queue = asyncio.Queue()

        async def consumer():
            async for _ in ready_batches(engine(queue)):
                pass

        task = asyncio.create_task(consumer())
        queue.put_nowait(_Out(0))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert closed

        # An error after some outputs: the outputs go out first, then the error.
        async def failing():
            yield _Out(0)
            yield _Out(1)
            raise ValueError("boom")

        seen = []
        with pytest.raises(ValueError):
            async for batch in ready_batches(failing()):
                seen.extend(o.i for o in batch)
        assert seen == [0, 1]

    asyncio.run(go())
