"""The worker half every connector shares (`TransferWorker`), wherever the KV lives.

Saves: a finished request's blocks are copied out (a CPU cache on the copy-out thread, the
blocks kept allocated until it reports them in `finished_sending`; a GPU cache from the
engine's thread, freed after this step) and exported in the background. With a streaming
transport (P2P) and a CPU cache an export is handed over before its copy-out, which then
goes chunk by chunk, so a consumer already pulling gets each chunk as soon as it is ready.
A hand-off saved layer by layer (`layerwise_save`) is gathered in `save_kv_layer` during the
forward and exported when it ends (`wait_for_save`).

Loads: fetched in the background into staging memory, checked block by block against the
consumer's own chain keys and written into the cache (kv_transfer.loads): a CPU cache on the
transfer thread (the engine's thread never stalls on a big load's copy; streamed chunks are
checked and written as they arrive), a GPU cache from `get_finished`, in its stream's order.
`get_finished` reports them, and the rest as failed blocks. A load past its deadline or
cancelled is given up under its lock (a write under way finishes first), so none of its late
bytes land once the scheduler hears of it.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import queue
import threading
import time
from typing import Any, Callable, NamedTuple, Optional

import torch

from fleetserve.kv_transfer.base import ConnectorContext, KVConnectorWorker, LoadSpec, SaveSpec, TransferStats
from fleetserve.kv_transfer.blocks import BlockBatch
from fleetserve.kv_transfer.cache_copy import BlockIndex, block_index, gather_layer
from fleetserve.kv_transfer.config import KVTransferConfig
from fleetserve.kv_transfer.digests import DigestsBehind, host_digests
from fleetserve.kv_transfer.errors import KVFormatError, TransferError
from fleetserve.kv_transfer.loads import Fetched, Load, LocalCache, Sink
from fleetserve.kv_transfer.shards import local_head_range
from fleetserve.kv_transfer.staging import StagingFull, StagingPool
from fleetserve.kv_transfer.stream import STREAM_CHUNK_BYTES, ExportProgress, plan_chunks
from fleetserve.kv_transfer.transport import Transport

logger = logging.getLogger(__name__)

# How long a worker half shutting down still waits for its exports (the engine core's flush,
# bounded by kv_save_timeout_s, waited for them first).
SHUTDOWN_GRACE_S = 1.0


class _LayerSave(NamedTuple):
    """A save filled layer by layer during this step's forward (save_kv_layer)."""

    spec: SaveSpec
    batch: BlockBatch  # being filled
    idx: BlockIndex
    done: set[int]  # layers copied
    t0: float


