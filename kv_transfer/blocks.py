"""What a transferred block is: its identity (chain key), its bytes, and how it is checked.

Identity. A block's **chain key** hashes the fingerprint of the KV format (model,
dtype, block size, layers, KV heads, head dim, cache layout), the cache salt and
every token up to the end of the block:

    key_0 = blake2b(fingerprint, salt, tokens[0:B])
    key_i = blake2b(key_{i-1}, tokens[i*B:(i+1)*B])

so a block is only ever accepted where the consumer's own prompt (with its own
fingerprint) produces the same key: stale, reused or foreign KV fails closed.
Keys are 128-bit blake2b (not the scheduler's 64-bit prefix-cache hash): they name
files in a shared folder that anyone may fill, so collisions must be out of reach.

Bytes. A batch of blocks travels as one tensor

    [num_blocks, num_layers, 2 (K, V), heads, block_size, head_dim]

(this rank's heads: `heads` = [h0, h1) of the model's KV heads) plus a JSON
header: magic, version, fingerprint, keys, dtype, shape, heads, and a digest per
block, so a truncated or corrupted payload is refused. Nothing is pickled.

Digests: xxh3_64 of each block's bytes on the CPU (~20 GB/s a core here, where
zlib's crc32 did 4 GB/s and cost more than the copies it guarded); `wsum64`
(a position-weighted 64-bit sum computed with tensor ops) where the bytes stay
on a GPU (the NCCL path), so they are never staged through the host to be checked.

Cost. A hand-off is gather (cache -> one contiguous buffer) + transport + scatter
(buffer -> cache); on a CPU both copy run by run of consecutive blocks (numpy byte views,
GIL released), a gather over scattered ids is one `index_select` per layer over 4 KiB rows
(so is anything on a GPU), and big buffers come from a `StagingPool` (a fresh 720 MiB
buffer costs ~0.2 s of page faults here, more than copying into it).
"""

from __future__ import annotations

import array
import concurrent.futures as cf
import hashlib
import json
import struct
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import xxhash

