"""A fixed pool of KV blocks with prefix-cache bookkeeping.

Every block is in exactly one of two states:

* referenced (``ref_cnt > 0``): owned by one or more requests;
* free (``ref_cnt == 0``): in the LRU free queue. A free block may still carry
  a hash, so a later request with the same prefix can take it back (0 -> 1)
  until the block is handed out as a new block, which evicts the hash.

The free queue is an intrusive doubly linked list, so removing a cache hit
from the middle of it is O(1).

Every change to the hash map (a hash registered, evicted, or all dropped) is
reported to `events` when one is attached (`scheduler.kv_events`): that is what
the router's cluster-wide prefix index is built from.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional, Sequence

from fleetserve.scheduler.kv_events import KVEventRecorder


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[int] = None
        self.prev_free: Optional[KVCacheBlock] = None
        self.next_free: Optional[KVCacheBlock] = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """LRU order: evict from the head, return freed blocks to the tail."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free = len(blocks)
        # Sentinels keep the link updates branch-free.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free, block.prev_free = block, prev
            prev = block
        prev.next_free, self._tail.prev_free = self._tail, prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        # Between the sentinels, every block in the queue has both links.
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None  # the head sentinel, when the queue is empty
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVCacheBlock] = {}
        self.events: Optional[KVEventRecorder] = None  # set to publish KV events

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def usage(self) -> float:
        return 1.0 - self.free_queue.num_free / self.num_blocks

    def get_cached_block(self, block_hash: int) -> Optional[KVCacheBlock]:
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.free_queue.num_free:
            raise ValueError(f"asked for {n} blocks, {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference; blocks given first are evicted first."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(
        self, block: KVCacheBlock, block_hash: int, parent_hash: Optional[int] = None, token_ids: Sequence[int] = ()
    ) -> None:
        """Register a full block under its chained hash (first writer wins).

        `parent_hash` (None for a first block) and `token_ids` only describe the
        block to KV event subscribers."""
        if block.block_hash is not None:
            return
        if block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if self.events is not None:
            self.events.stored(block_hash, parent_hash, token_ids)

    def uncache_blocks(self, block_ids: Iterable[int]) -> None:
        """Forget the hashes of blocks whose content is known to be bad."""
        for block_id in block_ids:
            self._evict(self.blocks[block_id])

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash)
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Drop every hash; refused (False) while any block is in use, as vLLM does."""
        if self.free_queue.num_free != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.cleared()
        return True
