"""The per-step scheduler: who runs now, for how many tokens, and where the KV goes.

There is no prefill phase and no decode phase. Each request has
`num_computed_tokens` and `num_tokens`; every step hands out a token budget
(`max_num_batched_tokens`) so that computed catches up with the total. That
one rule covers prefill, chunked prefill, prefix-cache continuations, decode
and recompute after preemption.

    schedule():
      1. running first: each gets min(gap, threshold, budget, room to
         max_model_len) tokens; when the pool is full, preempt (the victim
         goes to the front of waiting) and retry; a request that would have to
         preempt itself ends the pass.
      2. waiting next, only if nothing was preempted this step and fewer than
         max_num_seqs run: prefix-cache and connector hits first, then
         allocation; asynchronous KV loads park in WAITING_FOR_REMOTE_KVS.
      3. build the SchedulerOutput (new requests in full, known ones as
         diffs) and advance num_computed_tokens optimistically.

    update_from_output(): append sampled tokens, apply stop conditions, free
    finished requests (unless the connector is still sending their KV),
    move finished remote loads back to waiting, roll back failed loads.

Speculative decoding (scheduler/spec_decode.py) adds three touches: the gap
counts the draft tokens (`num_tokens_with_spec`), the drafts scheduled this
step travel in the SchedulerOutput, and update_from_output rolls
`num_computed_tokens` back by the rejected drafts and stores the next drafts.

Around this loop: the step's batch and the SchedulerOutput it becomes
(batch.py), queue order, preemption choice and capacity (policies.py), the
paged KV cache (kv_cache_manager.py), the stats it reports (stats.py); policy "fair" adds
per-tenant service counters (fair.py), charged where tokens are scheduled and sampled.
Policy "sjf", fair_shortest_first and capacity "reserve_predicted" add predicted output
lengths (length_aware.py): predicted on arrival, learned from at the finish.
"""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple, Optional

from fleetserve.scheduler.batch import StepBatch
from fleetserve.scheduler.block_pool import KVCacheBlock
from fleetserve.scheduler.config import CacheConfig, SchedulerConfig
from fleetserve.scheduler.connector import KVConnectorScheduler
from fleetserve.scheduler.fair import make_vtc, seat_victim
from fleetserve.scheduler.kv_cache_manager import KVCacheManager
from fleetserve.scheduler.kv_events import KVEventBatch
from fleetserve.scheduler.length_aware import make_length_tracker
from fleetserve.scheduler.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from fleetserve.scheduler.policies import make_capacity_policy, make_waiting_queue, pick_victim
from fleetserve.scheduler.request import Request, RequestStatus
from fleetserve.scheduler.spec_decode import DraftLengthPolicy, SpecDecodingStats, assign_drafts, lookahead_slots
from fleetserve.scheduler.stats import SchedulerStats, snapshot


