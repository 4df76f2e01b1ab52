"""The per-step feed: one Serve stream per (ingress, engine replica) pair carries every
request's deltas, instead of one Serve streaming item per delta per request.

Why. Each item of a Serve streaming call costs CPU in both processes (cloudpickle, the
gRPC generator wrapper, a task wake-up on each side), so one item per delta per request
grows with the streams in flight and is taken from the model's OpenMP threads (what it
cost at saturation: docs/design/router.md, "The per-step feed"). vLLM's engine core sends
its API server one message per step for all requests; this is the same for a Serve
deployment pair.

How. A request still makes its own `generate` call, routed by the request router as
before, and that call still owns the request: its first item (the first token, or the
error that refused it) comes back on it, cancelling it aborts the request, and its end
or failure is how the ingress learns the replica finished or died. What changes is the
path of the items after the one the replica marks:

    ingress                                         engine replica
    FeedHub.open(body) -> inbox for key k           generate({..., FEED_KEY: (feed id, k)})
      generate call  ──────────────────────────▶      an item with "feed": True
      ◀── items up to that one (TTFT) ─────────       later items -> FeedChannel.put(k, item)
    FeedHub's task reads feed(feed id) ◀── one list of (key, item) per loop turn ──
      and puts each item in its request's inbox

- The replica moves a request onto the feed at the first item that finds the ingress's
  feed open on it (`FeedChannel` registered under the feed id); until then the request
  streams on its own call as before, and the first item from a replica without a feed
  from us makes the ingress open one (`FeedHub.ensure`): a burst that reached an idle
  replica moves onto it a step or two later. A feed with no request bound to it for
  `FEED_IDLE_S` ends, so a replica being stopped (scale-down, Ctrl-C) is not held open by
  it: Serve drains a replica until no call is in flight.
- If a feed ends while requests are bound to it (the replica died, the stream broke, the
  ingress is going away), those requests fail with `FeedLost` and the ingress's migration
  continues them from the tokens their clients already have (router.routing.migration): items in
  flight on a broken stream cannot be recovered, and falling back to the requests' own
  calls could leave a gap or reorder them. (The replica still sends on a request's own
  call once its feed is closed there: first what the feed never sent, then the rest; it
  never moves that request onto a feed again. That covers a feed that closes on the
  replica while the ingress has not yet seen it end.) A request's own call ending before its last
  item came over the feed waits at most `FEED_END_GRACE_S` for it (the feed lags), then
  fails the same way.
- A request is done for the ingress when it has handed out an item that is finished or
  an error; the key's inbox is removed then (or when the stream is cancelled).
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import itertools
import logging
import uuid
from typing import Any, Optional

logger = logging.getLogger("ray.serve")

FEED_KEY = "_fleetserve_feed"  # body key: (feed id, request key); set by the ingress only
FEED_FLAG = "feed"  # on the item after which the request's items come over the feed
FEED_IDLE_S = 1.0  # a feed with no request bound to it ends after this long
FEED_END_GRACE_S = 30.0  # the own call ended: how long the last items may lag on the feed


class FeedLost(RuntimeError):
    """A request's items on the feed did not all arrive: its feed ended under it, or its
    call ended and the last items never came. The ingress's migration continues it."""


# -- the engine replica's side ---------------------------------------------------------


