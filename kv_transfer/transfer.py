"""The halves every connector shares; a connector only supplies its `Transport`.

Scheduler half (`TransferScheduler`): decides what a request loads (from its
`kv_transfer_params`, or by looking its chain keys up when the transport can),
records where (`update_state_after_alloc`), hands the worker loads, saves and
cancels (`build_connector_meta`), keeps a finished request's blocks until the
worker copied them out (`request_finished` -> delay_free), and gives up on a
load whose notice never came (`update_connector_output`, deadline + grace).

Worker half (`TransferWorker`): copies saved blocks out (a CPU cache on its copy-out
thread, the blocks kept allocated until it reports them in `finished_sending`; a GPU
cache from the engine's thread, freed after this step) and exports them in the background;
fetches loads in the background into staging memory, checks every fetched
block's chain key against the consumer's own and writes the good ones into the
cache there too (a CPU cache: the engine's thread never stalls on a big load's
copy; a GPU cache is written from `get_finished`, in its stream's order); with a
streaming transport (P2P) and a CPU cache, an export is handed over before its
copy-out (which then goes chunk by chunk) and a load's chunks are checked and
written as they arrive (`_Sink`), so the copies overlap the transfer; a transport
that `fetches_chunks` (Ray) hands a whole fetched batch to the sink chunk by chunk,
each chunk's check overlapping the write of the one before;
`get_finished` reports them and the rest as failed blocks. A load past its
deadline or cancelled is given up under its lock (a write under way finishes
first), so none of its late bytes land once the scheduler hears of it.
"""

from __future__ import annotations

import abc
import concurrent.futures as cf
import logging
import math
import queue
import threading
import time
from typing import Any, Optional

import torch

from fleetserve.kv_transfer.base import (ConnectorContext, ConnectorMetadata, KVConnectorBase,
                                         KVConnectorRole, KVConnectorWorker, LoadSpec, SaveSpec)
from fleetserve.kv_transfer.blocks import (STREAM_CHUNK_BYTES, BlockBatch, BlockIndex, DigestsBehind,
                                           ExportProgress, KVFormatError, StagingPool, block_index, chain_keys,
                                           gather_layer, host_digests, local_head_range,
                                           plan_chunks, scatter_blocks)
from fleetserve.kv_transfer.config import KVTransferConfig
from fleetserve.scheduler import ModelRunnerOutput, Request, RequestStatus, SchedulerOutput
from fleetserve.scheduler.connector import KVConnectorScheduler

logger = logging.getLogger(__name__)

# The scheduler gives up on a load this long after its deadline if the worker
# never reported it (a lost notice): the worker drops late bytes at the deadline.
NOTICE_GRACE_S = 2.0

# How long a worker half shutting down still waits for its exports (the engine core's flush,
# bounded by kv_save_timeout_s, waited for them first).
SHUTDOWN_GRACE_S = 1.0


def _omp_set_num_threads():
    """OpenMP's omp_set_num_threads as torch loaded it (libgomp, or Intel's/LLVM's), or None."""
    import ctypes

    try:
        return ctypes.CDLL(None).omp_set_num_threads
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if any(n in line for n in ("libgomp", "libiomp", "libomp"))}
    except OSError:
        return None
    for lib in sorted(libs):
        try:
            return ctypes.CDLL(lib).omp_set_num_threads
        except (OSError, AttributeError):
            continue
    return None


def one_core_per_thread() -> None:
    """Thread initializer of the transfer pools: this thread's torch ops (gathers, scatters)
    run on one core. With the engine's intra-op threads (2 here) a copy beside a forward or
    a gloo transfer oversubscribed the cores: a streamed 2k-token P2P hand-off took 52-57 ms
    with two threads per copy, 34-35 ms with one. OpenMP keeps the thread count per thread;
    torch.set_num_threads would change the process-wide default too."""
    torch.get_num_threads()  # torch's own per-thread set-up first: it would undo what follows
    setter = _omp_set_num_threads()
    if setter is not None:
        setter(1)


class TransferError(RuntimeError):
    """A fetch or export failed (missing, late, refused)."""


