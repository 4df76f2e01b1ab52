"""torch.distributed point-to-point connector: the consumer pulls blocks from the producer
rank that holds them, over a two-rank group (gloo: kept between pulls; NCCL: per pull).

    producer rank                                  consumer rank
    export: keep the gathered blocks (outbox,      fetch: find the producer rank's server in
      under a lease); a server (a TCPStore on        the Ray directory (owner actor: name
      a free port, registered in the Ray             "p2p/<engine_id>/r<rank>" -> host:port)
      directory) starts with the engine          new client: check "auth/salt" (the secret)
    server threads, each pull as it comes:         pid = store.add("pull_ids", 1);
      pop the PULLS queue (checked, sealed)        queue_push("pulls", {pid, oid, backend, group})
      store.set("hdr/<pid>", backend + header)     check the header (fingerprint, shape,
      wait for "go/<pid>" (the consumer's          digests' count) -> store.set("go/<pid>")
        verdict on the header)                     recv the payload into a staging buffer (gloo)
      send the payload over a 2-rank group         or device memory (NCCL), verify every
      (gloo or NCCL); the outbox entry goes          block's digest -> straight into blocks
      (the consumer has it) or its lease ends

Backend, chosen at run time per pull: **NCCL** when the producer's KV lives on a GPU,
`torch.distributed` has NCCL and the consumer asks for it (its KV is on a GPU too):
the blocks are gathered on the producer's GPU, sent GPU to GPU, checked there with
`wsum64` digests and written into the consumer's blocks without touching the host.
Otherwise **gloo** over TCP from host staging buffers (a GPU producer pulled by a CPU
consumer stages its blocks through the host first). The NCCL path cannot run on the
machines this project is developed on (no GPU; and two ranks of one NCCL group need
two GPUs): it is written, not yet run; the gloo path is tested.

A pull's fixed costs are kept small: the consumer keeps its store clients of a producer
between pulls (a new one is a TCP connect and torch's handshake), and the producer's server
blocks on the next pull's key instead of polling for it (leases end on a thread of their
own): docs/benchmarks/results/2026-11-29-kv-transfer-zen5.md.

Gloo groups are kept between pulls: forming one costs more than moving a short prompt's KV
(docs/design/kv-connector.md), so each consumer rank keeps one group per
producer server (keyed by its address, LRU of `p2p_max_groups`, default 16, on both
sides) and names it in every pull; each payload travels with the pull's id as its tag.
A pull naming a group the producer no longer has is answered "regroup" and the
consumer forms a new one in the same pull. Any error on a kept group drops it on
the consumer (the next pull forms a fresh one), and nothing stale survives a peer's
restart: a restarted producer registers a new address under a new engine id, and a
pull from a dead one fails within CONNECT_TIMEOUT_S (a failed load, handled by
policy). A receive that fails on a kept group (its deadline passed) keeps its
staging buffer out of the pool: gloo cannot cancel a posted receive. NCCL groups
are formed per pull and dropped after it. Header and verdict travel through the
store, so a consumer that refuses a header (another model, a malformed shape) never
joins a group op and the producer's server moves on at once.

Gloo pulls of a CPU cache stream: the producer exports a batch before copying it out
and sends each chunk (`stream_chunk_bytes`, default 8 MiB: its blocks' digests, then
its bytes) once it is gathered; the consumer checks each chunk as it lands and writes
it into its blocks while the next one arrives (kv_transfer.loads.Sink). A chunk whose copy-out
failed goes out as status 0 and nothing after it (both sides drop the group); a pull
that does not ask for a stream (several head shards to join, an older consumer) gets
the whole batch once it is gathered.

With the cluster's KV secret (FLEETSERVE_KV_SECRET or FLEETSERVE_KV_SECRET_FILE: secret.py),
every value the protocol reads from a store is sealed with it (p2p_auth): a client without
it can neither ask for an export nor answer a pull nor join a group's rendezvous. Without
one, pulls work as before and the producer logs one warning.

`kv_connector_extra_config`: `host` (the address peers reach this rank at;
default Ray's node IP, else 127.0.0.1), `p2p_max_groups` (kept gloo groups per
side, default 16), `p2p_server_threads` (pulls a producer rank serves at once, default 8),
`stream_chunk_bytes`, plus the Ray options of connectors.ray_store.

The producer's side is `p2p_server.P2PServer`, the consumer's `p2p_pull.P2PPuller`, the
plumbing they share `p2p_net`; the owner actor (connectors.ray_owner) is the directory.
"""

from __future__ import annotations

import time
from types import ModuleType
from typing import TYPE_CHECKING, Optional

import torch

