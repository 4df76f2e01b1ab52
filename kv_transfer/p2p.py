"""torch.distributed point-to-point connector: the consumer pulls blocks from the producer
rank that holds them, over a two-rank gloo group formed for the pull.

    producer rank                                  consumer rank
    export: keep the gathered blocks (outbox,      fetch: find the producer rank's server in
      under a lease); first export starts a          the Ray directory (owner actor: name
      server: a TCPStore on a free port,             "p2p/<engine_id>/r<rank>" -> host:port)
      registered in the Ray directory              pid = store.add("pull_ids", 1);
    server thread: for each pull id in order,        store.set("pull/<pid>", "<transfer_id>/r<rank>")
      form ProcessGroupGloo(PrefixStore(pid),      ProcessGroupGloo(PrefixStore(pid), rank 1 of 2)
      rank 0 of 2) and send sizes, header,         recv sizes, header, payload -> check -> blocks
      payload; the outbox entry goes (the
      consumer has it) or its lease ends

Groups are formed per pull and dropped after it (a few ms over TCP), so nothing
stale survives a peer's restart: a restarted producer registers a new address
under a new engine id, and a pull from a dead one fails at once (a failed load,
handled by policy). Bytes travel from CPU staging on every device: gloo. (NCCL
between GPUs, sending straight from device memory, is not built yet.)

`kv_connector_extra_config`: `host` (the address peers reach this rank at;
default Ray's node IP, else 127.0.0.1), plus the Ray options of ray_store.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time


import torch

from fleetserve.kv_transfer.base import ConnectorContext, KVConnectorRole, LoadSpec, SaveSpec
from fleetserve.kv_transfer.blocks import (BlockBatch, decode_batch, join_shards, local_head_range,
                                           parse_header, producer_shards)
from fleetserve.kv_transfer.config import KVTransferConfig
from fleetserve.kv_transfer.ray_store import connect_ray, get_owner
from fleetserve.kv_transfer.transfer import TransferConnector, TransferError, Transport

logger = logging.getLogger(__name__)
POLL_S = 0.005


def _group(store, pid: int, rank: int, timeout_s: float):
    import torch.distributed as dist

    return dist.ProcessGroupGloo(dist.PrefixStore(f"pg/{pid}", store), rank, 2,
                                 datetime.timedelta(seconds=max(0.5, timeout_s)))


class P2PTransport(Transport):
    def __init__(self, config: KVTransferConfig, ctx: ConnectorContext, role: KVConnectorRole) -> None:
        super().__init__(config, ctx, role)
        extra = config.kv_connector_extra_config
        self._extra = extra
        self.owner_name = str(extra.get("owner_name", "fleetserve-kv-owner"))
        self.namespace = str(extra.get("namespace", "fleetserve"))
        self._outbox: dict[str, tuple[bytes, torch.Tensor, float]] = {}
        self._lock = threading.Lock()
        self._store = None
        self._stop = threading.Event()
        if role is KVConnectorRole.WORKER and config.is_producer:
            self._serve_forever()  # registered before any request can name this engine

    def _directory(self):
        ray = connect_ray(self._extra)
        return ray, get_owner(ray, self.owner_name, self.namespace)

    def _name(self, engine_id: str, rank: int) -> str:
        return f"p2p/{engine_id}/r{rank}"

    # ---- producer ---------------------------------------------------------------
    def _serve_forever(self) -> None:
        import torch.distributed as dist

        if self._store is not None:
            return
        ray, owner = self._directory()
        host = self._extra.get("host") or ray.util.get_node_ip_address() or "127.0.0.1"
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=30))
        ray.get(owner.register.remote(self._name(self.ctx.engine_id, self.ctx.tp_rank),
                                      f"{host}:{self._store.port}"), timeout=30)
        threading.Thread(target=self._loop, name="kv-p2p-server", daemon=True).start()

    def _loop(self) -> None:
        served = 0
        while not self._stop.is_set():
            self._sweep()
            key = f"pull/{served + 1}"
            if not self._store.check([key]):
                time.sleep(POLL_S)
                continue
            served += 1
            oid = self._store.get(key).decode()
            try:
                self._send(served, oid)
            except Exception as e:  # noqa: BLE001 - one failed pull must not stop the server
                logger.warning("KV pull %d of %s failed: %s", served, oid, e)

    def _send(self, pid: int, oid: str) -> None:
        with self._lock:
            entry = self._outbox.pop(oid, None)  # handed over: the consumer has it now
        pg = _group(self._store, pid, 0, 30)
        header, payload = (entry[0], entry[1]) if entry else (b"", torch.empty(0, dtype=torch.uint8))
        pg.send([torch.tensor([len(header), payload.numel()], dtype=torch.int64)], 1, 0).wait()
        if entry is not None:
            pg.send([torch.frombuffer(bytearray(header), dtype=torch.uint8)], 1, 1).wait()
            pg.send([payload], 1, 2).wait()

    def _sweep(self) -> None:
        now = time.time()
        with self._lock:
            for oid in [o for o, e in self._outbox.items() if e[2] < now]:
                del self._outbox[oid]  # the lease ended unclaimed

    def export(self, spec: SaveSpec, batch: BlockBatch) -> None:
        self._serve_forever()
        payload = batch.data.reshape(-1).view(torch.uint8)
        with self._lock:
            self._outbox[f"{spec.transfer_id}/r{self.ctx.tp_rank}"] = (
                batch.header(), payload, time.time() + spec.lease_s)

    def held(self) -> int:
        with self._lock:
            return len(self._outbox)

    # ---- consumer ---------------------------------------------------------------
    def fetch(self, spec: LoadSpec) -> BlockBatch:
        heads = local_head_range(self.ctx.num_kv_heads, self.ctx.tp_size, self.ctx.tp_rank)
        shards = producer_shards(heads, self.ctx.num_kv_heads,
                                 int(spec.source.get("remote_tp_size", self.ctx.tp_size)))
        return join_shards([self._pull(spec, rank) for rank, _ in shards])

    def _pull(self, spec: LoadSpec, rank: int) -> BlockBatch:
        import torch.distributed as dist

        ray, owner = self._directory()
        engine = spec.source.get("remote_engine_id")
        addr = ray.get(owner.resolve.remote(self._name(str(engine), rank)),
                       timeout=max(0.1, spec.deadline - time.time()))
        if not addr:  # producers register at start-up: an unknown engine is gone or foreign
            raise TransferError(f"no point-to-point server registered for engine {engine} rank {rank}")
        host, port = addr.rsplit(":", 1)
        left = spec.deadline - time.time()
        store = dist.TCPStore(host, int(port), is_master=False,
                              timeout=datetime.timedelta(seconds=max(0.5, left)))
        pid = store.add("pull_ids", 1)
        store.set(f"pull/{pid}", f"{spec.transfer_id}/r{rank}")
        pg = _group(store, pid, 1, spec.deadline - time.time())
        sizes = torch.empty(2, dtype=torch.int64)
        pg.recv([sizes], 0, 0).wait()
        n_header, n_payload = int(sizes[0]), int(sizes[1])
        if n_header == 0:
            raise TransferError(f"producer has no transfer {spec.transfer_id} (expired or taken)")
        header = torch.empty(n_header, dtype=torch.uint8)
        payload = torch.empty(n_payload, dtype=torch.uint8)
        pg.recv([header], 0, 1).wait()
        pg.recv([payload], 0, 2).wait()
        meta, off = parse_header(header.numpy().tobytes())
        if off != n_header:
            raise TransferError("trailing bytes after the KV header")
        return decode_batch(meta, payload.numpy(), self.ctx.fingerprint)

    def shutdown(self) -> None:
        self._stop.set()


class P2PConnector(TransferConnector):
    transport_cls = P2PTransport