class Transport(abc.ABC):
    """How one connector moves bytes. Built once per role; fetch/export run on a pool."""

    # The scheduler can find stored blocks by chain key with no params (a prefix cache).
    supports_lookup = False
    # The producer exports every finished request's full blocks, asked or not.
    saves_all = False
    # export() keeps the batch after it returns and releases it itself (BlockBatch.release).
    keeps_batch = False
    # Streams (CPU caches): export() is called before the batch is gathered (its `progress`
    # says which chunks are ready; their digests are set as they are), and fetch(spec, sink)
    # hands each chunk to `sink` as it arrives and is verified (see _Sink), so copies out of
    # and into the caches overlap the transport.
    streams = False
    # fetch(spec, sink) hands a load's blocks to `sink` chunk by chunk, each verified just
    # before it is written (every streaming transport does): the check overlaps the writes.
    fetches_chunks = False

    def __init__(self, config: KVTransferConfig, ctx: ConnectorContext, role: KVConnectorRole) -> None:
        self.config = config
        self.ctx = ctx
        self.role = role
        self.kv_caches: list = []
        self.staging: Optional[StagingPool] = None

    def location(self, transfer_id: str) -> dict[str, Any]:
        """Extra `remote_*` params a consumer needs to find this producer's blocks."""
        return {}

    def payload_device(self, cache_device) -> Any:
        """Where exported blocks are gathered: the host, unless the transport sends
        straight from the cache's device (NCCL)."""
        return "cpu"

    def register_kv_caches(self, kv_caches: list, staging: StagingPool) -> None:
        """The worker's caches are known: fetches may stage into `staging` from now on."""
        self.kv_caches = kv_caches
        self.staging = staging

    def block_shape(self, num_blocks: int, heads: tuple[int, int]) -> tuple[int, ...]:
        """[n, layers, 2, heads, block_size, head_dim] of `num_blocks` blocks of `heads`."""
        return (num_blocks, self.ctx.num_layers, 2, heads[1] - heads[0], self.ctx.block_size,
                self.ctx.head_dim)

    @abc.abstractmethod
    def export(self, spec: SaveSpec, batch: BlockBatch) -> None: ...

    @abc.abstractmethod
    def fetch(self, spec: LoadSpec) -> BlockBatch:
        """The blocks of `spec` (keys in order; fewer is fine), by spec.deadline or raise.
        A streaming transport takes a second argument, the load's `_Sink` (or None)."""

    def confirm(self, spec: LoadSpec) -> None:
        """The consumer has what it needs: the producer may release it."""

    def lookup(self, keys: list[str]) -> int:
        """How many of `keys`, from the first, can be fetched now."""
        return 0

    def shutdown(self) -> None:
        return None


