"""The consumer's side of P2P: one pull of one producer shard.

    find the producer rank's server (the owner actor's directory, then kept)
    take a store client (kept between pulls; a new one first checks the producer's
      "auth/salt": same secret, or none on both sides) and the pull's id (PULL_IDS)
    ask: push PullRequest onto PULLS                  (again on REGROUP, or NOT_YET until the deadline)
    accept: the header under "hdr/<pid>", checked     -> "go/<pid>" = 1 (or 0: refused, no group op)
    receive: into a staging buffer (gloo) or device memory (NCCL); a streamed batch chunk by
      chunk, each checked against its digests and handed to the load's sink as it lands

The store client goes back to the idle ones only if every store op of the pull was answered
(one that timed out may still be answered later, out of turn). A receive that fails on a kept
gloo group drops the group and quarantines its buffer: gloo cannot cancel a posted receive,
so the producer's late bytes may still land there. Every value read from the store is
checked against the cluster's secret when there is one (p2p_auth): a forged header is refused.
"""

from __future__ import annotations

import collections
import datetime
import json
import logging
import struct
import threading
import time
import uuid
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional

import torch

from fleetserve.kv_transfer.base import ConnectorContext, LoadSpec
from fleetserve.kv_transfer.blocks import BlockBatch, Header, batch_from_tensor, check_header, parse_header
from fleetserve.kv_transfer.connectors import p2p_net
from fleetserve.kv_transfer.connectors.p2p_auth import Channel, StoreAuth, read_salt
from fleetserve.kv_transfer.connectors.p2p_net import (
    CONNECT_TIMEOUT_S,
    NOT_YET,
    PULL_IDS,
    PULLS,
    REGROUP,
    STORE_TIMEOUT_S,
    Group,
    Groups,
    PullRequest,
    nccl_usable,
    server_name,
    stream_tag,
    tag,
    timeout_until,
)
from fleetserve.kv_transfer.digests import host_digests
from fleetserve.kv_transfer.errors import KVFormatError, TransferError
from fleetserve.kv_transfer.secret import ClusterSecret
from fleetserve.kv_transfer.shards import readers_of
from fleetserve.kv_transfer.staging import StagingPool
from fleetserve.kv_transfer.stream import ChunkSink
from fleetserve.kv_transfer.transport import block_shape

if TYPE_CHECKING:
    import torch.distributed as dist

logger = logging.getLogger(__name__)

POLL_S = 0.005  # a consumer told "not yet" asks again this much later
MAX_IDLE_CLIENTS = 4  # store clients a consumer keeps per producer address, between pulls
QUARANTINE = 4  # failed receives whose group and buffer are kept (see P2PPuller.quarantine)
MAX_ADDRESSES = 1024  # producer addresses remembered (engine ids are minted per start)

# (name "p2p/<engine>/r<rank>", deadline) -> "host:port", or None when nobody registered it.
Resolver = Callable[[str, float], Optional[str]]


class _Accepted(NamedTuple):
    """A header the consumer accepted: what the receive needs."""

    backend: str
    meta: Header
    dtype: torch.dtype
    shape: list[int]
    nbytes: int
    chunks: Optional[list[int]]  # blocks per chunk of a streamed batch


