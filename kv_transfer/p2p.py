"""torch.distributed point-to-point connector: the consumer pulls blocks from the producer
rank that holds them, over a two-rank group formed for the pull.

    producer rank                                  consumer rank
    export: keep the gathered blocks (outbox,      fetch: find the producer rank's server in
      under a lease); a server (a TCPStore on        the Ray directory (owner actor: name
      a free port, registered in the Ray             "p2p/<engine_id>/r<rank>" -> host:port)
      directory) starts with the engine          pid = store.add("pull_ids", 1);
    server thread, for each pull id in order:      store.set("pull/<pid>", {oid, backend})
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

Groups are formed per pull and dropped after it (a few ms over TCP), so nothing
stale survives a peer's restart: a restarted producer registers a new address
under a new engine id, and a pull from a dead one fails at once (a failed load,
handled by policy). Header and verdict travel through the store, so a consumer
that refuses a header (another model, a malformed shape) never joins the group
and the producer's server moves on at once.

`kv_connector_extra_config`: `host` (the address peers reach this rank at;
default Ray's node IP, else 127.0.0.1), plus the Ray options of ray_store.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from typing import Any

import torch

from fleetserve.kv_transfer.base import ConnectorContext, KVConnectorRole, LoadSpec, SaveSpec
from fleetserve.kv_transfer.blocks import (BlockBatch, KVFormatError, batch_from_tensor, check_header,
                                           join_shards, local_head_range, parse_header,
                                           producer_shards)
from fleetserve.kv_transfer.config import KVTransferConfig
from fleetserve.kv_transfer.ray_store import connect_ray, get_owner
from fleetserve.kv_transfer.transfer import TransferConnector, TransferError, Transport

logger = logging.getLogger(__name__)
POLL_S = 0.005  # the server looks for a new pull this often
STORE_TIMEOUT_S = 30.0


def nccl_usable(device: torch.device) -> bool:
    import torch.distributed as dist

    return device.type == "cuda" and dist.is_available() and dist.is_nccl_available()


def _group(store, pid: int, rank: int, timeout_s: float, backend: str):
    """The two-rank group of pull `pid` (rank 0: the producer)."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(f"pg/{pid}", store)
    timeout = datetime.timedelta(seconds=max(0.5, timeout_s))
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
    return dist.ProcessGroupGloo(prefixed, rank, 2, timeout)