MAGIC = b"FSKV"
VERSION = 2  # 1: crc32 per block
LAYOUT = "2HNBD-v1"  # replica.layers.attention: [2, kv_heads, num_blocks, block_size, head_dim]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KVFormatError(ValueError):
    """A payload that is not what it claims to be (truncated, corrupt, foreign)."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def kv_geometry(hf_config: Any) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of the whole model."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return hf_config.num_hidden_layers, kv_heads, head_dim


def rope_identity(hf_config: Any) -> str:
    """The rotary embedding's parameters as one string: keys are cached after rope, so engines
    whose rope differs (theta, type, scaling) must never share blocks. transformers 5 configs and
    our ModelConfig keep them all in `rope_parameters`; older configs in `rope_theta` and
    `rope_scaling`. (Until 2026-11-28 the fingerprint read `rope_theta` alone, which those
    configs no longer have: every fingerprint had "" there. Fingerprints changed with this, so
    a shared-storage folder written before misses once; it never hits wrongly.)"""
    params = getattr(hf_config, "rope_parameters", None)
    if not params:
        params = {"rope_theta": getattr(hf_config, "rope_theta", None),
                  "rope_scaling": getattr(hf_config, "rope_scaling", None)}
    return json.dumps(params, sort_keys=True, default=str)


def kv_fingerprint(model_id: str, hf_config: Any, dtype: torch.dtype | str, block_size: int,
                   key_layout: str = "rows") -> str:
    """Everything two engines must share for one's KV blocks to be valid in the other.
    `key_layout`: how keys sit inside a block ("rows", or "k_tiled" where the CPU attention
    kernel keeps them tiled: replica.layers.attention.kv_cache_layout)."""
    layers, kv_heads, head_dim = kv_geometry(hf_config)
    dtype = dtype if isinstance(dtype, str) else dtype_name(dtype)
    parts = [model_id, getattr(hf_config, "model_type", ""), str(hf_config.hidden_size),
             str(hf_config.vocab_size), rope_identity(hf_config), dtype,
             f"B{block_size}", f"L{layers}", f"H{kv_heads}", f"D{head_dim}", LAYOUT]
    if key_layout != "rows":  # the fingerprints of row-major engines stay what they were
        parts.append(f"K:{key_layout}")
    return hashlib.blake2b("|".join(parts).encode(), digest_size=16).hexdigest()


def chain_keys(fingerprint: str, token_ids: Sequence[int], block_size: int,
               num_blocks: int, cache_salt: Optional[str] = None) -> list[str]:
    """Chain keys of the first `num_blocks` full blocks of `token_ids`."""
    num_blocks = min(num_blocks, len(token_ids) // block_size)
    keys: list[str] = []
    parent = hashlib.blake2b((fingerprint + "|" + (cache_salt or "")).encode(), digest_size=16).digest()
    tokens = array.array("q", token_ids[:num_blocks * block_size])
    raw = memoryview(tokens).cast("B")
    step = block_size * tokens.itemsize
    for i in range(num_blocks):
        parent = hashlib.blake2b(parent + raw[i * step:(i + 1) * step], digest_size=16).digest()
        keys.append(parent.hex())
    return keys


def local_head_range(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """The model's KV heads [h0, h1) that rank `tp_rank` of `tp_size` holds
    (with more ranks than KV heads, each head is replicated on tp/heads ranks)."""
    if num_kv_heads >= tp_size:
        per = num_kv_heads // tp_size
        return tp_rank * per, (tp_rank + 1) * per
    h = tp_rank // (tp_size // num_kv_heads)
    return h, h + 1


def producer_shards(heads: tuple[int, int], num_kv_heads: int,
                    producer_tp: int) -> list[tuple[int, tuple[int, int]]]:
    """(producer rank, its head range) of the shards that together hold `heads`, in head
    order, one rank per distinct range: a consumer rank takes the heads it owns from
    whatever TP size the producer ran with."""
    found: dict[tuple[int, int], int] = {}
    for rank in range(producer_tp):
        rng = local_head_range(num_kv_heads, producer_tp, rank)
        if rng not in found and rng[0] < heads[1] and heads[0] < rng[1]:
            found[rng] = rank
    return sorted(((r, rng) for rng, r in found.items()), key=lambda x: x[1][0])


def readers_of(shard: tuple[int, int], num_kv_heads: int, consumer_tp: int) -> int:
    """How many consumer ranks read a producer shard (its owner frees it after all did)."""
    return sum(1 for r in range(consumer_tp)
               if (lambda h: h[0] < shard[1] and shard[0] < h[1])(
                   local_head_range(num_kv_heads, consumer_tp, r)))


def join_shards(batches: list["BlockBatch"]) -> "BlockBatch":
    """Head shards of the same blocks side by side, cut to the blocks every shard agrees on."""
    if len(batches) == 1:
        return batches[0]
    n = 0
    while all(n < len(b.keys) for b in batches) and len({b.keys[n] for b in batches}) == 1:
        n += 1
    data = torch.cat([b.data[:n] for b in batches], dim=3)
    for b in batches:
        b.release()
    return BlockBatch(batches[0].fingerprint, batches[0].keys[:n], data,
                      (batches[0].heads[0], batches[-1].heads[1]), digest=batches[0].digest)


# ---- moving blocks in and out of the paged cache -----------------------------------
def gather_blocks(kv_caches: list[torch.Tensor], block_ids: Sequence[int],
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Copy blocks out of the cache into `out` (default: a new CPU tensor, pinned when the
    cache is on a GPU): [n, layers, 2, heads, block_size, head_dim]. `out` may live on the
    cache's device (gathered there, e.g. for NCCL) or on the CPU (staged through the host)."""
    first = kv_caches[0]
    if out is None:
        out = torch.empty((len(block_ids), len(kv_caches), *first.shape[:2], *first.shape[3:]),
                          dtype=first.dtype, pin_memory=first.is_cuda)
    idx = block_index(block_ids, first.device)
    for layer, kv in enumerate(kv_caches):
        gather_layer(kv, idx, out, layer)
    if first.is_cuda and out.device != first.device:
        torch.cuda.current_stream(first.device).synchronize()
    return out


