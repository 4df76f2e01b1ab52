"""Ray object store connector: the producer `ray.put`s a request's blocks, the consumer gets them.

    producer worker (holds the KV)              owner actor (detached, named)   consumer worker
    gather blocks -> ray.put -> owner.hold([ref])  holds the ref under a lease
    params: remote_ray_owner=<name>             lookup(transfer_id) -> [ref] <-- poll until deadline
                                                release(transfer_id)         <-- ray.get(ref), confirm
                                                (or the lease ends: dropped)

The blocks leave from the process that holds the KV (the engine-core process for
TP=1, each rank for TP>1): gathered into one host buffer and put once (Ray copies it
into shared memory, numpy's bytes out of band: no serialization of the payload).
The detached owner actor *borrows* the object (Ray's reference counting keeps it
alive while the actor holds the ref) until the consumer confirms or the lease
(`kv_lease_s`) ends. On one node the consumer reads it zero-copy from shared memory
and copies it straight into its blocks, chunk by chunk (`stream_chunk_bytes`, default 8
MiB): each chunk's digests are computed on a second thread while the chunk before is
written, and the first damaged block ends what is written. Across nodes Ray moves it.
The producer likewise hashes each chunk while it gathers the next.

Ray 2.56 removed `ray.put(_owner=...)`, so the object's owner is the producer process:
if that process dies before the consumer reads, the object is lost and the load fails
(by policy: recompute, or a clear error). `durable_owner: true` instead makes the
actor put its own copy (one more copy of every byte: its cost is in
docs/design/kv-connector.md), so an export outlives its producer.

The object is a (header bytes, uint8 array) pair: the header is JSON (keys,
fingerprint, per-block digests) and is parsed and checked like every other
connector's; Ray's own serialization stays inside the cluster. The worker connects
to Ray and finds the owner actor when its cache is registered (engine start), not on
a request's first transfer.

Each process pays a page fault per 4 KiB page of the store's shared memory the first time
it touches one, and the store's allocator hands out fresh addresses until it has gone round
the whole store once, so without help a new engine's exports pay them until it has put the
store's size. When the store's memory is already allocated (Ray started with
`RAY_preallocate_plasma_memory=1` in its environment: `ray start`, or `fleetserve serve`'s
embedded Ray), each worker maps all of it at engine start, on a background thread at the
lowest priority (`ray_store_warmup`); a sparse store is left alone (mapping it would allocate
all of it). What that costs and saves: docs/benchmarks/results/2026-11-29-kv-transfer-zen5.md.

`kv_connector_extra_config`: `ray_address` (default: the Ray this process is
connected to, else RAY_ADDRESS), `owner_name` (default "fleetserve-kv-owner"),
`namespace` (default "fleetserve"), `durable_owner` (default false), `map_store`
(default true: the warm-up above), `stream_chunk_bytes`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from types import ModuleType
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from fleetserve.kv_transfer.base import ConnectorContext, KVConnectorRole, LoadSpec, SaveSpec
from fleetserve.kv_transfer.blocks import BlockBatch, decode_batch, deliver_verified, parse_header
from fleetserve.kv_transfer.config import KVTransferConfig
from fleetserve.kv_transfer.connectors.ray_owner import Export, KVObjectOwner, connect_ray, get_owner
from fleetserve.kv_transfer.connectors.ray_store_warmup import map_store
from fleetserve.kv_transfer.errors import TransferError
from fleetserve.kv_transfer.shards import join_shards, local_head_range, producer_shards, readers_of
from fleetserve.kv_transfer.staging import StagingPool
from fleetserve.kv_transfer.stream import STREAM_CHUNK_BYTES, ChunkSink
from fleetserve.kv_transfer.transfer import TransferConnector
from fleetserve.kv_transfer.transport import Transport

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

logger = logging.getLogger(__name__)

POLL_S = 0.005  # an export not held yet is asked for again this often (owners without wait_lookup)
WAIT_S = 5.0  # a wait_lookup call waits this long at most (then the consumer asks again)


class RayObjectStoreTransport(Transport):
    fetches_chunks = True

    def __init__(self, config: KVTransferConfig, ctx: ConnectorContext, role: KVConnectorRole) -> None:
        super().__init__(config, ctx, role)
        extra = config.kv_connector_extra_config
        self.owner_name = str(extra.get("owner_name", "fleetserve-kv-owner"))
        self.namespace = str(extra.get("namespace", "fleetserve"))
        self.durable = bool(extra.get("durable_owner", False))
        self._extra = extra
        self.chunk_bytes = int(extra.get("stream_chunk_bytes", STREAM_CHUNK_BYTES))
        self._ray: Optional[ModuleType] = None
        self._owners: dict[tuple[str, str], ActorHandle[KVObjectOwner]] = {}  # by (name, namespace)
        self._stop = threading.Event()
        self.mapped_bytes: Optional[int] = None  # set once the store warm-up is over
        self._mapper: Optional[threading.Thread] = None

    def register_kv_caches(self, kv_caches: list[torch.Tensor], staging: StagingPool) -> None:
        super().register_kv_caches(kv_caches, staging)
        self._connect()  # at engine start: a request's first transfer must not pay for it
        if bool(self._extra.get("map_store", True)) and self._mapper is None:
            self._mapper = threading.Thread(target=self._map_store, name="kv-map-store", daemon=True)
            self._mapper.start()

    def _map_store(self) -> None:
        ray = self._connect()

        def ensure_mapped() -> None:  # an object too big to be inlined: the client maps the store
            ref = ray.put(np.zeros(1 << 20, dtype=np.uint8))
            del ref

        try:  # the lowest priority: an engine starting or serving beside it comes first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # (this thread only, on Linux)
        except (OSError, AttributeError):
            pass
        try:
            t0 = time.perf_counter()
            self.mapped_bytes = map_store(self._stop, ensure_mapped)
            if self.mapped_bytes:
                logger.info(
                    "mapped %d MiB of the object store in %.2f s", self.mapped_bytes >> 20, time.perf_counter() - t0
                )
        except Exception:  # noqa: BLE001 - a warm-up only: transfers work without it
            logger.debug("object store warm-up failed", exc_info=True)
            self.mapped_bytes = 0

    def wait_store_mapped(self, timeout: float) -> Optional[int]:
        """The bytes of the store the warm-up mapped, once it is over (None: still going)."""
        if self._mapper is not None:
            self._mapper.join(timeout)
        return self.mapped_bytes

    def shutdown(self) -> None:
        self._stop.set()

    def _connect(self) -> ModuleType:
        if self._ray is None:
            ray = connect_ray(self._extra)
            self._owners[(self.owner_name, self.namespace)] = get_owner(ray, self.owner_name, self.namespace)
            self._ray = ray
        return self._ray

    def _owner(self, spec: Optional[LoadSpec] = None) -> tuple[ModuleType, ActorHandle[KVObjectOwner]]:
        """The owner actor a consumer's params name (ours by default), looked up once."""
        ray = self._connect()
        key = (
            str(spec.source.get("remote_ray_owner", self.owner_name)) if spec else self.owner_name,
            str(spec.source.get("remote_ray_namespace", self.namespace)) if spec else self.namespace,
        )
        owner = self._owners.get(key)
        if owner is None:
            try:
                owner = ray.get_actor(key[0], namespace=key[1])
            except ValueError as e:
                raise TransferError(f"no KV owner {key[0]!r} in namespace {key[1]!r}") from e
            self._owners[key] = owner
        return ray, owner

    def location(self, transfer_id: Optional[str]) -> dict[str, Any]:
        return {"remote_ray_owner": self.owner_name, "remote_ray_namespace": self.namespace}

    def _object_id(self, transfer_id: Optional[str]) -> str:
        # One object per rank: a TP consumer finds the ranks' shards by head range.
        return f"{transfer_id}/r{self.ctx.tp_rank}"

    def export(self, spec: SaveSpec, batch: BlockBatch) -> None:
        ray, owner = self._owner()
        oid = self._object_id(spec.transfer_id)
        call: ObjectRef[None]
        if self.durable:  # the actor puts (and owns) its own copy
            call = owner.adopt.remote(oid, batch.header(), batch.payload(), spec.lease_s)
        else:  # put once from here; the actor borrows it (Ray counts its reference)
            ref = ray.put((batch.header(), batch.payload()))
            call = owner.hold.remote(oid, [ref], batch.nbytes, spec.lease_s)
        ray.get(call, timeout=60)

    def fetch(self, spec: LoadSpec, sink: Optional[ChunkSink] = None) -> BlockBatch:
        """The blocks of `spec`; with a `sink` and one producer shard, each chunk is verified
        and written into the cache as the next one is checked."""
        ray, owner = self._owner(spec)
        shards = self._shards(spec)
        sink = sink if len(shards) == 1 else None  # shards are joined first: whole batches
        return join_shards(
            [self._fetch_one(ray, owner, spec, f"{spec.transfer_id}/r{rank}", sink) for rank, _ in shards]
        )

    def _shards(self, spec: LoadSpec) -> list[tuple[int, tuple[int, int]]]:
        heads = local_head_range(self.ctx.num_kv_heads, self.ctx.tp_size, self.ctx.tp_rank)
        return producer_shards(heads, self.ctx.num_kv_heads, int(spec.source.get("remote_tp_size", self.ctx.tp_size)))

    def _fetch_one(
        self,
        ray: ModuleType,
        owner: ActorHandle[KVObjectOwner],
        spec: LoadSpec,
        oid: str,
        sink: Optional[ChunkSink] = None,
    ) -> BlockBatch:
        refs: Optional[list[ObjectRef[Export]]] = None
        # An owner actor started by an older fleetserve (detached: it outlives upgrades) may
        # lack wait_lookup: then ask every POLL_S.
        wait = getattr(owner, "wait_lookup", None)
        while refs is None:
            left = spec.deadline - time.time()
            if left <= 0:
                raise TransferError(f"transfer {oid} not exported before the deadline")
            if wait is not None:
                refs = ray.get(wait.remote(oid, min(left, WAIT_S)), timeout=left + 1.0)
                continue
            refs = ray.get(owner.lookup.remote(oid), timeout=left)
            if refs is None:
                time.sleep(POLL_S)
        try:
            export: Export = ray.get(refs[0], timeout=max(0.001, spec.deadline - time.time()))
        except ray.exceptions.RayError as e:  # e.g. the producer (the object's owner) died
            raise TransferError(f"transfer {oid} is gone: {type(e).__name__}") from e
        header, payload = export
        meta, off = parse_header(header)
        if off != len(header):
            raise TransferError("trailing bytes after the KV header")
        # A zero-copy view of the shared-memory object: checked, then copied straight into
        # the consumer's blocks (chunk by chunk, the checks overlapping the writes, with a sink).
        if sink is not None and meta.get("digest") == "xxh3_64":
            return deliver_verified(meta, payload, self.ctx.fingerprint, sink, self.chunk_bytes)
        return decode_batch(meta, payload, self.ctx.fingerprint)

    def confirm(self, spec: LoadSpec) -> None:
        _, owner = self._owner(spec)
        for rank, rng in self._shards(spec):
            readers = readers_of(rng, self.ctx.num_kv_heads, self.ctx.tp_size)
            owner.release.remote(f"{spec.transfer_id}/r{rank}", self.ctx.tp_rank, readers)


class RayObjectStoreConnector(TransferConnector):
    transport_cls = RayObjectStoreTransport
