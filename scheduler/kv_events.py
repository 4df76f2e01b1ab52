"""KV cache events: what an engine's prefix cache gains and loses, in vLLM's shape.

An engine's prefix cache is the set of block hashes in its block pool's hash map
(`BlockPool.cached`). Three events describe every change to that set:

* ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size)``: hashes
  registered, as a chain (``block_hashes[0]``'s parent is ``parent_block_hash``,
  ``None`` for a first block; ``token_ids`` are the blocks' tokens, concatenated);
* ``BlockRemoved(block_hashes)``: hashes forgotten (the block was handed out anew,
  or its content was found bad);
* ``AllBlocksCleared()``: the whole map was dropped (a prefix-cache reset).

The block pool reports each change to a `KVEventRecorder` as it happens; the
engine takes the recorded events once per step as one `KVEventBatch` with the
next sequence number (from 1, no holes), so that a subscriber that applies every
batch in order holds exactly the engine's set, and one that sees a hole knows it
missed something and must resync. `KVCacheMirror` is such a subscriber: the
replica keeps one (so it can answer a resync with a snapshot) and so does the
router's index, per replica.

Hashes are opaque here (ints today; whatever `kv_cache_manager` hashes with).
Pure Python: the scheduler package imports neither torch nor ray.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Optional, Sequence, Union

BlockHash = Hashable


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[BlockHash]
    parent_block_hash: Optional[BlockHash]
    token_ids: list[int]
    block_size: int


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[BlockHash]


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(slots=True)
class KVEventBatch:
    """Events of one engine step (or of commands between steps), in order."""

    seq: int
    ts: float
    events: list[KVEvent] = field(default_factory=list)


class KVEventRecorder:
    """Collects the pool's changes; `take_batch()` hands them out once per step.

    Consecutive stores that continue one chain are merged into one `BlockStored`
    and consecutive removals into one `BlockRemoved`, as vLLM batches them.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.seq = 0  # of the last batch taken
        self._events: list[KVEvent] = []

    def stored(self, block_hash: BlockHash, parent_hash: Optional[BlockHash], token_ids: Sequence[int]) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockStored) and parent_hash is not None and last.block_hashes[-1] == parent_hash:
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
            return
        self._events.append(BlockStored([block_hash], parent_hash, list(token_ids), self.block_size))

    def removed(self, block_hash: BlockHash) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockRemoved([block_hash]))

    def cleared(self) -> None:
        # Whatever came before in this batch is moot.
        self._events = [AllBlocksCleared()]

    def take_batch(self) -> Optional[KVEventBatch]:
        """The events since the last call as the next batch, or None when there are none."""
        if not self._events:
            return None
        self.seq += 1
        batch = KVEventBatch(self.seq, time.time(), self._events)
        self._events = []
        return batch


class SequenceGap(Exception):
    """A batch arrived out of order: the subscriber missed events and must resync."""


class KVCacheMirror:
    """The set of block hashes an engine caches, rebuilt from its event batches."""

    def __init__(self) -> None:
        self.hashes: set[BlockHash] = set()
        self.seq = 0  # of the last batch applied

    def apply(self, batch: KVEventBatch) -> None:
        if batch.seq != self.seq + 1:
            raise SequenceGap(f"expected batch {self.seq + 1}, got {batch.seq}")
        apply_events(self.hashes, batch.events)
        self.seq = batch.seq

    def reset(self, seq: int, hashes: Iterable[BlockHash]) -> None:
        """Start over from a snapshot taken after batch `seq`."""
        self.hashes = set(hashes)
        self.seq = seq


def apply_events(hashes: set[BlockHash], events: Iterable[KVEvent]) -> tuple[list[BlockHash], list[BlockHash]]:
    """Apply events to a set of hashes; returns (added, removed) (a clear removes all)."""
    added: list[BlockHash] = []
    removed: list[BlockHash] = []
    for ev in events:
        if isinstance(ev, BlockStored):
            for h in ev.block_hashes:
                if h not in hashes:
                    hashes.add(h)
                    added.append(h)
        elif isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                if h in hashes:
                    hashes.discard(h)
                    removed.append(h)
        elif isinstance(ev, AllBlocksCleared):
            removed.extend(hashes)
            hashes.clear()
        else:
            raise TypeError(f"not a KV event: {ev!r}")
    return added, removed


class KVEventLog:
    """An engine's published batches, kept where subscribers can read them.

    It keeps the latest `max_batches` batches for replay, and a mirror of the
    whole cache for a snapshot when a subscriber is too far behind (or new, or
    was reading another engine: `instance` names this log, so a restarted
    engine, which starts a new log, makes every subscriber resync). Appends come
    from the engine's thread, reads from the event loop: one lock.
    """

    def __init__(self, max_batches: int = 1024) -> None:
        self.instance = uuid.uuid4().hex
        self.mirror = KVCacheMirror()
        self._batches: deque[KVEventBatch] = deque(maxlen=max_batches)
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []

    @property
    def seq(self) -> int:
        return self.mirror.seq

    def add_listener(self, fn: Callable[[], None]) -> None:
        """`fn()` is called (on the appending thread) after every append."""
        self._listeners.append(fn)

    def append(self, batch: KVEventBatch) -> None:
        with self._lock:
            self.mirror.apply(batch)  # SequenceGap here is a bug: batches travel in order
            self._batches.append(batch)
        for fn in list(self._listeners):
            fn()

    def read(self, since_seq: int, instance: Optional[str]) -> dict[str, Any]:
        """What a subscriber that has applied batches up to `since_seq` of `instance` needs:
        ``{"instance", "batches": [...]}`` (possibly empty), or, when the batches it lacks
        are gone or it follows another instance, ``{"instance", "snapshot": (seq, hashes)}``."""
        with self._lock:
            seq = self.mirror.seq
            if instance == self.instance and 0 <= since_seq <= seq:
                if since_seq == seq:
                    return {"instance": self.instance, "batches": []}
                if self._batches and self._batches[0].seq <= since_seq + 1:
                    start = since_seq + 1 - self._batches[0].seq
                    return {
                        "instance": self.instance,
                        "batches": [self._batches[i] for i in range(start, len(self._batches))],
                    }
            return {"instance": self.instance, "snapshot": (seq, list(self.mirror.hashes))}