class BlockIndex:
    """Which cache blocks a copy reads or writes, in batch order: as a tensor (for index
    ops) and as runs of consecutive ids, ascending or descending (`runs`: (start, stop,
    first id, step) over positions of the batch). A fresh cache hands out ascending ids; a
    request's freed blocks go back reversed, so reused ones come out in descending runs."""

    __slots__ = ("ids", "tensor", "runs")

    def __init__(self, ids: Sequence[int], device, runs: Optional[list] = None) -> None:
        self.ids = list(ids)
        self.tensor = torch.as_tensor(self.ids, dtype=torch.long, device=device)
        self.runs = block_runs(self.ids) if runs is None else runs

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, sl: slice) -> "BlockIndex":
        start, stop, _ = sl.indices(len(self.ids))
        runs = []
        for s, e, b, step in self.runs:
            lo, hi = max(s, start), min(e, stop)
            if lo < hi:
                runs.append((lo - start, hi - start, b + (lo - s) * step, step))
        return BlockIndex(self.ids[start:stop], self.tensor.device, runs)


def block_runs(ids: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """Maximal runs of ids that step by +1 or -1: (start, stop, first id, step) each."""
    runs, s, n = [], 0, len(ids)
    while s < n:
        e, step = s + 1, 1
        if e < n and abs(ids[e] - ids[s]) == 1:
            step = ids[e] - ids[s]
            while e < n and ids[e] - ids[e - 1] == step:
                e += 1
        runs.append((s, e, ids[s], step))
        s = e
    return runs


def block_index(block_ids: Sequence[int], device) -> BlockIndex:
    return BlockIndex(block_ids, device)


# A gather runs one numpy copy per run of blocks and layer where runs average at least this
# many blocks, else one index_select per layer (faster over scattered ids). A scatter into a
# CPU cache always copies run by run: index_copy_ ran at 8-9 GB/s where these copies ran at
# 12-20, even one block at a time (a 2k-token SmolLM2 prompt: 10-14 ms -> 7-9 ms).
GATHER_RUN_BLOCKS = 8


def _bytes(t: torch.Tensor):
    """`t` as a numpy array of bytes (its last dim in bytes), sharing its memory. Plain
    numpy copies between such views release the GIL, as torch's do."""
    return t.view(torch.uint8).numpy()


def _run_slice(b: int, k: int, step: int) -> slice:
    """Cache blocks b, b+step, ..., k of them, as a slice along the blocks dim."""
    if step == 1:
        return slice(b, b + k)
    return slice(b, b - k if b - k >= 0 else None, -1)


def _byte_copyable(kv: torch.Tensor, other: torch.Tensor) -> bool:
    return (kv.device.type == "cpu" and other.device.type == "cpu" and kv.dtype == other.dtype
            and kv.is_contiguous() and other.stride(-1) == 1)


def gather_layer(kv: torch.Tensor, idx: BlockIndex, out: torch.Tensor, layer: int) -> None:
    """Blocks `idx` of one layer's cache ([2, heads, nb, bs, hd]) into `out[:, layer]`:
    run by run where the ids come in long runs (CPU), else one `index_select` over the
    cache's 4 KiB rows (a block of a layer is 2*heads rows), written in place; a GPU cache
    into a host `out` copies without waiting (sync before reading)."""
    two, heads, nb, bs, hd = kv.shape
    if len(idx.runs) * GATHER_RUN_BLOCKS <= len(idx) and _byte_copyable(kv, out):
        src = _bytes(kv).transpose(2, 0, 1, 3, 4)  # [nb, 2, heads, bs, row bytes]
        dst = _bytes(out)[:, layer]
        for s, e, b, step in idx.runs:
            dst[s:e] = src[_run_slice(b, e - s, step)]
        return
    src = kv.view(two * heads, nb, bs * hd).transpose(0, 1)  # [nb, 2*heads, row]
    dst = out.view(out.shape[0], out.shape[1], two * heads, bs * hd)[:, layer]
    if dst.device == kv.device:
        torch.index_select(src, 0, idx.tensor, out=dst)
    else:
        dst.copy_(src.index_select(0, idx.tensor), non_blocking=True)


def scatter_blocks(kv_caches: list[torch.Tensor], block_ids: Sequence[int], data: torch.Tensor) -> None:
    """Write `data` ([n, layers, 2, heads, block_size, head_dim], any strides, any device)
    straight into the cache's blocks, no intermediate copy: into a CPU cache one copy per
    run of consecutive blocks and layer, else one `index_copy_` per layer (a CPU source
    for a GPU cache goes up one layer at a time)."""
    first = kv_caches[0]
    if tuple(data.shape[2:]) != (first.shape[0], first.shape[1], *first.shape[3:]) \
            or data.shape[:2] != (len(block_ids), len(kv_caches)):
        raise ValueError(f"blocks of shape {tuple(data.shape)} do not fit {len(block_ids)} blocks "
                         f"of {len(kv_caches)} layers of {tuple(first.shape)}")
    if _byte_copyable(first, data):
        src = _bytes(data)
        runs = block_runs(block_ids)
        for layer, kv in enumerate(kv_caches):
            dst = _bytes(kv).transpose(2, 0, 1, 3, 4)  # [nb, 2, heads, bs, row bytes]
            for s, e, b, step in runs:
                dst[_run_slice(b, e - s, step)] = src[s:e, layer]
        return
    idx = block_index(block_ids, first.device).tensor
    for layer, kv in enumerate(kv_caches):
        kv.permute(2, 0, 1, 3, 4).index_copy_(0, idx, data[:, layer].to(first.device, non_blocking=True))
    if first.is_cuda and data.device.type == "cpu":
        torch.cuda.current_stream(first.device).synchronize()  # before `data`'s buffer is reused


class StagingPool:
    """Reusable host buffers for gathered or received blocks, up to `max_bytes` kept.

    A fresh buffer of a few hundred MiB costs more in page faults than the copy into it
    (0.2 s per 720 MiB on this machine's VM), so buffers go back here once their bytes
    are no longer needed (`BlockBatch.release`) and the next transfer reuses them."""

    def __init__(self, max_bytes: int = 1 << 30, pin_memory: bool = False) -> None:
        self.max_bytes = max_bytes
        self.pin_memory = pin_memory
        self._free: list[torch.Tensor] = []  # uint8 buffers
        self._lock = threading.Lock()

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> tuple[torch.Tensor, Callable[[], None]]:
        """(a tensor of `shape`, the callback that gives its buffer back)."""
        need = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        buf = None
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= need]
            if fits:  # the smallest that fits
                buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        if buf is None:
            buf = torch.empty(max(need, 1), dtype=torch.uint8, pin_memory=self.pin_memory)
        return buf[:need].view(dtype).view(tuple(shape)), lambda: self._give(buf)

    def _give(self, buf: torch.Tensor) -> None:
        with self._lock:
            if any(b is buf for b in self._free):
                return
            # Least recently given back goes first: the sizes recent transfers use stay. (It
            # used to be the biggest: with 22-360 MiB buffers kept, each 720 MiB one was
            # dropped and faulted in afresh, 0.2 s per hand-off, for a 16k-token prompt.)
            if buf.numel() > self.max_bytes:
                return  # never kept: over the cap on its own
            self._free.append(buf)
            while sum(b.numel() for b in self._free) > self.max_bytes:
                self._free.pop(0)

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._free)


