"""Per-block digests, computed once where the blocks are gathered and checked where they land.

xxh3_64 of each block's bytes on the CPU (zlib's crc32 cost more than the copies it guarded:
docs/benchmarks/results/2026-11-24-kv-transfer-epyc-avx512.md); `wsum64` (a
position-weighted 64-bit sum computed with tensor ops) where the bytes stay on a GPU (the
NCCL path), so they are never staged through the host to be checked.

Both check integrity (a torn, truncated or corrupted block), not authenticity: anyone can
compute them. `KeyedDigest` (the shared-storage folder's `"digest": "keyed"`) is keyed with
the cluster's KV secret: it also refuses a block forged by someone without the secret.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import hmac
import threading
from typing import Iterator, Optional

import numpy as np
import numpy.typing as npt
import torch
import xxhash

from fleetserve.kv_transfer.errors import KVFormatError
from fleetserve.kv_transfer.secret import ClusterSecret

_HASH_POOL: Optional[cf.ThreadPoolExecutor] = None
_HASH_POOL_LOCK = threading.Lock()
_PARALLEL_HASH_BYTES = 32 << 20  # below this a second thread costs more than it saves


def _xxh3(mv: memoryview, per: int, lo: int, hi: int) -> list[int]:
    return [xxhash.xxh3_64_intdigest(mv[i * per : (i + 1) * per]) for i in range(lo, hi)]


def _hash_pool() -> cf.ThreadPoolExecutor:
    global _HASH_POOL
    if _HASH_POOL is None:
        with _HASH_POOL_LOCK:
            if _HASH_POOL is None:
                _HASH_POOL = cf.ThreadPoolExecutor(1, thread_name_prefix="kv-digest")
    return _HASH_POOL


def host_digests(buf: npt.NDArray[np.uint8], n: int) -> list[int]:
    """xxh3_64 of each of the `n` equal slices of a contiguous host buffer (two threads for
    big buffers: xxhash releases the GIL)."""
    mv = buf.data.cast("B")
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
        self._mv = _host_bytes(data)
        self._per = len(self._mv) // max(1, data.shape[0])
        self._futs: list[cf.Future[list[int]]] = []

    def add(self, start: int, end: int) -> cf.Future[list[int]]:
        """Blocks start..end-1 are in place: hash them (the future's result: their digests)."""
        fut = _hash_pool().submit(_xxh3, self._mv, self._per, start, end)
        self._futs.append(fut)
        return fut

    def result(self) -> list[int]:
        return [d for f in self._futs for d in f.result()]


def digests_ahead(data: torch.Tensor, chunks: list[tuple[int, int]]) -> Iterator[tuple[int, int, list[int]]]:
    """Yields (start, end, digests of blocks start..end-1) for each chunk of a contiguous host
    batch in order; the next chunk's digests are computed on the digest thread while the
    caller works on this one (verifies and writes it into the cache)."""
    if not chunks:
        return
    mv = _host_bytes(data)
    per = len(mv) // max(1, data.shape[0])
    pool = _hash_pool()
    fut = pool.submit(_xxh3, mv, per, *chunks[0])
    for i, (s, e) in enumerate(chunks):
        got = fut.result()
        if i + 1 < len(chunks):
            fut = pool.submit(_xxh3, mv, per, *chunks[i + 1])
        yield s, e, got


_WSUM_WEIGHTS: dict[tuple[int, torch.device], torch.Tensor] = {}


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


def compute_digests(data: torch.Tensor, digest: str) -> list[int]:
    """A batch's digests (`digest`: one of DIGESTS) where its bytes live; KVFormatError for a
    kind this data cannot have."""
    if digest == "wsum64":
        return device_digests(data)
    if digest != "xxh3_64" or data.device.type != "cpu":
        raise KVFormatError(f"digest {digest!r} on {data.device.type} data is not supported")
    return host_digests(data.contiguous().view(torch.uint8).numpy(), data.shape[0])


def _host_bytes(data: torch.Tensor) -> memoryview:
    """A contiguous host tensor's bytes, no copy."""
    return data.view(torch.uint8).numpy().data.cast("B")


KEYED_TAG_BYTES = 32


class KeyedDigest:
    """A keyed digest of one stored block (BLAKE2b-256 keyed with the cluster secret's
    "storage-digest" key) over its fingerprint, its chain key, its head range, its header and
    its bytes: only a holder of the secret can make one, and one made for a block is not
    valid for any other name (another key, heads or model)."""

    __slots__ = ("_key",)

    def __init__(self, secret: ClusterSecret) -> None:
        self._key = secret.key("storage-digest")

    def tag(self, fingerprint: str, key: str, heads: tuple[int, int], header: bytes, payload: memoryview) -> bytes:
        h = hashlib.blake2b(key=self._key, digest_size=KEYED_TAG_BYTES, person=b"fleetserve-kvb1")
        for part in (fingerprint.encode(), key.encode(), f"{heads[0]}-{heads[1]}".encode(), header):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        h.update(payload)  # (hashlib releases the GIL for big buffers)
        return h.digest()

    def check(
        self, fingerprint: str, key: str, heads: tuple[int, int], header: bytes, payload: memoryview, tag: bytes
    ) -> None:
        """KVFormatError unless `tag` is this block's keyed digest."""
        if len(tag) != KEYED_TAG_BYTES:
            raise KVFormatError("the block has no keyed digest (written without the cluster's KV secret)")
        if not hmac.compare_digest(tag, self.tag(fingerprint, key, heads, header, payload)):
            raise KVFormatError("the block's keyed digest does not match (not written with the cluster's KV secret)")

    def __repr__(self) -> str:
        return "KeyedDigest(<redacted>)"
