"""The per-step feed (router/feed.py) between the ingress's `ReplicaStream` and a real
`EngineReplica` on a real AsyncEngine, outside Serve: a stand-in for Serve's streaming
calls runs each replica generator as a task of its own (as Serve does: the replica runs
ahead of the reader, and cancelling a call cancels that task)."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetserve.router import feed as feed_mod
from fleetserve.router.api.protocol import sampling_dict
from fleetserve.router.feed import FEED_KEY, FeedChannel, FeedHub, FeedLost, Inbox
from fleetserve.router.replica import EngineReplica
from fleetserve.router.routing.migration import MigratingStream
from fleetserve.router.streams import ReplicaStream
from fleetserve.scheduler import SamplingParams


class Call:
    """A Serve streaming call: the replica's generator pumped by its own task."""

    def __init__(self, agen) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.ensure_future(self._pump(agen))

    async def _pump(self, agen) -> None:
        try:
            async for item in agen:
                self._queue.put_nowait(("item", item))
            self._queue.put_nowait(("end", None))
        except asyncio.CancelledError:
            self._queue.put_nowait(("error", RuntimeError("call cancelled")))
            raise
        except Exception as e:  # noqa: BLE001 - handed to the reader, as Serve does
            self._queue.put_nowait(("error", e))
        finally:
            await agen.aclose()

    def __aiter__(self):
        return self

    async def __anext__(self):
        kind, value = await self._queue.get()
        if kind == "item":
            return value
        self._queue.put_nowait((kind, value))  # the end stays the end
        if kind == "end":
            raise StopAsyncIteration
        raise value

    def cancel(self) -> None:
        self._task.cancel()


class Method:
    def __init__(self, fn, calls: list) -> None:
        self._fn, self._calls = fn, calls

    def remote(self, *args, **kwargs) -> Call:
        call = Call(self._fn(*args, **kwargs))
        self._calls.append(call)
        return call


class Handle:
    """The engine pool's streaming handle, for one replica."""

    def __init__(self, replica: EngineReplica) -> None:
        self.calls: list[Call] = []
        self.generate = Method(replica.generate, self.calls)
        self.feed = Method(replica.feed, self.calls)


@pytest.fixture(scope="module")
def replica(tiny_model_dir):
    r = EngineReplica(
        {
            "model": str(tiny_model_dir),
            "max_model_len": 256,
            "max_num_seqs": 8,
            "num_threads": 1,
            "num_gpu_blocks_override": 64,
        },
        "fleetserve.replica.engine.async_engine:AsyncEngine",
    )
    yield r
    r.engine.shutdown()


def body(rid: str, ids: list[int], **params) -> dict:
    params.setdefault("temperature", 0.0)
    return {
        "request_id": rid,
        "prompt_token_ids": ids,
        "sampling_params": sampling_dict(SamplingParams(**params)),
        "priority": 0,
    }


async def read_all(stream) -> tuple[list[int], list[dict]]:
    tokens, items = [], []
    async for item in stream:
        items.append(item)
        assert "error" not in item, item
        tokens += item["outputs"][0]["token_ids"]
    return tokens, items


