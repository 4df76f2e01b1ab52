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

Bytes. A batch of blocks travels as one CPU tensor

    [num_blocks, num_layers, 2 (K, V), heads, block_size, head_dim]

(this rank's heads: `heads` = [h0, h1) of the model's KV heads) plus a JSON
header: magic, version, fingerprint, keys, dtype, shape, heads, and a crc32 per
block, so a truncated or corrupted payload is refused. Nothing is pickled.
"""

from __future__ import annotations

import array
import hashlib
import json
import struct
import warnings
import zlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

MAGIC = b"FSKV"
VERSION = 1
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


def kv_fingerprint(model_id: str, hf_config: Any, dtype: torch.dtype | str, block_size: int) -> str:
    """Everything two engines must share for one's KV blocks to be valid in the other."""
    layers, kv_heads, head_dim = kv_geometry(hf_config)
    dtype = dtype if isinstance(dtype, str) else dtype_name(dtype)
    parts = [model_id, getattr(hf_config, "model_type", ""), str(hf_config.hidden_size),
             str(hf_config.vocab_size), str(getattr(hf_config, "rope_theta", "")), dtype,
             f"B{block_size}", f"L{layers}", f"H{kv_heads}", f"D{head_dim}", LAYOUT]
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
    return BlockBatch(batches[0].fingerprint, batches[0].keys[:n], data,
                      (batches[0].heads[0], batches[-1].heads[1]))


# ---- moving blocks in and out of the paged cache -----------------------------------
def gather_blocks(kv_caches: list[torch.Tensor], block_ids: Sequence[int]) -> torch.Tensor:
    """Copy blocks out of the cache: [n, layers, 2, heads, block_size, head_dim] on the CPU."""
    first = kv_caches[0]
    two, heads, _, bs, hd = first.shape
    out = torch.empty((len(block_ids), len(kv_caches), two, heads, bs, hd), dtype=first.dtype,
                      pin_memory=first.is_cuda)
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=first.device)
    for layer, kv in enumerate(kv_caches):
        out[:, layer].copy_(kv.index_select(2, idx).permute(2, 0, 1, 3, 4), non_blocking=first.is_cuda)
    if first.is_cuda:
        torch.cuda.current_stream(first.device).synchronize()
    return out


def scatter_blocks(kv_caches: list[torch.Tensor], block_ids: Sequence[int], data: torch.Tensor) -> None:
    """Write `data` ([n, layers, 2, heads, block_size, head_dim]) into the cache's blocks."""
    first = kv_caches[0]
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=first.device)
    for layer, kv in enumerate(kv_caches):
        kv.index_copy_(2, idx, data[:, layer].permute(1, 2, 0, 3, 4).to(first.device, non_blocking=True))


# ---- the wire format ------------------------------------------------------------------
@dataclass(slots=True)
class BlockBatch:
    """Blocks in flight: their keys, their tensor, the heads they cover."""

    fingerprint: str
    keys: list[str]
    data: torch.Tensor  # [n, layers, 2, heads, block_size, head_dim], CPU
    heads: tuple[int, int]
    # crc32 per block, computed once where the blocks are gathered and carried end to
    # end (a split or a re-export reuses them), so damage anywhere after is caught.
    crcs: Optional[list[int]] = None

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def checksums(self) -> list[int]:
        if self.crcs is None:
            raw = self.data.view(torch.uint8).reshape(len(self.keys), -1).numpy()
            self.crcs = [zlib.crc32(row) for row in raw]
        return self.crcs

    def block(self, i: int) -> "BlockBatch":
        return BlockBatch(self.fingerprint, [self.keys[i]], self.data[i:i + 1], self.heads,
                          [self.checksums()[i]])

    def header(self) -> bytes:
        meta = {"v": VERSION, "fingerprint": self.fingerprint, "keys": self.keys,
                "dtype": dtype_name(self.data.dtype), "shape": list(self.data.shape),
                "heads": list(self.heads), "crc32": self.checksums()}
        body = json.dumps(meta, separators=(",", ":")).encode()
        return MAGIC + struct.pack("<I", len(body)) + body

    def payload(self):
        """The raw bytes, as a flat uint8 numpy view (no copy)."""
        return self.data.view(torch.uint8).reshape(-1).numpy()


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


def decode_batch(meta: dict, payload, fingerprint: str) -> BlockBatch:
    """Check a header against its payload (a bytes-like of exactly the tensor's bytes) and
    build the batch. Raises KVFormatError on any mismatch; never trusts the header's sizes."""
    if meta.get("fingerprint") != fingerprint:
        raise KVFormatError("KV from another model or format (fingerprint mismatch)")
    dtype = _DTYPES.get(meta.get("dtype"))
    shape, keys, crcs = meta.get("shape"), meta.get("keys"), meta.get("crc32")
    if dtype is None or not isinstance(shape, list) or len(shape) != 6 \
            or not isinstance(keys, list) or not isinstance(crcs, list) \
            or len(keys) != shape[0] or len(crcs) != shape[0]:
        raise KVFormatError("malformed KV header")
    nbytes = torch.empty((), dtype=dtype).element_size()
    for s in shape:
        if not isinstance(s, int) or s < 0:
            raise KVFormatError("malformed KV shape")
        nbytes *= s
    mv = memoryview(payload).cast("B")
    if len(mv) != nbytes:
        raise KVFormatError(f"payload has {len(mv)} bytes, header says {nbytes} (truncated?)")
    if nbytes == 0:
        raise KVFormatError("empty KV payload")
    per = nbytes // shape[0]
    for i, crc in enumerate(crcs):
        if zlib.crc32(mv[i * per:(i + 1) * per]) != crc:
            raise KVFormatError(f"block {i} fails its checksum (corrupt)")
    with warnings.catch_warnings():  # read-only buffers (Ray's store): we only read them
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(mv, dtype=torch.uint8)
    data = raw.view(dtype).reshape(shape)
    heads = tuple(meta.get("heads") or (0, shape[3]))
    return BlockBatch(fingerprint, [str(k) for k in keys], data, (int(heads[0]), int(heads[1])),
                      [int(c) for c in crcs])


def encode_to_bytes(batch: BlockBatch) -> bytes:
    """Header + payload in one bytes object (tests and small transports)."""
    return batch.header() + batch.payload().tobytes()


def decode_from_bytes(buf, fingerprint: str) -> BlockBatch:
    meta, off = parse_header(buf)
    return decode_batch(meta, memoryview(buf)[off:], fingerprint)