class FeedChannel:
    """What the requests bound to one ingress's feed produced since the feed last sent.
    Lives on the replica's event loop; `put` never blocks (a slow reader gets bigger
    batches, as `ready_batches` does for one stream)."""

    def __init__(self) -> None:
        self.open = True
        self.bound = 0  # requests whose later items go over this feed
        self._pending: list[tuple[int, Any]] = []
        self._waiter: Optional[asyncio.Future] = None
        self._sent: list[asyncio.Future] = []  # `drained` waiters, woken when a batch goes out

    def put(self, key: int, payload: Any) -> None:
        self._pending.append((key, payload))
        self._wake()

    def unbind(self) -> None:
        self.bound -= 1
        if self.bound <= 0:
            self._wake()  # the idle clock starts now

    def close(self) -> None:
        """No more sends. What was put and not yet sent stays until its request takes it
        back (`reclaim`) to send it on its own call."""
        self.open = False
        self._wake()
        self._wake_sent()

    async def drained(self, key: int, timeout_s: float) -> bool:
        """Wait until the feed has taken request `key`'s items to send (True), or closed or
        `timeout_s` passed first (False: whatever is left is the request's to `reclaim`, or,
        past the deadline, the ingress's to count lost). A request's call ends only after
        this, so items a feed holds when it closes never outlive the call that could send them."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.open and any(k == key for k, _ in self._pending):
            left = deadline - loop.time()
            if left <= 0:
                return False
            fut = loop.create_future()
            self._sent.append(fut)
            try:
                await asyncio.wait_for(fut, left)
            except asyncio.TimeoutError:
                return False
            finally:
                if fut in self._sent:
                    self._sent.remove(fut)
        return self.open

    def reclaim(self, key: int) -> list[Any]:
        """Request `key`'s items that a closed feed never sent, in order."""
        mine = [payload for k, payload in self._pending if k == key]
        if mine:
            self._pending = [(k, payload) for k, payload in self._pending if k != key]
        return mine

    async def take(self, idle_s: Optional[float] = None) -> Optional[list[tuple[int, Any]]]:
        """The next batch; None when the feed should end (closed, or idle for `idle_s`
        (`FEED_IDLE_S`) with no request bound to it)."""
        idle_s = FEED_IDLE_S if idle_s is None else idle_s
        loop = asyncio.get_running_loop()
        while not self._pending or not self.open:
            if not self.open:
                return None
            idle = self.bound <= 0
            self._waiter = loop.create_future()
            try:
                if idle:
                    try:
                        await asyncio.wait_for(self._waiter, idle_s)
                    except asyncio.TimeoutError:
                        if not self._pending and self.bound <= 0:
                            return None
                else:
                    await self._waiter
            finally:
                self._waiter = None
        batch, self._pending = self._pending, []
        self._wake_sent()
        return batch

    def _wake_sent(self) -> None:
        waiters, self._sent = self._sent, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class FeedChannels:
    """The replica's open feeds, by feed id (one per ingress process and engine pool)."""

    def __init__(self) -> None:
        self._channels: dict[str, FeedChannel] = {}

    def get(self, feed_id: str) -> Optional[FeedChannel]:
        channel = self._channels.get(feed_id)
        return channel if channel is not None and channel.open else None

    def open(self, feed_id: str) -> FeedChannel:
        old = self._channels.get(feed_id)
        if old is not None:  # the ingress opened it again (it lost the old one): replace
            old.close()
        channel = self._channels[feed_id] = FeedChannel()
        return channel

    def close(self, feed_id: str, channel: FeedChannel) -> None:
        channel.close()
        if self._channels.get(feed_id) is channel:
            del self._channels[feed_id]

    def __len__(self) -> int:
        return len(self._channels)


# -- the ingress's side -----------------------------------------------------------------