from fleetserve.kv_transfer.base import ConnectorContext, KVConnectorRole, LoadSpec, SaveSpec
from fleetserve.kv_transfer.blocks import BlockBatch
from fleetserve.kv_transfer.cache_copy import Device
from fleetserve.kv_transfer.config import KVTransferConfig
from fleetserve.kv_transfer.connectors.p2p_net import nccl_usable, server_name
from fleetserve.kv_transfer.connectors.p2p_pull import P2PPuller
from fleetserve.kv_transfer.connectors.p2p_server import SERVER_THREADS, P2PServer
from fleetserve.kv_transfer.connectors.ray_owner import KVObjectOwner, connect_ray, get_owner
from fleetserve.kv_transfer.secret import load_secret
from fleetserve.kv_transfer.shards import join_shards, local_head_range, producer_shards
from fleetserve.kv_transfer.staging import StagingPool
from fleetserve.kv_transfer.stream import ChunkSink
from fleetserve.kv_transfer.transfer import TransferConnector
from fleetserve.kv_transfer.transport import Transport

if TYPE_CHECKING:
    from ray.actor import ActorHandle

# At engine start: the first engine of a cluster also starts the directory's owner actor (a
# process importing torch, slow on a busy machine).
REGISTER_TIMEOUT_S = 120.0


class P2PTransport(Transport):
    keeps_batch = True  # the outbox holds it until it is pulled or its lease ends
    streams = True  # gloo pulls move in chunks, overlapping the copies out of and into the caches
    fetches_chunks = True

    def __init__(self, config: KVTransferConfig, ctx: ConnectorContext, role: KVConnectorRole) -> None:
        super().__init__(config, ctx, role)
        extra = config.kv_connector_extra_config
        self._extra = extra
        self.owner_name = str(extra.get("owner_name", "fleetserve-kv-owner"))
        self.namespace = str(extra.get("namespace", "fleetserve"))
        self._owner: Optional[ActorHandle[KVObjectOwner]] = None
        max_groups = int(extra.get("p2p_max_groups", 16))
        secret = load_secret()  # from this process's environment, never from the config
        threads = int(extra.get("p2p_server_threads", SERVER_THREADS))
        self.server = P2PServer(ctx.tp_rank, max_groups, secret, threads)  # producer
        self.puller = P2PPuller(ctx, max_groups, self._resolve, secret)  # consumer

    def register_kv_caches(self, kv_caches: list[torch.Tensor], staging: StagingPool) -> None:
        super().register_kv_caches(kv_caches, staging)
        self.puller.register(kv_caches[0].device, staging)
        self._directory()  # connect at engine start, not on the first request
        if self.config.is_producer:
            self._serve()  # registered before any request can name this engine

    def payload_device(self, cache_device: torch.device) -> Device:
        return cache_device if nccl_usable(torch.device(cache_device)) else "cpu"

    def _directory(self) -> tuple[ModuleType, ActorHandle[KVObjectOwner]]:
        ray = connect_ray(self._extra)
        if self._owner is None:
            self._owner = get_owner(ray, self.owner_name, self.namespace)
        return ray, self._owner

    def _resolve(self, name: str, deadline: float) -> Optional[str]:
        ray, owner = self._directory()
        addr: Optional[str] = ray.get(owner.resolve.remote(name), timeout=max(0.1, deadline - time.time()))
        return addr

    def _serve(self) -> None:
        if self.server.started:
            return
        ray, owner = self._directory()
        host = str(self._extra.get("host") or ray.util.get_node_ip_address() or "127.0.0.1")
        port = self.server.start(host)
        ray.get(
            owner.register.remote(server_name(self.ctx.engine_id, self.ctx.tp_rank), f"{host}:{port}"),
            timeout=REGISTER_TIMEOUT_S,
        )

    def export(self, spec: SaveSpec, batch: BlockBatch) -> None:
        self.server.export(spec.transfer_id, batch, spec.lease_s)

    def held(self) -> int:
        """Exports in the outbox."""
        return self.server.held()

    def fetch(self, spec: LoadSpec, sink: Optional[ChunkSink] = None) -> BlockBatch:
        """The blocks of `spec`; with a `sink` and one producer shard, streamed into it chunk by
        chunk as they arrive (the returned batch holds the same bytes)."""
        heads = local_head_range(self.ctx.num_kv_heads, self.ctx.tp_size, self.ctx.tp_rank)
        shards = producer_shards(heads, self.ctx.num_kv_heads, int(spec.source.get("remote_tp_size", self.ctx.tp_size)))
        sink = sink if len(shards) == 1 else None  # shards are joined first: whole pulls
        return join_shards([self.puller.pull(spec, rank, rng, sink) for rank, rng in shards])

    def kept_groups(self) -> tuple[int, int]:
        """(groups kept as producer, as consumer)."""
        return len(self.server.groups), len(self.puller.groups)

    def shutdown(self) -> None:
        self.server.shutdown()
        self.puller.shutdown()


class P2PConnector(TransferConnector):
    transport_cls = P2PTransport
