"""A load on the worker half: what it is checked against, where it is written, and how it is
given up without a late byte landing.

A fetched batch (or, streamed, its header first) is checked against the consumer's own
request by `LocalCache.check`: fingerprint, KV heads, block shape and dtype, then chain key
by chain key, so only the longest prefix that is exactly the prompt's own blocks is used.
A CPU cache is written on the load's transfer thread (`LocalCache.write`) under the load's
lock; once the load is abandoned (its deadline passed, or the scheduler cancelled it) under
that lock, nothing of it is written any more, so the scheduler may reuse its blocks.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from fleetserve.kv_transfer.base import LoadSpec
from fleetserve.kv_transfer.blocks import BlockBatch
from fleetserve.kv_transfer.cache_copy import scatter_blocks
from fleetserve.kv_transfer.errors import KVFormatError

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LocalCache:
    """This rank's side of every load: the fingerprint blocks must carry, the model's KV heads
    [h0, h1) this rank holds, and its caches (per layer [2, heads, num_blocks, block_size,
    head_dim])."""

    fingerprint: str
    heads: tuple[int, int]
    kv_caches: list[torch.Tensor]

    def check(
        self,
        spec: LoadSpec,
        fingerprint: str,
        keys: list[str],
        heads: tuple[int, int],
        shape: Sequence[int],
        dtype: torch.dtype,
    ) -> tuple[int, int]:
        """(offset, n): blocks offset..offset+n-1 of a batch with this header are exactly the
        first n that `spec` asked for; KVFormatError if the batch cannot be this load's. A
        hand-off's batch holds the prompt from block 0 and the spec may start later (this
        engine caches a prefix of the prompt): then offset is spec.first_block."""
        if fingerprint != self.fingerprint:
            raise KVFormatError("fingerprint mismatch")
        if not (heads[0] <= self.heads[0] and self.heads[1] <= heads[1]):
            raise KVFormatError(f"blocks hold KV heads {heads}, this rank needs {self.heads}")
        want = self.kv_caches[0].shape
        _, layers, two, _, bs, hd = shape
        if (layers, two, bs, hd) != (len(self.kv_caches), want[0], want[3], want[4]) or dtype != self.kv_caches[
            0
        ].dtype:
            raise KVFormatError(f"block shape {tuple(shape)} does not fit this cache")
        offset = 0
        if spec.keys and spec.first_block and len(keys) > spec.first_block and keys[spec.first_block] == spec.keys[0]:
            offset = spec.first_block  # chain keys: a match there vouches for every block before
        good = 0
        for got, expected in zip(keys[offset:], spec.keys):
            if got != expected:
                break
            good += 1
        if good < min(len(keys) - offset, len(spec.keys)):
            logger.warning(
                "KV load of %s: block %d's chain key differs from the prompt's "
                "(stale or foreign KV); refused from there",
                spec.req_id,
                offset + good,
            )
        return offset, good

    def check_batch(self, spec: LoadSpec, batch: BlockBatch) -> tuple[int, int]:
        """`check` of a whole batch."""
        return self.check(spec, batch.fingerprint, batch.keys, batch.heads, batch.data.shape, batch.data.dtype)

    def write(self, block_ids: list[int], data: torch.Tensor, heads: tuple[int, int]) -> int:
        """`data` (blocks of KV heads `heads`) into `block_ids`, this rank's heads only; returns
        the bytes written."""
        h0 = self.heads[0] - heads[0]
        data = data[:, :, :, h0 : h0 + self.heads[1] - self.heads[0]]
        scatter_blocks(self.kv_caches, block_ids, data)
        return data.numel() * data.element_size()


@dataclass(slots=True)
class Fetched:
    """What a load's transfer thread hands to `get_finished`: the batch still to be written
    (None when it was written there), where its good blocks start, how many, the bytes
    written."""

    batch: Optional[BlockBatch]
    offset: int
    good: int
    written: int


class Load:
    """One load in flight on the worker: fetched, checked and (CPU caches) written into its
    blocks on a transfer thread. `lock` orders that write against giving the load up: once
    `abandoned` is set under the lock, no byte of it lands in the cache any more."""

    __slots__ = ("spec", "t0", "lock", "abandoned", "future")

    def __init__(self, spec: LoadSpec, t0: float) -> None:
        self.spec, self.t0 = spec, t0
        self.lock = threading.Lock()
        self.abandoned = False
        self.future: Optional[cf.Future[Fetched]] = None

    def abandon(self) -> None:
        """Waits for a write in progress (a few ms) and forbids the rest."""
        with self.lock:
            self.abandoned = True

    def done(self) -> bool:
        """Whether its transfer thread has finished with it."""
        return self.future is not None and self.future.done()

    def result(self) -> Fetched:
        """What its transfer thread found (or raises what it raised)."""
        if self.future is None:
            raise RuntimeError(f"the load of {self.spec.req_id} was never started")
        return self.future.result()


class Sink:
    """Where a streaming transport delivers a load's chunks as they arrive (CPU caches, on the
    load's transfer thread; a `stream.ChunkSink`): `begin` checks the batch's header against
    the request (as `LocalCache.check_batch` does a whole batch), `write` puts a chunk's
    verified blocks into the cache under the load's lock (nothing once the load was given up).
    Blocks are written in order; a block that failed its digest ends the good prefix there."""

    def __init__(self, cache: LocalCache, load: Load) -> None:
        self.cache, self.load = cache, load
        self.used = False
        self.offset = self.good = self.written = 0
        self.heads = (0, 0)

    def begin(
        self, fingerprint: str, keys: list[str], heads: tuple[int, int], shape: Sequence[int], dtype: torch.dtype
    ) -> None:
        """Raises KVFormatError if the batch cannot be this load's."""
        self.offset, self.good = self.cache.check(self.load.spec, fingerprint, keys, heads, shape, dtype)
        self.heads = heads
        self.used = True

    def wanted(self) -> int:
        """How many of the batch's blocks, from the first, this load can still use."""
        return self.offset + self.good

    def write(self, start: int, data: torch.Tensor, n_ok: int) -> None:
        """Blocks start.. of the batch (`data`: [k, layers, 2, heads, bs, hd]), the first
        `n_ok` of them verified."""
        if n_ok < data.shape[0]:
            self.good = max(0, min(self.good, start + n_ok - self.offset))
        lo, hi = max(start, self.offset), min(start + n_ok, self.offset + self.good)
        if lo >= hi:
            return
        ids = self.load.spec.block_ids[lo - self.offset : hi - self.offset]
        with self.load.lock:
            if not self.load.abandoned:
                self.written += self.cache.write(ids, data[lo - start : hi - start], self.heads)

    def fetched(self) -> Fetched:
        """The load, once it was checked and written chunk by chunk as it came."""
        return Fetched(None, self.offset, self.good, self.written)