class Inbox:
    """One request's items, from the feed and from its own call, in arrival order."""

    __slots__ = ("items", "error", "ended", "_waiter")

    def __init__(self) -> None:
        self.items: collections.deque = collections.deque()
        self.error: Optional[BaseException] = None
        self.ended = False  # the request's own call ended
        self._waiter: Optional[asyncio.Future] = None

    def put(self, payload: Any) -> None:
        if isinstance(payload, list):
            self.items.extend(payload)
        else:
            self.items.append(payload)
        self._wake()

    def end(self) -> None:
        self.ended = True
        self._wake()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._wake()

    async def get(self, grace_s: Optional[float] = None) -> Any:
        grace_s = FEED_END_GRACE_S if grace_s is None else grace_s
        while not self.items:
            if self.error is not None:
                raise self.error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                if self.ended:  # only the feed can still bring the rest
                    try:
                        await asyncio.wait_for(self._waiter, grace_s)
                    except asyncio.TimeoutError:
                        if not self.items:
                            raise FeedLost(
                                f"the replica ended the request, but its last "
                                f"outputs did not arrive on the feed within "
                                f"{grace_s:g} s"
                            ) from None
                else:
                    await self._waiter
            finally:
                self._waiter = None
        return self.items.popleft()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class FeedHub:
    """This ingress's feeds to one engine pool: one Serve stream per replica, read by a task
    that sorts each batch into the requests' inboxes."""

    def __init__(self, stream_handle, name: str = "engine") -> None:
        self._handle = stream_handle  # the pool's handle with stream=True
        self.feed_id = f"{name}-{uuid.uuid4().hex[:12]}"
        self._keys = itertools.count()
        self._inboxes: dict[int, Inbox] = {}
        self._feeds: dict[str, asyncio.Task] = {}
        self._bound: dict[str, set[int]] = {}  # replica id -> keys whose items ride its feed
        self._replica_of: dict[int, str] = {}
        self.batches = 0  # counters for tests and debugging
        self.items = 0

    def open(self, generate, body: dict, **kwargs):
        """Call `generate` (the pool's streaming `generate` method handle) for `body` (and
        `kwargs`: a pin) with an inbox ready for its feed items; returns (the call, its
        key, its inbox)."""
        key = next(self._keys)
        inbox = self._inboxes[key] = Inbox()
        try:
            call = generate.remote({**body, FEED_KEY: (self.feed_id, key)}, **kwargs)
        except BaseException:
            self._inboxes.pop(key, None)
            raise
        return call, key, inbox

    def forget(self, key: int) -> None:
        self._inboxes.pop(key, None)
        replica_id = self._replica_of.pop(key, None)
        if replica_id is not None:
            self._bound.get(replica_id, set()).discard(key)

    def bind(self, key: int, replica_id: str) -> None:
        """The replica moved request `key` onto our feed: if that feed ends before the
        request does, the request fails over (`FeedLost`) rather than wait or lose items."""
        inbox = self._inboxes.get(key)
        if inbox is None:
            return
        if replica_id not in self._feeds:  # ended here already: its last items may be lost
            inbox.fail(FeedLost(f"the feed from replica {replica_id} ended as the request moved onto it"))
            return
        self._bound.setdefault(replica_id, set()).add(key)
        self._replica_of[key] = replica_id

    def ensure(self, replica_id: str) -> None:
        """Open a feed to `replica_id` unless one is open or opening."""
        if not replica_id or replica_id in self._feeds:
            return
        # A context of its own: Serve's router keys calls by the request context's internal
        # id, and a call sharing the id of the request that started it confuses it.
        self._feeds[replica_id] = asyncio.get_running_loop().create_task(
            self._run(replica_id), context=contextvars.Context()
        )

    def open_feeds(self) -> list[str]:
        return list(self._feeds)

    async def close(self) -> None:
        tasks = list(self._feeds.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, replica_id: str) -> None:
        from ray.serve.context import _set_request_context

        from fleetserve.router.routing.request_router import TARGET_KWARG

        # (Serve's private context API: Ray 2.60 has no public way to give a call its own id.)
        _set_request_context(_internal_request_id=str(uuid.uuid4()))
        call = None
        try:
            call = self._handle.feed.remote(self.feed_id, replica_id, **{TARGET_KWARG: replica_id})
            inboxes = self._inboxes
            async for batch in call:
                self.batches += 1
                self.items += len(batch)
                for key, payload in batch:
                    inbox = inboxes.get(key)
                    if inbox is not None:  # None: the request was cancelled or is done
                        inbox.put(payload)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the requests' own calls say what failed
            logger.info("feed from replica %s ended: %s: %s", replica_id, type(e).__name__, e)
        finally:
            if call is not None:
                call.cancel()
            if self._feeds.get(replica_id) is asyncio.current_task():
                del self._feeds[replica_id]
            # Requests still on this feed: their items in flight are gone with it. They fail
            # over (migration continues them from what their clients saw) instead of falling
            # back to their own calls with a gap. A feed that ended because nothing was bound
            # to it on the replica has only finished requests here: their last items are
            # already in their inboxes, which hand out items before the error.
            for key in self._bound.pop(replica_id, ()):
                self._replica_of.pop(key, None)
                inbox = self._inboxes.get(key)
                if inbox is not None:
                    inbox.fail(FeedLost(f"the feed from replica {replica_id} ended while the request was on it"))
