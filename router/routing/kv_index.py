"""The cluster-wide prefix index: block hash -> the replicas whose KV cache holds it.

Built from the engines' KV events (`scheduler.kv_events`), not from routing
history: every replica's `KVEventLog` is read by `router.routing.kv_subscriber`, which
hands each reply to `KVIndex.update`. Per replica the index keeps a
`KVCacheMirror` (the replica's set of hashes, and the sequence number of the
last batch applied) plus, across replicas, one map hash -> holders for lookups.

Consistency: a reply is either the batches after the subscriber's cursor, or a
snapshot. The index applies batches only in sequence; a hole (`SequenceGap`) or a
reply from another engine instance (the replica restarted its engine) drops the
replica's view and asks for a snapshot on the next read. So, once a replica's
events have been read, `hashes_of(replica)` is exactly what its engine caches.

The hashes are the engine's own (`scheduler.hash_token_blocks`: same function,
block size and salt), so a router hashes a prompt and walks the chain here.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Optional

from fleetserve.scheduler import KVCacheMirror, SequenceGap
from fleetserve.scheduler.kv_events import apply_events

logger = logging.getLogger("ray.serve")


@dataclass(slots=True)
class _ReplicaView:
    instance: Optional[str] = None  # the engine's KVEventLog; None: needs a snapshot
    mirror: KVCacheMirror = field(default_factory=KVCacheMirror)


class KVIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: dict[Hashable, set[str]] = {}
        self._views: dict[str, _ReplicaView] = {}
        self.num_resyncs = 0  # snapshots applied (first contact included)
        self.num_gaps = 0  # holes in a replica's sequence (each forces a resync)

    # -- what the subscriber asks and tells ------------------------------------

    def cursor(self, replica_id: str) -> tuple[Optional[str], int]:
        """(engine instance, last batch applied) for the next read of `replica_id`."""
        with self._lock:
            view = self._views.get(replica_id)
            return (None, -1) if view is None or view.instance is None else (view.instance, view.mirror.seq)

    def update(self, replica_id: str, reply: dict) -> None:
        """Apply one `KVEventLog.read()` reply from `replica_id`."""
        with self._lock:
            view = self._views.setdefault(replica_id, _ReplicaView())
            instance = reply["instance"]
            if "snapshot" in reply:
                seq, hashes = reply["snapshot"]
                self._drop(replica_id, view)
                view.mirror.reset(seq, ())
                self._add(replica_id, view.mirror.hashes, hashes)
                view.mirror.seq, view.instance = seq, instance
                self.num_resyncs += 1
                return
            if instance != view.instance:
                view.instance = None  # another engine: ask for a snapshot
                return
            for batch in reply["batches"]:
                if batch.seq <= view.mirror.seq:
                    continue  # already applied (a reply raced a snapshot)
                try:
                    self._apply(replica_id, view, batch)
                except SequenceGap as e:
                    logger.warning("KV events of replica %s: %s; resyncing", replica_id, e)
                    self.num_gaps += 1
                    view.instance = None
                    return

    def remove_replica(self, replica_id: str) -> None:
        with self._lock:
            view = self._views.pop(replica_id, None)
            if view is not None:
                self._drop(replica_id, view)

    def retain(self, replica_ids: Iterable[str]) -> None:
        """Forget every replica not in `replica_ids` (they are gone)."""
        keep = set(replica_ids)
        for rid in [r for r in self._views if r not in keep]:
            self.remove_replica(rid)

    # -- what the policy asks ----------------------------------------------------

    def match_lengths(self, hashes: list, replica_ids: Iterable[str]) -> dict[str, int]:
        """Leading blocks of `hashes` (a chain) each replica caches; absent when 0."""
        alive = set(replica_ids)
        matched: dict[str, int] = {}
        with self._lock:
            for i, h in enumerate(hashes):
                alive &= self._holders.get(h, set())
                if not alive:
                    break
                for rid in alive:
                    matched[rid] = i + 1
        return matched

    def hashes_of(self, replica_id: str) -> set:
        with self._lock:
            view = self._views.get(replica_id)
            return set(view.mirror.hashes) if view is not None else set()

    def num_blocks(self, replica_id: str) -> int:
        """How many blocks the replica's cache holds (0 before its first read)."""
        with self._lock:
            view = self._views.get(replica_id)
            return len(view.mirror.hashes) if view is not None else 0

    def replicas(self) -> list[str]:
        with self._lock:
            return list(self._views)

    def __len__(self) -> int:
        return len(self._holders)

    # -- internals (lock held) -------------------------------------------------------

    def _apply(self, replica_id: str, view: _ReplicaView, batch) -> None:
        if batch.seq != view.mirror.seq + 1:
            raise SequenceGap(f"expected batch {view.mirror.seq + 1}, got {batch.seq}")
        added, removed = apply_events(view.mirror.hashes, batch.events)
        view.mirror.seq = batch.seq
        for h in added:
            self._holders.setdefault(h, set()).add(replica_id)
        self._discard(replica_id, removed)

    def _add(self, replica_id: str, into: set, hashes: Iterable) -> None:
        for h in hashes:
            into.add(h)
            self._holders.setdefault(h, set()).add(replica_id)

    def _drop(self, replica_id: str, view: _ReplicaView) -> None:
        self._discard(replica_id, view.mirror.hashes)
        view.mirror.hashes = set()

    def _discard(self, replica_id: str, hashes: Iterable) -> None:
        for h in hashes:
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(replica_id)
                if not holders:
                    del self._holders[h]
