"""The scheduler half every connector shares (`TransferScheduler`), in the EngineCore.

It decides what a request loads (from its `kv_transfer_params`, or by looking its chain keys
up when the transport can), records where (`update_state_after_alloc`), hands the worker
loads, saves and cancels (`build_connector_meta`), keeps a finished request's blocks until
the worker copied them out (`request_finished` -> delay_free), and gives up on a load whose
notice never came (`update_connector_output`, deadline + grace). A P/D hand-off with
`layerwise_save` is saved during the forward that computes the end of its prompt instead.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from fleetserve.kv_transfer.base import ConnectorContext, ConnectorMetadata, LoadSpec, SaveSpec, TransferStats
from fleetserve.kv_transfer.config import KVTransferConfig
from fleetserve.kv_transfer.keys import chain_keys
from fleetserve.scheduler import ModelRunnerOutput, Request, RequestStatus, SchedulerOutput
from fleetserve.scheduler.connector import KVConnectorScheduler

if TYPE_CHECKING:  # (the transports import torch; this half runs without it: fleetserve.sim)
    from fleetserve.kv_transfer.transport import Transport

logger = logging.getLogger(__name__)

# The scheduler gives up on a load this long after its deadline if the worker
# never reported it (a lost notice): the worker drops late bytes at the deadline.
NOTICE_GRACE_S = 2.0


class TransferScheduler(KVConnectorScheduler):
    def __init__(
        self,
        config: KVTransferConfig,
        ctx: ConnectorContext,
        transport: Transport,
        clock: Optional[Callable[[], float]] = None,
    ) -> None:
        # `clock`: what load deadlines are measured in; None: time.time() (the worker ranks,
        # maybe in other processes, read them). The simulator passes its virtual clock.
        self.config = config
        self.ctx = ctx
        self.transport = transport
        self._clock = clock
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
        self.layerwise = config.is_producer and bool(config.kv_connector_extra_config.get("layerwise_save", False))
        self._track: dict[str, tuple[Request, list[int]]] = {}  # req_id -> (request, block ids)
        self._layer_saved: dict[str, dict[str, Any]] = {}  # req_id -> the params it finishes with

    # ---- helpers --------------------------------------------------------------
    def _now(self) -> float:
        return time.time() if self._clock is None else self._clock()

    def _chain_keys(self, request: Request, num_blocks: int) -> list[str]:
        memo = self._keys.get(request.request_id)
        if memo is None or memo[0] != request.num_tokens or len(memo[1]) < num_blocks:
            keys = chain_keys(
                self.ctx.fingerprint,
                request.all_token_ids,
                self.ctx.block_size,
                request.num_tokens // self.ctx.block_size,
                request.cache_salt,
            )
            memo = (request.num_tokens, keys)
            self._keys[request.request_id] = memo
        return memo[1][:num_blocks]

    @staticmethod
    def _params(request: Request) -> dict[str, Any]:
        return request.kv_transfer_params or {}

    # ---- the contract -----------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        if (
            self.layerwise
            and self._params(request).get("do_remote_decode")
            and request.request_id not in self._layer_saved
        ):
            self._track.setdefault(request.request_id, (request, []))
        if not self.config.is_consumer or request.request_id in self._loaded:
            return 0, False
        bs = self.ctx.block_size
        params = self._params(request)
        full = request.num_tokens // bs * bs
        if params.get("do_remote_prefill"):
            if params.get("remote_block_size", bs) != bs:
                logger.warning(
                    "request %s: remote block size %s != %d; computing locally",
                    request.request_id,
                    params.get("remote_block_size"),
                    bs,
                )
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

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        bs = self.ctx.block_size
        local = request.num_computed_tokens - num_external_tokens
        first, last = local // bs, math.ceil((local + num_external_tokens) / bs)
        params = self._params(request)
        remote = bool(params.get("do_remote_prefill"))
        spec = LoadSpec(
            request.request_id,
            params.get("transfer_id") if remote else None,
            list(block_ids[first:last]),
            self._chain_keys(request, last)[first:],
            self._now() + self.config.kv_load_timeout_s,
            {k: v for k, v in params.items() if k.startswith("remote_")},
            first,
        )
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
            self._meta.saves.append(
                SaveSpec(
                    rid,
                    tid,
                    block_ids[:n_full],
                    self._chain_keys(request, n_full),
                    self.config.kv_lease_s,
                    layerwise=True,
                )
            )
            self._layer_saved[rid] = self._handoff_params(tid, n_full)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
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

    def _export(self, request: Request, block_ids: list[int]) -> Optional[dict[str, Any]]:
        """Queue a save of the request's computed full blocks; returns the params for the
        caller ({} for a prefix-cache save), or None when nothing is saved."""
        params = self._params(request)
        remote = bool(params.get("do_remote_decode"))
        if (
            not self.config.is_producer
            or not (remote or self.transport.saves_all)
            or request.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)
        ):
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
        self._meta.saves.append(
            SaveSpec(request.request_id, tid, list(block_ids[start:n_full]), keys[start:], self.config.kv_lease_s)
        )
        return self._handoff_params(tid, n_full) if remote else {}

    def _handoff_params(self, tid: Optional[str], n_full: int) -> dict[str, Any]:
        """What the consumer needs to find the producer's `n_full` exported blocks."""
        bs = self.ctx.block_size
        return {
            "do_remote_prefill": True,
            "transfer_id": tid,
            "remote_engine_id": self.ctx.engine_id,
            "remote_connector": self.config.kv_connector,
            "remote_num_tokens": n_full * bs,
            "remote_block_size": bs,
            "remote_tp_size": self.ctx.tp_size,
            "remote_lease_s": self.config.kv_lease_s,
            **self.transport.location(tid),
        }

    def update_connector_output(self, runner_output: ModelRunnerOutput) -> None:
        for rid in runner_output.finished_recving:
            if self._loading.pop(rid, None) is not None:
                self._loaded.add(rid)
        for rid in runner_output.finished_sending:
            self._saving.discard(rid)
        now = self._now()
        for rid, spec in list(self._loading.items()):
            if now > spec.deadline + NOTICE_GRACE_S:
                # The worker failed it at the deadline but its notice never came:
                # fail every block (the worker writes nothing after the deadline).
                logger.warning(
                    "KV load of %s: no word from the worker %.1f s after its deadline; failing its blocks",
                    rid,
                    NOTICE_GRACE_S,
                )
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

    def take_stats(self) -> Optional[TransferStats]:
        """Scheduler-side counts: loads it gave up on (no notice by deadline + grace)."""
        n, self.num_expired_loads = self.num_expired_loads, 0
        return TransferStats(expired_loads=n) if n else None

    def shutdown(self) -> None:
        self.transport.shutdown()
