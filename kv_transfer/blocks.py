"""A batch of blocks in flight, and its wire format.

A batch travels as one tensor

    [num_blocks, num_layers, 2 (K, V), heads, block_size, head_dim]

(this rank's heads: `heads` = [h0, h1) of the model's KV heads) plus a JSON header: magic,
version, fingerprint, chain keys (kv_transfer.keys), dtype, shape, heads, and a digest per
block (kv_transfer.digests), so a truncated or corrupted payload is refused. Nothing is
pickled; a header is checked for shape and sense before any of its sizes is used.
"""

from __future__ import annotations

import json
import struct
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import numpy as np
import numpy.typing as npt
import torch

from fleetserve.kv_transfer.digests import DIGESTS, compute_digests, digests_ahead
from fleetserve.kv_transfer.errors import KVFormatError
from fleetserve.kv_transfer.keys import dtype_name
from fleetserve.kv_transfer.stream import MAX_CHUNKS, STREAM_CHUNK_BYTES, ChunkSink, ExportProgress, plan_chunks

MAGIC = b"FSKV"
VERSION = 2  # 1: crc32 per block
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# A header as parsed from JSON: nothing in it is trusted before check_header.
Header = dict[str, Any]
# What payloads arrive as: bytes from a store or a file, Ray's zero-copy numpy arrays.
BytesLike = Union[bytes, bytearray, memoryview, npt.NDArray[np.uint8]]


def as_memoryview(buf: BytesLike) -> memoryview:
    """`buf`'s bytes, no copy (a numpy array through its buffer)."""
    return buf.data if isinstance(buf, np.ndarray) else memoryview(buf)


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

    def block(self, i: int) -> BlockBatch:
        return BlockBatch(
            self.fingerprint, [self.keys[i]], self.data[i : i + 1], self.heads, [self.checksums()[i]], self.digest
        )

    def header(self, chunks: Optional[list[int]] = None) -> bytes:
        """The JSON header; with `chunks` (blocks per chunk, in order) the digests are left
        out: they travel with each chunk (a streamed batch)."""
        meta: Header = {
            "v": VERSION,
            "fingerprint": self.fingerprint,
            "keys": self.keys,
            "dtype": dtype_name(self.data.dtype),
            "shape": list(self.data.shape),
            "heads": list(self.heads),
            "digest": self.digest,
            "digests": None if chunks else self.checksums(),
        }
        if chunks:
            meta["chunks"] = chunks
        body = json.dumps(meta, separators=(",", ":")).encode()
        return MAGIC + struct.pack("<I", len(body)) + body

    def payload(self) -> npt.NDArray[np.uint8]:
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


def parse_header(buf: BytesLike) -> tuple[Header, int]:
    """(header dict, payload offset) of a buffer that starts with a header."""
    mv = as_memoryview(buf)
    if len(mv) < 8 or bytes(mv[:4]) != MAGIC:
        raise KVFormatError("not a fleetserve KV payload (bad magic)")
    (n,) = struct.unpack("<I", mv[4:8])
    if len(mv) < 8 + n:
        raise KVFormatError("truncated header")
    try:
        meta = json.loads(bytes(mv[8 : 8 + n]))
    except ValueError as e:
        raise KVFormatError(f"unreadable header: {e}") from e
    if not isinstance(meta, dict) or meta.get("v") != VERSION:
        raise KVFormatError("unsupported KV payload version")
    return meta, 8 + n


