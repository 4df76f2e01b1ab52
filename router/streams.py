"""Reading an engine replica's `generate` stream: `ReplicaStream` (one call, with the
per-step feed of router/feed.py), and the two ways the routes consume a stream to its
end (`drain` for whole responses, `stream_items` for streamed ones).

Every stream here has the same small interface, which MigratingStream
(router/routing/migration.py), the P/D and reuse streams and MergedStream
(router/api/completions.py) share: `async for` over items (dicts; an error item has
"error" and "status"), and `cancel()`, which aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import collections
from typing import AsyncIterator, Optional

from fleetserve.router.api.errors import error_body, is_error
from fleetserve.router.feed import FEED_FLAG, FeedHub, Inbox
from fleetserve.router.routing.registry import release_request


async def drain(gen, first: dict, take) -> Optional[dict]:
    """`take` each item, `first` on, to the stream's end; the error item that ended it, if one
    did. The stream is cancelled on the way out (a no-op when it finished; an abort in the
    engine when this request was cancelled)."""
    try:
        item = first
        while not is_error(item):
            take(item)
            try:
                item = await gen.__anext__()
            except StopAsyncIteration:
                return None
        return item
    finally:
        gen.cancel()


async def stream_items(gen, first: dict) -> AsyncIterator[dict]:
    """`first`, then the stream's items up to its end or an error item; a replica that fails
    mid-stream ends it with a 500 error item (the client is told, not cut off)."""
    item = first
    while True:
        yield item
        if is_error(item):
            return
        try:
            item = await gen.__anext__()
        except StopAsyncIteration:
            return
        except Exception as e:  # noqa: BLE001 - reported to the client as the stream's end
            item = error_body(f"internal error: {type(e).__name__}: {e}", 500)


class ReplicaStream:
    """A replica's `generate` stream, one delta at a time. The replica sends a list
    when several deltas were ready at once (router.replica.ready_batches); they are
    handed out here without awaiting in between, so their SSE chunks also leave in one
    ASGI message.

    With a `FeedHub` (router.feed) the call carries a feed key: when the replica marks an
    item (`"feed": True`: the replica has our feed open), the later items come from the
    hub's feed into this stream's inbox, and a task of ours waits on the call itself (its
    end, its failure, or items it still sends if the feed closed). Until then, and without
    a hub, everything comes on the call as before; a first item from a replica that has no
    feed from us opens one (the replica moves this request onto it once it is open)."""

    def __init__(
        self, gen, hub: Optional[FeedHub] = None, key: Optional[int] = None, inbox: Optional[Inbox] = None
    ) -> None:
        self._gen = gen
        self._ready: collections.deque = collections.deque()
        self._hub, self._key, self._inbox = hub, key, inbox
        self._watcher: Optional[asyncio.Task] = None
        self._first = True
        self._done = False

    @classmethod
    def open(cls, generate, body: dict, hub: Optional[FeedHub], **kwargs) -> "ReplicaStream":
        if hub is None:
            return cls(generate.remote(body, **kwargs))
        call, key, inbox = hub.open(generate, body, **kwargs)
        return cls(call, hub, key, inbox)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._ready:
            return self._ready.popleft()
        if self._watcher is not None:  # the feed brings the items
            if self._done:
                raise StopAsyncIteration
            try:
                item = await self._inbox.get()
            except BaseException:
                self._finish()
                raise
            if isinstance(item, dict) and (item.get("finished") or is_error(item)):
                self._finish()
            return item
        try:
            item = await self._gen.__anext__()
        except BaseException:  # the end, an error, or our caller cancelled: stop counting it
            self._finish()
            raise
        if self._hub is not None and self._inbox is not None:  # (hub.open gives both)
            last = item[-1] if isinstance(item, list) else item
            if isinstance(last, dict) and last.pop(FEED_FLAG, False):
                # The rest comes over the feed (already arriving in our inbox, in order).
                self._watcher = asyncio.ensure_future(self._watch(self._inbox))
                self._hub.bind(self._key, last.get("replica", ""))
            elif self._first and not is_error(last):
                self._hub.ensure(last.get("replica", ""))  # no feed there yet: open one
            self._first = False
        if isinstance(item, list):
            self._ready.extend(item[1:])
            item = item[0]
        if (
            self._watcher is None
            and isinstance(item, dict)
            and (item.get("finished") or is_error(item))
            and not self._ready
        ):
            self._finish()
        return item

    async def _watch(self, inbox: Inbox) -> None:
        """The call itself, while the feed brings the items: its end, its failure, or items
        it sends once the feed closed on the replica."""
        try:
            async for payload in self._gen:
                inbox.put(payload)
            inbox.end()
        except asyncio.CancelledError:
            pass
        except Exception as e:  # noqa: BLE001 - raised to the reader (migration decides)
            inbox.fail(e)

    def cancel(self) -> None:
        self._gen.cancel()
        if self._watcher is not None:
            self._watcher.cancel()
        self._finish()

    def _finish(self) -> None:
        # After a last item the watcher stays: the call ends right after it on the replica.
        if self._done:
            return
        self._done = True
        self._forget_key()
        # (`_request_metadata` is private: Ray 2.60's response exposes `request_id`, not the
        # internal id Serve's router keys calls by, and no public way to it.)
        meta = getattr(self._gen, "_request_metadata", None)
        if meta is not None:
            release_request(meta.internal_request_id)

    def _forget_key(self) -> None:
        if self._hub is not None and self._key is not None:
            self._hub.forget(self._key)
            self._key = None
