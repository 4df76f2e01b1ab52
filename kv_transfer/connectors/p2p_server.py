"""The producer's side of P2P: an outbox of exports under their leases, and the server that
answers pulls from it.

The server's threads (`p2p_server_threads`, default 8), each with a store client of its own,
take pull requests from the store's PULLS queue, so pulls are served independently: a
consumer that stalls mid-pull holds one thread until its STORE_TIMEOUT_S ends, not the
others, and an id a consumer took and never asked with leaves no gap anybody waits on.
With the cluster's secret every value is sealed (p2p_auth): a request that is not is
refused and counted (`refused`), and an id served before is dropped (a replay).

For each pull the server writes the backend and the batch's header (or REGROUP, NOT_YET, or
nothing for a transfer taken or expired) under "hdr/<pid>", waits for the consumer's verdict
under "go/<pid>", then sends the payload over a two-rank group: a kept gloo group the
consumer names, or one formed for this pull (NCCL). A streamed pull gets each chunk (its
blocks' digests, then its bytes) as soon as it is gathered.
"""

from __future__ import annotations

import collections
import datetime
import json
import logging
import struct
import threading
import time
from typing import TYPE_CHECKING, Optional

import torch

from fleetserve.kv_transfer.blocks import BlockBatch
from fleetserve.kv_transfer.connectors import p2p_net
from fleetserve.kv_transfer.connectors.p2p_auth import AuthError, Channel, publish_salt
from fleetserve.kv_transfer.connectors.p2p_net import (
    NOT_YET,
    PULLS,
    REGROUP,
    STORE_TIMEOUT_S,
    Group,
    Groups,
    PullRequest,
    stream_tag,
    tag,
)
from fleetserve.kv_transfer.errors import TransferError
from fleetserve.kv_transfer.secret import ClusterSecret, warn_unkeyed
from fleetserve.kv_transfer.stream import StreamAborted, plan_chunks

if TYPE_CHECKING:
    import torch.distributed as dist

logger = logging.getLogger(__name__)

# The server's wait for the next pull, before it waits again: long, because a wait that times
# out logs a warning in torch (an idle server logs once an hour); shutdown() wakes it.
IDLE_WAIT_S = 3600.0
SWEEP_S = 0.25  # expired leases in the outbox are released this often
GONE_MEMORY = 4096  # transfers taken or expired that the producer remembers as such
SERVER_THREADS = 8  # pulls served at once (each thread has a store client of its own)
REFUSAL_LOG_EVERY = 1000  # refused requests are logged the first time and then once per this many


class _Held:
    """An export in the outbox. `refs`: the outbox's own (until every consumer rank that reads
    it has pulled it, or its lease ends) and one per send in progress; the batch's buffer goes
    back to the pool when the last one is dropped."""

    __slots__ = ("batch", "lease_end", "served", "refs")

    def __init__(self, batch: BlockBatch, lease_end: float) -> None:
        self.batch, self.lease_end = batch, lease_end
        self.served = 0
        self.refs = 1