# ---- digests ------------------------------------------------------------------------------
_HASH_POOL: Optional[cf.ThreadPoolExecutor] = None
_HASH_POOL_LOCK = threading.Lock()
_PARALLEL_HASH_BYTES = 32 << 20  # below this a second thread costs more than it saves


def _xxh3(mv: memoryview, per: int, lo: int, hi: int) -> list[int]:
    return [xxhash.xxh3_64_intdigest(mv[i * per:(i + 1) * per]) for i in range(lo, hi)]


def _hash_pool() -> cf.ThreadPoolExecutor:
    global _HASH_POOL
    if _HASH_POOL is None:
        with _HASH_POOL_LOCK:
            if _HASH_POOL is None:
                _HASH_POOL = cf.ThreadPoolExecutor(1, thread_name_prefix="kv-digest")
    return _HASH_POOL


def host_digests(buf, n: int) -> list[int]:
    """xxh3_64 of each of the `n` equal slices of a contiguous host buffer (two threads for
    big buffers: xxhash releases the GIL)."""
    mv = memoryview(buf).cast("B")
    per = len(mv) // n
    if len(mv) < _PARALLEL_HASH_BYTES or n < 2:
        return _xxh3(mv, per, 0, n)
    half = n // 2
    rest = _hash_pool().submit(_xxh3, mv, per, half, n)
    return _xxh3(mv, per, 0, half) + rest.result()