class TransferScheduler(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig, ctx: ConnectorContext, transport: Transport) -> None:
        self.config = config
        self.ctx = ctx
        self.transport = transport
        self._meta = ConnectorMetadata()
        self._loading: dict[str, LoadSpec] = {}  # req_id -> its load, until the worker reports
        self._saving: set[str] = set()
        # Loads that finished: a hand-off is read once (a preempted request recomputes;
        # the producer may have released its copy on our confirmation).
        self._loaded: set[str] = set()
        self._keys: dict[str, tuple[int, list[str]]] = {}  # req_id -> (num tokens, keys) memo
        self.num_expired_loads = 0
        # Layer-wise saves (kv_connector_extra_config.layerwise_save): a hand-off is copied
        # out during the forward that computes the end of its prompt (save_kv_layer).
        self.layerwise = config.is_producer and bool(
            config.kv_connector_extra_config.get("layerwise_save", False))
        self._track: dict[str, tuple[Request, list[int]]] = {}  # req_id -> (request, block ids)
        self._layer_saved: dict[str, dict] = {}  # req_id -> the params it finishes with

    # ---- helpers --------------------------------------------------------------
    def _chain_keys(self, request: Request, num_blocks: int) -> list[str]:
        memo = self._keys.get(request.request_id)
        if memo is None or memo[0] != request.num_tokens or len(memo[1]) < num_blocks:
            keys = chain_keys(self.ctx.fingerprint, request.all_token_ids, self.ctx.block_size,
                              request.num_tokens // self.ctx.block_size, request.cache_salt)
            memo = (request.num_tokens, keys)
            self._keys[request.request_id] = memo
        return memo[1][:num_blocks]

    @staticmethod
    def _params(request: Request) -> dict[str, Any]:
        return request.kv_transfer_params or {}

    # ---- the contract -----------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        if self.layerwise and self._params(request).get("do_remote_decode") \
                and request.request_id not in self._layer_saved:
            self._track.setdefault(request.request_id, (request, []))
        if not self.config.is_consumer or request.request_id in self._loaded:
            return 0, False
        bs = self.ctx.block_size
        params = self._params(request)
        full = request.num_tokens // bs * bs
        if params.get("do_remote_prefill"):
            if params.get("remote_block_size", bs) != bs:
                logger.warning("request %s: remote block size %s != %d; computing locally",
                               request.request_id, params.get("remote_block_size"), bs)
                return 0, False
            avail = min(int(params.get("remote_num_tokens", 0)) // bs * bs, full)
        elif self.transport.supports_lookup:
            keys = self._chain_keys(request, full // bs)
            first = num_computed_tokens // bs
            avail = (first + self.transport.lookup(keys[first:])) * bs
        else:
            return 0, False
        # Never the last token: it is computed here for the first logits.
        n = min(avail, request.num_tokens - 1) - num_computed_tokens
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        bs = self.ctx.block_size
        local = request.num_computed_tokens - num_external_tokens
        first, last = local // bs, math.ceil((local + num_external_tokens) / bs)
        params = self._params(request)
        remote = bool(params.get("do_remote_prefill"))
        spec = LoadSpec(request.request_id, params.get("transfer_id") if remote else None,
                        list(block_ids[first:last]), self._chain_keys(request, last)[first:],
                        time.time() + self.config.kv_load_timeout_s,
                        {k: v for k, v in params.items() if k.startswith("remote_")}, first)
        self._meta.loads.append(spec)
        self._loading[request.request_id] = spec

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Optional[ConnectorMetadata]:
        if self._track:
            self._plan_layerwise_saves(scheduler_output)
        meta, self._meta = self._meta, ConnectorMetadata()
        return meta if meta else None

    def _plan_layerwise_saves(self, so: SchedulerOutput) -> None:
        """Follow tracked hand-offs' block tables (as vLLM does: full lists for new requests,
        deltas for cached ones); the step that computes the end of a prompt saves its blocks
        layer by layer during that step's forward."""
        for new in so.scheduled_new_reqs:
            if new.req_id in self._track:
                self._track[new.req_id][1][:] = new.block_ids
        for cached in so.scheduled_cached_reqs:
            if cached.req_id in self._track and cached.new_block_ids:
                self._track[cached.req_id][1].extend(cached.new_block_ids)
        bs = self.ctx.block_size
        for rid, n in so.num_scheduled_tokens.items():
            entry = self._track.get(rid)
            if entry is None:
                continue
            request, block_ids = entry
            end = request.num_computed_tokens  # already advanced by this step's tokens
            if not end - n < request.num_prompt_tokens <= end:
                continue
            del self._track[rid]
            n_full = min(request.num_prompt_tokens // bs, len(block_ids))
            if n_full == 0:
                continue  # nothing to hand over: request_finished says so
            tid = self._params(request).get("transfer_id")
            self._meta.saves.append(SaveSpec(rid, tid, block_ids[:n_full], self._chain_keys(request, n_full),
                                             self.config.kv_lease_s, layerwise=True))
            self._layer_saved[rid] = self._handoff_params(tid, n_full)

    def request_finished(self, request: Request, block_ids: list[int]):
        rid = request.request_id
        self._loaded.discard(rid)
        self._track.pop(rid, None)
        saved = self._layer_saved.pop(rid, None)
        if saved is not None:
            # Copied out during its last prefill step: the blocks are free to go now. (An
            # aborted one's export is never named to anyone; its lease ends it.)
            self._keys.pop(rid, None)
            failed = request.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)
            return False, None if failed else saved
        if rid in self._loading:
            # Finished (aborted) while receiving: the worker drops the load and
            # says so in finished_sending; only then may the blocks be reused.
            del self._loading[rid]
            self._keys.pop(rid, None)
            self._meta.cancels.append(rid)
            return True, None
        spec_params = self._export(request, block_ids)
        self._keys.pop(rid, None)
        if spec_params is None:
            return False, None
        self._saving.add(rid)
        return True, spec_params or None

    def _export(self, request: Request, block_ids: list[int]) -> Optional[dict]:
        """Queue a save of the request's computed full blocks; returns the params for the
        caller ({} for a prefix-cache save), or None when nothing is saved."""
        params = self._params(request)
        remote = bool(params.get("do_remote_decode"))
        if not self.config.is_producer or not (remote or self.transport.saves_all) \
                or request.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
            return None
        bs = self.ctx.block_size
        n_full = min(request.num_computed_tokens, request.num_tokens, len(block_ids) * bs) // bs
        if remote:
            n_full = min(n_full, request.num_prompt_tokens // bs)
        keys = self._chain_keys(request, n_full)
        # A prefix-cache save skips what the store already holds.
        start = 0 if remote else self.transport.lookup(keys)
        if n_full <= start:
            return None
        tid = params.get("transfer_id") if remote else None
        self._meta.saves.append(SaveSpec(request.request_id, tid, list(block_ids[start:n_full]),
                                         keys[start:], self.config.kv_lease_s))
        return self._handoff_params(tid, n_full) if remote else {}

    def _handoff_params(self, tid: str, n_full: int) -> dict:
        """What the consumer needs to find the producer's `n_full` exported blocks."""
        bs = self.ctx.block_size
        return {"do_remote_prefill": True, "transfer_id": tid,
                "remote_engine_id": self.ctx.engine_id,
                "remote_connector": self.config.kv_connector,
                "remote_num_tokens": n_full * bs, "remote_block_size": bs,
                "remote_tp_size": self.ctx.tp_size, "remote_lease_s": self.config.kv_lease_s,
                **self.transport.location(tid)}

    def update_connector_output(self, runner_output: ModelRunnerOutput) -> None:
        for rid in runner_output.finished_recving:
            if self._loading.pop(rid, None) is not None:
                self._loaded.add(rid)
        for rid in runner_output.finished_sending:
            self._saving.discard(rid)
        now = time.time()
        for rid, spec in list(self._loading.items()):
            if now > spec.deadline + NOTICE_GRACE_S:
                # The worker failed it at the deadline but its notice never came:
                # fail every block (the worker writes nothing after the deadline).
                logger.warning("KV load of %s: no word from the worker %.1f s after its "
                               "deadline; failing its blocks", rid, NOTICE_GRACE_S)
                del self._loading[rid]
                self._loaded.add(rid)
                self._meta.cancels.append(rid)
                self.num_expired_loads += 1
                runner_output.finished_recving.add(rid)
                runner_output.invalid_block_ids.update(spec.block_ids)

    def has_pending_work(self) -> bool:
        """Saves, loads or cancels queued for the next step's metadata."""
        return bool(self._meta)

    def num_pending_saves(self) -> int:
        return len(self._meta.saves)

    def load_failure_policy(self, request: Request) -> str:
        if self._params(request).get("do_remote_prefill"):
            return self.config.kv_load_failure_policy
        return "recompute"  # an opportunistic prefix-cache hit: just compute it

    def take_stats(self) -> Optional[dict]:
        """Scheduler-side counts: loads it gave up on (no notice by deadline + grace)."""
        n, self.num_expired_loads = self.num_expired_loads, 0
        return {"expired_loads": n} if n else None

    def shutdown(self) -> None:
        self.transport.shutdown()


class _Load:
    """One load in flight on the worker: fetched, checked and (CPU caches) written into its
    blocks on a transfer thread. `lock` orders that write against giving the load up (its
    deadline passed, or the scheduler cancelled it): once `abandoned` is set under the lock,
    no byte of it lands in the cache any more, so the scheduler may reuse its blocks."""

    __slots__ = ("spec", "t0", "lock", "abandoned", "future")

    def __init__(self, spec: LoadSpec, t0: float) -> None:
        self.spec, self.t0 = spec, t0
        self.lock = threading.Lock()
        self.abandoned = False
        self.future: Optional[cf.Future] = None

    def abandon(self) -> None:
        """Waits for a write in progress (a few ms) and forbids the rest."""
        with self.lock:
            self.abandoned = True


class _Fetched:
    """What a load's transfer thread hands to `get_finished`."""

    __slots__ = ("batch", "offset", "good", "written")

    def __init__(self, batch: Optional[BlockBatch], offset: int, good: int, written: int) -> None:
        self.batch, self.offset, self.good, self.written = batch, offset, good, written


class _Sink:
    """Where a streaming transport delivers a load's chunks as they arrive (CPU caches, on the
    load's transfer thread): `begin` checks the batch's header against the request (as
    `TransferWorker._check` does a whole batch), `write` puts a chunk's verified blocks into
    the cache under the load's lock (nothing once the load was given up). Blocks are written
    in order; a block that failed its digest ends the good prefix there."""

    def __init__(self, worker: "TransferWorker", load: _Load) -> None:
        self.worker, self.load = worker, load
        self.used = False
        self.offset = self.good = self.written = 0
        self.heads = (0, 0)

    def begin(self, fingerprint: str, keys: list[str], heads: tuple[int, int], shape, dtype) -> None:
        """Raises KVFormatError if the batch cannot be this load's."""
        self.offset, self.good = self.worker._check_meta(self.load.spec, fingerprint, keys, heads, shape, dtype)
        self.heads = heads
        self.used = True

    def wanted(self) -> int:
        """How many of the batch's blocks, from the first, this load can still use."""
        return self.offset + self.good

    def write(self, start: int, data: torch.Tensor, n_ok: int) -> None:
        """Blocks start.. of the batch (`data`: [k, layers, 2, heads, bs, hd]), the first
        `n_ok` of them verified."""
        if n_ok < data.shape[0]:
            self.good = max(0, min(self.good, start + n_ok - self.offset))
        lo, hi = max(start, self.offset), min(start + n_ok, self.offset + self.good)
        if lo >= hi:
            return
        ids = self.load.spec.block_ids[lo - self.offset:hi - self.offset]
        with self.load.lock:
            if not self.load.abandoned:
                self.written += self.worker._write_blocks(ids, data[lo - start:hi - start], self.heads)


class TransferWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, ctx: ConnectorContext, transport: Transport,
                 max_workers: int = 4) -> None:
        self.config = config
        self.ctx = ctx
        self.transport = transport
        self.heads = local_head_range(ctx.num_kv_heads, ctx.tp_size, ctx.tp_rank)
        self.kv_caches: list = []
        self.uses_layer_hooks = config.is_producer and bool(
            config.kv_connector_extra_config.get("layerwise_save", False))
        self.staging = StagingPool(int(config.kv_connector_extra_config.get("staging_max_bytes", 1 << 30)))
        self._payload_device = torch.device("cpu")
        self._metadata: Optional[ConnectorMetadata] = None
        self._pool = cf.ThreadPoolExecutor(max_workers, thread_name_prefix="kv-transfer",
                                           initializer=one_core_per_thread)
        self._loads: dict[str, _Load] = {}
        # A CPU cache is copied off the engine's thread (a 2k-token SmolLM2 prompt is 90 MiB:
        # ~7 ms a step stalled): a load's blocks are written on its transfer thread, not in
        # get_finished; a finished request's blocks are copied out on `_copy_pool` (they stay
        # allocated until the copy is done: reported then in finished_sending), then exported
        # on `_pool`. A GPU cache is copied from the engine's thread, in its stream's order.
        self._copy_off_engine_thread = False
        self._chunk_bytes = int(config.kv_connector_extra_config.get("stream_chunk_bytes", STREAM_CHUNK_BYTES))
        self._copy_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="kv-copy-out",
                                                initializer=one_core_per_thread)
        self._copied_out: "queue.SimpleQueue[str]" = queue.SimpleQueue()
        # (request id, future) of every copy-out and export not reaped yet.
        self._exports: list[tuple[str, cf.Future]] = []
        self._exports_lock = threading.Lock()
        # Layer-wise saves of this step: (spec, batch being filled, block index, layers done, t0).
        self._layer_saves: list[tuple[SaveSpec, BlockBatch, BlockIndex, set[int], float]] = []
        self._sending_done: set[str] = set()
        self._invalid: set[int] = set()
        self.stats = self._new_stats()
        # Exports record their sends from transfer threads; the engine's thread takes the dict.
        self._stats_lock = threading.Lock()

    def register_kv_caches(self, kv_caches: list) -> None:
        self.kv_caches = kv_caches
        device = kv_caches[0].device
        self.staging.pin_memory = device.type == "cuda"
        self._payload_device = torch.device(self.transport.payload_device(device))
        self._copy_off_engine_thread = device.type == "cpu"
        self.transport.register_kv_caches(kv_caches, self.staging)

    def _empty_batch(self, spec: SaveSpec) -> BlockBatch:
        """Room for `spec`'s blocks: a pooled host buffer, or device memory when the transport
        sends from the device (checked there with wsum64 digests)."""
        first = self.kv_caches[0]
        shape = (len(spec.block_ids), len(self.kv_caches), first.shape[0], first.shape[1],
                 first.shape[3], first.shape[4])
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
        for spec in meta.saves:
            t0 = time.perf_counter()
            batch = self._empty_batch(spec)
            idx = block_index(spec.block_ids, self.kv_caches[0].device)
            if spec.layerwise:  # filled by save_kv_layer as this step's forward goes
                self._layer_saves.append((spec, batch, idx, set(), t0))
                continue
            if self._copy_off_engine_thread:
                self._track_export(spec.req_id, self._copy_pool.submit(self._copy_out, spec, batch, idx, t0))
                continue
            for layer, kv in enumerate(self.kv_caches):
                gather_layer(kv, idx, batch.data, layer)
            self._copied()
            # Copied out: the scheduler may reuse the blocks after this step.
            self._sending_done.add(spec.req_id)
            self._track_export(spec.req_id, self._pool.submit(self._export, spec, batch, t0))
        for spec in meta.loads:
            load = _Load(spec, time.perf_counter())
            load.future = self._pool.submit(self._fetch, load)
            # (once the future is done, so that get_finished, woken by it, sees it done)
            load.future.add_done_callback(self._wake_engine)
            self._loads[spec.req_id] = load

    def _wake_engine(self, _future=None) -> None:
        self.wakeup()

    def save_kv_layer(self, layer: int, kv_layer, attn_metadata) -> None:
        for _, batch, idx, done, _ in self._layer_saves:
            gather_layer(kv_layer, idx, batch.data, layer)
            done.add(layer)

    def wait_for_save(self) -> None:
        """The forward is over: complete this step's layer-wise saves and export them (a layer
        the model did not report, e.g. a step without a forward, is copied now)."""
        if not self._layer_saves:
            return
        saves, self._layer_saves = self._layer_saves, []
        for spec, batch, idx, done, t0 in saves:
            for layer, kv in enumerate(self.kv_caches):
                if layer not in done:
                    gather_layer(kv, idx, batch.data, layer)
        self._copied()
        for spec, batch, _, _, t0 in saves:
            self._track_export(spec.req_id, self._pool.submit(self._export, spec, batch, t0))

    def _copy_out(self, spec: SaveSpec, batch: BlockBatch, idx: BlockIndex, t0: float) -> None:
        """On the copy-out thread: the request's blocks into `batch` (nobody writes them: the
        request has finished and its blocks stay allocated until reported), then the export
        goes to the transfer pool. The blocks are reported free whatever happens."""
        if self.transport.streams:
            return self._stream_out(spec, batch, idx, t0)
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
        batch.digests = [0] * n
        try:
            try:
                self.transport.export(spec, batch)
            except BaseException as e:
                progress.fail(e)
                batch.release()
                raise
            try:
                for s, e in progress.chunks:
                    out, part = batch.data[s:e], idx[s:e]
                    for layer, kv in enumerate(self.kv_caches):
                        gather_layer(kv, part, out, layer)
                    batch.digests[s:e] = host_digests(out.view(torch.uint8).numpy(), e - s)
                    progress.advance()
            except BaseException as e:
                progress.fail(e)  # a sender stops at the failed chunk; the transport releases the batch
                raise
        finally:
            self._copied_out.put(spec.req_id)
            self.wakeup()
        with self._stats_lock:
            self.stats["bytes_sent"].append(batch.nbytes)
            self.stats["seconds_sent"].append(time.perf_counter() - t0)

    def _track_export(self, req_id: str, fut: cf.Future) -> None:
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
            if load.future.done():
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

    def _fetch(self, load: _Load) -> _Fetched:
        """On a transfer thread: fetch the blocks, check them against the consumer's own keys
        and, for a CPU cache, write the good prefix into the blocks unless the load was given
        up meanwhile."""
        spec = load.spec
        if self.transport.fetches_chunks and self._copy_off_engine_thread:
            sink = _Sink(self, load)
            try:
                batch = self.transport.fetch(spec, sink)
            except KVFormatError:
                self._confirm(spec)  # refused: its producer need not keep it for us
                raise
            if sink.used:  # checked and written chunk by chunk as it came
                batch.release()
                self._confirm(spec)
                return _Fetched(None, sink.offset, sink.good, sink.written)
        else:
            batch = self.transport.fetch(spec)
        try:
            offset, good = self._check(spec, batch)
        except BaseException:
            batch.release()
            self._confirm(spec)
            raise
        if not (good and self._copy_off_engine_thread):
            return _Fetched(batch, offset, good, 0)  # written (or refused) in get_finished
        try:
            with load.lock:
                written = 0 if load.abandoned else self._write(spec, batch, offset, good)
        finally:
            batch.release()  # its bytes are in the cache (or dropped)
            self._confirm(spec)
        return _Fetched(None, offset, good, written)

    def _write(self, spec: LoadSpec, batch: BlockBatch, offset: int, good: int) -> int:
        """Blocks offset..offset+good-1 of `batch` (this rank's heads) into the spec's first
        `good` blocks; returns the bytes written."""
        return self._write_blocks(spec.block_ids[:good], batch.data[offset:offset + good], batch.heads)

    def _write_blocks(self, block_ids: list[int], data: torch.Tensor, heads: tuple[int, int]) -> int:
        """`data` (blocks of KV heads `heads`) into `block_ids`, this rank's heads only."""
        h0 = self.heads[0] - heads[0]
        data = data[:, :, :, h0:h0 + self.heads[1] - self.heads[0]]
        scatter_blocks(self.kv_caches, block_ids, data)
        return data.numel() * data.element_size()

    def _promote(self, load: _Load) -> None:
        """Account for a finished load (and write it, where the transfer thread did not)."""
        spec = load.spec
        fetched = None
        try:
            fetched = load.future.result()
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

    def _check(self, spec: LoadSpec, batch: BlockBatch) -> tuple[int, int]:
        """(offset, n): blocks offset..offset+n-1 of `batch` are exactly the first n that `spec`
        asked for. A hand-off's batch holds the prompt from block 0 and the spec may start
        later (this engine caches a prefix of the prompt): then offset is spec.first_block."""
        return self._check_meta(spec, batch.fingerprint, batch.keys, batch.heads, batch.data.shape,
                                batch.data.dtype)

    def _check_meta(self, spec: LoadSpec, fingerprint: str, keys: list[str], heads: tuple[int, int],
                    shape, dtype: torch.dtype) -> tuple[int, int]:
        """`_check` from what a batch's header says (a streamed batch, before its bytes)."""
        if fingerprint != self.ctx.fingerprint:
            raise KVFormatError("fingerprint mismatch")
        if not (heads[0] <= self.heads[0] and self.heads[1] <= heads[1]):
            raise KVFormatError(f"blocks hold KV heads {heads}, this rank needs {self.heads}")
        want = self.kv_caches[0].shape
        _, layers, two, _, bs, hd = shape
        if (layers, two, bs, hd) != (len(self.kv_caches), want[0], want[3], want[4]) \
                or dtype != self.kv_caches[0].dtype:
            raise KVFormatError(f"block shape {tuple(shape)} does not fit this cache")
        offset = 0
        if spec.keys and spec.first_block and len(keys) > spec.first_block \
                and keys[spec.first_block] == spec.keys[0]:
            offset = spec.first_block  # chain keys: a match there vouches for every block before
        good = 0
        for got, expected in zip(keys[offset:], spec.keys):
            if got != expected:
                break
            good += 1
        if good < min(len(keys) - offset, len(spec.keys)):
            logger.warning("KV load of %s: block %d's chain key differs from the prompt's "
                           "(stale or foreign KV); refused from there", spec.req_id, offset + good)
        return offset, good

    def _reap_exports(self) -> None:
        with self._exports_lock:
            done, still = [], []
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

    def take_stats(self) -> Optional[dict]:
        with self._stats_lock:
            out = self.stats
            if not any(out.values()):
                return None
            self.stats = self._new_stats()
        return out

    @staticmethod
    def _new_stats() -> dict:
        return {"bytes_sent": [], "seconds_sent": [], "bytes_recv": [], "seconds_recv": [],
                "failed_loads": 0, "expired_loads": 0, "dropped_saves": 0}

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


class TransferConnector(KVConnectorBase):
    """A connector made of the shared halves and a `transport_cls`."""

    transport_cls: type = None  # type: ignore[assignment]

    def build_half(self, role: KVConnectorRole):
        transport = self.transport_cls(self.config, self.ctx, role)
        if role is KVConnectorRole.SCHEDULER:
            return TransferScheduler(self.config, self.ctx, transport)
        return TransferWorker(self.config, self.ctx, transport)
