"""The fleet in virtual time: a router with the real routing policy in front of `SimReplica`s.

`Cluster.run(trace)` is a discrete-event loop over one heap of timed events:

* a trace arrival: the router ranks the replicas with the real policy
  (`router.routing.policies.make_policy`) over `ReplicaLoad` snapshots built as
  `router/routing/request_router.py` builds them (its own exact in-flight requests and
  prompt tokens per replica, plus the engine load each replica last reported), and sends
  the request, which reaches the replica `network_latency_s` later;
* a step end: the replica applies the step's model output, delivers tokens, and starts its
  next step at once while it has work (replicas step back to back, and idle otherwise);
* a load report, every `stats_period_s`: each replica's engine load (`get_stats()`, as
  `EngineCore.get_load` reports it) becomes what the router sees;
* a KV event delivery, `kv_event_lag_s` after the step that produced the batch: the batch
  goes into the replica's `KVEventLog` and the router's `KVIndex` reads it as the real
  subscriber does (`index.update(replica, log.read(*index.cursor(replica)))`).

Serve's admission is kept: a replica with `max_num_seqs + max_waiting_requests + 8` of this
router's requests in flight (the deployment's `max_ongoing_requests`, cluster/deploy.py) is
skipped for the next tier, and when every replica is full the request waits at the router
until one finishes. Requests whose prompt the engine would refuse (no room for an output
token in `max_model_len`, or longer than the whole KV pool) are refused with the reason.

Every random choice is the policy's, seeded with `seed`; the run is deterministic.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from typing import Any, Callable, Optional, Sequence

from fleetserve.router.routing.kv_index import KVIndex
from fleetserve.router.routing.policies import ReplicaLoad, RouteRequest, RoutingPolicy, make_policy
from fleetserve.scheduler import KVEventBatch, KVEventLog
from fleetserve.sim.replica import SimReplica, StepStart
from fleetserve.sim.result import GapHistogram, Record, SimResult, summarize
from fleetserve.sim.shape import StepCostModel
from fleetserve.sim.traces import DEFAULT_VOCAB_SIZE, TraceRequest

DEFAULT_MAX_MODEL_LEN = 8192  # used when neither the engine args nor the caller set one
DEFAULT_NETWORK_LATENCY_S = 0.0005  # router -> replica, one way
DEFAULT_KV_EVENT_LAG_S = 0.05  # the KV subscriber's poll interval
DEFAULT_STATS_PERIOD_S = 1.0  # RoutingOptions.stats_period_s

_TO_REPLICA, _STEP_END, _REPORT, _KV_EVENTS = 0, 1, 2, 3


def _engine_args(engine_args: Any, overrides: dict[str, Any]) -> Any:
    """The `EngineArgs` of `fleetserve serve` (the same flags), with `overrides` applied."""
    from fleetserve.replica.engine.engine_args import EngineArgs

    if engine_args is None:
        return EngineArgs(**overrides)
    if isinstance(engine_args, dict):
        return EngineArgs(**{**engine_args, **overrides})
    return engine_args.model_copy(update=overrides) if overrides else engine_args


class SimRouter:
    """The ingress router's choice, as `FleetRequestRouter` makes it, over simulated replicas."""

    def __init__(self, policy: RoutingPolicy, replica_ids: list[str], max_ongoing: int) -> None:
        self.policy = policy
        self.max_ongoing = max_ongoing
        # One load snapshot per replica, updated in place (the policies only read them).
        self.loads = {rid: ReplicaLoad(rid) for rid in replica_ids}
        self._load_list = list(self.loads.values())
        self._inflight: dict[str, tuple[str, int]] = {}  # request id -> (replica, prompt tokens)
        self.held: deque[tuple[Record, list[int]]] = deque()  # every replica was full
        self.num_held = 0

    def route(self, request: RouteRequest) -> Optional[str]:
        """The replica `request` goes to (recorded as in flight there), or None when every
        replica has `max_ongoing` requests of this router in flight."""
        ranked = self.policy.rank(self._load_list, request)
        cap, loads = self.max_ongoing, self.loads
        for tier in ranked:
            for rid in tier:
                if loads[rid].num_ongoing < cap:
                    self._record(rid, request)
                    return rid
        return None

    def _record(self, replica_id: str, request: RouteRequest) -> None:
        n = len(request.prompt_token_ids)
        self._inflight[request.request_id] = (replica_id, n)
        load = self.loads[replica_id]
        load.num_ongoing += 1
        load.ongoing_tokens += n
        self.policy.on_routed(replica_id, request)

    def release(self, request_id: str) -> None:
        entry = self._inflight.pop(request_id, None)
        if entry is None:
            return
        load = self.loads[entry[0]]
        load.num_ongoing = max(0, load.num_ongoing - 1)
        load.ongoing_tokens = max(0, load.ongoing_tokens - entry[1])
        self.policy.on_completed(request_id)

    def report(self, replica_id: str, stats: dict[str, Any]) -> None:
        load = self.loads[replica_id]
        load.num_running = int(stats.get("num_running", 0))
        load.num_waiting = int(stats.get("num_waiting", 0))
        load.kv_cache_usage = float(stats.get("kv_cache_usage", 0.0))