def check_header(meta: Header, fingerprint: str) -> tuple[torch.dtype, list[int], int]:
    """(dtype, shape, payload bytes) of a header, checked for shape and sense; raises
    KVFormatError on anything malformed or foreign. Never trusts the header's sizes."""
    if meta.get("fingerprint") != fingerprint:
        raise KVFormatError("KV from another model or format (fingerprint mismatch)")
    dtype = _DTYPES.get(str(meta.get("dtype")))
    shape, keys, sums = meta.get("shape"), meta.get("keys"), meta.get("digests")
    chunks = meta.get("chunks")
    if (
        dtype is None
        or not isinstance(shape, list)
        or len(shape) != 6
        or not isinstance(keys, list)
        or len(keys) != shape[0]
        or meta.get("digest") not in DIGESTS
    ):
        raise KVFormatError("malformed KV header")
    if chunks is None:
        if not isinstance(sums, list) or len(sums) != shape[0]:
            raise KVFormatError("malformed KV header (digests)")
    elif (
        sums is not None
        or not isinstance(chunks, list)
        or not chunks
        or len(chunks) > MAX_CHUNKS
        or not all(isinstance(c, int) and c > 0 for c in chunks)
        or sum(chunks) != shape[0]
    ):
        raise KVFormatError("malformed KV header (chunks)")
    nbytes = torch.empty((), dtype=dtype).element_size()
    for s in shape:
        if not isinstance(s, int) or s < 0:
            raise KVFormatError("malformed KV shape")
        nbytes *= s
    if nbytes == 0:
        raise KVFormatError("empty KV payload")
    return dtype, shape, nbytes


def batch_from_tensor(
    meta: Header, data: torch.Tensor, fingerprint: str, on_release: Optional[Callable[[], None]] = None
) -> BlockBatch:
    """Build a batch over received bytes (`data`: uint8, on any device) and verify every
    block's digest. Raises KVFormatError on any mismatch."""
    tensor, keys, heads = _unpack(meta, data, fingerprint)
    digest = meta["digest"]
    got = compute_digests(tensor, digest)
    for i, (a, b) in enumerate(zip(got, meta["digests"])):
        if a != b:
            raise KVFormatError(f"block {i} fails its {digest} digest (corrupt)")
    return BlockBatch(fingerprint, keys, tensor, heads, got, digest, on_release)


def _unpack(meta: Header, data: torch.Tensor, fingerprint: str) -> tuple[torch.Tensor, list[str], tuple[int, int]]:
    """(the blocks over `data`, uint8, as the header describes them; their keys; their heads),
    once the header fits this consumer and `data` is exactly the batch's bytes."""
    dtype, shape, nbytes = check_header(meta, fingerprint)
    if meta.get("chunks") is not None:
        raise KVFormatError("a streamed batch's digests travel with its chunks, not in its header")
    if data.numel() != nbytes:
        raise KVFormatError(f"payload has {data.numel()} bytes, header says {nbytes} (truncated?)")
    heads = meta.get("heads") or (0, shape[3])
    return data.view(dtype).view(shape), [str(k) for k in meta["keys"]], (int(heads[0]), int(heads[1]))


def _host_bytes(payload: BytesLike) -> torch.Tensor:
    """A uint8 tensor over a host bytes-like, no copy (read-only buffers such as Ray's store
    are fine: the bytes are only read)."""
    mv = as_memoryview(payload).cast("B")
    if len(mv) == 0:
        raise KVFormatError("empty KV payload")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mv, dtype=torch.uint8)


def decode_batch(meta: Header, payload: BytesLike, fingerprint: str) -> BlockBatch:
    """`batch_from_tensor` over a host bytes-like of exactly the tensor's bytes."""
    return batch_from_tensor(meta, _host_bytes(payload), fingerprint)


def deliver_verified(
    meta: Header, payload: BytesLike, fingerprint: str, sink: ChunkSink, chunk_bytes: int = STREAM_CHUNK_BYTES
) -> BlockBatch:
    """`decode_batch`, handing the blocks to `sink` as they are verified: each chunk's digests
    are computed on the digest thread while the previous chunk is written into the cache. The
    first block that fails its digest ends what is written. Returns the batch (its bytes are
    `payload`'s)."""
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
    return batch.header() + bytes(batch.payload().data)


def decode_from_bytes(buf: BytesLike, fingerprint: str) -> BlockBatch:
    meta, off = parse_header(buf)
    return decode_batch(meta, as_memoryview(buf)[off:], fingerprint)