class P2PPuller:
    """One consumer rank's pulls: producer addresses, idle store clients and kept gloo groups
    (both per producer address, LRU), quarantined receives."""

    def __init__(
        self, ctx: ConnectorContext, max_groups: int, resolve: Resolver, secret: Optional[ClusterSecret] = None
    ) -> None:
        self.ctx = ctx
        self._resolve = resolve
        self._secret = secret
        self.device = torch.device("cpu")
        self.staging: Optional[StagingPool] = None
        # address -> (group id, group, the lock one exchange at a time on it takes)
        self.groups: Groups[tuple[str, Group, threading.Lock]] = Groups(max_groups)
        # Failed receives kept with their group and buffer, so late bytes land nowhere reused.
        self.quarantine: collections.deque[tuple[Group, list[dist.Work], torch.Tensor]] = collections.deque(
            maxlen=QUARANTINE
        )
        self._addresses: dict[str, str] = {}  # "p2p/<engine>/r<rank>" -> host:port
        # Producer address -> store clients idle between pulls (a new one costs a TCP connect
        # and torch's handshake: docs/benchmarks/results/2026-11-29-kv-transfer-zen5.md).
        self.clients: collections.OrderedDict[str, list[Channel]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def register(self, device: torch.device, staging: StagingPool) -> None:
        self.device, self.staging = device, staging

    def pull(self, spec: LoadSpec, rank: int, heads: tuple[int, int], sink: Optional[ChunkSink] = None) -> BlockBatch:
        """Producer rank `rank`'s shard (KV heads `heads`) of `spec`'s blocks, by spec.deadline;
        with a `sink`, streamed into it chunk by chunk."""
        addr = self._address(spec, rank)
        host, port = addr.rsplit(":", 1)
        chan, pid = self._client(addr, host, int(port), spec.deadline)
        pull = _Pull(self, spec, rank, heads, sink, addr, chan, pid)
        clean = False
        try:
            try:
                accepted = pull.accept(pull.ask())
            except (TransferError, KVFormatError):
                clean = True  # refused once every store op was answered
                raise
            # NCCL forms this pull's group through this client, and the group may still use it
            # (its monitor) after the pull: that client is not kept.
            clean = pull.gid is not None
            return pull.receive(accepted)
        finally:
            if clean:
                self._idle(addr, chan)

    def _address(self, spec: LoadSpec, rank: int) -> str:
        """host:port of the producer rank's server. Engine ids are minted per engine start, so
        an address, once found, stays right for that id (a restarted producer registers under
        a new one)."""
        engine = spec.source.get("remote_engine_id")
        name = server_name(str(engine), rank)
        addr = self._addresses.get(name)
        if addr is None:
            addr = self._resolve(name, spec.deadline)
            if not addr:  # producers register at start-up: an unknown engine is gone or foreign
                raise TransferError(f"no point-to-point server registered for engine {engine} rank {rank}")
            if len(self._addresses) >= MAX_ADDRESSES:
                self._addresses.clear()
            self._addresses[name] = addr
        return addr

    def _client(self, addr: str, host: str, port: int, deadline: float) -> tuple[Channel, Optional[int]]:
        """(a store client of the producer at `addr`, this pull's id when already taken).

                An idle client from an earlier pull is tried first: taking the pull's id is its
                check, within CONNECT_TIMEOUT_S as for a new connection (a producer that restarted
                at this address, or died, fails it; then a new client is made, in what is left of
                that time). A new one connects within CONNECT_TIMEOUT_S (a dead producer fails the
                load then, not at its deadline) and checks the producer's secret (AuthError: another
        secret, or only one side has one). Either then waits for answers up to the deadline."""
        connect_s = max(0.5, min(deadline - time.time(), CONNECT_TIMEOUT_S))
        with self._lock:
            idle = self.clients.get(addr)
            kept = idle.pop() if idle else None
        if kept is not None:
            t0 = time.monotonic()
            try:
                kept.store.set_timeout(datetime.timedelta(seconds=connect_s))
                pid = kept.store.add(PULL_IDS, 1)
                kept.store.set_timeout(timeout_until(deadline, 0.5))
                return kept, pid
            except Exception:  # noqa: BLE001 - reset, refused or silent: a new client decides
                logger.debug("idle store client of %s failed; connecting again", addr, exc_info=True)
                connect_s = max(0.5, connect_s - (time.monotonic() - t0))
        store = p2p_net.connect_store(host, port, connect_s, deadline)
        return Channel(store, read_salt(store, self._secret, addr)), None

    def _idle(self, addr: str, chan: Channel) -> None:
        """Keep a client whose every op was answered, for the next pull from `addr`."""
        with self._lock:
            idle = self.clients.setdefault(addr, [])
            self.clients.move_to_end(addr)
            if len(idle) < MAX_IDLE_CLIENTS:
                idle.append(chan)
            while len(self.clients) > self.groups.cap:
                self.clients.popitem(last=False)

    def form_group(self, addr: str, gid: str, auth: Optional[StoreAuth], lock: threading.Lock) -> Group:
        """A new kept gloo group with the producer at `addr`, through a store client of its
        own (it outlives this pull's), its rendezvous sealed with `auth` (the producer's)."""
        import torch.distributed as dist

        host, port = addr.rsplit(":", 1)
        group_store = dist.TCPStore(
            host, int(port), is_master=False, timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S)
        )
        pg = p2p_net.make_group(Channel(group_store, auth), f"g/{gid}", 1, STORE_TIMEOUT_S, "gloo")
        self.groups.put(addr, (gid, pg, lock))
        return pg

    def quarantine_receive(self, addr: str, gid: str, pg: Group, works: list[dist.Work], buf: torch.Tensor) -> None:
        """A receive on the kept group `gid` failed: drop the group and keep its buffer out of
        the staging pool (its bytes may still land) until QUARANTINE later failures push it out."""
        kept = self.groups.get(addr)
        if kept is not None and kept[0] == gid:
            self.groups.drop(addr)
        self.quarantine.append((pg, works, buf))

    def take_buffer(self, nbytes: int, backend: str) -> tuple[torch.Tensor, Optional[Callable[[], None]]]:
        """Where a payload is received: device memory for NCCL, else a staging buffer (and the
        callback that gives it back)."""
        if backend == "nccl":
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device), None
        if self.staging is None:
            raise RuntimeError("the transport's KV caches are not registered yet")
        return self.staging.take((nbytes,), torch.uint8)

    def shutdown(self) -> None:
        with self._lock:
            self.clients.clear()
        self.groups.clear()


