"""The producer's side of P2P: an outbox of exports under their leases, and the server that
answers pulls from it in the order of their ids.

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
from fleetserve.kv_transfer.connectors.p2p_net import (
    NOT_YET,
    REGROUP,
    STORE_TIMEOUT_S,
    Group,
    Groups,
    PullRequest,
    store_set,
    stream_tag,
    tag,
)
from fleetserve.kv_transfer.errors import TransferError
from fleetserve.kv_transfer.stream import StreamAborted, plan_chunks

if TYPE_CHECKING:
    import torch.distributed as dist

logger = logging.getLogger(__name__)

# The server's wait for the next pull, before it waits again: long, because a wait that times
# out logs a warning in torch (an idle server logs once an hour); shutdown() wakes it.
IDLE_WAIT_S = 3600.0
SWEEP_S = 0.25  # expired leases in the outbox are released this often
GONE_MEMORY = 4096  # transfers taken or expired that the producer remembers as such


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

    def __init__(self, tp_rank: int, max_groups: int) -> None:
        self.tp_rank = tp_rank
        self._outbox: dict[str, _Held] = {}  # "<transfer id>/r<rank>" -> its export
        self._lock = threading.Lock()
        self._store: Optional[dist.TCPStore] = None
        self._served = 0  # pulls served, in order of their ids
        self._stop = threading.Event()
        self.groups: Groups[Group] = Groups(max_groups)  # kept gloo groups by id
        self._gone: collections.OrderedDict[str, None] = collections.OrderedDict()

    @property
    def started(self) -> bool:
        return self._store is not None

    def start(self, host: str) -> int:
        """Listen on a free port of `host` and start serving; returns the port."""
        import torch.distributed as dist

        self._store = store = dist.TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S)
        )
        threading.Thread(target=self._loop, args=(store,), name="kv-p2p-server", daemon=True).start()
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
    def _loop(self, store: dist.TCPStore) -> None:
        # Blocks on the next pull's key (woken as soon as the consumer sets it; polling for it
        # cost every pull a few ms: docs/benchmarks/results/2026-11-29-kv-transfer-zen5.md).
        while not self._stop.is_set():
            key = f"pull/{self._served + 1}"
            t0 = time.monotonic()
            try:
                store.wait([key], datetime.timedelta(seconds=IDLE_WAIT_S))
            except Exception as e:  # noqa: BLE001 - DistStoreError: idle for IDLE_WAIT_S; wait again
                if time.monotonic() - t0 < 1.0:  # not a timeout: never spin on a broken store
                    logger.warning("P2P server's wait failed: %s", e)
                    self._stop.wait(1.0)
                continue
            if self._stop.is_set():
                return
            self._served += 1
            try:
                self._send(store, self._served, json.loads(store.get(key)))
            except Exception as e:  # noqa: BLE001 - one failed pull must not stop the server
                logger.warning("KV pull %d failed: %s", self._served, e)

    def _send(self, store: dist.TCPStore, pid: int, pull: PullRequest) -> None:
        raw_gid = pull.get("group")  # a kept gloo group the consumer names (None: one for this pull)
        gid = str(raw_gid) if raw_gid is not None else None
        oid = str(pull.get("oid"))
        with self._lock:
            held = oid in self._outbox
        if held and gid is not None and not pull.get("new") and self.groups.get(gid) is None:
            store_set(store, f"hdr/{pid}", REGROUP)  # evicted here: the consumer forms it again
            return
        entry, known_gone = self._take(oid, int(pull.get("readers", 1)))
        if entry is None:
            # Taken or expired: a clear "no". Otherwise the export is still being gathered
            # (the producer's reply can overtake it): the consumer asks again.
            store_set(store, f"hdr/{pid}", b"" if known_gone else NOT_YET)
            return
        try:
            self._send_held(store, pid, pull, gid, entry.batch)
        finally:
            self._unref(entry)

    def _send_held(
        self, store: dist.TCPStore, pid: int, pull: PullRequest, gid: Optional[str], batch: BlockBatch
    ) -> None:
        backend = "nccl" if pull.get("backend") == "nccl" and batch.data.is_cuda else "gloo"
        # Streamed (chunk by chunk, each as soon as it is gathered) when the consumer asks for
        # it on a kept gloo group; else whole, once every chunk is gathered.
        stream = bool(pull.get("stream")) and backend == "gloo" and gid is not None
        prog = batch.progress
        if prog is not None and not stream:
            try:
                prog.wait_all(STORE_TIMEOUT_S)
            except StreamAborted:
                store_set(store, f"hdr/{pid}", b"")  # nothing to hand over: the load fails at once
                raise
        if backend == "gloo" and batch.data.device.type != "cpu":  # a CPU consumer: via the host
            batch = BlockBatch(batch.fingerprint, batch.keys, batch.data.cpu(), batch.heads)
        chunks = None
        if stream:
            n = batch.data.shape[0]
            chunks = prog.chunks if prog is not None else plan_chunks(n, batch.nbytes // n)
        store_set(
            store, f"hdr/{pid}", backend.encode() + b"\n" + batch.header([e - s for s, e in chunks] if chunks else None)
        )
        if store.get(f"go/{pid}") != b"1":
            return  # the consumer refused the header: it never joins the group
        payload = batch.data.reshape(-1).view(torch.uint8)
        if backend != "gloo" or gid is None:
            p2p_net.make_group(store, pid, 0, STORE_TIMEOUT_S, backend).send([payload], 1, 0).wait()
            return
        pg = self.groups.get(gid)
        if pull.get("new") or pg is None:
            pg = p2p_net.make_group(store, f"g/{gid}", 0, STORE_TIMEOUT_S, "gloo")
            self.groups.put(gid, pg)
        try:
            if chunks:
                self._send_chunks(pg, pid, batch, chunks, payload)
            else:
                pg.send([payload], 1, tag(pid)).wait()
        except BaseException:
            self.groups.drop(gid, pg)  # the consumer went away or timed out
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
            # Wake the server's wait by writing the key it waits for (a pull racing this fails),
            # through a client of its own: one client's ops run one at a time, so the server's
            # own would wait out the wait first.
            import torch.distributed as dist

            try:
                waker = dist.TCPStore(
                    self._store.host, self._store.port, is_master=False, timeout=datetime.timedelta(seconds=2)
                )
                waker.set(f"pull/{self._served + 1}", "{}")
            except Exception:  # noqa: BLE001 - the store is gone: the server thread is too
                logger.debug("could not wake the P2P server thread", exc_info=True)
        self.groups.clear()