class TransferWorker(KVConnectorWorker):
    def __init__(
        self, config: KVTransferConfig, ctx: ConnectorContext, transport: Transport, max_workers: int = 4
    ) -> None:
        self.config = config
        self.ctx = ctx
        self.transport = transport
        self.heads = local_head_range(ctx.num_kv_heads, ctx.tp_size, ctx.tp_rank)
        self.kv_caches: list[torch.Tensor] = []
        self.cache = LocalCache(ctx.fingerprint, self.heads, self.kv_caches)
        self.uses_layer_hooks = config.is_producer and bool(
            config.kv_connector_extra_config.get("layerwise_save", False)
        )
        self.staging = StagingPool(int(config.kv_connector_extra_config.get("staging_max_bytes", 1 << 30)))
        self._payload_device = torch.device("cpu")
        # The engine's set-up for threads that copy (set_thread_initializer), run first on each.
        self._thread_initializer: Optional[Callable[[], None]] = None
        self._pool = cf.ThreadPoolExecutor(max_workers, thread_name_prefix="kv-transfer", initializer=self._init_thread)
        self._loads: dict[str, Load] = {}
        # A CPU cache is copied off the engine's thread (a big prompt's copy would stall the step:
        # docs/benchmarks/results/2026-11-29-kv-transfer-zen5.md): a load's blocks are written on
        # its transfer thread, not in get_finished; a finished request's blocks are copied out on
        # `_copy_pool` (they stay allocated until the copy is done: reported then in
        # finished_sending), then exported on `_pool`. A GPU cache is copied from the engine's
        # thread, in its stream's order.
        self._copy_off_engine_thread = False
        self._chunk_bytes = int(config.kv_connector_extra_config.get("stream_chunk_bytes", STREAM_CHUNK_BYTES))
        self._copy_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="kv-copy-out", initializer=self._init_thread)
        self._copied_out: queue.SimpleQueue[str] = queue.SimpleQueue()
        # (request id, future) of every copy-out and export not reaped yet.
        self._exports: list[tuple[str, cf.Future[None]]] = []
        self._exports_lock = threading.Lock()
        self._layer_saves: list[_LayerSave] = []  # this step's
        self._sending_done: set[str] = set()
        self._invalid: set[int] = set()
        self.stats = self._new_stats()
        self._staging_refused_seen = 0
        # Exports record their sends from transfer threads; the engine's thread takes the dict.
        self._stats_lock = threading.Lock()

    def set_thread_initializer(self, initializer: Optional[Callable[[], None]]) -> None:
        """Run `initializer` first on every thread this half starts to copy blocks (e.g. the
        replica's replica.worker.omp_bind.one_core_per_thread). Threads start at the first
        transfer: set it before the caches are registered."""
        self._thread_initializer = initializer

    def _init_thread(self) -> None:
        init = self._thread_initializer
        if init is not None:
            init()

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        self.cache = LocalCache(self.ctx.fingerprint, self.heads, kv_caches)
        device = kv_caches[0].device
        self.staging.pin_memory = device.type == "cuda"
        self._payload_device = torch.device(self.transport.payload_device(device))
        self._copy_off_engine_thread = device.type == "cpu"
        self.transport.register_kv_caches(kv_caches, self.staging)

    def _empty_batch(self, spec: SaveSpec) -> BlockBatch:
        """Room for `spec`'s blocks: a pooled host buffer, or device memory when the transport
        sends from the device (checked there with wsum64 digests)."""
        first = self.kv_caches[0]
        shape = (
            len(spec.block_ids),
            len(self.kv_caches),
            first.shape[0],
            first.shape[1],
            first.shape[3],
            first.shape[4],
        )
        if self._payload_device.type == "cpu":
            data, release = self.staging.take(shape, first.dtype)
            return BlockBatch(self.ctx.fingerprint, spec.keys, data, self.heads, on_release=release)
        data = torch.empty(shape, dtype=first.dtype, device=self._payload_device)
        return BlockBatch(self.ctx.fingerprint, spec.keys, data, self.heads, digest="wsum64")

    def _copied(self) -> None:
        """Host copies from a GPU cache were queued without waiting: wait for them now."""
        first = self.kv_caches[0]
        if first.is_cuda and self._payload_device.type == "cpu":
            torch.cuda.current_stream(first.device).synchronize()

    def start_load_kv(self) -> None:
        meta = self._metadata
        if not meta:
            return
        for rid in meta.cancels:
            load = self._loads.pop(rid, None)
            if load is not None:
                load.abandon()  # its bytes, if they still come, are dropped
            self._sending_done.add(rid)
        for save in meta.saves:
            self._start_save(save)
        for spec in meta.loads:
            load = Load(spec, time.perf_counter())
            load.future = self._pool.submit(self._fetch, load)
            # (once the future is done, so that get_finished, woken by it, sees it done)
            load.future.add_done_callback(self._wake_engine)
            self._loads[spec.req_id] = load

    def _start_save(self, spec: SaveSpec) -> None:
        t0 = time.perf_counter()
        try:
            batch = self._empty_batch(spec)
        except StagingFull as e:
            # Dropped, not staged past the cap: the consumer's load fails and it recomputes.
            logger.warning("KV save of %s dropped: %s", spec.req_id, e)
            with self._stats_lock:
                self.stats["dropped_saves"] += 1
            self._sending_done.add(spec.req_id)  # nothing copies its blocks: free to go
            return
        idx = block_index(spec.block_ids, self.kv_caches[0].device)
        if spec.layerwise:  # filled by save_kv_layer as this step's forward goes
            self._layer_saves.append(_LayerSave(spec, batch, idx, set(), t0))
            return
        if self._copy_off_engine_thread:
            self._track_export(spec.req_id, self._copy_pool.submit(self._copy_out, spec, batch, idx, t0))
            return
        for layer, kv in enumerate(self.kv_caches):
            gather_layer(kv, idx, batch.data, layer)
        self._copied()
        # Copied out: the scheduler may reuse the blocks after this step.
        self._sending_done.add(spec.req_id)
        self._track_export(spec.req_id, self._pool.submit(self._export, spec, batch, t0))

    def _wake_engine(self, _future: Optional[cf.Future[Any]] = None) -> None:
        self.wakeup()

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, attn_metadata: object) -> None:
        for save in self._layer_saves:
            gather_layer(kv_layer, save.idx, save.batch.data, layer)
            save.done.add(layer)

    def wait_for_save(self) -> None:
        """The forward is over: complete this step's layer-wise saves and export them (a layer
        the model did not report, e.g. a step without a forward, is copied now)."""
        if not self._layer_saves:
            return
        saves, self._layer_saves = self._layer_saves, []
        for save in saves:
            for layer, kv in enumerate(self.kv_caches):
                if layer not in save.done:
                    gather_layer(kv, save.idx, save.batch.data, layer)
        self._copied()
        for save in saves:
            self._track_export(save.spec.req_id, self._pool.submit(self._export, save.spec, save.batch, save.t0))

    def _copy_out(self, spec: SaveSpec, batch: BlockBatch, idx: BlockIndex, t0: float) -> None:
        """On the copy-out thread: the request's blocks into `batch` (nobody writes them: the
        request has finished and its blocks stay allocated until reported), then the export
        goes to the transfer pool. The blocks are reported free whatever happens."""
        if self.transport.streams:
            self._stream_out(spec, batch, idx, t0)
            return
        try:
            n = len(spec.block_ids)
            # Chunk by chunk (a host batch: xxh3), each chunk's digests computed on the digest
            # thread while the next one is gathered (the export's header carries them).
            digests = DigestsBehind(batch.data)
            for s, e in plan_chunks(n, batch.nbytes // max(1, n), self._chunk_bytes):
                out, part = batch.data[s:e], idx[s:e]
                for layer, kv in enumerate(self.kv_caches):
                    gather_layer(kv, part, out, layer)
                digests.add(s, e)
            batch.digests = digests.result()
        except BaseException:
            batch.release()
            raise
        finally:
            self._copied_out.put(spec.req_id)
            self.wakeup()
        # (tracked before this copy-out's own future is done: the save never looks finished)
        self._track_export(spec.req_id, self._pool.submit(self._export, spec, batch, t0))

    def _stream_out(self, spec: SaveSpec, batch: BlockBatch, idx: BlockIndex, t0: float) -> None:
        """`_copy_out` for a streaming transport: exported first, then gathered chunk by chunk
        (each chunk's digests computed while its bytes are still in the CPU's caches), so a
        consumer already pulling gets each chunk as soon as it is ready."""
        n = len(spec.block_ids)
        batch.progress = progress = ExportProgress(plan_chunks(n, batch.nbytes // max(1, n), self._chunk_bytes))
        batch.digests = digests = [0] * n
        try:
            try:
                self.transport.export(spec, batch)
            except BaseException as err:
                progress.fail(err)
                batch.release()
                raise
            try:
                for lo, hi in progress.chunks:
                    out, part = batch.data[lo:hi], idx[lo:hi]
                    for layer, kv in enumerate(self.kv_caches):
                        gather_layer(kv, part, out, layer)
                    digests[lo:hi] = host_digests(out.view(torch.uint8).numpy(), hi - lo)
                    progress.advance()
            except BaseException as err:
                progress.fail(err)  # a sender stops at the failed chunk; the transport releases the batch
                raise
        finally:
            self._copied_out.put(spec.req_id)
            self.wakeup()
        with self._stats_lock:
            self.stats["bytes_sent"].append(batch.nbytes)
            self.stats["seconds_sent"].append(time.perf_counter() - t0)

    def _track_export(self, req_id: str, fut: cf.Future[None]) -> None:
        with self._exports_lock:
            self._exports.append((req_id, fut))
        # An idle engine steps while saves are in flight: wake it when this one ends.
        fut.add_done_callback(self._wake_engine)

    def num_saves_in_flight(self) -> int:
        """Saves being copied out or exported (one per request, however many futures)."""
        with self._exports_lock:
            return len({rid for rid, f in self._exports if not f.done()})

    def _export(self, spec: SaveSpec, batch: BlockBatch, t0: float) -> None:
        nbytes = batch.nbytes
        try:
            self.transport.export(spec, batch)
        finally:
            if not self.transport.keeps_batch:
                batch.release()
        with self._stats_lock:  # a transfer thread: take_stats may be swapping the dict
            self.stats["bytes_sent"].append(nbytes)
            self.stats["seconds_sent"].append(time.perf_counter() - t0)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        recving: set[str] = set()
        now = time.time()
        for rid, load in list(self._loads.items()):
            if load.done():
                del self._loads[rid]
                recving.add(rid)
                self._promote(load)
            elif now > load.spec.deadline:
                # Failed whole, even if its write was under way (abandon() waits for it): the
                # scheduler recomputes into these blocks.
                load.abandon()
                del self._loads[rid]
                recving.add(rid)
                self._invalid.update(load.spec.block_ids)
                self.stats["expired_loads"] += 1
                logger.warning("KV load of %s (transfer %s) missed its deadline", rid, load.spec.transfer_id)
        self._reap_exports()
        while True:
            try:
                self._sending_done.add(self._copied_out.get_nowait())
            except queue.Empty:
                break
        sending, self._sending_done = self._sending_done, set()
        return sending, recving

    def _fetch(self, load: Load) -> Fetched:
        """On a transfer thread: fetch the blocks, check them against the consumer's own keys
        and, for a CPU cache, write the good prefix into the blocks unless the load was given
        up meanwhile."""
        spec = load.spec
        if self.transport.fetches_chunks and self._copy_off_engine_thread:
            sink = Sink(self.cache, load)
            try:
                batch = self.transport.fetch(spec, sink)
            except KVFormatError:
                self._confirm(spec)  # refused: its producer need not keep it for us
                raise
            if sink.used:  # checked and written chunk by chunk as it came
                batch.release()
                self._confirm(spec)
                return sink.fetched()
        else:
            batch = self.transport.fetch(spec)
        try:
            offset, good = self.cache.check_batch(spec, batch)
        except BaseException:
            batch.release()
            self._confirm(spec)
            raise
        if not (good and self._copy_off_engine_thread):
            return Fetched(batch, offset, good, 0)  # written (or refused) in get_finished
        try:
            with load.lock:
                written = 0 if load.abandoned else self._write(spec, batch, offset, good)
        finally:
            batch.release()  # its bytes are in the cache (or dropped)
            self._confirm(spec)
        return Fetched(None, offset, good, written)

    def _write(self, spec: LoadSpec, batch: BlockBatch, offset: int, good: int) -> int:
        """Blocks offset..offset+good-1 of `batch` (this rank's heads) into the spec's first
        `good` blocks; returns the bytes written."""
        return self.cache.write(spec.block_ids[:good], batch.data[offset : offset + good], batch.heads)

    def _promote(self, load: Load) -> None:
        """Account for a finished load (and write it, where the transfer thread did not)."""
        spec = load.spec
        fetched = None
        try:
            fetched = load.result()
            good = fetched.good
        except (TransferError, KVFormatError, OSError, ValueError) as e:
            logger.warning("KV load of %s (transfer %s) failed: %s", spec.req_id, spec.transfer_id, e)
            good = 0
        except Exception:  # noqa: BLE001 - a transport bug must fail the load, not the engine
            logger.exception("KV load of %s failed unexpectedly", spec.req_id)
            good = 0
        if fetched is not None and fetched.batch is not None:  # not written on the transfer thread
            nbytes = self._write(spec, fetched.batch, fetched.offset, good) if good else 0
            fetched.batch.release()  # its bytes are in the cache (or refused)
            self._pool.submit(self._confirm, spec)
        else:
            nbytes = fetched.written if fetched is not None else 0
        if good:
            self.stats["bytes_recv"].append(nbytes)
            self.stats["seconds_recv"].append(time.perf_counter() - load.t0)
        if good < len(spec.block_ids):
            self._invalid.update(spec.block_ids[good:])
            self.stats["failed_loads"] += 1

    def _confirm(self, spec: LoadSpec) -> None:
        try:
            self.transport.confirm(spec)
        except Exception:  # noqa: BLE001 - the producer's lease ends it anyway
            logger.warning("could not confirm transfer %s to its producer", spec.transfer_id)

    def _reap_exports(self) -> None:
        with self._exports_lock:
            done: list[tuple[str, cf.Future[None]]] = []
            still: list[tuple[str, cf.Future[None]]] = []
            for entry in self._exports:
                (done if entry[1].done() else still).append(entry)
            self._exports = still
        failed = 0
        for rid, fut in done:
            if fut.cancelled():
                continue  # counted by shutdown, which cancelled it
            if fut.exception() is not None:
                failed += 1
                logger.warning("KV save of %s dropped: its export failed: %s", rid, fut.exception())
        if failed:
            with self._stats_lock:
                self.stats["dropped_saves"] += failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def take_stats(self) -> Optional[TransferStats]:
        refused = self.staging.num_refused  # saves dropped and loads failed for the staging cap
        with self._stats_lock:
            self.stats["staging_refused"] = refused - self._staging_refused_seen
            self._staging_refused_seen = refused
            out = self.stats
            if not any(out.values()):
                return None
            self.stats = self._new_stats()
        return out

    @staticmethod
    def _new_stats() -> TransferStats:
        return TransferStats(
            bytes_sent=[],
            seconds_sent=[],
            bytes_recv=[],
            seconds_recv=[],
            failed_loads=0,
            expired_loads=0,
            dropped_saves=0,
            staging_refused=0,
        )

    def wait_for_exports(self, timeout: float = 30.0) -> int:
        """Block until every queued export finished (tests, shutdown); returns how many saves
        are still unfinished at the deadline."""
        deadline = time.monotonic() + timeout
        while True:  # a copy-out queues its export when it is done: wait for that one too
            with self._exports_lock:
                pending = [f for _, f in self._exports if not f.done()]
            left = deadline - time.monotonic()
            if not pending or left <= 0:
                break
            cf.wait(pending, timeout=left)
        self._reap_exports()
        return self.num_saves_in_flight()

    def shutdown(self) -> None:
        # The engine waited for its saves already (EngineCore.shutdown: up to kv_save_timeout_s,
        # reporting what it gives up on); a short grace here, not a second deadline.
        left = self.wait_for_exports(SHUTDOWN_GRACE_S)
        if left:
            logger.info("KV connector worker shutting down with %d saves unfinished: dropped", left)
        self._copy_pool.shutdown(wait=False, cancel_futures=True)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.transport.shutdown()