class _Pull:
    """One pull's state: its store client and id, and the group it names."""

    def __init__(
        self,
        puller: P2PPuller,
        spec: LoadSpec,
        rank: int,
        heads: tuple[int, int],
        sink: Optional[ChunkSink],
        addr: str,
        chan: Channel,
        pid: Optional[int],
    ) -> None:
        self.puller, self.spec, self.rank, self.heads, self.sink = puller, spec, rank, heads, sink
        self.addr, self.chan, self.pid = addr, chan, pid
        self.gid: Optional[str] = None  # a kept gloo group's id (None: NCCL, a group for this pull)
        self.pg: Optional[Group] = None  # that group, when it is kept already
        self.lock: Optional[threading.Lock] = None  # ... and the lock its exchanges take
        self.quarantined = False  # the receive failed and its buffer is kept out of the pool

    def _request(self, pid: int, backend: str) -> PullRequest:
        ctx = self.puller.ctx
        return PullRequest(
            pid=pid,
            oid=f"{self.spec.transfer_id}/r{self.rank}",
            backend=backend,
            group=self.gid,
            new=self.pg is None,
            stream=self.sink is not None and backend == "gloo",
            readers=readers_of(self.heads, ctx.num_kv_heads, ctx.tp_size),
        )

    def ask(self) -> bytes:
        """Ask the producer's server until it answers with a header (again after REGROUP, once;
        after NOT_YET, until the deadline); TransferError when it has nothing for us."""
        backend = "nccl" if nccl_usable(self.puller.device) else "gloo"
        kept = self.puller.groups.get(self.addr) if backend == "gloo" else None
        regroups = 0
        while True:
            if backend == "gloo":
                self.gid, self.pg, self.lock = kept if kept is not None else (uuid.uuid4().hex, None, None)
            if self.pid is None:
                self.pid = self.chan.store.add(PULL_IDS, 1)
            self.chan.push(PULLS, json.dumps(self._request(self.pid, backend)).encode())
            reply = self.chan.take(f"hdr/{self.pid}")  # waits for the server (the store's timeout: the deadline)
            if reply == REGROUP:
                self.puller.groups.drop(self.addr)
                kept = None
                regroups += 1
                if regroups > 1:
                    raise TransferError(f"producer {self.addr} asked for a new group twice")
            elif reply == NOT_YET:
                if time.time() + POLL_S >= self.spec.deadline:
                    raise TransferError(f"transfer {self.spec.transfer_id} not exported before the deadline")
                time.sleep(POLL_S)
            elif not reply:
                raise TransferError(f"producer has no transfer {self.spec.transfer_id} (expired or taken)")
            else:
                return reply
            self.pid = None

    def accept(self, reply: bytes) -> _Accepted:
        """The producer's header, checked against this load (and begun on its sink when
        streamed); a refused one (KVFormatError) is answered "go: 0", so the producer never
        joins a group op for it."""
        ctx, spec = self.puller.ctx, self.spec
        backend, _, header = reply.partition(b"\n")
        try:
            meta, off = parse_header(header)
            if off != len(header):
                raise KVFormatError("trailing bytes after the KV header")
            dtype, shape, nbytes = check_header(meta, ctx.fingerprint)
            if tuple(shape[1:]) != block_shape(ctx, shape[0], self.heads)[1:] or shape[0] > spec.first_block + len(
                spec.keys
            ):
                raise KVFormatError(
                    f"blocks of shape {shape} do not fit this request's {len(spec.keys)} blocks of heads {self.heads}"
                )
            chunks: Optional[list[int]] = meta.get("chunks")
            if chunks is not None:
                if self.sink is None or backend != b"gloo" or self.gid is None or meta.get("digest") != "xxh3_64":
                    raise KVFormatError("a streamed batch this pull did not ask for")
                self.sink.begin(meta["fingerprint"], [str(k) for k in meta["keys"]], self.heads, shape, dtype)
        except KVFormatError:
            self.chan.put(f"go/{self.pid}", b"0")
            raise
        return _Accepted(backend.decode(), meta, dtype, shape, nbytes, chunks)

    def receive(self, acc: _Accepted) -> BlockBatch:
        """Say "go" and receive the payload; the buffer goes back to the pool on failure
        (unless quarantined)."""
        buf, release = self.puller.take_buffer(acc.nbytes, acc.backend)
        try:
            if self.gid is None:  # NCCL: a group for this pull only
                self.chan.put(f"go/{self.pid}", b"1")
                pg = p2p_net.make_group(self.chan, str(self.pid), 1, self.spec.deadline - time.time(), acc.backend)
                pg.recv([buf], 0, 0).wait()
                del pg
                return batch_from_tensor(acc.meta, buf, self.puller.ctx.fingerprint, release)
            # One exchange at a time on a kept group (gloo loses messages when receives are
            # posted on one pair from several threads while its sends arrive): "go" is said
            # only under the group's lock, so the producer sends in that order. A new group's
            # lock is held before any other pull can find the group.
            lock = self.lock if self.lock is not None else threading.Lock()
            if not lock.acquire(timeout=max(0.0, self.spec.deadline - time.time())):
                self.chan.put(f"go/{self.pid}", b"0")  # the producer's thread moves on at once
                raise TransferError(f"transfer {self.spec.transfer_id}: its group stayed busy until the deadline")
            try:
                self.chan.put(f"go/{self.pid}", b"1")
                pg = (
                    self.pg
                    if self.pg is not None
                    else self.puller.form_group(self.addr, self.gid, self.chan.auth, lock)
                )
                return self._receive_kept(acc, pg, buf, release)
            finally:
                lock.release()
        except BaseException:
            if release is not None and not self.quarantined:  # (a quarantined buffer never goes back)
                release()
            raise

    def _receive_kept(
        self, acc: _Accepted, pg: Group, buf: torch.Tensor, release: Optional[Callable[[], None]]
    ) -> BlockBatch:
        """The payload over the kept gloo group `pg` (streamed chunk by chunk into the sink when
        the header says so)."""
        works: list[dist.Work] = []
        try:
            if acc.chunks is not None and self.sink is not None:
                tensor = buf.view(acc.dtype).view(acc.shape)
                per = acc.nbytes // acc.shape[0]
                digests = receive_chunks(pg, self._pid(), buf, acc.chunks, per, works, tensor, self.sink, self.spec)
                keys = [str(k) for k in acc.meta["keys"]]
                return BlockBatch(self.puller.ctx.fingerprint, keys, tensor, self.heads, digests, "xxh3_64", release)
            works.append(pg.recv([buf], 0, tag(self._pid())))
            works[0].wait(timeout_until(self.spec.deadline))
        except BaseException:
            self.puller.quarantine_receive(self.addr, str(self.gid), pg, works, buf)
            self.quarantined = True  # never back to the pool: the producer's bytes may still land
            raise
        return batch_from_tensor(acc.meta, buf, self.puller.ctx.fingerprint, release)

    def _pid(self) -> int:
        if self.pid is None:
            raise RuntimeError("the pull has no id yet")
        return self.pid


