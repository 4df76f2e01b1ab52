"""Paged KV cache bookkeeping for the scheduler: which blocks each request owns.

Small verbs, one result type (a list of block ids):

* ``get_computed_blocks(request)`` -> (hit blocks, hit tokens): the longest
  chain of cached full blocks of the prompt, never including the last prompt
  token (the model must compute at least one token to produce logits);
* ``allocate_slots(request, num_new_tokens, ...)`` -> new block ids, or None
  when the pool cannot hold them;
* ``free(request)``.

Sliding windows (``sliding_window``: the window every attention layer of the model
has, the largest where they differ; None when some layer attends to everything): the
query at position p reads the keys at positions > p - W only, so once a request's
next token is at p, its blocks wholly at or before p - W are never read again. They go
back to the pool as the request advances (vLLM's sliding-window manager does the same
per layer group); their place in the request's list holds ``NULL_BLOCK`` so block
indices keep meaning token positions. A freed full block keeps its hash: it stays a
prefix-cache hit until evicted, like the blocks of a finished request. Workers keep
the ids they were given: the attention reads only the blocks inside the window, and
the masked reads of the torch paths weigh whatever a reused block holds by zero.

Block hashes chain: ``hash(parent_hash, block_tokens, extra_keys)``. By default
(``hash_algo="builtin"``) they are Python's hash of a tuple of ints, which is
deterministic across processes (only str/bytes hashing is salted), so a router
can compute the same hashes as a replica; a 64-bit hash makes an accidental
collision between two different prefixes astronomically unlikely, but nothing
stops a crafted one. ``"sha256"`` (vLLM's ``--prefix-caching-hash-algo sha256``)
is collision-resistant, for tenants who must not collide with or probe each
other's prefixes. The per-request `cache_salt` enters the first block's extra key.
"""

from __future__ import annotations

import hashlib
from typing import Optional, Sequence

from fleetserve.scheduler.block_pool import BlockPool, KVCacheBlock
from fleetserve.scheduler.kv_events import KVEventBatch, KVEventRecorder
from fleetserve.scheduler.request import Request

NONE_HASH = 0x5EED

# Where a request's list held a block it no longer needs (outside every layer's window).
NULL_BLOCK = KVCacheBlock(-1)


def salt_to_int(cache_salt: Optional[str]) -> int:
    if not cache_salt:
        return 0
    return int.from_bytes(hashlib.blake2b(cache_salt.encode(), digest_size=8).digest(), "little")


def hash_block_tokens(parent_hash: int, tokens: tuple[int, ...], extra: int = 0) -> int:
    return hash((parent_hash, tokens, extra))


def _sha256_block(parent_hash: int, tokens: tuple[int, ...], extra: int) -> int:
    """vLLM's `--prefix-caching-hash-algo sha256`: a cryptographic chain, so nobody can
    craft a prompt whose block collides with another tenant's (the 64-bit tuple hash is
    fast but not collision-resistant). 128 bits of the digest, as an int."""
    data = (
        parent_hash.to_bytes(16, "little", signed=True)
        + extra.to_bytes(8, "little")
        + b"".join(t.to_bytes(4, "little") for t in tokens)
    )
    return int.from_bytes(hashlib.sha256(data).digest()[:16], "little", signed=True)


HASH_ALGOS = {"builtin": hash_block_tokens, "sha256": _sha256_block}


def hash_token_blocks(
    token_ids: list[int],
    block_size: int,
    cache_salt: Optional[str] = None,
    start: int = 0,
    parent: int = NONE_HASH,
    algo: str = "builtin",
) -> list[int]:
    """Chained hashes of the full blocks of `token_ids`, from block `start`."""
    salt = salt_to_int(cache_salt)
    block_hash = HASH_ALGOS[algo]
    out = []
    for i in range(start, len(token_ids) // block_size):
        extra = salt if i == 0 else 0
        parent = block_hash(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]), extra)
        out.append(parent)
    return out


