"""torch.distributed point-to-point connector: the consumer pulls blocks from the producer
rank that holds them, over a two-rank group (gloo: kept between pulls; NCCL: per pull).

    producer rank                                  consumer rank
    export: keep the gathered blocks (outbox,      fetch: find the producer rank's server in
      under a lease); a server (a TCPStore on        the Ray directory (owner actor: name
      a free port, registered in the Ray             "p2p/<engine_id>/r<rank>" -> host:port)
      directory) starts with the engine          pid = store.add("pull_ids", 1);
    server thread, for each pull id in order:      store.set("pull/<pid>", {oid, backend, group})
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
between pulls (a new one is a TCP connect and torch's handshake, 1-5 ms here), and the
producer's server blocks on the next pull's key instead of polling for it (woken within
~0.3 ms; leases end on a thread of their own).

Gloo groups are kept between pulls: forming one costs ~30 ms over loopback TCP (more
than moving a 512-token prompt's KV), so each consumer rank keeps one group per
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
it into its blocks while the next one arrives (transfer._Sink). A chunk whose copy-out
failed goes out as status 0 and nothing after it (both sides drop the group); a pull
that does not ask for a stream (several head shards to join, an older consumer) gets
the whole batch once it is gathered.

`kv_connector_extra_config`: `host` (the address peers reach this rank at;
default Ray's node IP, else 127.0.0.1), `p2p_max_groups` (kept gloo groups per
side, default 16), `stream_chunk_bytes`, plus the Ray options of connectors.ray_store.
"""

from __future__ import annotations

import collections
import datetime
import json
import logging
import socket
import struct
import threading
import time
import uuid
from typing import Any, Optional

import torch

from fleetserve.kv_transfer.base import ConnectorContext, KVConnectorRole, LoadSpec, SaveSpec
from fleetserve.kv_transfer.blocks import BlockBatch, batch_from_tensor, check_header, parse_header
from fleetserve.kv_transfer.config import KVTransferConfig
from fleetserve.kv_transfer.connectors.ray_owner import connect_ray, get_owner
from fleetserve.kv_transfer.digests import host_digests
from fleetserve.kv_transfer.errors import KVFormatError, TransferError
from fleetserve.kv_transfer.shards import join_shards, local_head_range, producer_shards, readers_of
from fleetserve.kv_transfer.stream import StreamAborted, plan_chunks
from fleetserve.kv_transfer.transfer import TransferConnector
from fleetserve.kv_transfer.transport import Transport

logger = logging.getLogger(__name__)
POLL_S = 0.005  # a consumer told "not yet" asks again this much later
IDLE_WAIT_S = 3600.0  # the server's wait for the next pull, before it waits again
SWEEP_S = 0.25  # expired leases in the outbox are released this often
MAX_IDLE_CLIENTS = 4  # store clients a consumer keeps per producer address, between pulls
STORE_TIMEOUT_S = 30.0
# At engine start: the first engine of a cluster also starts the directory's owner actor (a
# process importing torch: 30 s was too short with both cores busy).
REGISTER_TIMEOUT_S = 120.0
CONNECT_TIMEOUT_S = 3.0  # a live producer's store accepts at once; a dead one's port refuses
QUARANTINE = 4  # failed receives whose group and buffer are kept (see _pull)
REGROUP = b"!regroup"  # the producer's answer to a pull naming a group it does not have
NOT_YET = b"!notyet"  # ... to a pull of a transfer it has not exported yet (ask again)
GONE_MEMORY = 4096  # transfers taken or expired that the producer remembers as such


def nccl_usable(device: torch.device) -> bool:
    import torch.distributed as dist

    return device.type == "cuda" and dist.is_available() and dist.is_nccl_available()


def _tag(pid: int) -> int:
    return pid % (1 << 30)


def _stag(pid: int, m: int) -> int:
    """Tag of message `m` of streamed pull `pid` (never a `_tag`: those stay below 2**30)."""
    return (1 << 30) | ((pid % (1 << 20)) << 10) | m