def receive_chunks(
    pg: Group,
    pid: int,
    buf: torch.Tensor,
    chunks: list[int],
    per: int,
    works: list[dist.Work],
    tensor: torch.Tensor,
    sink: ChunkSink,
    spec: LoadSpec,
) -> list[int]:
    """A streamed pull: every receive posted at once (status+digests, then bytes, per chunk,
    the bytes straight into their place in `buf`; `works` collects them), then the chunks in
    order as they land, each one's blocks checked against their digests and handed to `sink`
    (writing chunk c overlaps receiving the next). Returns the digests."""
    heads, pos = [], 0
    for c, k in enumerate(chunks):
        head = torch.empty(8 * (k + 1), dtype=torch.uint8)
        heads.append(head)
        works.append(pg.recv([head], 0, stream_tag(pid, 2 * c)))
        works.append(pg.recv([buf[pos * per : (pos + k) * per]], 0, stream_tag(pid, 2 * c + 1)))
        pos += k
    digests: list[int] = []
    pos = 0
    for c, k in enumerate(chunks):
        works[2 * c].wait(timeout_until(spec.deadline))
        status, *sums = struct.unpack(f"<{k + 1}Q", heads[c].numpy().tobytes())
        if status != 1:
            raise TransferError(f"transfer {spec.transfer_id}: the producer could not gather its blocks")
        works[2 * c + 1].wait(timeout_until(spec.deadline))
        part = tensor[pos : pos + k]
        got = host_digests(part.view(torch.uint8).numpy(), k)
        ok = next((i for i, (a, b) in enumerate(zip(got, sums)) if a != b), k)
        if ok < k:
            logger.warning(
                "KV load of %s: block %d fails its xxh3_64 digest (corrupt); refused from there", spec.req_id, pos + ok
            )
        sink.write(pos, part, ok)
        digests += got
        pos += k
    return digests
