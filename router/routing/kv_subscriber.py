"""Keeps a `KVIndex` fed with every engine replica's KV events (runs in the ingress).

One asyncio task per replica long-polls `EngineReplica.kv_events(since_seq,
instance)` through a call pinned to that replica (the mechanism the ingress uses
for metrics): the replica answers at once when it has batches the index lacks,
otherwise when its engine publishes the next one (or after `wait_s`). Between
polls the task sleeps `poll_interval_s`, so a busy engine's steps reach the index
in batches of ~that period instead of one call per step (each call costs CPU in
three processes). The index's own cursor (instance, last sequence
number) makes every read resume exactly where the last one ended; a replica that
restarted its engine, or a hole in the sequence, gets a snapshot instead.

A supervisor task follows the router's replica set: a new replica (a restart
comes back under a new id) gets a follower; a gone one is cancelled and dropped
from the index. Tasks run in a fresh `contextvars.Context`: Serve reads the
current request's context when a handle call is made, and calls that inherited an
incoming request's internal id would be confused with that request's calls.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import Callable, Optional

from fleetserve.router.routing.kv_index import KVIndex
from fleetserve.router.routing.request_router import TARGET_KWARG

logger = logging.getLogger("ray.serve")


class KVEventSubscriber:
    def __init__(
        self,
        handle,
        replica_ids: Callable[[], list[str]],
        index: KVIndex,
        poll_interval_s: float = 0.05,
        wait_s: float = 1.0,
        membership_period_s: float = 0.5,
        call_timeout_s: float = 10.0,
    ) -> None:
        self._handle = handle
        self._replica_ids = replica_ids
        self.index = index
        self.poll_interval_s = poll_interval_s
        self.wait_s = wait_s
        self.membership_period_s = membership_period_s
        self.call_timeout_s = call_timeout_s
        self._followers: dict[str, asyncio.Task] = {}
        self._supervisor: Optional[asyncio.Task] = None
        self.num_polls = 0
        self.num_errors = 0

    def start(self) -> None:
        if self._supervisor is None:
            loop = asyncio.get_running_loop()
            self._supervisor = loop.create_task(self._supervise(), context=contextvars.Context())

    async def stop(self) -> None:
        tasks = [t for t in [self._supervisor, *self._followers.values()] if t is not None]
        for t in tasks:
            t.cancel()
        if tasks:  # a follower inside a Serve call may take a while to see its cancel: bounded
            await asyncio.wait(tasks, timeout=5.0)
        self._supervisor, self._followers = None, {}

    async def _supervise(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                current = set(self._replica_ids())
            except Exception as e:  # noqa: BLE001 - the router is not there yet: try again
                logger.debug("KV subscriber: no replica list yet: %s", e)
                current = set(self._followers)
            for rid in [r for r in self._followers if r not in current]:
                self._followers.pop(rid).cancel()
                self.index.remove_replica(rid)
            for rid in current - set(self._followers):
                self._followers[rid] = loop.create_task(self._follow(rid), context=contextvars.Context())
            await asyncio.sleep(self.membership_period_s)

    async def _follow(self, replica_id: str) -> None:
        while True:
            instance, seq = self.index.cursor(replica_id)
            try:
                reply = await asyncio.wait_for(
                    self._handle.kv_events.remote(seq, instance, self.wait_s, **{TARGET_KWARG: replica_id}),
                    self.wait_s + self.call_timeout_s,
                )
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - replica restarting or gone: retry, then the
                self.num_errors += 1  # supervisor cancels us if it is really gone
                logger.debug("KV events of replica %s: %r", replica_id, e)
                await asyncio.sleep(max(self.membership_period_s, self.poll_interval_s))
                continue
            self.num_polls += 1
            if reply.get("disabled"):
                logger.warning(
                    "replica %s does not publish KV events (engine started without "
                    "enable_kv_cache_events): prefix routing cannot see its cache",
                    replica_id,
                )
                return
            if reply.get("replica") != replica_id:
                # A pinned call to a replica that is gone goes anywhere: not its events.
                await asyncio.sleep(self.membership_period_s)
                continue
            self.index.update(replica_id, reply)
            await asyncio.sleep(self.poll_interval_s)