_CONNECTING: dict[str, threading.Thread] = {}  # connects given up on, still running (see connect_store)
_CONNECTING_LOCK = threading.Lock()


def connect_store(host: str, port: int, timeout: float, deadline: float) -> Any:
    """A client of a producer's TCPStore within `timeout` seconds, or TransferError; its
    waits for answers then last until `deadline` (a `time.time()`).

    TCPStore's client alone overruns its timeout: it retries a refused port until the
    timeout and then retries the whole connect with backoff (8 s for a 3 s timeout, seen
    in CI, when a killed producer's socket accepted a connection and then reset it). So
    one plain connect first (a dead producer's refusal fails the load at once), then the
    store is made on a thread that is waited for `timeout` at most. A thread given up on
    ends when torch's client does (a reset socket ends it; a producer that accepts and
    never answers, stopped but not dead, can hold it for minutes), so there is at most
    one per address: while it lives, pulls from that address fail at once.
    """
    import torch.distributed as dist

    addr = f"{host}:{port}"
    with _CONNECTING_LOCK:
        stuck = _CONNECTING.get(addr)
        if stuck is not None and stuck.is_alive():
            raise TransferError(f"point-to-point server {addr} did not answer an earlier connect; "
                                "still waiting on it")
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:  # refused, unreachable, timed out
        raise TransferError(f"point-to-point server {host}:{port} unreachable ({e}); "
                            "stopped, or not reachable from here") from None
    box: dict[str, Any] = {}
    done = threading.Event()

    def make() -> None:
        try:
            box["store"] = dist.TCPStore(host, port, is_master=False,
                                         timeout=datetime.timedelta(seconds=timeout))
            box["store"].set_timeout(datetime.timedelta(seconds=max(0.5, deadline - time.time())))
        except Exception as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        finally:
            done.set()

    thread = threading.Thread(target=make, name="p2p-connect", daemon=True)
    thread.start()
    if not done.wait(timeout):
        with _CONNECTING_LOCK:
            for gone in [a for a, t in _CONNECTING.items() if not t.is_alive()]:
                del _CONNECTING[gone]
            _CONNECTING[addr] = thread
        raise TransferError(f"point-to-point server {host}:{port} did not answer within {timeout:.1f} s")
    if "error" in box:
        raise TransferError(f"point-to-point server {host}:{port}: {box['error']}") from None
    return box["store"]


class _Groups:
    """Kept gloo groups, least recently used first out (each holds a TCP connection and
    gloo's threads)."""

    def __init__(self, cap: int) -> None:
        self.cap = max(1, cap)
        self._groups: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str):
        with self._lock:
            group = self._groups.get(key)
            if group is not None:
                self._groups.move_to_end(key)
            return group

    def put(self, key: str, group) -> None:
        with self._lock:
            self._groups[key] = group
            self._groups.move_to_end(key)
            while len(self._groups) > self.cap:
                self._groups.popitem(last=False)

    def drop(self, key: str, group=None) -> None:
        with self._lock:
            if group is None or self._groups.get(key) is group:
                self._groups.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._groups)

    def clear(self) -> None:
        with self._lock:
            self._groups.clear()