class DigestsBehind:
    """Digests of a host batch's blocks computed chunk by chunk on the digest thread while
    the caller fills the next chunk (a gather out of the cache): `add(s, e)` once blocks
    s..e-1 are in `data`, `result()` all of them in order. The gather and the hashing
    overlap on two cores, and each chunk is hashed while it is still in the CPU's caches."""

    def __init__(self, data: torch.Tensor) -> None:
        self._mv = memoryview(data.view(torch.uint8).numpy()).cast("B")
        self._per = len(self._mv) // max(1, data.shape[0])
        self._futs: list[cf.Future] = []

    def add(self, start: int, end: int) -> cf.Future:
        """Blocks start..end-1 are in place: hash them (the future's result: their digests)."""
        fut = _hash_pool().submit(_xxh3, self._mv, self._per, start, end)
        self._futs.append(fut)
        return fut

    def result(self) -> list[int]:
        return [d for f in self._futs for d in f.result()]


def digests_ahead(data: torch.Tensor, chunks: list[tuple[int, int]]):
    """Yields (start, end, digests of blocks start..end-1) for each chunk of a contiguous host
    batch in order; the next chunk's digests are computed on the digest thread while the
    caller works on this one (verifies and writes it into the cache)."""
    if not chunks:
        return
    mv = memoryview(data.view(torch.uint8).numpy()).cast("B")
    per = len(mv) // max(1, data.shape[0])
    pool = _hash_pool()
    fut = pool.submit(_xxh3, mv, per, *chunks[0])
    for i, (s, e) in enumerate(chunks):
        got = fut.result()
        if i + 1 < len(chunks):
            fut = pool.submit(_xxh3, mv, per, *chunks[i + 1])
        yield s, e, got


_WSUM_WEIGHTS: dict = {}


def device_digests(data: torch.Tensor) -> list[int]:
    """`wsum64` per block: sum over the block's 32-bit words w_j of w_j * (2j + 1), mod 2^64,
    with tensor ops where the data lives (a GPU's bytes are checked on the GPU). Any single
    changed word changes it; so do swapped words."""
    n = data.shape[0]
    words = data.contiguous().view(torch.int32).view(n, -1)
    key = (words.shape[1], words.device)
    w = _WSUM_WEIGHTS.get(key)
    if w is None:
        w = torch.arange(words.shape[1], dtype=torch.int64, device=words.device).mul_(2).add_(1)
        _WSUM_WEIGHTS[key] = w
    sums = (words.to(torch.int64) & 0xFFFFFFFF).mul_(w).sum(dim=1)
    return [int(s) & 0xFFFFFFFFFFFFFFFF for s in sums.tolist()]


