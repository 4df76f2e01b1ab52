"""Shared-storage connector: a folder of KV blocks named by their chain keys.

    <path>/<fingerprint>/<key[:2]>/<key>.h<h0>-<h1>.kvb      one block, one rank's heads
    <path>/<fingerprint>/tmp/                                 writes in progress

Content-addressed: a block's file name is its chain key (its tokens, everything
before them, the cache salt, and the model/dtype/layout fingerprint), so any
engine of the same model can load any block another wrote, across restarts:
a persistent prefix cache. Unlike vLLM's reference connector:

* writes are atomic: a temporary file in the same folder, then `os.replace`;
  a reader sees a whole file or none;
* every file carries its key, fingerprint and a digest of its bytes; a corrupt,
  truncated or foreign file is never a hit (it is deleted when found);
* a size cap (`max_bytes`) evicts least recently used files (reads refresh a
  file's mtime); several processes may read, write and evict one folder at once
  (a file removed under a reader is just a miss).

The digests check integrity, not authenticity: anyone who can write the folder can write
a well-formed file for a known prefix. With `"digest": "keyed"` every file also ends with
a keyed digest (digests.KeyedDigest: the cluster's KV secret, the block's fingerprint, key
and heads, its header and bytes); a file without a valid one is refused (counted in
`refused`, removed) and its blocks recomputed. One folder, one mode: each refuses the
other's files.

`kv_connector_extra_config`: `path` (required), `max_bytes` (default 8 GiB),
`fsync` (default false: the checksum, not the disk, guarantees integrity),
`digest` ("unkeyed", the default, or "keyed": needs FLEETSERVE_KV_SECRET).
"""

from __future__ import annotations

import io
import logging
import os
import secrets
import struct
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from fleetserve.kv_transfer.base import ConnectorContext, KVConnectorRole, LoadSpec, SaveSpec
from fleetserve.kv_transfer.blocks import MAGIC, BlockBatch, batch_from_tensor, check_header, parse_header
from fleetserve.kv_transfer.config import KVTransferConfig
from fleetserve.kv_transfer.digests import KEYED_TAG_BYTES, KeyedDigest
from fleetserve.kv_transfer.errors import KVFormatError, TransferError
from fleetserve.kv_transfer.secret import KV_SECRET_ENV, load_secret
from fleetserve.kv_transfer.shards import join_shards, local_head_range, producer_shards
from fleetserve.kv_transfer.stream import ChunkSink
from fleetserve.kv_transfer.transfer import TransferConnector
from fleetserve.kv_transfer.transport import Transport

logger = logging.getLogger(__name__)

POLL_S = 0.005  # a hand-off's files may still be on their way: look again this often
DIGEST_MODES = ("unkeyed", "keyed")