class P2PTransport(Transport):
    keeps_batch = True  # the outbox holds it until it is pulled or its lease ends

    def __init__(self, config: KVTransferConfig, ctx: ConnectorContext, role: KVConnectorRole) -> None:
        super().__init__(config, ctx, role)
        extra = config.kv_connector_extra_config
        self._extra = extra
        self.owner_name = str(extra.get("owner_name", "fleetserve-kv-owner"))
        self.namespace = str(extra.get("namespace", "fleetserve"))
        self._outbox: dict[str, tuple[BlockBatch, float]] = {}  # oid -> (batch, lease end)
        self._lock = threading.Lock()
        self._store = None
        self._owner = None
        self._device = torch.device("cpu")
        self._stop = threading.Event()

    def register_kv_caches(self, kv_caches: list, staging) -> None:
        super().register_kv_caches(kv_caches, staging)
        self._device = kv_caches[0].device
        self._directory()  # connect at engine start, not on the first request
        if self.config.is_producer:
            self._serve_forever()  # registered before any request can name this engine

    def payload_device(self, cache_device) -> Any:
        return cache_device if nccl_usable(torch.device(cache_device)) else "cpu"

    def _directory(self):
        ray = connect_ray(self._extra)
        if self._owner is None:
            self._owner = get_owner(ray, self.owner_name, self.namespace)
        return ray, self._owner

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
                                    timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
        ray.get(owner.register.remote(self._name(self.ctx.engine_id, self.ctx.tp_rank),
                                      f"{host}:{self._store.port}"), timeout=30)
        threading.Thread(target=self._loop, name="kv-p2p-server", daemon=True).start()

    def _loop(self) -> None:
        served = 0
        while not self._stop.is_set():
            self._sweep()
            key = f"pull/{served + 1}"
            # (a polled check: TCPStore.wait with a short timeout logs a warning per timeout)
            if not self._store.check([key]):
                time.sleep(POLL_S)
                continue
            served += 1
            try:
                self._send(served, json.loads(self._store.get(key)))
            except Exception as e:  # noqa: BLE001 - one failed pull must not stop the server
                logger.warning("KV pull %d failed: %s", served, e)

    def _send(self, pid: int, pull: dict) -> None:
        with self._lock:
            entry = self._outbox.pop(str(pull.get("oid")), None)  # handed over: the consumer has it
        if entry is None:
            self._store.set(f"hdr/{pid}", b"")
            return
        batch = entry[0]
        try:
            backend = "nccl" if pull.get("backend") == "nccl" and batch.data.is_cuda else "gloo"
            if backend == "gloo" and batch.data.device.type != "cpu":  # a CPU consumer: via the host
                batch = BlockBatch(batch.fingerprint, batch.keys, batch.data.cpu(), batch.heads)
            self._store.set(f"hdr/{pid}", backend.encode() + b"\n" + batch.header())
            if self._store.get(f"go/{pid}") != b"1":
                return  # the consumer refused the header: it never joins the group
            pg = _group(self._store, pid, 0, STORE_TIMEOUT_S, backend)
            pg.send([batch.data.reshape(-1).view(torch.uint8)], 1, 0).wait()
        finally:
            entry[0].release()

    def _sweep(self) -> None:
        now = time.time()
        with self._lock:
            gone = [o for o, e in self._outbox.items() if e[1] < now]
            expired = [self._outbox.pop(o)[0] for o in gone]  # the lease ended unclaimed
        for batch in expired:
            batch.release()

    def export(self, spec: SaveSpec, batch: BlockBatch) -> None:
        batch.checksums()  # here, on the export thread, not in the server's send
        with self._lock:
            old = self._outbox.pop(f"{spec.transfer_id}/r{self.ctx.tp_rank}", None)
            self._outbox[f"{spec.transfer_id}/r{self.ctx.tp_rank}"] = (batch, time.time() + spec.lease_s)
        if old is not None:
            old[0].release()

    def held(self) -> int:
        with self._lock:
            return len(self._outbox)

    # ---- consumer ---------------------------------------------------------------
    def fetch(self, spec: LoadSpec) -> BlockBatch:
        heads = local_head_range(self.ctx.num_kv_heads, self.ctx.tp_size, self.ctx.tp_rank)
        shards = producer_shards(heads, self.ctx.num_kv_heads,
                                 int(spec.source.get("remote_tp_size", self.ctx.tp_size)))
        return join_shards([self._pull(spec, rank, rng) for rank, rng in shards])

    def _pull(self, spec: LoadSpec, rank: int, heads: tuple[int, int]) -> BlockBatch:
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
        backend = "nccl" if nccl_usable(self._device) else "gloo"
        store.set(f"pull/{pid}", json.dumps({"oid": f"{spec.transfer_id}/r{rank}", "backend": backend}))
        reply = store.get(f"hdr/{pid}")  # waits for the server (the store's timeout: the deadline)
        if not reply:
            raise TransferError(f"producer has no transfer {spec.transfer_id} (expired or taken)")
        backend, _, header = reply.partition(b"\n")
        try:
            meta, off = parse_header(header)
            if off != len(header):
                raise KVFormatError("trailing bytes after the KV header")
            _, shape, nbytes = check_header(meta, self.ctx.fingerprint)
            if tuple(shape[1:]) != self.block_shape(shape[0], heads)[1:] or shape[0] > len(spec.keys):
                raise KVFormatError(f"blocks of shape {shape} do not fit this request's {len(spec.keys)} "
                                    f"blocks of heads {heads}")
        except KVFormatError:
            store.set(f"go/{pid}", b"0")
            raise
        release = None
        if backend == b"nccl":
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        else:
            buf, release = self.staging.take((nbytes,), torch.uint8)
        store.set(f"go/{pid}", b"1")
        try:
            pg = _group(store, pid, 1, spec.deadline - time.time(), backend.decode())
            pg.recv([buf], 0, 0).wait()
            return batch_from_tensor(meta, buf, self.ctx.fingerprint, release)
        except BaseException:
            if release is not None:
                release()
            raise

    def shutdown(self) -> None:
        self._stop.set()


class P2PConnector(TransferConnector):
    transport_cls = P2PTransport