DIGESTS = ("xxh3_64", "wsum64")


# ---- streamed exports ---------------------------------------------------------------------
STREAM_CHUNK_BYTES = 8 << 20  # a streamed batch moves in chunks of about this many bytes
MAX_CHUNKS = 256  # (P2P tags a stream's messages 0..2*MAX_CHUNKS-1 within a pull's tag range)


def plan_chunks(num_blocks: int, block_bytes: int, chunk_bytes: int = STREAM_CHUNK_BYTES) -> list[tuple[int, int]]:
    """[start, end) block ranges of about `chunk_bytes` each (at least one block; at most
    MAX_CHUNKS ranges)."""
    per = max(1, chunk_bytes // max(1, block_bytes), -(-num_blocks // MAX_CHUNKS))
    return [(s, min(s + per, num_blocks)) for s in range(0, num_blocks, per)]


class StreamAborted(RuntimeError):
    """A streamed batch's gathering failed: the rest of its chunks never come."""


class ExportProgress:
    """A batch that is exported while its blocks are still being copied out of the cache,
    chunk by chunk (each chunk's digests computed as it lands), so a transport can send the
    first chunks while the later ones are gathered (P2P). The gatherer calls `advance` per
    chunk (or `fail`); senders wait for the chunk they need. The batch's buffer goes back
    to its pool only once the gatherer is done with it (`when_done`)."""

    def __init__(self, chunks: list[tuple[int, int]]) -> None:
        self.chunks = chunks
        self._cond = threading.Condition()
        self._ready = 0
        self._error: Optional[BaseException] = None
        self._on_done: list[Callable[[], None]] = []

    def _over(self) -> bool:
        """Every chunk gathered, or gathering failed (under self._cond)."""
        return self._ready == len(self.chunks) or self._error is not None

    def advance(self) -> None:
        """The next chunk is gathered and its digests are set."""
        with self._cond:
            self._ready += 1
            self._cond.notify_all()
            last = self._ready == len(self.chunks)
        if last:
            self._finish()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()
        self._finish()

    def _finish(self) -> None:
        with self._cond:
            callbacks, self._on_done = self._on_done, []
        for cb in callbacks:
            cb()

    def wait_chunk(self, c: int, timeout: float) -> None:
        """Until chunk `c` is ready; raises StreamAborted if gathering failed or took longer
        than `timeout` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready > c or self._error is not None, timeout):
                raise StreamAborted(f"chunk {c} not gathered within {timeout:.1f} s")
            if self._ready <= c:
                raise StreamAborted(f"gathering the blocks failed: {self._error}")

    def wait_all(self, timeout: float) -> None:
        self.wait_chunk(len(self.chunks) - 1, timeout)

    def when_done(self, cb: Callable[[], None]) -> None:
        """`cb` once the gatherer no longer writes the buffer (now, if it is done)."""
        with self._cond:
            if not self._over():
                self._on_done.append(cb)
                return
        cb()


# ---- the wire format ------------------------------------------------------------------
@dataclass(slots=True)
class BlockBatch:
    """Blocks in flight: their keys, their tensor, the heads they cover."""

    fingerprint: str
    keys: list[str]
    data: torch.Tensor  # [n, layers, 2, heads, block_size, head_dim], contiguous
    heads: tuple[int, int]
    # A digest per block, computed once where the blocks are gathered and carried end to
    # end (a split or a re-export reuses them), so damage anywhere after is caught.
    digests: Optional[list[int]] = None
    digest: str = "xxh3_64"  # or "wsum64" for bytes that stay on a GPU
    # Gives `data`'s staging buffer back (StagingPool) once nobody reads it any more.
    on_release: Optional[Callable[[], None]] = field(default=None, repr=False)
    # Set while the blocks are still being gathered (a streamed export; see ExportProgress).
    progress: Optional[ExportProgress] = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def checksums(self) -> list[int]:
        if self.digests is None:
            self.digests = compute_digests(self.data, self.digest)
        return self.digests

    def block(self, i: int) -> "BlockBatch":
        return BlockBatch(self.fingerprint, [self.keys[i]], self.data[i:i + 1], self.heads,
                          [self.checksums()[i]], self.digest)

    def header(self, chunks: Optional[list[int]] = None) -> bytes:
        """The JSON header; with `chunks` (blocks per chunk, in order) the digests are left
        out: they travel with each chunk (a streamed batch)."""
        meta = {"v": VERSION, "fingerprint": self.fingerprint, "keys": self.keys,
                "dtype": dtype_name(self.data.dtype), "shape": list(self.data.shape),
                "heads": list(self.heads), "digest": self.digest,
                "digests": None if chunks else self.checksums()}
        if chunks:
            meta["chunks"] = chunks
        body = json.dumps(meta, separators=(",", ":")).encode()
        return MAGIC + struct.pack("<I", len(body)) + body

    def payload(self):
        """The raw bytes, as a flat uint8 numpy view (no copy; CPU data only)."""
        return self.data.view(torch.uint8).reshape(-1).numpy()

    def release(self) -> None:
        """The bytes are no longer needed (sent, written, or copied into the cache)."""
        cb, self.on_release = self.on_release, None
        if cb is not None:
            if self.progress is not None:  # not while the gatherer may still write it
                self.progress.when_done(cb)
            else:
                cb()


def compute_digests(data: torch.Tensor, digest: str) -> list[int]:
    if digest == "wsum64":
        return device_digests(data)
    if digest != "xxh3_64" or data.device.type != "cpu":
        raise KVFormatError(f"digest {digest!r} on {data.device.type} data is not supported")
    return host_digests(data.contiguous().view(torch.uint8).numpy(), data.shape[0])


def parse_header(buf) -> tuple[dict, int]:
    """(header dict, payload offset) of a buffer that starts with a header."""
    mv = memoryview(buf)
    if len(mv) < 8 or bytes(mv[:4]) != MAGIC:
        raise KVFormatError("not a fleetserve KV payload (bad magic)")
    (n,) = struct.unpack("<I", mv[4:8])
    if len(mv) < 8 + n:
        raise KVFormatError("truncated header")
    try:
        meta = json.loads(bytes(mv[8:8 + n]))
    except ValueError as e:
        raise KVFormatError(f"unreadable header: {e}") from e
    if not isinstance(meta, dict) or meta.get("v") != VERSION:
        raise KVFormatError("unsupported KV payload version")
    return meta, 8 + n


def check_header(meta: dict, fingerprint: str) -> tuple[torch.dtype, list[int], int]:
    """(dtype, shape, payload bytes) of a header, checked for shape and sense; raises
    KVFormatError on anything malformed or foreign. Never trusts the header's sizes."""
    if meta.get("fingerprint") != fingerprint:
        raise KVFormatError("KV from another model or format (fingerprint mismatch)")
    dtype = _DTYPES.get(meta.get("dtype"))
    shape, keys, sums = meta.get("shape"), meta.get("keys"), meta.get("digests")
    chunks = meta.get("chunks")
    if dtype is None or not isinstance(shape, list) or len(shape) != 6 \
            or not isinstance(keys, list) or len(keys) != shape[0] or meta.get("digest") not in DIGESTS:
        raise KVFormatError("malformed KV header")
    if chunks is None:
        if not isinstance(sums, list) or len(sums) != shape[0]:
            raise KVFormatError("malformed KV header (digests)")
    elif sums is not None or not isinstance(chunks, list) or not chunks or len(chunks) > MAX_CHUNKS \
            or not all(isinstance(c, int) and c > 0 for c in chunks) or sum(chunks) != shape[0]:
        raise KVFormatError("malformed KV header (chunks)")
    nbytes = torch.empty((), dtype=dtype).element_size()
    for s in shape:
        if not isinstance(s, int) or s < 0:
            raise KVFormatError("malformed KV shape")
        nbytes *= s
    if nbytes == 0:
        raise KVFormatError("empty KV payload")
    return dtype, shape, nbytes


def batch_from_tensor(meta: dict, data: torch.Tensor, fingerprint: str,
                      on_release: Optional[Callable[[], None]] = None) -> BlockBatch:
    """Build a batch over received bytes (`data`: uint8, on any device) and verify every
    block's digest. Raises KVFormatError on any mismatch."""
    tensor, keys, heads = _unpack(meta, data, fingerprint)
    digest = meta["digest"]
    got = compute_digests(tensor, digest)
    for i, (a, b) in enumerate(zip(got, meta["digests"])):
        if a != b:
            raise KVFormatError(f"block {i} fails its {digest} digest (corrupt)")
    return BlockBatch(fingerprint, keys, tensor, heads, got, digest, on_release)


def _unpack(meta: dict, data: torch.Tensor, fingerprint: str) -> tuple[torch.Tensor, list[str], tuple[int, int]]:
    """(the blocks over `data`, uint8, as the header describes them; their keys; their heads),
    once the header fits this consumer and `data` is exactly the batch's bytes."""
    dtype, shape, nbytes = check_header(meta, fingerprint)
    if meta.get("chunks") is not None:
        raise KVFormatError("a streamed batch's digests travel with its chunks, not in its header")
    if data.numel() != nbytes:
        raise KVFormatError(f"payload has {data.numel()} bytes, header says {nbytes} (truncated?)")
    heads = meta.get("heads") or (0, shape[3])
    return data.view(dtype).view(shape), [str(k) for k in meta["keys"]], (int(heads[0]), int(heads[1]))


def _host_bytes(payload) -> torch.Tensor:
    """A uint8 tensor over a host bytes-like, no copy (read-only buffers such as Ray's store
    are fine: the bytes are only read)."""
    mv = memoryview(payload).cast("B")
    if len(mv) == 0:
        raise KVFormatError("empty KV payload")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mv, dtype=torch.uint8)