def update_block_hashes(request: Request, block_size: int, algo: str = "builtin") -> None:
    """Extend `request.block_hashes` to cover every full block of its tokens."""
    hashes = request.block_hashes
    if len(hashes) < request.num_tokens // block_size:
        parent = hashes[-1] if hashes else NONE_HASH
        hashes.extend(
            hash_token_blocks(request.all_token_ids, block_size, request.cache_salt, len(hashes), parent, algo)
        )


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
        hash_algo: str = "builtin",
        sliding_window: Optional[int] = None,
    ) -> None:
        if hash_algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {sorted(HASH_ALGOS)}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}")
        self.hash_algo = hash_algo
        self.sliding_window = sliding_window
        # How many leading blocks of each request were given back (outside the window).
        self.num_window_freed: dict[str, int] = {}
        self.num_window_freed_blocks = 0  # total, for metrics and tests
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        if enable_kv_cache_events:
            self.pool.events = KVEventRecorder(block_size)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in the cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    # ---- queries -----------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def cdiv(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids by position; -1 where a block outside the sliding window
        was given back."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs need every prompt position computed: no hits.
            return [], 0
        update_block_hashes(request, self.block_size, self.hash_algo)
        # Never hit the last token: at least one must be computed for logits.
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_queried: int, num_hit: int) -> None:
        """Count a lookup once, when the request is actually admitted."""
        self.prefix_cache_queries += num_queried
        self.prefix_cache_hits += num_hit

    def num_blocks_to_allocate(
        self, request: Request, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock] = ()
    ) -> int:
        """Free blocks that holding `num_tokens` tokens of `request` would consume."""
        owned = len(self.req_to_blocks.get(request.request_id, ())) + len(new_computed_blocks)
        # Hits that sit in the free queue are taken out of it, costing a free block each.
        revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        return max(0, self.cdiv(num_tokens) - owned) + revived

    # ---- verbs -------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_external_tokens: int = 0,
        delay_caching: bool = False,
    ) -> Optional[list[int]]:
        """Make room for `num_new_tokens` (+ external ones) after the computed tokens.

        `new_computed_blocks` are this request's prefix-cache hits (only on
        admission). Returns the ids of the blocks added to the request (hits
        included), or None when the pool cannot hold them; on None nothing
        has changed. `delay_caching` keeps blocks that are still being filled
        by an asynchronous load out of the prefix cache.
        """
        blocks = self.req_to_blocks.get(request.request_id)
        if self.sliding_window is not None and blocks:
            self._free_outside_window(request.request_id, blocks, request.num_computed_tokens)
        if blocks is not None and not new_computed_blocks and not num_external_tokens:
            # Fast path (most decodes): the owned blocks already have room.
            total = request.num_computed_tokens + num_new_tokens
            bs = self.block_size
            if total <= len(blocks) * bs:
                # (cache_blocks' own first check, without the call when no block filled up)
                if (
                    self.enable_caching
                    and not delay_caching
                    and min(total, request.num_tokens) // bs > self.num_cached_blocks.get(request.request_id, 0)
                ):
                    self.cache_blocks(request, min(total, request.num_tokens))
                return []
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total = num_computed + num_external_tokens + num_new_tokens
        need = self.num_blocks_to_allocate(request, total, new_computed_blocks)
        if need > self.pool.num_free_blocks:
            return None
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        added: list[KVCacheBlock] = []
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            added.extend(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            self.num_cached_blocks[request.request_id] = len(blocks)
        num_new_blocks = self.cdiv(total) - len(blocks)
        if num_new_blocks > 0:
            new = self.pool.get_new_blocks(num_new_blocks)
            blocks.extend(new)
            added.extend(new)
        if self.enable_caching and not delay_caching:
            # Blocks whose tokens will be known and computed after this step.
            self.cache_blocks(request, min(total, request.num_tokens))
        # Hits wholly before the window go back at the request's next allocation, after the
        # workers got its whole block list (NewRequestData) once.
        return [b.block_id for b in added]

    def _free_outside_window(self, rid: str, blocks: list[KVCacheBlock], next_pos: int) -> None:
        """Give back the leading blocks no query at `next_pos` or later reads: those wholly
        at positions <= next_pos - sliding_window."""
        assert self.sliding_window is not None
        dead = min(len(blocks), max(0, next_pos - self.sliding_window + 1) // self.block_size)
        done = self.num_window_freed.get(rid, 0)
        if dead <= done:
            return
        gone = blocks[done:dead]
        blocks[done:dead] = [NULL_BLOCK] * (dead - done)
        self.num_window_freed[rid] = dead
        self.num_window_freed_blocks += dead - done
        self.pool.free_blocks(gone)  # oldest first: the first to be evicted

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the full blocks among the first `num_tokens` tokens."""
        num_full = num_tokens // self.block_size
        rid = request.request_id
        done = self.num_cached_blocks.get(rid, 0)
        if num_full <= done:
            return
        update_block_hashes(request, self.block_size, self.hash_algo)
        blocks = self.req_to_blocks[rid]
        hashes = request.block_hashes
        if self.pool.events is None:
            for i in range(done, num_full):
                if blocks[i] is not NULL_BLOCK:
                    self.pool.cache_block(blocks[i], hashes[i])
        else:  # subscribers also get each block's parent and tokens
            bs, tokens = self.block_size, request.all_token_ids
            for i in range(done, num_full):
                if blocks[i] is not NULL_BLOCK:
                    self.pool.cache_block(
                        blocks[i], hashes[i], hashes[i - 1] if i else None, tokens[i * bs : (i + 1) * bs]
                    )
        self.num_cached_blocks[rid] = num_full

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        freed = self.num_window_freed.pop(request.request_id, 0)
        if blocks:
            # Tail blocks first: they are the least likely to be shared.
            self.pool.free_blocks(reversed(blocks[freed:]))

    def uncache_tail(self, request: Request, num_valid_tokens: int) -> None:
        """Unregister the hashes this request set on blocks past its first
        `num_valid_tokens` tokens: their KV is not (or not correctly) computed."""
        rid = request.request_id
        keep = num_valid_tokens // self.block_size
        done = self.num_cached_blocks.get(rid, 0)
        if done > keep:
            blocks = self.req_to_blocks[rid]
            self.pool.uncache_blocks(b.block_id for b in blocks[keep:done] if b is not NULL_BLOCK)
            self.num_cached_blocks[rid] = keep

    def uncache_blocks(self, block_ids: set[int]) -> None:
        self.pool.uncache_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def take_events(self) -> Optional[KVEventBatch]:
        """The KV events since the last call, as one batch (None: none, or events are off)."""
        return self.pool.events.take_batch() if self.pool.events is not None else None

    def cached_block_hashes(self) -> set[int]:
        """Every hash the prefix cache holds now (what KV event subscribers rebuild)."""
        return set(self.pool.cached)

    # ---- invariants (tests and debug checks) --------------------------------
    def check_invariants(self) -> None:
        refs = [0] * self.pool.num_blocks
        for rid, blocks in self.req_to_blocks.items():
            freed = self.num_window_freed.get(rid, 0)
            assert all(b is NULL_BLOCK for b in blocks[:freed]), f"{rid}: a freed place holds a block"
            for b in blocks[freed:]:
                assert b is not NULL_BLOCK, f"{rid}: a null block inside the window"
                refs[b.block_id] += 1
        free_ids = {b.block_id for b in self.pool.free_queue}
        assert len(free_ids) == self.pool.free_queue.num_free, "free queue count drifted"
        for block in self.pool.blocks:
            assert block.ref_cnt == refs[block.block_id], f"{block} owned {refs[block.block_id]}x"
            assert (block.ref_cnt == 0) == (block.block_id in free_ids), f"{block} free state"
        for h, block in self.pool.cached.items():
            assert block.block_hash == h, f"hash map points at {block} for {h}"
