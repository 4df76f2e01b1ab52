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

Prefill/decode disaggregation (`pd=(num_prefill, num_decode)`) follows router/routing/pd.py:
a prefill pool and a decode pool, each with its own router and policy instance (and KV index),
as the real app has one router per pool. Per request the decode pool's policy picks the decode
replica first (taken at once: the real flow's reservation), its cached prefix is read from that
pool's KV index (`cached_prompt_tokens`), and the real `wants_remote_prefill` decides:

* decode_only: the decode replica gets the request and computes the prompt itself;
* pd: a prefill replica (its pool's policy) runs the prompt with max_tokens=1 and
  `{"do_remote_decode", transfer_id}`; its scheduler runs the real connector scheduler half
  (kv_transfer.scheduler_half.TransferScheduler, as a kv_producer), which queues the export
  and keeps the blocks (delay_free). Its final output's `kv_transfer_params` go back to the
  router and on to the decode replica (two network hops); the sampled token is not streamed
  to the client (the real router drains the prefill stream for its params). The decode
  replica's scheduler half (a kv_consumer) admits the request into WAITING_FOR_REMOTE_KVS
  with its blocks and hands the load to its worker in the step's connector metadata; the
  load (a pull) starts then and ends `cost.kv_transfer_seconds(bytes, kv_connector)` later,
  bytes being its blocks times `block_size * kv_bytes_per_token`. At its end the decode
  replica is told `finished_recving` and the prefill replica `finished_sending` (its blocks
  free), each at its next step's end. The decode replica then computes the prompt's last
  token and decodes; TTFT is the trace arrival to its first token.

Transfers do not share a link (each runs at the profile's bandwidth), and an export the decode
replica never loads (its own cache held the prompt by then) is released at its first token. The
prefill replica's blocks are held until the pull ends; the real worker half frees them once
they are copied out of the cache (the export keeps the copy), so the simulator holds them a
little longer than the engine does (it never frees them earlier).

Every random choice is the policy's, seeded with `seed`; the run is deterministic.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections import deque
from typing import Any, Callable, Optional, Sequence

from fleetserve.kv_transfer.base import ConnectorContext, ConnectorMetadata
from fleetserve.kv_transfer.config import KVTransferConfig
from fleetserve.kv_transfer.registry import canonical_connector_name
from fleetserve.kv_transfer.scheduler_half import TransferScheduler
from fleetserve.router.routing.kv_index import KVIndex
from fleetserve.router.routing.pd_decision import PDSettings, cached_prompt_tokens, wants_remote_prefill
from fleetserve.router.routing.policies import ReplicaLoad, RouteRequest, RoutingPolicy, make_policy
from fleetserve.router.routing.policies.prefix_aware import PrefixAwareBase
from fleetserve.router.routing.slo import SloAdmission, SloDecision, SloSettings
from fleetserve.scheduler import KVEventBatch, KVEventLog
from fleetserve.sim.replica import SimReplica, StepStart
from fleetserve.sim.result import GapHistogram, Record, SimResult, summarize
from fleetserve.sim.shape import StepCostModel
from fleetserve.sim.traces import DEFAULT_VOCAB_SIZE, TraceRequest

DEFAULT_MAX_MODEL_LEN = 8192  # used when neither the engine args nor the caller set one
DEFAULT_NETWORK_LATENCY_S = 0.0005  # router -> replica, one way
DEFAULT_KV_EVENT_LAG_S = 0.05  # the KV subscriber's poll interval
DEFAULT_STATS_PERIOD_S = 1.0  # RoutingOptions.stats_period_s

DEFAULT_KV_CONNECTOR = "p2p"

_TO_REPLICA, _STEP_END, _REPORT, _KV_EVENTS, _TRANSFER_END, _NOTICE = 0, 1, 2, 3, 4, 5

# The connectors whose transports the simulator stands in for: a hand-off by transfer id, no
# lookup by chain key and no save of every request (shared_storage's prefix cache is not modelled).
_PD_CONNECTORS = ("P2PConnector", "RayObjectStoreConnector")
# What the simulated requests ask of the decode engine (one sequence, no prompt logprobs).
_SIM_SAMPLING: dict[str, Any] = {"n": 1, "prompt_logprobs": None}


class SimTransport:
    """The transport under the real scheduler half, as P2P's and the Ray store's look to it:
    hand-offs by transfer id only (no lookup, no save of every request, no extra params)."""

    supports_lookup = False
    saves_all = False

    def lookup(self, keys: list[str]) -> int:
        return 0

    def location(self, transfer_id: Optional[str]) -> dict[str, Any]:
        return {}

    def shutdown(self) -> None:
        return None


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

    def __init__(
        self, policy: RoutingPolicy, replica_ids: list[str], max_ongoing: int, slo: Optional[SloAdmission] = None
    ) -> None:
        self.policy = policy
        self.max_ongoing = max_ongoing
        # SLO-aware admission (router/routing/slo.py), the object the ingress uses; None: off.
        self.slo = slo
        self.refusal: Optional[SloDecision] = None  # the last `pick`'s refusal, if it refused
        # One load snapshot per replica, updated in place (the policies only read them).
        self.loads = {rid: ReplicaLoad(rid) for rid in replica_ids}
        self._load_list = list(self.loads.values())
        self._inflight: dict[str, tuple[str, int]] = {}  # request id -> (replica, prompt tokens)
        self.held: deque[tuple[Record, list[int]]] = deque()  # every replica was full
        self.num_held = 0

    def route(self, request: RouteRequest, tenant: Optional[str] = None) -> Optional[str]:
        """The replica `request` goes to (recorded as in flight there), or None when every
        replica has `max_ongoing` requests of this router in flight (or the SLO admission
        refused it: `refusal`)."""
        rid = self.pick(request, tenant)
        if rid is not None:
            self.record(rid, request)
        return rid

    def pick(self, request: RouteRequest, tenant: Optional[str] = None) -> Optional[str]:
        """The policy's first replica with room for `request`, not recorded yet; with SLO
        admission, the first of those predicted to meet the request's SLO (None and
        `refusal` set when none is)."""
        ranked = self.policy.rank(self._load_list, request)
        cap, loads = self.max_ongoing, self.loads
        self.refusal = None
        if self.slo is not None:
            room = [rid for tier in ranked for rid in tier if loads[rid].num_ongoing < cap]
            if not room:
                return None
            decision = self.slo.choose(room, len(request.prompt_token_ids), tenant)
            if decision.refused:
                self.refusal = decision
            return decision.replica_id
        for tier in ranked:
            for rid in tier:
                if loads[rid].num_ongoing < cap:
                    return rid
        return None

    def cached_blocks(self, request: RouteRequest, replica_id: str) -> int:
        """The leading prompt blocks `replica_id` caches as the policy knows it (0 for a policy
        that does not know), as `FleetRequestRouter.rank` tells the P/D flow."""
        if not isinstance(self.policy, PrefixAwareBase):
            return 0
        return self.policy.match_lengths(self.policy.block_hashes(request), {replica_id}).get(replica_id, 0)

    def record(self, replica_id: str, request: RouteRequest) -> None:
        n = len(request.prompt_token_ids)
        self._inflight[request.request_id] = (replica_id, n)
        load = self.loads[replica_id]
        load.num_ongoing += 1
        load.ongoing_tokens += n
        self.policy.on_routed(replica_id, request)
        if self.slo is not None:
            self.slo.routed(replica_id, n)

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
        if self.slo is not None:
            self.slo.report(replica_id, stats)


class _Pool:
    """Replicas behind one router: the whole fleet, or one P/D pool."""

    def __init__(
        self,
        name: str,
        policy: RoutingPolicy,
        indices: list[int],
        ids: list[str],
        max_ongoing: int,
        slo: Optional[SloAdmission] = None,
    ) -> None:
        self.name = name
        self.policy = policy
        self.indices = indices  # into Cluster.replicas
        self.router = SimRouter(policy, ids, max_ongoing, slo)
        self.kv_index: Optional[KVIndex] = getattr(policy, "kv_index", None) if policy.uses_kv_events else None


class Cluster:
    """`num_replicas` simulated replicas of one engine config behind one router, or with
    `pd=(num_prefill, num_decode)` a prefill pool and a decode pool (module docstring)."""

    def __init__(
        self,
        cost_model: StepCostModel,
        num_replicas: Optional[int] = None,
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
        pd: Optional[tuple[int, int]] = None,
        pd_min_prefill_tokens: int = PDSettings.min_prefill_tokens,
        kv_connector: str = DEFAULT_KV_CONNECTOR,
        slo: Optional[SloSettings] = None,
    ) -> None:
        if pd is not None:
            num_prefill, num_decode = (int(x) for x in pd)
            if num_prefill < 1 or num_decode < 1:
                raise ValueError(f"pd needs at least one prefill and one decode replica, got {pd}")
            if num_replicas is not None and num_replicas != num_prefill + num_decode:
                raise ValueError(f"num_replicas={num_replicas} but pd={pd} makes {num_prefill + num_decode}")
            num_replicas = num_prefill + num_decode
            if canonical_connector_name(kv_connector) not in _PD_CONNECTORS:
                raise ValueError(f"kv_connector {kv_connector!r} is not simulated for P/D: use p2p or ray_object_store")
            if pd_min_prefill_tokens < 0:
                raise ValueError(f"pd_min_prefill_tokens must be non-negative, got {pd_min_prefill_tokens}")
        if num_replicas is None:
            num_replicas = 1
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
        self.pd = (num_prefill, num_decode) if pd is not None else None
        self.pd_settings = PDSettings(min_prefill_tokens=pd_min_prefill_tokens)
        self.kv_connector = kv_connector

        def new_policy(seed_offset: int) -> RoutingPolicy:
            kwargs = dict(policy_kwargs or {})
            kwargs.setdefault("seed", seed + seed_offset)
            kwargs.setdefault("clock", self.clock)
            return make_policy(policy, **kwargs)

        # The decode pool's router (or the fleet's) is built first: its policy is `self.policy`.
        self.policy = new_policy(0)
        prefill_policy = new_policy(1) if pd is not None else None
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
        self.block_size = cache_cfg.block_size
        for p in (self.policy, prefill_policy):
            if p is not None:
                p.set_hashing(cache_cfg.block_size, cache_cfg.prefix_caching_hash_algo)
        if max_ongoing_requests is None:
            max_ongoing_requests = args.max_num_seqs + args.max_waiting_requests + 8
        # SLO-aware admission at the (decode pool's) router, with the engines' step budget.
        self.slo: Optional[SloAdmission] = None
        if slo is not None and slo.enabled:
            slo = dataclasses.replace(
                slo,
                max_num_batched_tokens=sched_cfg.max_num_batched_tokens,
                max_num_seqs=sched_cfg.max_num_seqs,
                block_size=cache_cfg.block_size,
            )
            self.slo = SloAdmission(slo, self.clock)
        if self.pd is None:
            self.replicas = [
                SimReplica(f"replica-{i}", sched_cfg, cache_cfg, cost_model, vocab_size) for i in range(num_replicas)
            ]
            ids = [r.replica_id for r in self.replicas]
            self.decode_pool = _Pool(
                "colocated", self.policy, list(range(num_replicas)), ids, max_ongoing_requests, self.slo
            )
            self.prefill_pool: Optional[_Pool] = None
            pools = [self.decode_pool]
        else:
            assert prefill_policy is not None
            num_prefill, num_decode = self.pd
            self.replicas = [
                SimReplica(
                    f"prefill-{i}",
                    sched_cfg,
                    cache_cfg,
                    cost_model,
                    vocab_size,
                    self._connector("kv_producer", f"prefill-{i}"),
                    "prefill",
                )
                for i in range(num_prefill)
            ] + [
                SimReplica(
                    f"decode-{i}",
                    sched_cfg,
                    cache_cfg,
                    cost_model,
                    vocab_size,
                    self._connector("kv_consumer", f"decode-{i}"),
                    "decode",
                )
                for i in range(num_decode)
            ]
            p_idx = list(range(num_prefill))
            d_idx = list(range(num_prefill, num_replicas))
            self.prefill_pool = _Pool(
                "prefill", prefill_policy, p_idx, [self.replicas[i].replica_id for i in p_idx], max_ongoing_requests
            )
            self.decode_pool = _Pool(
                "decode",
                self.policy,
                d_idx,
                [self.replicas[i].replica_id for i in d_idx],
                max_ongoing_requests,
                self.slo,
            )
            pools = [self.prefill_pool, self.decode_pool]
        self.pools = pools
        self._pool_of = [self.decode_pool] * num_replicas
        for pool in pools:
            for i in pool.indices:
                self._pool_of[i] = pool
        self._by_id = {r.replica_id: i for i, r in enumerate(self.replicas)}
        self.router = self.decode_pool.router
        self.kv_index: Optional[KVIndex] = self.decode_pool.kv_index
        self.kv_logs = [KVEventLog() for _ in self.replicas] if any(p.kv_index is not None for p in pools) else []
        self.config = {
            "num_replicas": num_replicas,
            "policy": policy,
            "seed": seed,
            "max_model_len": self.max_model_len,
            "num_blocks": self.num_blocks,
            "block_size": cache_cfg.block_size,
            "max_num_seqs": sched_cfg.max_num_seqs,
            "max_num_batched_tokens": sched_cfg.max_num_batched_tokens,
            "scheduling_policy": sched_cfg.policy,
            "enable_prefix_caching": cache_cfg.enable_prefix_caching,
            "enable_chunked_prefill": sched_cfg.enable_chunked_prefill,
            "network_latency_s": network_latency_s,
            "stats_period_s": stats_period_s,
            "kv_event_lag_s": kv_event_lag_s,
            "max_ongoing_requests": max_ongoing_requests,
        }
        if self.slo is not None:
            st = self.slo.settings
            self.config["slo_admission"] = {
                "ttft_s": st.default.ttft_s,
                "itl_s": st.default.itl_s,
                "tenants": {k: v.to_dict() for k, v in st.tenants.items()},
                "profile": (st.profile or {}).get("name", "unnamed") if st.profile is not None else None,
                "headroom": st.headroom,
            }
        if self.pd is not None:
            self.config.update(pd=list(self.pd), pd_min_prefill_tokens=pd_min_prefill_tokens, kv_connector=kv_connector)

    def _connector(self, role: str, engine_id: str) -> TransferScheduler:
        """The real connector scheduler half of a P/D pool's engine (`PDOptions.kv_transfer_config`
        of its role), over the simulator's transport and virtual clock."""
        config = KVTransferConfig.model_validate(
            {"kv_connector": self.kv_connector, "kv_role": role, "engine_id": engine_id}
        )
        ctx = ConnectorContext(
            engine_id=engine_id,
            fingerprint="sim",
            block_size=self.block_size,
            num_layers=1,
            num_kv_heads=1,
            head_dim=1,
        )
        return TransferScheduler(config, ctx, SimTransport(), clock=self.clock)  # type: ignore[arg-type]

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
        for rec, tr in zip(records, trace):  # what a length predictor sees
            rec.session, rec.max_tokens = tr.session, tr.max_tokens
        self._records = {r.request_id: r for r in records}
        self._prefills: dict[str, Record] = {}  # prefill request id -> its client request
        self._ids: dict[str, list[int]] = {}  # client request id -> prompt, while it is in prefill
        self._exports: dict[str, tuple[int, str]] = {}  # transfer id -> (prefill replica, its request)
        self._handoff: dict[str, str] = {}  # client request id -> transfer id, until its first token
        self.kv_bytes_moved = 0
        self._itl = GapHistogram()
        self._heap: list[tuple[float, int, int, int, Any]] = []
        self._seq = 0
        self._open = 0  # requests routed or held and not finished
        self._end = 0.0
        self._pending_arrivals = len(order)
        self._push(0.0, _REPORT, 0, None)
        n = len(order)
        done = self._loop(trace, order, records, progress)
        if progress is not None:
            progress(done, n)
        self._check_done(records)
        return self._summarize(records, wall0, slo_ttft_s, slo_itl_s)

    def _loop(self, trace, order, records, progress) -> int:
        """The event loop: arrivals in trace order interleaved with the heap's events."""
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
                elif kind == _TRANSFER_END:
                    done += self._on_transfer_end(idx, payload)
                elif kind == _NOTICE:
                    if not self.replicas[idx].busy:
                        done += self._kick(idx)
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
        return done

    def _summarize(self, records, wall0: float, slo_ttft_s: Optional[float], slo_itl_s: Optional[float]) -> SimResult:
        duration = max(self._end, max((r.arrival_s for r in records), default=0.0))
        replicas = []
        for r in self.replicas:
            s = r.scheduler
            entry: dict[str, Any] = {
                "replica": r.replica_id,
                "utilization": r.busy_s / duration if duration else 0.0,
                "busy_s": r.busy_s,
                "steps": r.num_steps,
                "tokens": r.num_tokens,
                "preemptions": s.num_preemptions,
                "prefix_cache_queries": s.kv.prefix_cache_queries,
                "prefix_cache_hits": s.kv.prefix_cache_hits,
            }
            if r.pool is not None:
                entry["pool"] = r.pool
            replicas.append(entry)
        config = dict(self.config, router_held=sum(p.router.num_held for p in self.pools))
        result = summarize(
            records, duration, replicas, self._itl, config, slo_ttft_s, slo_itl_s, kv_bytes_moved=self.kv_bytes_moved
        )
        if self.pd is not None:
            result.pd = self._pd_summary(records, replicas)
        result.wall_s = time.perf_counter() - wall0
        return result

    def _pd_summary(self, records: list[Record], replicas: list[dict[str, Any]]) -> dict[str, Any]:
        paths: dict[str, int] = {"pd": 0, "decode_only": 0, "prefill_failed": 0}
        for r in records:
            if r.path is not None:
                paths[r.path] = paths.get(r.path, 0) + 1
        pools = {}
        for pool in self.pools:
            util = [replicas[i]["utilization"] for i in pool.indices]
            pools[pool.name] = {
                "replicas": len(pool.indices),
                "utilization": sum(util) / len(util),
                "busy_s": sum(replicas[i]["busy_s"] for i in pool.indices),
                "tokens": sum(replicas[i]["tokens"] for i in pool.indices),
                "router_held": pool.router.num_held,
            }
        return {
            "prefill_replicas": self.pd[0] if self.pd else 0,
            "decode_replicas": self.pd[1] if self.pd else 0,
            "min_prefill_tokens": self.pd_settings.min_prefill_tokens,
            "kv_connector": self.kv_connector,
            "paths": paths,
            "kv_bytes_moved": self.kv_bytes_moved,
            "pools": pools,
        }

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
        if not self._dispatch(rec, ids):
            self.decode_pool.router.held.append((rec, ids))
            self.decode_pool.router.num_held += 1
        return 0

    def _dispatch(self, rec: Record, ids: list[int]) -> bool:
        """Send a request on (False: every replica of the pool it needs first is full)."""
        router = self.decode_pool.router
        request = RouteRequest(rec.request_id, ids)
        if self.pd is None:
            rid = router.route(request, rec.tenant)
            if rid is None:
                return self._refused_by_slo(rec, router)
            rec.replica = rid
            self._send(self._by_id[rid], (rec, ids, rec.request_id, rec.output_tokens, None), 1)
            return True
        # P/D (router/routing/pd.py): the decode replica first, then the decision.
        rid = router.pick(request, rec.tenant)
        if rid is None:
            return self._refused_by_slo(rec, router)
        cached = cached_prompt_tokens(router.cached_blocks(request, rid), self.block_size, len(ids))
        router.record(rid, request)  # the reservation, taken before any prefill runs
        rec.replica = rid
        if not wants_remote_prefill(len(ids), cached, _SIM_SAMPLING, self.pd_settings):
            rec.path = "decode_only"
            self._send(self._by_id[rid], (rec, ids, rec.request_id, rec.output_tokens, None), 1)
            return True
        rec.path = "pd"
        if not self._dispatch_prefill(rec, ids):
            assert self.prefill_pool is not None
            self.prefill_pool.router.held.append((rec, ids))
            self.prefill_pool.router.num_held += 1
        return True

    def _refused_by_slo(self, rec: Record, router: SimRouter) -> bool:
        """After a pick found no replica: True when the SLO admission refused the request (it
        is done, as the client's 429), False when every replica was full (it waits)."""
        decision = router.refusal
        if decision is None:
            return False
        rec.refused = f"slo_{decision.reason}: {decision.message}"
        self._open -= 1
        return True

    def _dispatch_prefill(self, rec: Record, ids: list[int]) -> bool:
        """The prompt to a prefill replica as a one-token request that exports its KV
        (`export_body`), or False when the prefill pool is full."""
        assert self.prefill_pool is not None
        sub_id = f"{rec.request_id}-p0"
        rid = self.prefill_pool.router.route(RouteRequest(sub_id, ids))
        if rid is None:
            return False
        rec.prefill_replica = rid
        self._prefills[sub_id] = rec
        self._ids[rec.request_id] = ids
        params = {"do_remote_decode": True, "transfer_id": f"{rec.request_id}-t0"}
        self._send(self._by_id[rid], (rec, ids, sub_id, 1, params), 1)
        return True

    def _send(self, idx: int, payload: tuple[Any, ...], hops: int) -> None:
        self._push(self.now + hops * self.network_latency_s, _TO_REPLICA, idx, payload)

    def _on_to_replica(self, idx: int, payload: tuple[Any, ...]) -> None:
        rec, ids, request_id, max_tokens, params = payload
        replica = self.replicas[idx]
        client = (rec.session, rec.max_tokens) if request_id == rec.request_id else (None, None)
        replica.add_request(request_id, ids, max_tokens, rec.arrival_s, rec.priority, params, rec.tenant, *client)
        if not replica.busy:
            self._start(idx)

    def _start(self, idx: int) -> None:
        replica = self.replicas[idx]
        while True:
            step = replica.start_step()
            meta = step.output.kv_connector_metadata
            if meta is not None:
                self._on_connector_meta(idx, meta)
            if step.seconds != 0.0 or step.output.total_num_scheduled_tokens != 0:
                self._push(self.now + step.seconds, _STEP_END, idx, step)
                return
            # Nothing to compute (only finishes to tell the workers, or transfers' ends to hear
            # of): apply it now. Once a transfer's end was heard of, schedule again (a loaded
            # request waits to run, freed blocks admit others); otherwise go idle.
            noticed = bool(replica.finished_sending or replica.finished_recving)
            self._apply(idx, step)
            if not (noticed and replica.scheduler.has_requests()):
                return

    def _on_connector_meta(self, idx: int, meta: ConnectorMetadata) -> None:
        """What the scheduler half handed its worker this step: an export is ready to pull
        once its step ends (its blocks stay held, delay_free); a load starts its pull now."""
        for save in meta.saves:
            if save.transfer_id is not None:
                self._exports[save.transfer_id] = (idx, save.req_id)
        for load in meta.loads:
            tid = load.transfer_id
            export = self._exports.pop(tid, None) if tid is not None else None
            if export is None:
                raise AssertionError(f"{load.req_id} loads transfer {tid!r}, which no prefill replica exports")
            nbytes = len(load.block_ids) * self.block_size * int(self.cost.kv_bytes_per_token())
            seconds = float(self.cost.kv_transfer_seconds(nbytes, self.kv_connector))
            if not seconds >= 0.0:
                raise ValueError(f"the cost model returned {seconds!r} s to move {nbytes} bytes")
            self._handoff.pop(load.req_id, None)
            self._push(self.now + seconds, _TRANSFER_END, idx, (load.req_id, export, nbytes))
        for rid in meta.cancels:  # (the simulator aborts nothing; a cancel ends at once)
            self.replicas[idx].finished_sending.add(rid)

    def _on_transfer_end(self, idx: int, payload: tuple[str, tuple[int, str], int]) -> int:
        req_id, (p_idx, p_req), nbytes = payload
        self.kv_bytes_moved += nbytes
        self.replicas[idx].finished_recving.add(req_id)
        self.replicas[p_idx].finished_sending.add(p_req)
        done = 0
        for i in (idx, p_idx):
            if not self.replicas[i].busy:
                done += self._kick(i)
        return done

    def _kick(self, idx: int) -> int:
        """Start an idle replica (a transfer's end to hear of); finishes it applied."""
        before = self._finished
        self._start(idx)
        return self._finished - before

    def _on_step_end(self, idx: int, step: StepStart) -> int:
        done = self._apply(idx, step)
        self._end = self.now
        if self.replicas[idx].scheduler.has_requests():
            self._start(idx)
        return done

    _finished = 0  # requests finished so far (what an empty step applied inside _start finished)

    def _apply(self, idx: int, step: StepStart) -> int:
        """Apply a step's outputs at `now`: token times, finishes; returns requests finished."""
        replica = self.replicas[idx]
        outputs, kv_batch = replica.finish_step(step)
        if kv_batch is not None and self._pool_of[idx].kv_index is not None:
            self._push(self.now + self.kv_event_lag_s, _KV_EVENTS, idx, kv_batch)
        now = self.now
        recs = self._records
        gaps = self._itl.counts
        finished = 0
        for out in outputs:
            rec = recs.get(out.request_id)
            if rec is None:  # a prefill request: its token is not the client's
                if out.finish_reason is not None:
                    self._finish_prefill(replica, out.request_id, out.kv_transfer_params)
                continue
            k = len(out.new_token_ids)
            if k:
                if rec.first_token_s < 0:
                    rec.first_token_s = now
                    if self._handoff:
                        self._release_unloaded(rec.request_id)
                else:
                    gap = now - rec.last_token_s
                    gaps[gap] = gaps.get(gap, 0) + 1
                rec.last_token_s = now
                rec.num_output += k
            if out.finish_reason is not None:
                finished += 1
                self._finish(replica, rec, out.finish_reason, out.num_cached_tokens, out.num_remote_tokens)
        if len(gaps) > self._itl.max_keys:
            self._itl.maybe_fold()
        self._finished += finished
        return finished

    def _finish_prefill(self, replica: SimReplica, sub_id: str, params: Optional[dict[str, Any]]) -> None:
        """A prefill ended: its params go back to the router and on to the decode replica
        (`_open_decode`), which computes the prompt itself when there are none."""
        rec = self._prefills.pop(sub_id)
        ids = self._ids.pop(rec.request_id)
        replica.forget(sub_id)
        assert self.prefill_pool is not None
        router = self.prefill_pool.router
        router.release(sub_id)
        if params is None:
            rec.path = "prefill_failed"
        else:
            self._handoff[rec.request_id] = params["transfer_id"]
        assert rec.replica is not None
        self._send(self._by_id[rec.replica], (rec, ids, rec.request_id, rec.output_tokens, params), 2)
        while router.held:
            held_rec, held_ids = router.held[0]
            if not self._dispatch_prefill(held_rec, held_ids):
                break
            router.held.popleft()

    def _release_unloaded(self, request_id: str) -> None:
        """A decode replica answered without loading its hand-off (its cache held the prompt):
        the router releases the export (`release_soon`), and the prefill replica's blocks go."""
        tid = self._handoff.pop(request_id, None)
        export = self._exports.pop(tid, None) if tid is not None else None
        if export is None:
            return
        p_idx, p_req = export
        self.replicas[p_idx].finished_sending.add(p_req)
        # Heard of as the prefill replica's next event (not from inside this replica's step).
        self._push(self.now, _NOTICE, p_idx, None)

    def _finish(self, replica: SimReplica, rec: Record, reason: str, cached: int, remote: int = 0) -> None:
        rec.finish_s = self.now
        rec.finish_reason = reason
        rec.num_cached_tokens = cached
        rec.num_remote_tokens = remote
        request = replica.forget(rec.request_id)
        if request is not None:
            rec.num_preemptions = request.num_preemptions
            rec.predicted_output_tokens = request.predicted_output_tokens
        if rec.num_output == 0:
            rec.refused = f"finished_without_output: {reason}"
        self._open -= 1
        router = self.decode_pool.router
        router.release(rec.request_id)
        while router.held:
            held_rec, ids = router.held[0]
            if not self._dispatch(held_rec, ids):
                break
            router.held.popleft()

    def _on_report(self) -> None:
        for pool in self.pools:
            router = pool.router
            for i in pool.indices:
                r = self.replicas[i]
                stats = r.scheduler.get_stats()
                report = {
                    "num_running": stats.num_running,
                    "num_waiting": stats.num_waiting + stats.num_waiting_for_remote_kvs,
                    "kv_cache_usage": stats.kv_cache_usage,
                }
                if router.slo is not None:  # the rest of EngineCore.get_load, which it reads
                    report.update(
                        num_queued_tokens=r.scheduler.num_queued_tokens(),
                        num_blocks=stats.num_blocks,
                        num_steps=r.num_steps,
                        busy_s=r.busy_s,
                        num_step_tokens=r.num_tokens,
                    )
                router.report(r.replica_id, report)
        if self._open or self._pending_arrivals:
            self._push(self.now + self.stats_period_s, _REPORT, 0, None)

    def _on_kv_events(self, idx: int, batch: KVEventBatch) -> None:
        index = self._pool_of[idx].kv_index
        assert index is not None
        log = self.kv_logs[idx]
        log.append(batch)
        rid = self.replicas[idx].replica_id
        instance, seq = index.cursor(rid)
        index.update(rid, log.read(seq, instance))

    # ---- the end -------------------------------------------------------------------------
    def _check_done(self, records: list[Record]) -> None:
        """Conservation: every request finished or was refused, and no replica holds a
        request, a KV block (a prefill replica's delayed frees included) or an export."""
        lost = [r.request_id for r in records if not r.done]
        if lost:
            raise AssertionError(f"{len(lost)} requests neither finished nor refused: {lost[:5]}")
        for r in self.replicas:
            s = r.scheduler
            if s.has_unfinished_requests() or r.requests or s.sending:
                raise AssertionError(f"{r.replica_id} still holds requests")
            if r.leaked_blocks():
                raise AssertionError(f"{r.replica_id} leaked {r.leaked_blocks()} KV blocks")
        if self._exports or self._prefills:
            raise AssertionError(f"exports never loaded nor released: {sorted(self._exports)[:5]}")


def run_simulation(
    requests: Sequence[TraceRequest],
    cost_model: StepCostModel,
    num_replicas: Optional[int] = None,
    policy: str = "power_of_two",
    engine_args: Any = None,
    *,
    seed: int = 0,
    slo_ttft_s: Optional[float] = None,
    slo_itl_s: Optional[float] = None,
    pd: Optional[tuple[int, int]] = None,
    pd_min_prefill_tokens: int = PDSettings.min_prefill_tokens,
    kv_connector: str = DEFAULT_KV_CONNECTOR,
    progress: Optional[Callable[[int, int], None]] = None,
    **cluster_kwargs: Any,
) -> SimResult:
    """Simulate `requests` on `num_replicas` replicas of `engine_args` (an `EngineArgs`, a dict
    of its fields, or None for the defaults) behind `policy`, or with `pd=(num_prefill,
    num_decode)` on a prefill pool and a decode pool handing KV over by `kv_connector` (prompts
    with fewer than `pd_min_prefill_tokens` uncached tokens stay on the decode pool; num_replicas,
    if given, must be their sum); see `Cluster` for the rest."""
    cluster = Cluster(
        cost_model,
        num_replicas,
        policy,
        engine_args,
        seed=seed,
        pd=pd,
        pd_min_prefill_tokens=pd_min_prefill_tokens,
        kv_connector=kv_connector,
        **cluster_kwargs,
    )
    return cluster.run(requests, slo_ttft_s=slo_ttft_s, slo_itl_s=slo_itl_s, progress=progress)