def decode_batch(meta: dict, payload, fingerprint: str) -> BlockBatch:
    """`batch_from_tensor` over a host bytes-like of exactly the tensor's bytes."""
    return batch_from_tensor(meta, _host_bytes(payload), fingerprint)


def deliver_verified(meta: dict, payload, fingerprint: str, sink, chunk_bytes: int = STREAM_CHUNK_BYTES) -> BlockBatch:
    """`decode_batch`, handing the blocks to `sink` (transfer._Sink: `begin`, `wanted`, then
    `write` per chunk) as they are verified: each chunk's digests are computed on the digest thread while
    the previous chunk is written into the cache. The first block that fails its digest ends
    what is written. Returns the batch (its bytes are `payload`'s)."""
    tensor, keys, heads = _unpack(meta, _host_bytes(payload), fingerprint)
    if meta["digest"] != "xxh3_64":
        raise KVFormatError("a host batch with xxh3_64 digests was expected")
    sink.begin(fingerprint, keys, heads, list(tensor.shape), tensor.dtype)
    want = meta["digests"]
    n = tensor.shape[0]
    # Only the blocks the load can use are checked (none, if the keys refused it).
    chunks = [(s, e) for s, e in plan_chunks(n, tensor.nbytes // n, chunk_bytes) if s < sink.wanted()]
    for s, e, got in digests_ahead(tensor, chunks):
        ok = next((i for i, d in enumerate(got) if d != want[s + i]), e - s)
        sink.write(s, tensor[s:e], ok)
        if ok < e - s:
            break
    return BlockBatch(fingerprint, keys, tensor, heads, list(want), "xxh3_64")


def encode_to_bytes(batch: BlockBatch) -> bytes:
    """Header + payload in one bytes object (tests and small transports)."""
    return batch.header() + batch.payload().tobytes()


def decode_from_bytes(buf, fingerprint: str) -> BlockBatch:
    meta, off = parse_header(buf)
    return decode_batch(meta, memoryview(buf)[off:], fingerprint)