class Cluster:
    """`num_replicas` simulated replicas of one engine config behind one router."""

    def __init__(
        self,
        cost_model: StepCostModel,
        num_replicas: int = 1,
        policy: str = "power_of_two",
        engine_args: Any = None,
        *,
        max_model_len: Optional[int] = None,
        num_blocks: Optional[int] = None,
        seed: int = 0,
        network_latency_s: float = DEFAULT_NETWORK_LATENCY_S,
        stats_period_s: float = DEFAULT_STATS_PERIOD_S,
        kv_event_lag_s: float = DEFAULT_KV_EVENT_LAG_S,
        policy_kwargs: Optional[dict[str, Any]] = None,
        vocab_size: int = DEFAULT_VOCAB_SIZE,
        max_ongoing_requests: Optional[int] = None,
        engine_overrides: Optional[dict[str, Any]] = None,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        for name, v in (
            ("network_latency_s", network_latency_s),
            ("kv_event_lag_s", kv_event_lag_s),
        ):
            if v < 0:
                raise ValueError(f"{name} must be non-negative, got {v}")
        if stats_period_s <= 0:
            raise ValueError(f"stats_period_s must be positive, got {stats_period_s}")
        self.now = 0.0
        self._ran = False
        self.seed = seed
        self.cost = cost_model
        self.network_latency_s = network_latency_s
        self.stats_period_s = stats_period_s
        self.kv_event_lag_s = kv_event_lag_s
        self.vocab_size = vocab_size
        kwargs = dict(policy_kwargs or {})
        kwargs.setdefault("seed", seed)
        kwargs.setdefault("clock", self.clock)
        self.policy = make_policy(policy, **kwargs)
        self.uses_kv_events = self.policy.uses_kv_events
        args = _engine_args(engine_args, dict(engine_overrides or {}))
        if self.uses_kv_events and not args.enable_kv_cache_events:
            # As `fleetserve serve`: prefix_aware turns the engines' KV events on by itself.
            args = args.model_copy(update={"enable_kv_cache_events": True})
        self.engine_args = args
        self.max_model_len = int(max_model_len or args.max_model_len or DEFAULT_MAX_MODEL_LEN)
        self.num_blocks = self._num_blocks(args, num_blocks)
        sched_cfg = args.scheduler_config(self.max_model_len)
        cache_cfg = args.cache_config(self.num_blocks)
        self.policy.set_hashing(cache_cfg.block_size, cache_cfg.prefix_caching_hash_algo)
        self.replicas = [
            SimReplica(f"replica-{i}", sched_cfg, cache_cfg, cost_model, vocab_size) for i in range(num_replicas)
        ]
        self._by_id = {r.replica_id: i for i, r in enumerate(self.replicas)}
        if max_ongoing_requests is None:
            max_ongoing_requests = args.max_num_seqs + args.max_waiting_requests + 8
        self.router = SimRouter(self.policy, [r.replica_id for r in self.replicas], max_ongoing_requests)
        self.kv_index: Optional[KVIndex] = getattr(self.policy, "kv_index", None) if self.uses_kv_events else None
        self.kv_logs = [KVEventLog() for _ in self.replicas] if self.kv_index is not None else []
        self.config = {
            "num_replicas": num_replicas,
            "policy": policy,
            "seed": seed,
            "max_model_len": self.max_model_len,
            "num_blocks": self.num_blocks,
            "block_size": cache_cfg.block_size,
            "max_num_seqs": sched_cfg.max_num_seqs,
            "max_num_batched_tokens": sched_cfg.max_num_batched_tokens,
            "enable_prefix_caching": cache_cfg.enable_prefix_caching,
            "enable_chunked_prefill": sched_cfg.enable_chunked_prefill,
            "network_latency_s": network_latency_s,
            "stats_period_s": stats_period_s,
            "kv_event_lag_s": kv_event_lag_s,
            "max_ongoing_requests": max_ongoing_requests,
        }

    def clock(self) -> float:
        """Virtual time: what the policies' clock seam reads."""
        return self.now

    def _num_blocks(self, args: Any, num_blocks: Optional[int]) -> int:
        """KV blocks per replica: given, or `--num-gpu-blocks-override`, or
        `--kv-cache-memory-bytes` over the profile's KV bytes per block."""
        if num_blocks is not None:
            return int(num_blocks)
        if args.num_gpu_blocks_override is not None:
            return int(args.num_gpu_blocks_override)
        per_token = int(self.cost.kv_bytes_per_token())
        memory = args.kv_cache_memory_bytes
        if memory is None:
            memory = getattr(self.cost, "kv_cache_memory_bytes", None)
            memory = memory() if callable(memory) else memory
        if memory is None or per_token <= 0:
            raise ValueError(
                "the KV cache size is unknown: set num_gpu_blocks_override or kv_cache_memory_bytes in the "
                "engine args (or give a profile that knows its memory)"
            )
        n = int(memory) // (per_token * args.block_size)
        if n < 1:
            raise ValueError(f"kv_cache_memory_bytes={memory} holds no block of {args.block_size} tokens")
        return n

    # ---- the run ------------------------------------------------------------------------
    def run(
        self,
        trace: Sequence[TraceRequest],
        *,
        slo_ttft_s: Optional[float] = None,
        slo_itl_s: Optional[float] = None,
        progress: Optional[Callable[[int, int], None]] = None,
    ) -> SimResult:
        """Replay `trace` (arrival times in seconds from 0) and summarize. A cluster runs one
        trace: its replicas' caches and counters are that run's."""
        if self._ran:
            raise RuntimeError("a Cluster runs one trace; build another for the next run")
        self._ran = True
        wall0 = time.perf_counter()
        order = sorted(range(len(trace)), key=lambda i: trace[i].arrival_s)
        records = [
            Record(i, tr.request_id, tr.arrival_s, tr.output_tokens, tr.tenant, tr.priority or 0)
            for i, tr in enumerate(trace)
        ]
        self._records = {r.request_id: r for r in records}
        self._itl = GapHistogram()
        self._heap: list[tuple[float, int, int, int, Any]] = []
        self._seq = 0
        self._open = 0  # requests routed or held and not finished
        self._end = 0.0
        self._pending_arrivals = len(order)
        self._push(0.0, _REPORT, 0, None)
        heap = self._heap
        n = len(order)
        i = 0
        done = 0
        last_progress = 0
        inf = float("inf")
        while True:
            next_arrival = trace[order[i]].arrival_s if i < n else inf
            if heap and heap[0][0] <= next_arrival:
                t, _, kind, idx, payload = heapq.heappop(heap)
                self.now = t
                if kind == _STEP_END:
                    done += self._on_step_end(idx, payload)
                elif kind == _TO_REPLICA:
                    self._on_to_replica(idx, payload)
                elif kind == _KV_EVENTS:
                    self._on_kv_events(idx, payload)
                else:
                    self._on_report()
            elif i < n:
                k = order[i]
                i += 1
                self._pending_arrivals -= 1
                self.now = trace[k].arrival_s
                done += self._on_arrival(trace[k], records[k])
            else:
                break
            if progress is not None and done - last_progress >= 1000:
                last_progress = done
                progress(done, n)
        if progress is not None:
            progress(done, n)
        self._check_done(records)
        duration = max(self._end, max((r.arrival_s for r in records), default=0.0))
        replicas = []
        for r in self.replicas:
            s = r.scheduler
            replicas.append(
                {
                    "replica": r.replica_id,
                    "utilization": r.busy_s / duration if duration else 0.0,
                    "busy_s": r.busy_s,
                    "steps": r.num_steps,
                    "tokens": r.num_tokens,
                    "preemptions": s.num_preemptions,
                    "prefix_cache_queries": s.kv.prefix_cache_queries,
                    "prefix_cache_hits": s.kv.prefix_cache_hits,
                }
            )
        config = dict(self.config, router_held=self.router.num_held)
        result = summarize(records, duration, replicas, self._itl, config, slo_ttft_s, slo_itl_s)
        result.wall_s = time.perf_counter() - wall0
        return result

    def _push(self, t: float, kind: int, idx: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, idx, payload))

    # ---- events -------------------------------------------------------------------------
    def _on_arrival(self, tr: TraceRequest, rec: Record) -> int:
        ids = tr.token_ids(self.vocab_size)
        rec.prompt_tokens = len(ids)
        limit = self.replicas[0].max_prompt_tokens()
        if len(ids) > limit:
            if len(ids) >= self.max_model_len:
                rec.refused = (
                    f"prompt_too_long: {len(ids)} tokens, max_model_len {self.max_model_len} "
                    "(prompt plus at least one output token)"
                )
            else:
                rec.refused = f"prompt_exceeds_kv_cache: {len(ids)} tokens, the KV cache holds {limit}"
            return 1
        self._open += 1
        self._dispatch(rec, ids)
        return 0

    def _dispatch(self, rec: Record, ids: list[int]) -> bool:
        rid = self.router.route(RouteRequest(rec.request_id, ids))
        if rid is None:
            self.router.held.append((rec, ids))
            self.router.num_held += 1
            return False
        rec.replica = rid
        self._push(self.now + self.network_latency_s, _TO_REPLICA, self._by_id[rid], (rec, ids))
        return True

    def _on_to_replica(self, idx: int, payload: tuple[Record, list[int]]) -> None:
        rec, ids = payload
        replica = self.replicas[idx]
        replica.add_request(rec.request_id, ids, rec.output_tokens, rec.arrival_s, rec.priority)
        if not replica.busy:
            self._start(idx)

    def _start(self, idx: int) -> None:
        step = self.replicas[idx].start_step()
        if step.seconds == 0.0 and step.output.total_num_scheduled_tokens == 0:
            # Nothing to compute (only finishes to tell the workers): apply it now, go idle.
            self._apply(idx, step)
            return
        self._push(self.now + step.seconds, _STEP_END, idx, step)

    def _on_step_end(self, idx: int, step: StepStart) -> int:
        done = self._apply(idx, step)
        self._end = self.now
        if self.replicas[idx].scheduler.has_unfinished_requests():
            self._start(idx)
        return done

    def _apply(self, idx: int, step: StepStart) -> int:
        """Apply a step's outputs at `now`: token times, finishes; returns requests finished."""
        replica = self.replicas[idx]
        outputs, kv_batch = replica.finish_step(step)
        if kv_batch is not None and self.kv_index is not None:
            self._push(self.now + self.kv_event_lag_s, _KV_EVENTS, idx, kv_batch)
        now = self.now
        recs = self._records
        gaps = self._itl.counts
        finished = 0
        for out in outputs:
            rec = recs[out.request_id]
            k = len(out.new_token_ids)
            if k:
                if rec.first_token_s < 0:
                    rec.first_token_s = now
                else:
                    gap = now - rec.last_token_s
                    gaps[gap] = gaps.get(gap, 0) + 1
                rec.last_token_s = now
                rec.num_output += k
            if out.finish_reason is not None:
                finished += 1
                self._finish(replica, rec, out.finish_reason, out.num_cached_tokens)
        if len(gaps) > self._itl.max_keys:
            self._itl.maybe_fold()
        return finished

    def _finish(self, replica: SimReplica, rec: Record, reason: str, cached: int) -> None:
        rec.finish_s = self.now
        rec.finish_reason = reason
        rec.num_cached_tokens = cached
        request = replica.forget(rec.request_id)
        if request is not None:
            rec.num_preemptions = request.num_preemptions
        if rec.num_output == 0:
            rec.refused = f"finished_without_output: {reason}"
        self._open -= 1
        router = self.router
        router.release(rec.request_id)
        while router.held:
            held_rec, ids = router.held[0]
            if not self._dispatch_held(held_rec, ids):
                break
            router.held.popleft()

    def _dispatch_held(self, rec: Record, ids: list[int]) -> bool:
        rid = self.router.route(RouteRequest(rec.request_id, ids))
        if rid is None:
            return False
        rec.replica = rid
        self._push(self.now + self.network_latency_s, _TO_REPLICA, self._by_id[rid], (rec, ids))
        return True

    def _on_report(self) -> None:
        router = self.router
        for r in self.replicas:
            stats = r.scheduler.get_stats()
            router.report(
                r.replica_id,
                {
                    "num_running": stats.num_running,
                    "num_waiting": stats.num_waiting + stats.num_waiting_for_remote_kvs,
                    "kv_cache_usage": stats.kv_cache_usage,
                },
            )
        if self._open or self._pending_arrivals:
            self._push(self.now + self.stats_period_s, _REPORT, 0, None)

    def _on_kv_events(self, idx: int, batch: KVEventBatch) -> None:
        assert self.kv_index is not None
        log = self.kv_logs[idx]
        log.append(batch)
        rid = self.replicas[idx].replica_id
        instance, seq = self.kv_index.cursor(rid)
        self.kv_index.update(rid, log.read(seq, instance))

    # ---- the end -------------------------------------------------------------------------
    def _check_done(self, records: list[Record]) -> None:
        """Conservation: every request finished or was refused, and no replica holds a
        request or a referenced KV block."""
        lost = [r.request_id for r in records if not r.done]
        if lost:
            raise AssertionError(f"{len(lost)} requests neither finished nor refused: {lost[:5]}")
        for r in self.replicas:
            if r.scheduler.has_unfinished_requests() or r.requests:
                raise AssertionError(f"{r.replica_id} still holds requests")
            if r.leaked_blocks():
                raise AssertionError(f"{r.replica_id} leaked {r.leaked_blocks()} KV blocks")


def run_simulation(
    requests: Sequence[TraceRequest],
    cost_model: StepCostModel,
    num_replicas: int = 1,
    policy: str = "power_of_two",
    engine_args: Any = None,
    *,
    seed: int = 0,
    slo_ttft_s: Optional[float] = None,
    slo_itl_s: Optional[float] = None,
    **cluster_kwargs: Any,
) -> SimResult:
    """Simulate `requests` on `num_replicas` replicas of `engine_args` (an `EngineArgs`, a dict
    of its fields, or None for the defaults) behind `policy`; see `Cluster` for the rest."""
    cluster = Cluster(cost_model, num_replicas, policy, engine_args, seed=seed, **cluster_kwargs)
    return cluster.run(requests, slo_ttft_s=slo_ttft_s, slo_itl_s=slo_itl_s)