async def wait_until(cond, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def assert_no_leak(replica) -> None:
    deadline = time.monotonic() + 10
    while True:
        load = replica.engine.get_load()
        if load["num_running"] == 0 and load["num_waiting"] == 0 and load["num_free_blocks"] == load["num_blocks"]:
            return
        assert time.monotonic() < deadline, load
        time.sleep(0.02)


def aborted(replica) -> float:
    return sum(
        s.value
        for fam in text_string_to_metric_families(replica.engine.metrics_text())
        if fam.name == "vllm:request_success"
        for s in fam.samples
        if s.name.endswith("_total") and s.labels.get("finished_reason") == "abort"
    )


async def with_open_feed(replica):
    """A pool handle for `replica` and an ingress-side hub whose feed to it is open."""
    handle = Handle(replica)
    hub = FeedHub(handle)
    hub.ensure(replica.replica_id)
    await wait_until(lambda: len(replica._feeds) == 1, "feed open")
    return handle, hub


PROMPTS = [[5, 6, 7 + i, 8, 9] for i in range(6)]


def test_feed_carries_every_stream_and_matches_the_direct_path(replica, monkeypatch):
    monkeypatch.setattr(feed_mod, "FEED_IDLE_S", 0.3)

    async def go():
        handle = Handle(replica)
        hub = FeedHub(handle)
        expected = [
            (
                await read_all(
                    ReplicaStream.open(handle.generate, body(f"d{i}", p, max_tokens=12, ignore_eos=True), None)
                )
            )[0]
            for i, p in enumerate(PROMPTS)
        ]
        # The first request reaches a replica without a feed from us: it streams on its
        # own call, and its first item opens the feed.
        first = ReplicaStream.open(handle.generate, body("f", PROMPTS[0], max_tokens=12, ignore_eos=True), hub)
        assert (await read_all(first))[0] == expected[0]
        await wait_until(lambda: len(replica._feeds) == 1, "the feed opened on the replica")
        assert hub.open_feeds() == [replica.replica_id]
        fed_before = hub.items  # (the first request may have moved onto it mid-stream)
        streams = [
            ReplicaStream.open(handle.generate, body(f"r{i}", p, max_tokens=12, ignore_eos=True), hub)
            for i, p in enumerate(PROMPTS)
        ]
        results = await asyncio.gather(*[read_all(s) for s in streams])
        for (tokens, items), want in zip(results, expected):
            assert tokens == want  # greedy: the same tokens as the direct path, in order
            assert items[-1]["finished"] and not any(i["finished"] for i in items[:-1])
            assert all("feed" not in i for i in items)  # the flag is the ingress's business
        # 6 streams x 11 later tokens, sent in far fewer feed messages than items.
        assert hub.items - fed_before == 6 * 11, hub.items
        assert hub.batches < hub.items / 2, (hub.batches, hub.items)
        assert not hub._inboxes  # every key forgotten at its stream's end
        # No request bound: the feed ends on the replica, and the hub forgets it.
        await wait_until(lambda: not hub.open_feeds() and not len(replica._feeds), "idle feed ended")

    asyncio.run(go())
    assert_no_leak(replica)


def test_a_burst_sent_before_the_feed_opened_moves_onto_it_mid_stream(replica):
    """Requests already running when the feed opens switch to it at their next item: an idle
    server (no feed) hit by a burst still gets the burst's tokens over one feed. On a fast CPU a
    burst can end before its feed opens (nothing to move: the precondition, not the feed, is
    missed), so a burst that moved nothing runs again, with a fresh hub, up to 3 times."""

    async def go():
        handle = Handle(replica)
        # 120 tokens each: 6 x 8 blocks of the replica's 64
        expected = [
            (
                await read_all(
                    ReplicaStream.open(handle.generate, body(f"e{i}", p, max_tokens=120, ignore_eos=True), None)
                )
            )[0]
            for i, p in enumerate(PROMPTS)
        ]
        for attempt in range(3):
            await wait_until(lambda: not len(replica._feeds), "the last burst's feed closed")
            hub = FeedHub(handle)
            streams = [
                ReplicaStream.open(handle.generate, body(f"b{attempt}-{i}", p, max_tokens=120, ignore_eos=True), hub)
                for i, p in enumerate(PROMPTS)
            ]
            results = await asyncio.gather(*[read_all(s) for s in streams])
            assert [tokens for tokens, _ in results] == expected  # in order, none lost or repeated
            moved = sum(s._watcher is not None for s in streams)
            assert not hub._inboxes
            await hub.close()
            if moved:
                break
        assert moved >= 1 and hub.items > 0, (moved, hub.items)

    asyncio.run(go())
    assert_no_leak(replica)


def test_cancelled_stream_on_the_feed_aborts_and_frees_its_blocks(replica):
    async def go():
        handle, hub = await with_open_feed(replica)
        stream = ReplicaStream.open(handle.generate, body("c", PROMPTS[1], max_tokens=200, ignore_eos=True), hub)
        other = ReplicaStream.open(handle.generate, body("o", PROMPTS[2], max_tokens=8, ignore_eos=True), hub)
        for _ in range(3):
            await stream.__anext__()
        assert stream._watcher is not None  # on the feed
        stream.cancel()  # the client went away
        tokens, _ = await read_all(other)  # the other stream on the same feed goes on
        assert len(tokens) == 8
        await wait_until(lambda: replica.engine.get_load()["num_running"] == 0, "aborted")
        assert not hub._inboxes
        await hub.close()

    before = aborted(replica)
    asyncio.run(go())
    assert_no_leak(replica)
    assert aborted(replica) == before + 1


def test_a_feed_that_ends_under_a_request_fails_it_over_without_a_gap(replica):
    """The feed ends while a request rides it (its stream broke, the ingress dropped it):
    the items in flight are gone, so the request fails with FeedLost, and the ingress's
    migration continues it from what the client has: the same tokens as an uninterrupted
    run, none lost, none repeated."""

    async def go():
        handle = Handle(replica)
        hub = FeedHub(handle)
        direct, _ = await read_all(
            ReplicaStream.open(handle.generate, body("x", PROMPTS[3], max_tokens=40, ignore_eos=True), None)
        )
        hub.ensure(replica.replica_id)
        await wait_until(lambda: len(replica._feeds) == 1, "feed open")
        stream = ReplicaStream.open(handle.generate, body("y", PROMPTS[3], max_tokens=40, ignore_eos=True), hub)
        tokens = []
        for _ in range(4):
            tokens += (await stream.__anext__())["outputs"][0]["token_ids"]
        assert stream._watcher is not None
        await hub.close()  # the feed ends under the request
        with pytest.raises(FeedLost):
            while True:
                await asyncio.wait_for(stream.__anext__(), 10)
        assert not hub._inboxes and not hub._bound
        await wait_until(lambda: not len(replica._feeds), "feed closed on the replica")

        # The same through the ingress's MigratingStream: the client's stream goes on.
        hub.ensure(replica.replica_id)
        await wait_until(lambda: len(replica._feeds) == 1, "feed open again")
        migrating = MigratingStream(
            lambda b: ReplicaStream.open(handle.generate, b, hub),
            body("m", PROMPTS[3], max_tokens=40, ignore_eos=True),
            max_migrations=2,
            backoff_s=0,
        )
        got = []
        for _ in range(4):
            got += (await migrating.__anext__())["outputs"][0]["token_ids"]
        await hub.close()
        rest, items = await read_all(migrating)
        assert migrating.migrations == 1
        assert got + rest == direct  # greedy: nothing lost, nothing repeated, in order
        assert items[-1]["finished"]
        await hub.close()

    asyncio.run(go())
    assert_no_leak(replica)


def test_a_call_that_fails_while_its_items_ride_the_feed_raises_to_the_reader(replica):
    """The replica died: its calls fail (Serve raises in the reader). The stream raises that
    error (migration decides what next) instead of waiting on the feed."""

    async def go():
        handle, hub = await with_open_feed(replica)
        stream = ReplicaStream.open(handle.generate, body("z", PROMPTS[4], max_tokens=200, ignore_eos=True), hub)
        await stream.__anext__()
        await stream.__anext__()
        assert stream._watcher is not None
        call = handle.calls[-1]
        call._task.cancel()  # the replica side is gone...
        call._queue.put_nowait(("error", ConnectionError("the replica died")))  # ...and Serve says so
        with pytest.raises((ConnectionError, RuntimeError)):
            while True:
                await asyncio.wait_for(stream.__anext__(), 10)
        assert not hub._inboxes
        await hub.close()

    asyncio.run(go())
    assert_no_leak(replica)


@pytest.mark.parametrize("when", ["mid-request", "after its last item"])
def test_items_a_closed_feed_never_sent_go_out_on_the_call_in_order(replica, when):
    """The replica side alone: a feed channel nobody reads (its stream is stuck or gone)
    holds a bound request's items; when it closes, the request sends those items and then
    the rest on its own call, in order, so an ingress that never heard of the feed's end
    still gets every token. Also when the request had put its last item in already: its
    call waits for the feed to take them (`FeedChannel.drained`) instead of ending."""

    async def go():
        direct, _ = await read_all(
            ReplicaStream.open(Handle(replica).generate, body("p", PROMPTS[5], max_tokens=30, ignore_eos=True), None)
        )
        channel = replica._feeds.open("stuck-ingress")
        gen = Call(
            replica.generate({**body("q", PROMPTS[5], max_tokens=30, ignore_eos=True), FEED_KEY: ("stuck-ingress", 7)})
        )  # pumped, as Serve does
        first = await gen.__anext__()
        first = first[-1] if isinstance(first, list) else first
        assert first.pop("feed") is True and channel.bound == 1
        held = 5 if when == "mid-request" else len(direct) - len(first["outputs"][0]["token_ids"])
        await wait_until(
            lambda: sum(len(p["outputs"][0]["token_ids"]) for _, p in channel._pending) >= held,
            "items held by the unread feed",
        )
        if when != "mid-request":
            await asyncio.sleep(0.05)
            assert not gen._task.done()  # the call waits for the feed to take its items
        replica._feeds.close("stuck-ingress", channel)
        tokens = list(first["outputs"][0]["token_ids"])
        async for item in gen:
            for i in item if isinstance(item, list) else [item]:
                assert "feed" not in i
                tokens += i["outputs"][0]["token_ids"]
        assert tokens == direct  # the held items, then the rest: nothing lost, in order
        assert channel.bound == 0 and not channel._pending

    asyncio.run(go())
    assert_no_leak(replica)


def test_a_feed_pinned_to_another_replica_ends_at_once(replica):
    async def go():
        items = [b async for b in replica.feed("some-ingress", "not-this-replica")]
        assert items == [] and not len(replica._feeds)

    asyncio.run(go())


def test_errors_and_one_token_requests_stay_on_their_call(replica):
    async def go():
        handle, hub = await with_open_feed(replica)
        bad = body("bad", PROMPTS[0])
        bad["sampling_params"]["temperature"] = -1.0
        item = await ReplicaStream.open(handle.generate, bad, hub).__anext__()
        assert item["status"] == 400 and "temperature" in item["error"]["message"]
        tokens, items = await read_all(ReplicaStream.open(handle.generate, body("one", PROMPTS[0], max_tokens=1), hub))
        assert len(tokens) == 1 and items[-1]["finished"]
        assert hub.items == 0 and not hub._inboxes
        await hub.close()

    asyncio.run(go())
    assert_no_leak(replica)


def test_feed_channel_batches_and_ends_when_idle_or_closed():
    async def go():
        ch = FeedChannel()
        ch.bound = 1
        ch.put(1, "a")
        ch.put(2, "b")
        assert await ch.take() == [(1, "a"), (2, "b")]
        waiting = asyncio.ensure_future(ch.take(idle_s=0.05))
        await asyncio.sleep(0.1)
        assert not waiting.done()  # a request is bound: no idle end
        ch.unbind()
        assert await asyncio.wait_for(waiting, 2) is None  # idle: the feed ends
        ch2 = FeedChannel()
        later = asyncio.ensure_future(ch2.take(idle_s=10))
        await asyncio.sleep(0)
        ch2.close()
        assert await asyncio.wait_for(later, 2) is None

    asyncio.run(go())


def test_inbox_keeps_order_and_bounds_the_wait_after_the_call_ended():
    async def go():
        box = Inbox()
        box.put({"n": 1})
        box.put([{"n": 2}, {"n": 3}])
        assert [(await box.get())["n"] for _ in range(3)] == [1, 2, 3]
        box.end()  # the call ended; the feed may still bring the last item...
        late = asyncio.ensure_future(box.get(grace_s=5))
        await asyncio.sleep(0.01)
        box.put({"n": 4})
        assert (await late)["n"] == 4
        with pytest.raises(FeedLost):  # ...but not forever
            await box.get(grace_s=0.05)
        failed = Inbox()
        failed.fail(ConnectionError("replica died"))
        with pytest.raises(ConnectionError):
            await failed.get()

    asyncio.run(go())


def test_hub_adds_the_feed_key_without_touching_the_body():
    class Gen:
        def __init__(self):
            self.bodies = []

        def remote(self, b):
            self.bodies.append(b)
            return object()

    async def go():
        hub = FeedHub(None)
        gen = Gen()
        original = {"request_id": "r"}
        _, key, inbox = hub.open(gen, original)
        assert FEED_KEY not in original and gen.bodies[0][FEED_KEY] == (hub.feed_id, key)
        assert hub._inboxes[key] is inbox
        hub.forget(key)
        assert not hub._inboxes
        # A replica moved a request onto a feed this ingress no longer has (it ended a
        # moment before): the request fails over at once instead of waiting for items.
        _, key2, inbox2 = hub.open(gen, original)
        hub.bind(key2, "replica-without-a-feed")
        with pytest.raises(FeedLost):
            await asyncio.wait_for(inbox2.get(), 2)

    asyncio.run(go())
