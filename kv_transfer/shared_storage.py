"""Shared-storage connector: a folder of KV blocks named by their chain keys.

    <path>/<fingerprint>/<key[:2]>/<key>.h<h0>-<h1>.kvb      one block, one rank's heads
    <path>/<fingerprint>/tmp/                                 writes in progress

Content-addressed: a block's file name is its chain key (its tokens, everything
before them, the cache salt, and the model/dtype/layout fingerprint), so any
engine of the same model can load any block another wrote, across restarts:
a persistent prefix cache. Unlike vLLM's reference connector:

* writes are atomic: a temporary file in the same folder, then `os.replace`;
  a reader sees a whole file or none;
* every file carries its key, fingerprint and a crc32 of its bytes; a corrupt,
  truncated or foreign file is never a hit (it is deleted when found);
* a size cap (`max_bytes`) evicts least recently used files (reads refresh a
  file's mtime); several processes may read, write and evict one folder at once
  (a file removed under a reader is just a miss).

`kv_connector_extra_config`: `path` (required), `max_bytes` (default 8 GiB),
`fsync` (default false: the checksum, not the disk, guarantees integrity).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from pathlib import Path

import numpy as np

from fleetserve.kv_transfer.base import ConnectorContext, KVConnectorRole, LoadSpec, SaveSpec
from fleetserve.kv_transfer.blocks import (BlockBatch, KVFormatError, decode_batch, join_shards,
                                           parse_header, producer_shards)
from fleetserve.kv_transfer.config import KVTransferConfig
from fleetserve.kv_transfer.transfer import TransferConnector, TransferError, Transport

logger = logging.getLogger(__name__)

POLL_S = 0.005  # a hand-off's files may still be on their way: look again this often


class BlockStore:
    """The folder, one file per (block, head range). Thread- and process-safe."""

    def __init__(self, root: str | os.PathLike, fingerprint: str, heads: tuple[int, int],
                 max_bytes: int = 8 << 30, fsync: bool = False) -> None:
        self.dir = Path(root) / fingerprint
        self.tmp = self.dir / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self.heads = heads
        self.max_bytes = max_bytes
        self.fsync = fsync
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
                    f.write(one.header())
                    f.write(memoryview(one.payload()))
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

    def get(self, key: str, heads: tuple[int, int] | None = None) -> BlockBatch | None:
        """The block named `key` (for `heads`, default this rank's), or None if absent,
        corrupt, truncated or foreign."""
        path = self.path(key, heads)
        try:
            with open(path, "rb") as f:
                raw = np.fromfile(f, dtype=np.uint8)
        except FileNotFoundError:
            return None
        try:
            meta, off = parse_header(raw)
            batch = decode_batch(meta, raw[off:], self.fingerprint)
            if batch.keys != [key]:
                raise KVFormatError(f"file holds block {batch.keys}, not {key}")
        except KVFormatError as e:
            logger.warning("refusing KV file %s: %s; removing it", path, e)
            path.unlink(missing_ok=True)
            return None
        try:
            os.utime(path)  # recently used: last to be evicted
        except FileNotFoundError:
            pass
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
        from fleetserve.kv_transfer.blocks import local_head_range

        extra = config.kv_connector_extra_config
        if not extra.get("path"):
            raise ValueError("SharedStorageConnector needs kv_connector_extra_config.path")
        self.ranges = [local_head_range(ctx.num_kv_heads, ctx.tp_size, r) for r in range(ctx.tp_size)]
        self.store = BlockStore(extra["path"], ctx.fingerprint, self.ranges[ctx.tp_rank],
                                int(extra.get("max_bytes", 8 << 30)), bool(extra.get("fsync", False)))

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

    def fetch(self, spec: LoadSpec) -> BlockBatch:
        """This rank's heads of the blocks, from the shards the producer's TP wrote."""
        producer_tp = int(spec.source.get("remote_tp_size", self.ctx.tp_size))
        shards = producer_shards(self.store.heads, self.ctx.num_kv_heads, producer_tp)
        return join_shards([self._fetch_shard(spec, rng) for _, rng in shards])

    def _fetch_shard(self, spec: LoadSpec, heads: tuple[int, int]) -> BlockBatch:
        """Read the blocks in order; a hand-off's files may lag the producer's reply, so
        missing ones are awaited until the deadline (a lookup hit is read once)."""
        blocks = []
        for key in spec.keys:
            batch = self.store.get(key, heads)
            while batch is None and spec.transfer_id is not None and time.time() < spec.deadline:
                time.sleep(POLL_S)
                batch = self.store.get(key, heads)
            if batch is None:
                break
            blocks.append(batch)
        if not blocks:
            raise TransferError(f"no stored block for {spec.keys[0]}")
        import torch

        data = blocks[0].data if len(blocks) == 1 else torch.cat([b.data for b in blocks])
        return BlockBatch(self.ctx.fingerprint, [b.keys[0] for b in blocks], data, heads,
                          [b.crcs[0] for b in blocks])


class SharedStorageConnector(TransferConnector):
    transport_cls = SharedStorageTransport