class PrefixLookup(NamedTuple):
    """Where a request about to be admitted starts: its local prefix-cache hits, the
    tokens they cover (for a request back from a remote load: the ones it computed),
    and the tokens a connector supplies after them, in the background or not."""

    hits: list[KVCacheBlock]
    num_computed: int
    num_external: int
    load_async: bool


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        connector: Optional[KVConnectorScheduler] = None,
    ) -> None:
        if cache_config.num_blocks is None:
            raise ValueError("cache_config.num_blocks must be set before building a Scheduler")
        self.config = scheduler_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.connector = connector
        self.kv = KVCacheManager(
            cache_config.num_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            cache_config.enable_kv_cache_events,
            cache_config.prefix_caching_hash_algo,
            cache_config.sliding_window,
        )
        self.capacity = make_capacity_policy(
            scheduler_config.capacity_policy, scheduler_config.reserve_predicted_margin
        )
        # Output-length-aware scheduling: predictions for requests that arrive without the
        # router's, learned from the requests that finish here (scheduler/length_aware.py).
        self.lengths = make_length_tracker(
            scheduler_config.policy, scheduler_config.fair_shortest_first, scheduler_config.capacity_policy
        )

        self.requests: dict[str, Request] = {}
        # Policy "fair": the per-tenant service counters the waiting queue orders by.
        self.vtc = make_vtc(
            scheduler_config.policy, scheduler_config.fair_input_weight, scheduler_config.fair_output_weight
        )
        # Whether a preemption victim may sit anywhere in `running` (not only at its end).
        self._victims_by_rank = scheduler_config.policy == "sjf"
        self.waiting = make_waiting_queue(
            scheduler_config.policy, self.vtc, scheduler_config.sjf_aging_rate, scheduler_config.fair_shortest_first
        )
        self.running: list[Request] = []
        # Parked while a connector loads their KV; they hold blocks.
        self.waiting_for_remote_kvs: dict[str, Request] = {}
        # Finished, but the connector is still sending their KV: blocks held.
        self.sending: dict[str, Request] = {}

        self._finished_req_ids: set[str] = set()  # for the next SchedulerOutput
        self._pending_outputs: list[EngineCoreOutput] = []  # ignored on arrival
        self._finished_recving: set[str] = set()
        # Traced requests (Request.events) still prefilling: their steps are recorded.
        self._traced: set[str] = set()
        # Output tokens each worker-known request has not been sent yet.
        self._num_tokens_sent: dict[str, int] = {}
        self.num_preemptions = 0
        self.spec_stats = SpecDecodingStats(num_spec_tokens=scheduler_config.num_spec_tokens)
        self.draft_policy = (
            DraftLengthPolicy(scheduler_config.num_spec_tokens) if scheduler_config.adaptive_draft_length else None
        )

    # ---- requests in and out ---------------------------------------------------
    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"duplicate request id {rid!r}")
        if request.status != RequestStatus.WAITING:
            raise ValueError(f"request {rid!r} has status {request.status.name}, expected WAITING")
        # The whole pool holds num_blocks * block_size tokens of KV; the last
        # token of a request is never computed, so a request can grow to one
        # more than that. Capping here (finish_reason "length") keeps a request
        # that alone outgrows the pool from preempting itself forever. Under a
        # sliding window a request holds at most its window, a step's tokens and
        # a block either side: when that fits, only max_model_len caps it.
        max_len = min(self.config.max_model_len, self.kv.num_blocks * self.block_size + 1)
        if self.window_fits_pool():
            max_len = self.config.max_model_len
        sp = request.sampling_params
        room = max_len - request.num_prompt_tokens
        request.max_tokens = room if sp.max_tokens is None else min(sp.max_tokens, room)
        if room < 1:
            # Too long to ever run: finish it at once rather than block the queue.
            request.status = RequestStatus.FINISHED_IGNORED
            self._pending_outputs.append(EngineCoreOutput(rid, [], request.get_finished_reason()))
            return
        self.requests[rid] = request
        if self.vtc is not None:
            self.vtc.arrive(request)
        if self.lengths is not None:
            self.lengths.arrive(request)
        self.waiting.add(request)

    def window_fits_pool(self) -> bool:
        """Whether a request under the sliding window (one on every layer) holds few enough
        blocks at once that the pool never caps its length."""
        window, cfg = self.kv.sliding_window, self.config
        if window is None or cfg.capacity_policy == "guaranteed_no_evict":
            # (That policy reserves a request's blocks to completion up front: one longer
            # than the pool would never be admitted.)
            return False
        step = cfg.max_num_batched_tokens + cfg.num_spec_tokens + cfg.num_lookahead_tokens
        return self.kv.num_blocks * self.block_size >= window + step + 2 * self.block_size

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Abort the given ids; unknown or already finished ids are ignored.

        Returns the ids that were actually aborted."""
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[str]:
        """Finish requests from outside the step (abort, a stop string)."""
        if not status.is_finished:
            raise ValueError(f"{status.name} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        # dict.fromkeys: an id listed twice is finished (and freed) once.
        to_finish = [
            self.requests[rid]
            for rid in dict.fromkeys(request_ids)
            if rid in self.requests and not self.requests[rid].is_finished
        ]
        if not to_finish:
            return []
        running = [r for r in to_finish if r.status == RequestStatus.RUNNING]
        if running:
            drop = {id(r) for r in running}
            self.running = [r for r in self.running if id(r) not in drop]
        waiting = [r for r in to_finish if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)]
        if waiting:
            self.waiting.remove_many(waiting)
        for r in to_finish:
            self.waiting_for_remote_kvs.pop(r.request_id, None)
            r.status = status
            self._free_request(r)
        return [r.request_id for r in to_finish]

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting or self.waiting_for_remote_kvs)

    def has_requests(self) -> bool:
        """Whether the engine should keep stepping: unfinished requests, or
        finished ones the workers have not heard of / whose KV is still being sent,
        or work the connector queued for the next step (a save must not wait for
        another request to come)."""
        return bool(
            self.has_unfinished_requests()
            or self._finished_req_ids
            or self.sending
            or self._pending_outputs
            or (self.connector is not None and self.connector.has_pending_work())
        )

    def has_pending_outputs(self) -> bool:
        return bool(self._pending_outputs)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.waiting_for_remote_kvs)

    # ---- schedule --------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        batch = StepBatch(self.config.max_num_batched_tokens)
        self._schedule_running(batch)
        if not batch.preempted:
            self._preempt_for_share(batch)
            self._schedule_waiting(batch)
        finished, self._finished_req_ids = self._finished_req_ids, set()
        output = batch.to_output(self.running, self.requests, self.kv, self._num_tokens_sent, finished)
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
        return output

    def _num_new_tokens(self, num_tokens: int, num_computed: int, budget: int) -> int:
        n = num_tokens - num_computed
        # The threshold cuts prefills into chunks, so it only applies when
        # chunking is allowed (without it a prompt is skipped, never cut).
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < n and self.config.enable_chunked_prefill:
            n = threshold
        return min(n, budget, self.config.max_model_len - 1 - num_computed)

    def _schedule_running(self, batch: StepBatch) -> None:
        running, cfg, kv = self.running, self.config, self.kv
        num_lookahead = cfg.num_lookahead_tokens
        # _num_new_tokens, inlined: this loop runs for every running request every step.
        threshold = cfg.long_prefill_token_threshold if cfg.enable_chunked_prefill else 0
        last = cfg.max_model_len - 1
        i = 0
        while i < len(running) and batch.budget > 0:
            request = running[i]
            num_computed = request.num_computed_tokens
            n = request.num_tokens_with_spec - num_computed
            if 0 < threshold < n:
                n = threshold
            n = min(n, batch.budget, last - num_computed)
            if n <= 0:
                i += 1
                continue
            slots = n + lookahead_slots(request, n, num_lookahead) if num_lookahead else n
            blocks = kv.allocate_slots(request, slots)
            if blocks is None and self.capacity.can_preempt:
                num_preempted = len(batch.preempted)
                blocks = self._make_room(request, slots, batch)
                if blocks is None:
                    if not self._victims_by_rank:
                        break  # it had to preempt itself: nobody else can fit either
                    # sjf's victims are not the last admitted: requests after this one in
                    # `running` were not victims and its blocks are free now; they go on
                    # (`running[i]` is the next one). A step of none would stall them.
                    continue
                if len(batch.preempted) > num_preempted:
                    i = running.index(request)  # victims ahead of it moved it up
            if blocks is not None:
                if self.vtc is not None and num_computed < request.num_prompt_tokens:
                    self.vtc.charge_prompt(request, n)
                batch.add(request, n, blocks)
            # (blocks is None only without preemption, i.e. guaranteed_no_evict: skip it.)
            i += 1

    # ---- preemption --------------------------------------------------------------
    def _make_room(self, request: Request, num_slots: int, batch: StepBatch) -> Optional[list[int]]:
        """Preempt (`pick_victim`) until `request`, running, gets `num_slots` slots: the
        ids of its new blocks, or None when it had to preempt itself."""
        while True:
            victim = pick_victim(self.running, self.config.policy, self.vtc, self.config.sjf_aging_rate)
            # Before preempting itself, waiting requests back from remote loads give
            # their blocks back.
            if victim is not request or not self._release_waiting_holders(request):
                batch.drop(victim)
                self._preempt(victim)
                if victim is request:
                    return None
            blocks = self.kv.allocate_slots(request, num_slots)
            if blocks is not None:
                return blocks

    def _preempt_for_share(self, batch: StepBatch) -> None:
        """Policy "fair" with fair_preemption_gap: a seat for the waiting tenant served least
        when every seat is taken by tenants served more (scheduler/fair.py `seat_victim`)."""
        gap = self.config.fair_preemption_gap
        if self.vtc is None or gap is None or not self.waiting or self._has_free_seat():
            return
        victim = seat_victim(self.vtc, self.running, self.waiting.peek(), gap)
        if victim is not None:
            batch.drop(victim)
            self._preempt(victim)

    def _preempt(self, request: Request) -> None:
        """Take every block back from `request`, which will start over (recompute, as
        vLLM v1 does). A running request goes to the front of waiting; a waiting one
        (back from a remote load, `_release_waiting_holders`) keeps its place."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self.waiting.prepend(request)
        # A victim scheduled earlier in this pass already registered hashes for
        # blocks this step would have filled; they will never be computed.
        self.kv.uncache_tail(request, request.num_computed_tokens)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        if request.events is not None:
            request.record("preempted", num_preemptions=request.num_preemptions)
        self._num_tokens_sent.pop(request.request_id, None)

    def _release_waiting_holders(self, keep: Request) -> bool:
        """Last resort when `keep` cannot grow and would otherwise wait (or
        preempt itself) forever: waiting requests back from a remote load give
        their blocks back and will start over, like a preemption. Nothing
        else can reclaim those blocks. Returns whether any block was freed."""
        owned = self.kv.req_to_blocks
        holders = [r for r in self.waiting if r is not keep and r.request_id in owned]
        for r in holders:
            self._preempt(r)
        return bool(holders)

    # ---- admission -----------------------------------------------------------------
    def _block_holders(self) -> list[Request]:
        """Unfinished requests that own blocks: running, parked for a remote
        load, and back from one but not yet re-admitted."""
        holders = list(self.running)
        holders.extend(self.waiting_for_remote_kvs.values())
        owned = self.kv.req_to_blocks
        holders.extend(r for r in self.waiting if r.request_id in owned)
        return holders

    def _schedule_waiting(self, batch: StepBatch) -> None:
        kv, waiting = self.kv, self.waiting
        self.capacity.begin_step(self._block_holders, kv)
        skipped: list[Request] = []
        holders_only = False
        loras = self._loras_in_step()
        while waiting and batch.budget > 0 and self._has_free_seat():
            request = waiting.peek()
            if loras is not None and self._lora_must_wait(request, loras):
                skipped.append(waiting.pop())
                continue
            fresh = request.request_id not in kv.req_to_blocks
            lookup = None if holders_only and fresh else self._lookup(request)
            n = None if lookup is None else self._num_admitted_tokens(request, lookup, batch.budget)
            if lookup is None or n is None:
                skipped.append(waiting.pop())
                continue
            # A fresh request has num_computed_tokens == 0 here: allocate_slots
            # counts the hits itself.
            blocks = None
            if self.capacity.can_admit(request, lookup.hits, kv):
                blocks = kv.allocate_slots(
                    request, n, lookup.hits, lookup.num_external, delay_caching=lookup.load_async
                )
            if blocks is None:
                # Waiting requests back from a remote load hold blocks that no
                # preemption can reclaim: let them go first, or a request that
                # needs those blocks would wait for them forever.
                if fresh and any(r.request_id in kv.req_to_blocks for r in waiting):
                    skipped.append(waiting.pop())
                    holders_only = True
                    continue
                if not fresh and not self.running:
                    self._release_waiting_holders(request)
                break
            waiting.pop()
            if loras is not None and request.lora_id:
                loras.add(request.lora_id)
            self._admit(request, lookup, fresh, n, blocks, batch)
        for request in reversed(skipped):
            waiting.prepend(request)

    def _has_free_seat(self) -> bool:
        # In-flight remote loads hold a seat (and their blocks) like running requests.
        return len(self.running) + len(self.waiting_for_remote_kvs) < self.config.max_num_seqs

    def _loras_in_step(self) -> Optional[set[int]]:
        """--max-loras: the distinct LoRA adapters of this step so far (running requests'
        and remote loads'); None without LoRA."""
        if not self.config.max_loras:
            return None
        return {r.lora_id for r in self.running if r.lora_id} | {
            r.lora_id for r in self.waiting_for_remote_kvs.values() if r.lora_id
        }

    def _lora_must_wait(self, request: Request, loras: set[int]) -> bool:
        """A request with yet another adapter waits its turn once the step has max_loras."""
        return bool(request.lora_id) and request.lora_id not in loras and len(loras) >= self.config.max_loras

    def _lookup(self, request: Request) -> Optional[PrefixLookup]:
        """Where a request about to be admitted starts; None when the connector asks to wait."""
        if request.request_id in self.kv.req_to_blocks:
            # Back from a remote KV load: it already holds its blocks.
            return PrefixLookup([], request.num_computed_tokens, 0, False)
        hits, computed = self.kv.get_computed_blocks(request)
        if hits and self.window_fits_pool():
            # A request may outgrow the pool here, and so may its hits: with its first
            # chunk they must fit the pool at once (the ones behind the window go back at
            # its next step). Past that the rest is recomputed.
            cfg = self.config
            step = cfg.max_num_batched_tokens + cfg.num_spec_tokens + cfg.num_lookahead_tokens
            room = self.kv.num_blocks - self.kv.cdiv(step) - 1
            if len(hits) > room:
                hits = hits[: max(0, room)]
                computed = len(hits) * self.block_size
        if self.connector is None:
            return PrefixLookup(hits, computed, 0, False)
        ext, load_async = self.connector.get_num_new_matched_tokens(request, computed)
        if ext is None:  # the connector does not know yet: ask again later
            return None
        # At least the last prompt token is always computed here.
        return PrefixLookup(hits, computed, max(0, min(ext, request.num_tokens - 1 - computed)), load_async)

    def _num_admitted_tokens(self, request: Request, lookup: PrefixLookup, budget: int) -> Optional[int]:
        """Tokens an admitted request computes this step (none while its KV loads in the
        background); None when, without chunked prefill, its prompt does not fit what is
        left of the budget: it is skipped, not cut."""
        if lookup.load_async:
            return 0
        n = self._num_new_tokens(request.num_tokens, lookup.num_computed + lookup.num_external, request.num_tokens)
        if not self.config.enable_chunked_prefill and n > budget:
            return None
        return min(n, budget)

    def _admit(
        self,
        request: Request,
        lookup: PrefixLookup,
        fresh: bool,
        num_tokens: int,
        block_ids: list[int],
        batch: StepBatch,
    ) -> None:
        """`request`, just taken off waiting with its blocks, runs (or parks for its load)."""
        request.num_computed_tokens = lookup.num_computed + lookup.num_external
        if fresh:
            self._admitted_fresh(request, len(lookup.hits) * self.block_size, lookup.num_external)
        if request.events is not None:
            self._traced.add(request.request_id)
            request.record(
                "scheduled",
                cached_tokens=lookup.num_computed,
                external_tokens=lookup.num_external,
                remote_load=bool(lookup.load_async),
            )
        if lookup.load_async:
            # Blocks are held; the worker fills them in the background.
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            self.waiting_for_remote_kvs[request.request_id] = request
            return
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        if self.vtc is not None:
            self.vtc.charge_prompt(request, num_tokens)
        batch.add(request, num_tokens, block_ids)
        batch.new_reqs.append(request)

    def _admitted_fresh(self, request: Request, num_local_hit: int, num_external: int) -> None:
        """Bookkeeping for a request that got its first blocks."""
        kv = self.kv
        kv.record_prefix_lookup(request.num_tokens, num_local_hit)
        request.num_external_computed_tokens = num_external
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_local_hit + num_external
        if self.connector is not None:
            self.connector.update_state_after_alloc(request, kv.get_block_ids(request.request_id), num_external)
        # A parked request holds blocks too: reserve its future ones now.
        self.capacity.admitted(request, kv)

    # ---- update ----------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        if self.connector is not None:
            self.connector.update_connector_output(runner_output)
        if runner_output.invalid_block_ids:
            outputs.extend(self._handle_invalid_blocks(runner_output.invalid_block_ids, scheduler_output))
        if self._traced:
            self._record_steps(scheduler_output)
        self._append_sampled(scheduler_output, runner_output, outputs)
        if runner_output.spec_token_ids:
            assign_drafts(
                runner_output.spec_token_ids,
                self.requests,
                self.config.num_spec_tokens,
                self.draft_policy,
                self._free_draft_room(),
            )
        self._update_from_connector(runner_output)
        return outputs

    def _append_sampled(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput, outputs: list[EngineCoreOutput]
    ) -> None:
        """Append each request's sampled tokens up to its first stop, free the requests
        that stopped, and add an output for each request that produced something."""
        num_scheduled = scheduler_output.num_scheduled_tokens
        spec = scheduler_output.scheduled_spec_decode_tokens
        logprobs = runner_output.logprobs
        prompt_logprobs = runner_output.prompt_logprobs
        pooled = runner_output.pooler_output
        stopped: list[Request] = []
        requests = self.requests
        running = RequestStatus.RUNNING
        vtc = self.vtc
        for rid, sampled in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            request = requests.get(rid)
            if request is None or request.status != running or rid not in num_scheduled:
                continue  # aborted, or rolled back after a failed KV load
            new_tokens: list[int] = []
            # Only a step that reached the end of the known tokens yields a token.
            if sampled and request.num_computed_tokens >= request.num_tokens:
                if spec and rid in spec:
                    self._roll_back_rejected(request, len(spec[rid]), len(sampled))
                if len(sampled) == 1:  # most steps: one token per request
                    token = sampled[0]
                    request.append_output_token(token)
                    new_tokens.append(token)
                    self._check_stop(request, token)
                else:
                    for token in sampled:
                        request.append_output_token(token)
                        new_tokens.append(token)
                        if self._check_stop(request, token):
                            break
            if new_tokens and vtc is not None:
                vtc.charge_output(request, len(new_tokens))
            plp = prompt_logprobs.get(rid) if prompt_logprobs else None
            if not new_tokens and not plp:
                continue
            params = reason = events = None
            if request.status != running:
                stopped.append(request)
                params = self._free_request(request)
                reason = request.get_finished_reason()
                if request.events is not None:
                    events = self._take_events(request)
            outputs.append(
                EngineCoreOutput(
                    rid,
                    new_tokens,
                    reason,
                    request.stop_reason,
                    logprobs.get(rid) if logprobs else None,
                    plp,
                    request.num_cached_tokens,
                    params,
                    num_remote_tokens=request.num_external_computed_tokens,
                    embedding=pooled.get(rid) if pooled else None,
                    events=events,
                )
            )
        if stopped:
            drop = {id(r) for r in stopped}
            self.running = [r for r in self.running if id(r) not in drop]

    def _record_steps(self, scheduler_output: SchedulerOutput) -> None:
        """A step of each traced request that ran in it: its prefill chunks (tokens, the
        prompt computed so far) and its first decode step; later decode steps are not
        recorded one by one (the decode span counts them)."""
        num_scheduled = scheduler_output.num_scheduled_tokens
        for rid in list(self._traced):
            request = self.requests.get(rid)
            if request is None or request.events is None:
                self._traced.discard(rid)
                continue
            n = num_scheduled.get(rid)
            if n is None:
                continue
            if request.num_computed_tokens <= request.num_prompt_tokens:
                request.record("prefill_chunk", tokens=n, computed=request.num_computed_tokens)
            else:
                self._traced.discard(rid)  # decoding: nothing more per step

    def _take_events(self, request: Request) -> Optional[list[tuple[str, float, dict[str, Any]]]]:
        self._traced.discard(request.request_id)
        if request.num_draft_tokens:  # the decode span's acceptance (a summary, not one per step)
            request.record(
                "spec_decode", draft_tokens=request.num_draft_tokens, accepted_tokens=request.num_accepted_draft_tokens
            )
        events, request.events = request.events, None
        return events

    def _roll_back_rejected(self, request: Request, num_drafts: int, num_sampled: int) -> None:
        """The worker returns the accepted drafts plus one token of its own:
        the KV of the rejected drafts is wrong, so they count as not computed
        (their slots are overwritten next step)."""
        num_accepted = num_sampled - 1
        request.num_computed_tokens -= num_drafts - num_accepted
        request.num_draft_tokens += num_drafts
        request.num_accepted_draft_tokens += num_accepted
        self.spec_stats.observe(num_drafts, num_accepted)
        if self.draft_policy is not None:
            self.draft_policy.observe(request.request_id, num_drafts, num_accepted)

    def _free_draft_room(self) -> int:
        """With adaptive drafts and free_draft_tokens: what the next step may still take
        at about a one-token step's cost, beyond a token per running request (before the
        earned drafts). 0 while a prefill may join it."""
        free = self.config.free_draft_tokens
        if self.draft_policy is None or not free or self.waiting:
            return 0
        return free - sum(max(1, r.num_tokens - r.num_computed_tokens) for r in self.running)

    def _check_stop(self, request: Request, token: int) -> bool:
        sp = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output >= sp.min_tokens:
            if token == request.eos_token_id and not sp.ignore_eos:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if token in sp.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token
                return True
        if num_output >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def _free_request(self, request: Request) -> Optional[dict[str, Any]]:
        """Release a finished request; its blocks wait if the connector still sends them."""
        rid = request.request_id
        self._finished_req_ids.add(rid)
        self._num_tokens_sent.pop(rid, None)
        if self.vtc is not None:
            self.vtc.leave(request)
        if self.lengths is not None:
            self.lengths.finish(request)
        if self.draft_policy is not None:
            self.draft_policy.forget(rid)
        delay, params = False, None
        if self.connector is not None:
            delay, params = self.connector.request_finished(request, self.kv.get_block_ids(rid))
        if delay:
            self.sending[rid] = request
        else:
            self.kv.free(request)
            del self.requests[rid]
        return params

    def _update_from_connector(self, runner_output: ModelRunnerOutput) -> None:
        for rid in runner_output.finished_sending:
            request = self.sending.pop(rid, None)
            if request is not None:
                self.kv.free(request)
                del self.requests[rid]
        for rid in runner_output.finished_recving:
            request = self.waiting_for_remote_kvs.pop(rid, None)
            if request is None:
                continue
            # Back to the front of waiting: it already holds its blocks.
            request.status = RequestStatus.WAITING
            if request.events is not None:
                request.record("kv_loaded", tokens=request.num_external_computed_tokens)
            if self.kv.enable_caching:
                self.kv.cache_blocks(request, min(request.num_computed_tokens, request.num_tokens))
            self.waiting.prepend(request)

    def _handle_invalid_blocks(self, invalid: set[int], scheduler_output: SchedulerOutput) -> list[EngineCoreOutput]:
        """Roll requests whose KV failed to load back to their first bad block, or fail
        them (the connector's policy). Returns the outputs of the failed ones."""
        self.kv.uncache_blocks(invalid)
        bs = self.block_size
        failed: list[Request] = []
        for request in list(self.running) + list(self.waiting_for_remote_kvs.values()):
            block_ids = self.kv.get_block_ids(request.request_id)
            first_bad = next((i for i, b in enumerate(block_ids) if b in invalid), None)
            if first_bad is None:
                continue
            good = first_bad * bs
            if request.num_computed_tokens <= good:
                continue
            if request.events is not None:
                request.record("kv_load_failed", valid_tokens=good, lost_tokens=request.num_computed_tokens - good)
            request.num_computed_tokens = good
            lost = request.num_cached_tokens - min(request.num_cached_tokens, good)
            request.num_cached_tokens -= lost
            # External tokens follow the local hits: the cut comes off them first.
            request.num_external_computed_tokens = max(0, request.num_external_computed_tokens - lost)
            # Blocks from the first bad one on were loaded wrong or computed
            # over wrong KV: no later request may hit them.
            self.kv.uncache_tail(request, good)
            # The step's sampled token (if any) was computed over bad KV: drop it.
            scheduler_output.num_scheduled_tokens.pop(request.request_id, None)
            if self.connector is not None and self.connector.load_failure_policy(request) == "fail":
                failed.append(request)
        if not failed:
            return []
        self.finish_requests([r.request_id for r in failed], RequestStatus.FINISHED_ERROR)
        return [
            EngineCoreOutput(
                r.request_id,
                [],
                r.get_finished_reason(),
                num_cached_tokens=r.num_cached_tokens,
                num_remote_tokens=r.num_external_computed_tokens,
                events=self._take_events(r),
            )
            for r in failed
        ]

    # ---- stats -------------------------------------------------------------------
    def get_stats(self) -> SchedulerStats:
        return snapshot(self)

    def num_queued_tokens(self) -> int:
        """Tokens still to compute: what running requests have left (a prefill's rest, a
        decode's next token) plus every waiting request's tokens. The engine's load report
        carries it; the router's admission and SLO predictor read it."""
        queued = sum(r.num_tokens - r.num_computed_tokens for r in self.running)
        return queued + sum(r.num_tokens for r in self.waiting)

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def take_kv_events(self) -> Optional[KVEventBatch]:
        """KV cache events since the last call, as one `KVEventBatch` (or None)."""
        return self.kv.take_events()