class P2PServer:
    """One producer rank's outbox and the server thread that hands it out."""

    def __init__(
        self, tp_rank: int, max_groups: int, secret: Optional[ClusterSecret] = None, threads: int = SERVER_THREADS
    ) -> None:
        self.tp_rank = tp_rank
        self._secret = secret
        self.threads = max(1, threads)
        self._outbox: dict[str, _Held] = {}  # "<transfer id>/r<rank>" -> its export
        self._lock = threading.Lock()
        self._store: Optional[dist.TCPStore] = None
        self._stop = threading.Event()
        # Kept gloo groups by id, each with the lock its sends take: one consumer's pulls go out
        # over its group one at a time (gloo mixes concurrent sends on one pair up), other
        # consumers' groups are not held up by them.
        self.groups: Groups[tuple[Group, threading.Lock]] = Groups(max_groups)
        self._gone: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._seen: collections.OrderedDict[int, None] = collections.OrderedDict()  # pull ids served
        self.refused = 0  # requests not sealed with the secret, malformed, or replayed
        self.serving = 0  # pulls being served now

    @property
    def started(self) -> bool:
        return self._store is not None

    def start(self, host: str) -> int:
        """Listen on a free port of `host` and start serving; returns the port."""
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=STORE_TIMEOUT_S)
        self._store = store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        idle = datetime.timedelta(seconds=IDLE_WAIT_S)
        auth = publish_salt(store, self._secret)  # before the address is registered anywhere
        if auth is None:
            warn_unkeyed("the P2P KV server", "any client that reaches its port can read and plant KV")
        for i in range(self.threads):
            # Two clients a thread: one only pops the queue, one runs the pulls' ops. (A client
            # that popped can be woken again later for the queue: its next wait, were it for a
            # pull's key, would return before the key is there.)
            pops = dist.TCPStore(host, store.port, is_master=False, timeout=idle)
            ops = dist.TCPStore(host, store.port, is_master=False, timeout=timeout)
            threading.Thread(
                target=self._loop,
                args=(Channel(pops, auth), Channel(ops, auth)),
                name=f"kv-p2p-server-{i}",
                daemon=True,
            ).start()
        threading.Thread(target=self._sweep_loop, name="kv-p2p-leases", daemon=True).start()
        return store.port

    # ---- the outbox -------------------------------------------------------------
    def export(self, transfer_id: Optional[str], batch: BlockBatch, lease_s: float) -> None:
        if batch.progress is None:  # (a streamed batch's digests are set as it is gathered)
            batch.checksums()  # here, on the export thread, not in the server's send
        oid = f"{transfer_id}/r{self.tp_rank}"
        with self._lock:
            old = self._outbox.pop(oid, None)
            self._outbox[oid] = _Held(batch, time.time() + lease_s)
        if old is not None:
            self._unref(old)

    def held(self) -> int:
        with self._lock:
            return len(self._outbox)

    def _take(self, oid: str, readers: int) -> tuple[Optional[_Held], bool]:
        """(the export `oid` with a reference for this send, or None; whether it is known as
        taken or expired). Handed over to every consumer rank that reads it (a TP consumer's
        ranks each pull the shard holding their heads), it leaves the outbox."""
        with self._lock:
            entry = self._outbox.get(oid)
            if entry is not None:
                entry.refs += 1  # this send's
                entry.served += 1
                if entry.served >= max(1, readers):
                    del self._outbox[oid]
                    entry.refs -= 1
                    self._forget(oid)
            return entry, oid in self._gone

    def _unref(self, entry: _Held) -> None:
        with self._lock:
            entry.refs -= 1
            last = entry.refs == 0
        if last:
            entry.batch.release()

    def _sweep_loop(self) -> None:
        while not self._stop.wait(SWEEP_S):
            self._sweep()

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

    # ---- serving pulls ----------------------------------------------------------
    def _loop(self, queue: Channel, chan: Channel) -> None:
        # Blocks on the queue (woken as soon as a consumer pushes; polling cost every pull a few
        # ms: docs/benchmarks/results/2026-11-29-kv-transfer-zen5.md).
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                raw = queue.pop(PULLS)
            except AuthError:
                if not self._stop.is_set():  # (shutdown's wake-ups are not sealed)
                    self._refuse("not sealed with the cluster's KV secret")
                continue
            except Exception as e:  # noqa: BLE001 - DistStoreError: idle for IDLE_WAIT_S; wait again
                if "queue is empty" in str(e):
                    continue  # woken again for an item this client already took: wait again
                if time.monotonic() - t0 < 1.0:  # not a timeout: never spin on a broken store
                    if self._stop.is_set():
                        return
                    logger.warning("P2P server's wait failed: %s", e)
                    self._stop.wait(1.0)
                continue
            if self._stop.is_set():
                return
            pull = self._request(raw)
            if pull is None:
                continue
            with self._lock:
                self.serving += 1
            try:
                self._send(chan, pull["pid"], pull)
            except Exception as e:  # noqa: BLE001 - one failed pull must not stop the server
                logger.warning("KV pull %d failed: %s", pull["pid"], e)
            finally:
                with self._lock:
                    self.serving -= 1

    def _request(self, raw: bytes) -> Optional[PullRequest]:
        """The pull request in `raw`, or None (refused) when it is malformed or its id was
        served before (a replay)."""
        try:
            pull: PullRequest = json.loads(raw)
            pid = int(pull["pid"])
        except (ValueError, KeyError, TypeError):
            self._refuse("malformed")
            return None
        with self._lock:
            seen = pid in self._seen
            self._seen[pid] = None
            while len(self._seen) > GONE_MEMORY:
                self._seen.popitem(last=False)
        if seen:
            self._refuse(f"pull id {pid} served before (a replay)")
            return None
        pull["pid"] = pid
        return pull

    def _refuse(self, why: str) -> None:
        with self._lock:
            self.refused += 1
            n = self.refused
        if n == 1 or n % REFUSAL_LOG_EVERY == 0:
            logger.warning("P2P server refused a pull request (%s); %d refused so far", why, n)

    def _send(self, chan: Channel, pid: int, pull: PullRequest) -> None:
        raw_gid = pull.get("group")  # a kept gloo group the consumer names (None: one for this pull)
        gid = str(raw_gid) if raw_gid is not None else None
        oid = str(pull.get("oid"))
        with self._lock:
            held = oid in self._outbox
        if held and gid is not None and not pull.get("new") and self.groups.get(gid) is None:
            chan.put(f"hdr/{pid}", REGROUP)  # evicted here: the consumer forms it again
            return
        entry, known_gone = self._take(oid, int(pull.get("readers", 1)))
        if entry is None:
            # Taken or expired: a clear "no". Otherwise the export is still being gathered
            # (the producer's reply can overtake it): the consumer asks again.
            chan.put(f"hdr/{pid}", b"" if known_gone else NOT_YET)
            return
        try:
            self._send_held(chan, pid, pull, gid, entry.batch)
        finally:
            self._unref(entry)

    def _send_held(self, chan: Channel, pid: int, pull: PullRequest, gid: Optional[str], batch: BlockBatch) -> None:
        backend = "nccl" if pull.get("backend") == "nccl" and batch.data.is_cuda else "gloo"
        # Streamed (chunk by chunk, each as soon as it is gathered) when the consumer asks for
        # it on a kept gloo group; else whole, once every chunk is gathered.
        stream = bool(pull.get("stream")) and backend == "gloo" and gid is not None
        prog = batch.progress
        if prog is not None and not stream:
            try:
                prog.wait_all(STORE_TIMEOUT_S)
            except StreamAborted:
                chan.put(f"hdr/{pid}", b"")  # nothing to hand over: the load fails at once
                raise
        if backend == "gloo" and batch.data.device.type != "cpu":  # a CPU consumer: via the host
            batch = BlockBatch(batch.fingerprint, batch.keys, batch.data.cpu(), batch.heads)
        chunks = None
        if stream:
            n = batch.data.shape[0]
            chunks = prog.chunks if prog is not None else plan_chunks(n, batch.nbytes // n)
        chan.put(f"hdr/{pid}", backend.encode() + b"\n" + batch.header([e - s for s, e in chunks] if chunks else None))
        if chan.take(f"go/{pid}") != b"1":
            return  # the consumer refused the header: it never joins the group
        payload = batch.data.reshape(-1).view(torch.uint8)
        if backend != "gloo" or gid is None:
            p2p_net.make_group(chan, pid, 0, STORE_TIMEOUT_S, backend).send([payload], 1, 0).wait()
            return
        kept = self.groups.get(gid)
        if pull.get("new") or kept is None:
            kept = (p2p_net.make_group(chan, f"g/{gid}", 0, STORE_TIMEOUT_S, "gloo"), threading.Lock())
            self.groups.put(gid, kept)
        pg, sending = kept
        try:
            with sending:
                if chunks:
                    self._send_chunks(pg, pid, batch, chunks, payload)
                else:
                    pg.send([payload], 1, tag(pid)).wait()
        except BaseException:
            self.groups.drop(gid, kept)  # the consumer went away or timed out
            raise

    def _send_chunks(
        self, pg: Group, pid: int, batch: BlockBatch, chunks: list[tuple[int, int]], flat: torch.Tensor
    ) -> None:
        """Each chunk as two messages: its status and blocks' digests (8 bytes each), then its
        bytes, sent once it is gathered. A chunk that never gets gathered (the copy-out
        failed) goes out as status 0 and nothing after it: both sides drop the group."""
        per = batch.nbytes // batch.data.shape[0]
        works, heads = [], []
        ok = True
        for c, (s, e) in enumerate(chunks):
            if batch.progress is not None:
                try:
                    batch.progress.wait_chunk(c, STORE_TIMEOUT_S)
                except StreamAborted as err:
                    ok = False
                    logger.warning("KV pull %d: %s", pid, err)
            sums = batch.checksums()[s:e] if ok else [0] * (e - s)
            head = torch.frombuffer(bytearray(struct.pack(f"<{e - s + 1}Q", int(ok), *sums)), dtype=torch.uint8)
            heads.append(head)
            works.append(pg.send([head], 1, stream_tag(pid, 2 * c)))
            if not ok:
                break
            works.append(pg.send([flat[s * per : e * per]], 1, stream_tag(pid, 2 * c + 1)))
        for w in works:
            w.wait()
        if not ok:
            raise TransferError(f"pull {pid}: the export's blocks could not be gathered")

    def shutdown(self) -> None:
        self._stop.set()
        if self._store is not None:
            # Wake each server thread's wait with an item of its own on the queue, through a
            # client of its own (a thread's client runs one op at a time).
            import torch.distributed as dist

            try:
                waker = dist.TCPStore(
                    self._store.host, self._store.port, is_master=False, timeout=datetime.timedelta(seconds=2)
                )
                for _ in range(self.threads):
                    waker.queue_push(PULLS, b"")
            except Exception:  # noqa: BLE001 - the store is gone: the server threads are too
                logger.debug("could not wake the P2P server threads", exc_info=True)
        self.groups.clear()