class BlockStore:
    """The folder, one file per (block, head range). Thread- and process-safe."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        fingerprint: str,
        heads: tuple[int, int],
        max_bytes: int = 8 << 30,
        fsync: bool = False,
        keyed: Optional[KeyedDigest] = None,
    ) -> None:
        self.dir = Path(root) / fingerprint
        self.tmp = self.dir / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self.heads = heads
        self.max_bytes = max_bytes
        self.fsync = fsync
        self.keyed = keyed  # every file ends with its keyed digest; files without one are refused
        self.refused = 0  # files refused (corrupt, truncated, foreign, or failing the keyed digest)
        self._lock = threading.Lock()
        self._approx_bytes = self._scan()[1]

    def path(self, key: str, heads: tuple[int, int] | None = None) -> Path:
        h0, h1 = heads or self.heads
        return self.dir / key[:2] / f"{key}.h{h0}-{h1}.kvb"

    def contains(self, key: str) -> bool:
        return self.path(key).exists()

    def put(self, batch: BlockBatch) -> int:
        """Write each block of `batch` (skipping ones already there); returns bytes written."""
        written = 0
        for i, key in enumerate(batch.keys):
            final = self.path(key, batch.heads)
            if final.exists():
                continue
            one = batch.block(i)
            final.parent.mkdir(exist_ok=True)
            tmp = self.tmp / f"{key}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
            try:
                with open(tmp, "wb") as f:
                    header, payload = one.header(), one.payload().data
                    f.write(header)
                    f.write(payload)
                    if self.keyed is not None:
                        f.write(self.keyed.tag(self.fingerprint, key, batch.heads, header, payload.cast("B")))
                    if self.fsync:
                        f.flush()
                        os.fsync(f.fileno())
                os.replace(tmp, final)  # atomic: readers see all of it or nothing
            finally:
                tmp.unlink(missing_ok=True)
            written += final.stat().st_size
        if written:
            with self._lock:
                self._approx_bytes += written
                over = self._approx_bytes > self.max_bytes
            if over:
                self.evict()
        return written

    def get(
        self, key: str, heads: tuple[int, int] | None = None, out: Optional[torch.Tensor] = None
    ) -> BlockBatch | None:
        """The block named `key` (for `heads`, default this rank's), or None if absent,
        corrupt, truncated or foreign. Its bytes are read straight into `out` (one block's
        tensor, e.g. a slice of a staging buffer) when given, else into a new buffer."""
        path = self.path(key, heads)
        try:
            with open(path, "rb") as f:
                batch = self._read(f, key, heads or self.heads, out)
        except FileNotFoundError:
            return None
        except KVFormatError as e:
            with self._lock:
                self.refused += 1
            logger.warning("refusing KV file %s: %s; removing it (its blocks are recomputed)", path, e)
            path.unlink(missing_ok=True)
            return None
        try:
            os.utime(path)  # recently used: last to be evicted
        except FileNotFoundError:
            pass
        return batch

    def _read(self, f: io.BufferedReader, key: str, heads: tuple[int, int], out: Optional[torch.Tensor]) -> BlockBatch:
        head = f.read(8)
        if len(head) < 8 or head[:4] != MAGIC:
            raise KVFormatError("not a fleetserve KV payload (bad magic)")
        header = head + f.read(struct.unpack("<I", head[4:8])[0])
        meta, _ = parse_header(header)
        _, shape, nbytes = check_header(meta, self.fingerprint)
        if out is None:
            buf = torch.empty(nbytes, dtype=torch.uint8)
        elif list(out.shape) == shape and out.is_contiguous():
            buf = out.view(torch.uint8).view(-1)
        else:  # the fingerprint fixes the geometry: a file of another shape is damaged
            raise KVFormatError(f"block of shape {shape}, expected {list(out.shape)}")
        got = f.readinto(buf.numpy().data)
        if got != nbytes:
            raise KVFormatError(f"payload has {got} bytes, header says {nbytes} (truncated?)")
        tail = f.read(KEYED_TAG_BYTES + 1)
        if self.keyed is not None:  # before anything else trusts the header
            self.keyed.check(self.fingerprint, key, heads, header, buf.numpy().data.cast("B"), tail)
        elif tail:
            raise KVFormatError(f"payload has {got}+ bytes, header says {nbytes} (a keyed file, or damaged)")
        batch = batch_from_tensor(meta, buf, self.fingerprint)
        if batch.keys != [key]:
            raise KVFormatError(f"file holds block {batch.keys}, not {key}")
        return batch

    def _scan(self) -> tuple[list[tuple[float, int, Path]], int]:
        files, total = [], 0
        for sub in self.dir.iterdir():
            if sub.name == "tmp" or not sub.is_dir():
                continue
            for p in sub.iterdir():
                try:
                    st = p.stat()
                except FileNotFoundError:
                    continue
                files.append((st.st_mtime, st.st_size, p))
                total += st.st_size
        return files, total

    def evict(self) -> None:
        """Delete least recently used files until the folder is under 90% of its cap."""
        files, total = self._scan()
        files.sort()
        target = int(self.max_bytes * 0.9)
        for _, size, p in files:
            if total <= target:
                break
            p.unlink(missing_ok=True)  # another process may have taken it already
            total -= size
        with self._lock:
            self._approx_bytes = total
        self._sweep_tmp()

    def _sweep_tmp(self, older_than_s: float = 600.0) -> None:
        """Temporary files of writers that died mid-write."""
        now = time.time()
        for p in self.tmp.iterdir():
            try:
                if now - p.stat().st_mtime > older_than_s:
                    p.unlink(missing_ok=True)
            except FileNotFoundError:
                pass


class SharedStorageTransport(Transport):
    supports_lookup = True
    saves_all = True

    def __init__(self, config: KVTransferConfig, ctx: ConnectorContext, role: KVConnectorRole) -> None:
        super().__init__(config, ctx, role)
        extra = config.kv_connector_extra_config
        if not extra.get("path"):
            raise ValueError("SharedStorageConnector needs kv_connector_extra_config.path")
        self.ranges = [local_head_range(ctx.num_kv_heads, ctx.tp_size, r) for r in range(ctx.tp_size)]
        self.store = BlockStore(
            extra["path"],
            ctx.fingerprint,
            self.ranges[ctx.tp_rank],
            int(extra.get("max_bytes", 8 << 30)),
            bool(extra.get("fsync", False)),
            _keyed_digest(str(extra.get("digest", "unkeyed"))),
        )

    def lookup(self, keys: list[str]) -> int:
        """Leading keys stored for every rank's heads (the scheduler half asks for all ranks)."""
        n = 0
        for key in keys:
            if not all(self.store.path(key, r).exists() for r in self.ranges):
                break
            n += 1
        return n

    def export(self, spec: SaveSpec, batch: BlockBatch) -> None:
        self.store.put(batch)

    def fetch(self, spec: LoadSpec, sink: Optional[ChunkSink] = None) -> BlockBatch:
        """This rank's heads of the blocks, from the shards the producer's TP wrote (read whole:
        no `sink`)."""
        producer_tp = int(spec.source.get("remote_tp_size", self.ctx.tp_size))
        shards = producer_shards(self.store.heads, self.ctx.num_kv_heads, producer_tp)
        return join_shards([self._fetch_shard(spec, rng) for _, rng in shards])

    def _fetch_shard(self, spec: LoadSpec, heads: tuple[int, int]) -> BlockBatch:
        """Read the blocks in order, each file straight into its slot of one staging buffer;
        a hand-off's files may lag the producer's reply, so missing ones are awaited until
        the deadline (a lookup hit is read once)."""
        data, release = self.staging_pool().take(self.block_shape(len(spec.keys), heads), self.kv_caches[0].dtype)
        digests: list[int] = []
        for i, key in enumerate(spec.keys):
            batch = self.store.get(key, heads, data[i : i + 1])
            while batch is None and spec.transfer_id is not None and time.time() < spec.deadline:
                time.sleep(POLL_S)
                batch = self.store.get(key, heads, data[i : i + 1])
            if batch is None:
                break
            digests.append(batch.checksums()[0])  # (verified as it was read)
        if not digests:
            release()
            raise TransferError(f"no stored block for {spec.keys[0]}")
        n = len(digests)
        return BlockBatch(self.ctx.fingerprint, list(spec.keys[:n]), data[:n], heads, digests, on_release=release)


def _keyed_digest(mode: str) -> Optional[KeyedDigest]:
    """The folder's keyed digest for `mode`, or None (unkeyed)."""
    if mode not in DIGEST_MODES:
        raise ValueError(f"kv_connector_extra_config.digest must be one of {DIGEST_MODES}, not {mode!r}")
    if mode == "unkeyed":
        return None
    secret = load_secret()
    if secret is None:
        raise ValueError(
            f'SharedStorageConnector with "digest": "keyed" needs the cluster\'s KV secret ({KV_SECRET_ENV})'
        )
    return KeyedDigest(secret)


class SharedStorageConnector(TransferConnector):
    transport_cls = SharedStorageTransport