def _group(store, name, rank: int, timeout_s: float, backend: str):
    """The two-rank group `name` (a pull id, or a kept group's id; rank 0: the producer)."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(f"pg/{name}", store)
    timeout = datetime.timedelta(seconds=max(0.5, timeout_s))
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
    return dist.ProcessGroupGloo(prefixed, rank, 2, timeout)


class _Held:
    """An export in the producer's outbox. `refs`: the outbox's own (until every consumer rank
    that reads it has pulled it, or its lease ends) and one per send in progress; the batch's
    buffer goes back to the pool when the last one is dropped."""

    __slots__ = ("batch", "lease_end", "served", "refs")

    def __init__(self, batch: BlockBatch, lease_end: float) -> None:
        self.batch, self.lease_end = batch, lease_end
        self.served = 0
        self.refs = 1


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
        self._outbox: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self._store = None
        self._served = 0  # producer: pulls served, in order of their ids
        self._owner = None
        self._device = torch.device("cpu")
        self._stop = threading.Event()
        max_groups = int(extra.get("p2p_max_groups", 16))
        self._served_groups = _Groups(max_groups)  # producer: group id -> group
        self._pull_groups = _Groups(max_groups)  # consumer: producer address -> (group id, group)
        self._quarantine: collections.deque = collections.deque(maxlen=QUARANTINE)
        self._addresses: dict[str, str] = {}  # consumer: "p2p/<engine>/r<rank>" -> host:port
        self._gone: collections.OrderedDict[str, None] = collections.OrderedDict()  # producer
        # consumer: producer address -> store clients idle between pulls (a new one costs a
        # TCP connect and torch's handshake: 1.2-4.7 ms a pull here, as much as moving 4 MiB)
        self._clients: collections.OrderedDict[str, list] = collections.OrderedDict()

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
                                      f"{host}:{self._store.port}"), timeout=REGISTER_TIMEOUT_S)
        threading.Thread(target=self._loop, name="kv-p2p-server", daemon=True).start()
        threading.Thread(target=self._sweep_loop, name="kv-p2p-leases", daemon=True).start()

    def _loop(self) -> None:
        # Blocks on the next pull's key (woken within ~0.3 ms of the consumer's set; a polled
        # check cost each pull 2.5 ms on average). A wait that times out logs a warning in
        # torch, so the wait is long (an idle server logs once an hour) and shutdown() wakes
        # it by writing the key itself; leases end on their own thread (_sweep_loop).
        while not self._stop.is_set():
            key = f"pull/{self._served + 1}"
            t0 = time.monotonic()
            try:
                self._store.wait([key], datetime.timedelta(seconds=IDLE_WAIT_S))
            except Exception as e:  # noqa: BLE001 - DistStoreError: idle for IDLE_WAIT_S; wait again
                if time.monotonic() - t0 < 1.0:  # not a timeout: never spin on a broken store
                    logger.warning("P2P server's wait failed: %s", e)
                    self._stop.wait(1.0)
                continue
            if self._stop.is_set():
                return
            self._served += 1
            try:
                self._send(self._served, json.loads(self._store.get(key)))
            except Exception as e:  # noqa: BLE001 - one failed pull must not stop the server
                logger.warning("KV pull %d failed: %s", self._served, e)

    def _sweep_loop(self) -> None:
        while not self._stop.wait(SWEEP_S):
            self._sweep()

    def _send(self, pid: int, pull: dict) -> None:
        gid = pull.get("group")  # a kept gloo group the consumer names (None: one for this pull)
        gid = str(gid) if gid is not None else None
        oid = str(pull.get("oid"))
        with self._lock:
            held = oid in self._outbox
        if held and gid is not None and not pull.get("new") and self._served_groups.get(gid) is None:
            self._store.set(f"hdr/{pid}", REGROUP)  # evicted here: the consumer forms it again
            return
        with self._lock:
            entry = self._outbox.get(oid)
            if entry is not None:
                entry.refs += 1  # this send's
                entry.served += 1
                # Handed over to every consumer rank that reads it (a TP consumer's ranks each
                # pull the shard holding their heads): out of the outbox.
                if entry.served >= max(1, int(pull.get("readers", 1))):
                    del self._outbox[oid]
                    entry.refs -= 1
                    self._forget(oid)
            known_gone = oid in self._gone
        if entry is None:
            # Taken or expired: a clear "no". Otherwise the export is still being gathered
            # (the producer's reply can overtake it): the consumer asks again.
            self._store.set(f"hdr/{pid}", b"" if known_gone else NOT_YET)
            return
        batch = entry.batch
        try:
            backend = "nccl" if pull.get("backend") == "nccl" and batch.data.is_cuda else "gloo"
            # Streamed (chunk by chunk, each as soon as it is gathered) when the consumer asks
            # for it on a kept gloo group; else whole, once every chunk is gathered.
            stream = bool(pull.get("stream")) and backend == "gloo" and gid is not None
            prog = batch.progress
            if prog is not None and not stream:
                try:
                    prog.wait_all(STORE_TIMEOUT_S)
                except StreamAborted:
                    self._store.set(f"hdr/{pid}", b"")  # nothing to hand over: the load fails at once
                    raise
            if backend == "gloo" and batch.data.device.type != "cpu":  # a CPU consumer: via the host
                batch = BlockBatch(batch.fingerprint, batch.keys, batch.data.cpu(), batch.heads)
            chunks = None
            if stream:
                n = batch.data.shape[0]
                chunks = prog.chunks if prog is not None else plan_chunks(n, batch.nbytes // n)
            self._store.set(f"hdr/{pid}", backend.encode() + b"\n"
                            + batch.header([e - s for s, e in chunks] if chunks else None))
            if self._store.get(f"go/{pid}") != b"1":
                return  # the consumer refused the header: it never joins the group
            payload = [batch.data.reshape(-1).view(torch.uint8)]
            if backend != "gloo" or gid is None:
                _group(self._store, pid, 0, STORE_TIMEOUT_S, backend).send(payload, 1, 0).wait()
                return
            pg = self._served_groups.get(gid)
            if pull.get("new") or pg is None:
                pg = _group(self._store, f"g/{gid}", 0, STORE_TIMEOUT_S, "gloo")
                self._served_groups.put(gid, pg)
            try:
                if chunks:
                    self._send_chunks(pg, pid, batch, chunks, payload[0])
                else:
                    pg.send(payload, 1, _tag(pid)).wait()
            except BaseException:
                self._served_groups.drop(gid, pg)  # the consumer went away or timed out
                raise
        finally:
            self._unref(entry)

    def _unref(self, entry: _Held) -> None:
        with self._lock:
            entry.refs -= 1
            last = entry.refs == 0
        if last:
            entry.batch.release()

    def _send_chunks(self, pg, pid: int, batch: BlockBatch, chunks: list[tuple[int, int]], flat) -> None:
        """Each chunk as two messages: its status and blocks' digests (8 bytes each), then its
        bytes, sent once it is gathered. A chunk that never gets gathered (the copy-out
        failed) goes out as status 0 and nothing after it: both sides drop the group."""
        per = batch.nbytes // batch.data.shape[0]
        works, heads = [], []
        for c, (s, e) in enumerate(chunks):
            ok = True
            if batch.progress is not None:
                try:
                    batch.progress.wait_chunk(c, STORE_TIMEOUT_S)
                except StreamAborted as err:
                    ok = False
                    logger.warning("KV pull %d: %s", pid, err)
            sums = batch.checksums()[s:e] if ok else [0] * (e - s)
            head = torch.frombuffer(bytearray(struct.pack(f"<{e - s + 1}Q", int(ok), *sums)), dtype=torch.uint8)
            heads.append(head)
            works.append(pg.send([head], 1, _stag(pid, 2 * c)))
            if not ok:
                break
            works.append(pg.send([flat[s * per:e * per]], 1, _stag(pid, 2 * c + 1)))
        for w in works:
            w.wait()
        if not ok:
            raise TransferError(f"pull {pid}: the export's blocks could not be gathered")

    def _sweep(self) -> None:
        now = time.time()
        with self._lock:
            gone = [o for o, e in self._outbox.items() if e.lease_end < now]
            expired = [self._outbox.pop(o) for o in gone]  # the lease ended unclaimed
            for oid in gone:
                self._forget(oid)
        for entry in expired:
            self._unref(entry)

    def _forget(self, oid: str) -> None:
        """Remember `oid` as taken or expired (under self._lock)."""
        self._gone[oid] = None
        while len(self._gone) > GONE_MEMORY:
            self._gone.popitem(last=False)

    def export(self, spec: SaveSpec, batch: BlockBatch) -> None:
        if batch.progress is None:  # (a streamed batch's digests are set as it is gathered)
            batch.checksums()  # here, on the export thread, not in the server's send
        with self._lock:
            old = self._outbox.pop(f"{spec.transfer_id}/r{self.ctx.tp_rank}", None)
            self._outbox[f"{spec.transfer_id}/r{self.ctx.tp_rank}"] = _Held(batch, time.time() + spec.lease_s)
        if old is not None:
            self._unref(old)

    def held(self) -> int:
        with self._lock:
            return len(self._outbox)

    # ---- consumer ---------------------------------------------------------------
    def fetch(self, spec: LoadSpec, sink=None) -> BlockBatch:
        """The blocks of `spec`; with a `sink` (transfer._Sink) and one producer shard, streamed
        into it chunk by chunk as they arrive (the returned batch holds the same bytes)."""
        heads = local_head_range(self.ctx.num_kv_heads, self.ctx.tp_size, self.ctx.tp_rank)
        shards = producer_shards(heads, self.ctx.num_kv_heads,
                                 int(spec.source.get("remote_tp_size", self.ctx.tp_size)))
        sink = sink if len(shards) == 1 else None  # shards are joined first: whole pulls
        return join_shards([self._pull(spec, rank, rng, sink) for rank, rng in shards])

    def _pull(self, spec: LoadSpec, rank: int, heads: tuple[int, int], sink=None) -> BlockBatch:
        import torch.distributed as dist

        engine = spec.source.get("remote_engine_id")
        name = self._name(str(engine), rank)
        # Engine ids are minted per engine start, so an address, once found, stays right
        # for that id (a restarted producer registers under a new one).
        addr = self._addresses.get(name)
        if addr is None:
            ray, owner = self._directory()
            addr = ray.get(owner.resolve.remote(name), timeout=max(0.1, spec.deadline - time.time()))
            if not addr:  # producers register at start-up: an unknown engine is gone or foreign
                raise TransferError(f"no point-to-point server registered for engine {engine} rank {rank}")
            if len(self._addresses) >= 1024:
                self._addresses.clear()
            self._addresses[name] = addr
        host, port = addr.rsplit(":", 1)
        store, pid = self._client(addr, host, int(port), spec.deadline)
        # The client goes back to the idle ones only if every store op of this pull was
        # answered (one that timed out may still be answered later, out of turn).
        clean = False
        try:
            backend = "nccl" if nccl_usable(self._device) else "gloo"
            kept = self._pull_groups.get(addr) if backend == "gloo" else None
            regroups = 0
            while True:
                if backend == "gloo":
                    gid, pg = kept if kept is not None else (uuid.uuid4().hex, None)
                else:
                    gid, pg = None, None
                if pid is None:
                    pid = store.add("pull_ids", 1)
                store.set(f"pull/{pid}", json.dumps({"oid": f"{spec.transfer_id}/r{rank}", "backend": backend,
                                                     "group": gid, "new": pg is None,
                                                     "stream": sink is not None and backend == "gloo",
                                                     "readers": readers_of(heads, self.ctx.num_kv_heads,
                                                                           self.ctx.tp_size)}))
                reply = store.get(f"hdr/{pid}")  # waits for the server (the store's timeout: the deadline)
                if reply == REGROUP:
                    self._pull_groups.drop(addr)
                    kept = None
                    regroups += 1
                    if regroups > 1:
                        clean = True
                        raise TransferError(f"producer {addr} asked for a new group twice")
                elif reply == NOT_YET:
                    if time.time() + POLL_S >= spec.deadline:
                        clean = True
                        raise TransferError(f"transfer {spec.transfer_id} not exported before the deadline")
                    time.sleep(POLL_S)
                else:
                    break
                pid = None
            if not reply:
                clean = True
                raise TransferError(f"producer has no transfer {spec.transfer_id} (expired or taken)")
            backend, _, header = reply.partition(b"\n")
            try:
                meta, off = parse_header(header)
                if off != len(header):
                    raise KVFormatError("trailing bytes after the KV header")
                dtype, shape, nbytes = check_header(meta, self.ctx.fingerprint)
                if tuple(shape[1:]) != self.block_shape(shape[0], heads)[1:] \
                        or shape[0] > spec.first_block + len(spec.keys):
                    raise KVFormatError(f"blocks of shape {shape} do not fit this request's {len(spec.keys)} "
                                        f"blocks of heads {heads}")
                chunks = meta.get("chunks")
                if chunks is not None:
                    if sink is None or backend != b"gloo" or gid is None or meta.get("digest") != "xxh3_64":
                        raise KVFormatError("a streamed batch this pull did not ask for")
                    sink.begin(meta["fingerprint"], [str(k) for k in meta["keys"]], heads, shape, dtype)
            except KVFormatError:
                store.set(f"go/{pid}", b"0")
                clean = True
                raise
            release = None
            if backend == b"nccl":
                buf = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
            else:
                buf, release = self.staging_pool().take((nbytes,), torch.uint8)
            store.set(f"go/{pid}", b"1")
            # NCCL forms this pull's group through this client, and the group may still use
            # it (its monitor) after the pull: that client is not kept.
            clean = gid is not None
            try:
                if gid is None:  # NCCL: a group for this pull only
                    pg = _group(store, pid, 1, spec.deadline - time.time(), backend.decode())
                    pg.recv([buf], 0, 0).wait()
                    del pg
                else:
                    if pg is None:
                        # The group's own store client: it outlives this pull's.
                        group_store = dist.TCPStore(host, int(port), is_master=False,
                                                    timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
                        pg = _group(group_store, f"g/{gid}", 1, STORE_TIMEOUT_S, "gloo")
                        self._pull_groups.put(addr, (gid, pg))
                    if chunks is not None:
                        works = []
                        views = self._post_chunks(pg, pid, buf, chunks, nbytes // shape[0], works)
                        try:
                            tensor = buf.view(dtype).view(shape)
                            digests = self._take_chunks(works, views, tensor, chunks, sink, spec)
                        except BaseException:
                            self._drop_pull_group(addr, gid)
                            self._quarantine.append((pg, works, buf))  # as below: receives still posted
                            release = None
                            raise
                        return BlockBatch(self.ctx.fingerprint, [str(k) for k in meta["keys"]], tensor, heads,
                                          digests, "xxh3_64", release)
                    work = pg.recv([buf], 0, _tag(pid))
                    try:
                        work.wait(datetime.timedelta(seconds=max(0.001, spec.deadline - time.time())))
                    except BaseException:
                        self._drop_pull_group(addr, gid)
                        # Gloo cannot cancel a posted receive: the producer's bytes may still land in
                        # `buf`. It never goes back to the pool; the group, the receive and the
                        # buffer are kept until QUARANTINE later failures have pushed them out.
                        self._quarantine.append((pg, work, buf))
                        release = None
                        raise
                return batch_from_tensor(meta, buf, self.ctx.fingerprint, release)
            except BaseException:
                if release is not None:
                    release()
                raise
        finally:
            if clean:
                self._idle(addr, store)

    @staticmethod
    def _post_chunks(pg, pid: int, buf: torch.Tensor, chunks: list[int], per: int, works: list) -> list:
        """Post every receive of a streamed pull at once (status+digests, then bytes, per
        chunk, the bytes straight into their place in `buf`); returns the digest buffers."""
        views, pos = [], 0
        for c, k in enumerate(chunks):
            head = torch.empty(8 * (k + 1), dtype=torch.uint8)
            views.append(head)
            works.append(pg.recv([head], 0, _stag(pid, 2 * c)))
            works.append(pg.recv([buf[pos * per:(pos + k) * per]], 0, _stag(pid, 2 * c + 1)))
            pos += k
        return views

    @staticmethod
    def _take_chunks(works: list, heads: list, tensor: torch.Tensor, chunks: list[int], sink,
                     spec: LoadSpec) -> list[int]:
        """Chunks in order as they land: each one's blocks checked against their digests and
        handed to `sink` (writing chunk c overlaps receiving the next). Returns the digests."""
        digests: list[int] = []
        pos = 0
        for c, k in enumerate(chunks):
            works[2 * c].wait(datetime.timedelta(seconds=max(0.001, spec.deadline - time.time())))
            status, *sums = struct.unpack(f"<{k + 1}Q", heads[c].numpy().tobytes())
            if status != 1:
                raise TransferError(f"transfer {spec.transfer_id}: the producer could not gather its blocks")
            works[2 * c + 1].wait(datetime.timedelta(seconds=max(0.001, spec.deadline - time.time())))
            part = tensor[pos:pos + k]
            got = host_digests(part.view(torch.uint8).numpy(), k)
            ok = next((i for i, (a, b) in enumerate(zip(got, sums)) if a != b), k)
            if ok < k:
                logger.warning("KV load of %s: block %d fails its xxh3_64 digest (corrupt); refused from there",
                               spec.req_id, pos + ok)
            sink.write(pos, part, ok)
            digests += got
            pos += k
        return digests

    def _client(self, addr: str, host: str, port: int, deadline: float) -> tuple[Any, Optional[int]]:
        """(a store client of the producer at `addr`, this pull's id when already taken).

        An idle client from an earlier pull is tried first: taking the pull's id is its
        check, within CONNECT_TIMEOUT_S as for a new connection (a producer that restarted
        at this address, or died, fails it; then a new client is made, in what is left of
        that time). A new one connects within CONNECT_TIMEOUT_S (a dead producer fails the
        load then, not at its deadline). Either then waits for answers up to the deadline."""
        connect_s = max(0.5, min(deadline - time.time(), CONNECT_TIMEOUT_S))
        with self._lock:
            idle = self._clients.get(addr)
            store = idle.pop() if idle else None
        if store is not None:
            t0 = time.monotonic()
            try:
                store.set_timeout(datetime.timedelta(seconds=connect_s))
                pid = store.add("pull_ids", 1)
                store.set_timeout(datetime.timedelta(seconds=max(0.5, deadline - time.time())))
                return store, pid
            except Exception:  # noqa: BLE001 - reset, refused or silent: a new client decides
                logger.debug("idle store client of %s failed; connecting again", addr, exc_info=True)
                connect_s = max(0.5, connect_s - (time.monotonic() - t0))
        return connect_store(host, port, connect_s, deadline), None

    def _idle(self, addr: str, store) -> None:
        """Keep a client whose every op was answered, for the next pull from `addr`."""
        with self._lock:
            idle = self._clients.setdefault(addr, [])
            self._clients.move_to_end(addr)
            if len(idle) < MAX_IDLE_CLIENTS:
                idle.append(store)
            while len(self._clients) > self._pull_groups.cap:
                self._clients.popitem(last=False)

    def _drop_pull_group(self, addr: str, gid: str) -> None:
        kept = self._pull_groups.get(addr)
        if kept is not None and kept[0] == gid:
            self._pull_groups.drop(addr)

    def kept_groups(self) -> tuple[int, int]:
        """(groups kept as producer, as consumer)."""
        return len(self._served_groups), len(self._pull_groups)

    def shutdown(self) -> None:
        self._stop.set()
        if self._store is not None:
            # Wake the server's wait by writing the key it waits for (a pull racing this fails),
            # through a client of its own: one client's ops run one at a time, so the server's
            # own would wait out the wait first.
            import torch.distributed as dist

            try:
                dist.TCPStore(self._store.host, self._store.port, is_master=False,
                              timeout=datetime.timedelta(seconds=2)).set(f"pull/{self._served + 1}", b"{}")
            except Exception:  # noqa: BLE001 - the store is gone: the server thread is too
                logger.debug("could not wake the P2P server thread", exc_info=True)
        with self._lock:
            self._clients.clear()
        self._served_groups.clear()
        self._pull_groups.clear()


class P2PConnector(TransferConnector):
    transport_cls = P2PTransport
