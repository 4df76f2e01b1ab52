"""Ray Serve's custom request router, driven by a fleetserve routing policy.

Serve builds one `FleetRequestRouter` per deployment handle, in the process that
holds the handle (the ingress replica), and asks `choose_replicas()` for ranked
tiers of replicas for every call. This class turns Serve's `RunningReplica`s into
plain `ReplicaLoad` snapshots, lets the policy rank them, and keeps the router's
own exact in-flight accounting (requests and prompt tokens per replica), which
`on_request_completed` releases. Engine-reported load (`record_routing_stats` on
the replica deployment, every `stats_period_s`) arrives on `RunningReplica.routing_stats`.

Two kinds of calls go through it:
- `generate(request_dict)`: `request_dict["prompt_token_ids"]` is what the
  prefix-aware policy hashes (the ingress tokenizes before routing).
- calls pinned to one replica: a keyword argument `_fleetserve_target=<replica id>`
  makes the router return exactly that replica. The ingress uses it to reach
  every replica (metrics, load); it learns their ids from `replica_ids()` of
  the router registered in `router.routing.registry` under the deployment's name.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from fleetserve.router.routing import registry
from fleetserve.router.routing.migration import AVOID_KEY
from fleetserve.router.routing.policies import (
    ReplicaLoad,
    RouteRequest,
    RoutingPolicy,
    make_policy,
    prefer_adapter_holders,
)
from fleetserve.router.routing.policies.prefix_aware import PrefixAwareBase
from fleetserve.router.routing.slo import SLO_PICK_KEY, SloAdmission, SloDecision, SloSettings
from fleetserve.router.tracing import TRACE_KEY
from fleetserve.router.tracing import carrier_of as trace_carrier_of
from fleetserve.router.tracing import current as current_tracing
from fleetserve.scheduler import prefix_salt

logger = logging.getLogger("ray.serve")

TARGET_KWARG = "_fleetserve_target"


class FleetRequestRouter(RequestRouter):
    # Serve declares `initialize_state(**kwargs)`; it calls it with the deployment's
    # request_router_kwargs as keywords, which these name.
    def initialize_state(  # type: ignore[override]
        self, deployment: str, policy: str = "power_of_two", slo: Optional[dict] = None, **policy_kwargs: Any
    ) -> None:
        """Serve's call with the deployment's `request_router_kwargs` (cluster/deploy.py):
        `deployment`, the deployment's name (what the registry keys this router by, with the
        public `app_name`), the policy's name and its settings, and the SLO admission's
        settings (`SloSettings.to_dict()`; None: off)."""
        self.policy: RoutingPolicy = make_policy(policy, **policy_kwargs)
        # SLO-aware admission (router/routing/slo.py): the ingress asks `slo_decide` before it
        # sends a request, and the pick it makes goes first here. Fed the replicas' reports.
        self.slo: Optional[SloAdmission] = SloAdmission(SloSettings.from_dict(slo)) if slo else None
        self._slo_seen: dict[str, int] = {}  # replica id -> id() of the last report fed to it
        # How many more requests a replica holding a request's LoRA adapter may have than the
        # policy's pick that lacks it, and still be preferred (prefer_adapter_holders).
        self._lora_slack = int(policy_kwargs.get("imbalance_threshold", 4))
        # internal request id -> (replica id, prompt tokens, request id) for requests in flight.
        self._inflight: dict[str, tuple[str, int, str]] = {}
        self._ongoing: dict[str, list[int]] = {}  # replica id -> [requests, tokens]
        self._lock = threading.Lock()
        self._fleet_deployment = deployment
        registry.register(self.app_name, deployment, self)

    # -- what the ingress asks -------------------------------------------------

    def replica_ids(self) -> list[str]:
        return [rid.unique_id for rid in list(self.curr_replicas)]

    def replica_actors(self) -> dict[str, Any]:
        """Replica id -> the replica's Ray actor handle: for control-plane calls that must not
        queue behind requests (router.health), as Serve's own health checks do."""
        # (`_actor_handle` is private: Ray 2.60's RunningReplica exposes only `actor_id`, and no
        # public API calls a replica outside Serve's request queue.)
        return {rid.unique_id: r._actor_handle for rid, r in list(self.curr_replicas.items())}

    def ongoing(self) -> dict[str, int]:
        with self._lock:
            return {rid: v[0] for rid, v in self._ongoing.items()}

    def rank(self, request: RouteRequest) -> list[tuple[str, int]]:
        """The policy's order for `request` over the current replicas, each with the leading
        prompt blocks it caches (0 for policies that do not know): what the P/D flow asks
        to pick the decode replica before it decides on a prefill."""
        loads = {r.replica_id.unique_id: self._load(r) for r in self.curr_replicas.values()}
        ranked = [t[0] for t in self._rank(loads, request)]
        if not isinstance(self.policy, PrefixAwareBase) or not ranked:
            return [(rid, 0) for rid in ranked]
        hits = self.policy.match_lengths(self.policy.block_hashes(request), set(ranked))
        return [(rid, hits.get(rid, 0)) for rid in ranked]

    def slo_decide(self, body: dict) -> Optional[SloDecision]:
        """SLO admission for a generate body (its prompt, its tenant) over the current replicas
        in the policy's order: where it should go, or its refusal; None when admission is off
        or there is no replica yet."""
        slo = getattr(self, "slo", None)
        request = _request_of(body)
        if slo is None or request is None or not slo.settings.target_for(body.get("tenant")).active:
            return None  # (a request without targets keeps the policy's routing as it is)
        loads = {r.replica_id.unique_id: self._load(r) for r in list(self.curr_replicas.values())}
        if not loads:
            return None
        ranked = [rid for tier in _avoiding_ids(self._rank(loads, request), body) for rid in tier]
        return slo.choose(ranked, len(request.prompt_token_ids), body.get("tenant"))

    # -- Serve's hooks ---------------------------------------------------------

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: Optional[PendingRequest] = None
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if not by_id:
            return []
        traced = _traced_body(pending_request)
        if traced is not None:
            start_ns = time.time_ns()
            tiers = self._choose(by_id, pending_request)
            self._trace_route(traced, by_id, tiers, pending_request, start_ns)
            return tiers
        return self._choose(by_id, pending_request)

    def _choose(
        self, by_id: dict[str, RunningReplica], pending_request: Optional[PendingRequest]
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Without this Serve retries a full tier in a tight loop, starving its
            # own event loop (the probes that would free the tier never run).
            pending_request.routing_context.should_backoff = True
        target = pending_request.kwargs.get(TARGET_KWARG) if pending_request else None
        request = _route_request(pending_request)
        if target is not None:
            # A pinned call to a replica that is gone goes anywhere; the caller
            # sees which replica answered. A pinned generate (P/D: the router chose
            # the decode replica itself) still counts toward that replica's load.
            if target not in by_id:
                return [list(by_id.values())]
            if request is not None and pending_request is not None:
                self._record(target, request, pending_request)
            return [[by_id[target]]]
        ranked = self._rank({rid: self._load(r) for rid, r in by_id.items()}, request)
        ranked = _avoiding(ranked, pending_request)
        pick = _slo_pick(pending_request)
        if pick is not None and any(pick in tier for tier in ranked):  # the SLO admission's choice goes first
            ranked = [[pick]] + [t for t in ([r for r in tier if r != pick] for tier in ranked) if t]
        if request is not None and pending_request is not None and ranked:
            self._record(ranked[0][0], request, pending_request)
        return [[by_id[rid] for rid in tier] for tier in ranked]

    def _trace_route(
        self,
        body: dict,
        by_id: dict[str, RunningReplica],
        tiers: list[list[RunningReplica]],
        pending: Optional[PendingRequest],
        start_ns: int,
    ) -> None:
        """The `route` span of a traced call (router/tracing.py): the policy, the candidates,
        the pick and why (pinned by the P/D or reuse flow, the policy's first choice, or a
        migrated request's choice that skips the replicas that failed it), the pick's load."""
        tracing = current_tracing()
        carrier = trace_carrier_of(body)
        if tracing is None or carrier is None:
            return
        try:
            chosen = tiers[0][0].replica_id.unique_id if tiers and tiers[0] else None
            target = pending.kwargs.get(TARGET_KWARG) if pending is not None else None
            reason = "pinned" if target is not None and target in by_id else "policy"
            if body.get(AVOID_KEY):
                reason = "policy, avoiding failed replicas"
            attrs: dict[str, Any] = {
                "fleetserve.route.deployment": self._deployment_name(),
                "fleetserve.route.policy": getattr(self.policy, "name", type(self.policy).__name__),
                "fleetserve.route.candidates": len(by_id),
                "fleetserve.route.replica": chosen,
                "fleetserve.route.reason": reason,
                "fleetserve.route.tiers": len(tiers),
            }
            if chosen is not None:
                load = self._load(by_id[chosen])
                attrs.update(
                    {
                        "fleetserve.route.replica_ongoing": load.num_ongoing,
                        "fleetserve.route.replica_running": load.num_running,
                        "fleetserve.route.replica_waiting": load.num_waiting,
                        "fleetserve.route.replica_kv_usage": round(load.kv_cache_usage, 4),
                    }
                )
                request = _route_request(pending)
                if isinstance(self.policy, PrefixAwareBase) and request is not None:
                    hits = self.policy.match_lengths(self.policy.block_hashes(request), {chosen})
                    attrs["fleetserve.route.prefix_hit_blocks"] = hits.get(chosen, 0)
            if tracing.settings.detailed:
                attrs["fleetserve.route.candidate_loads"] = [
                    f"{rid}: ongoing={ld.num_ongoing} running={ld.num_running} waiting={ld.num_waiting} "
                    f"kv={ld.kv_cache_usage:.3f}"
                    for rid, ld in ((rid, self._load(r)) for rid, r in sorted(by_id.items()))
                ]
            tracing.record("route", tracing.extract(carrier), start_ns, time.time_ns(), attrs)
        except Exception as e:  # noqa: BLE001 - observability never fails routing
            logger.debug("route span: %r", e)

    def _deployment_name(self) -> Optional[str]:
        return getattr(self, "_fleet_deployment", None)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.release_request(internal_request_id)

    def release_request(self, internal_request_id: str) -> None:
        """Stop counting a request: Serve's completion callback, or the ingress when its call
        ended (registry.release_request), whichever comes first; the second finds nothing."""
        with self._lock:
            entry = self._inflight.pop(internal_request_id, None)
            if entry is not None:
                self._release(*entry[:2])
        if entry is not None:
            self.policy.on_completed(entry[2])

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        ids = {r.replica_id.unique_id for r in replicas}
        self.policy.on_replicas_changed(ids)
        slo = getattr(self, "slo", None)
        if slo is not None:
            slo.forget(ids)

    # -- bookkeeping -----------------------------------------------------------

    def _rank(self, loads: dict[str, ReplicaLoad], request: Optional[RouteRequest]) -> list[list[str]]:
        ranked = self.policy.rank(list(loads.values()), request)
        if request is not None and request.lora_name:
            ranked = prefer_adapter_holders(ranked, loads, request.lora_name, self._lora_slack)
        return ranked

    def _load(self, r: RunningReplica) -> ReplicaLoad:
        rid = r.replica_id.unique_id
        stats = r.routing_stats or {}
        slo = getattr(self, "slo", None)
        if slo is not None and stats and self._slo_seen.get(rid) != id(stats):
            # Serve replaces the dict at each poll of record_routing_stats: a new report.
            self._slo_seen[rid] = id(stats)
            slo.report(rid, stats)
        with self._lock:
            requests, tokens = self._ongoing.get(rid, (0, 0))
        return ReplicaLoad(
            replica_id=rid,
            num_ongoing=requests,
            ongoing_tokens=tokens,
            num_running=int(stats.get("num_running", 0)),
            num_waiting=int(stats.get("num_waiting", 0)),
            kv_cache_usage=float(stats.get("kv_cache_usage", 0.0)),
            loras=frozenset(stats.get("loras") or ()),
        )

    def _record(self, replica_id: str, request: RouteRequest, pending: PendingRequest) -> None:
        internal_id = pending.metadata.internal_request_id
        with self._lock:
            previous = self._inflight.pop(internal_id, None)
            if previous is not None:  # Serve retried routing (a full tier): undo
                self._release(*previous[:2])
            entry = (replica_id, len(request.prompt_token_ids), request.request_id)
            self._inflight[internal_id] = entry
            counts = self._ongoing.setdefault(replica_id, [0, 0])
            counts[0] += 1
            counts[1] += len(request.prompt_token_ids)
        if previous is None:
            self.policy.on_routed(replica_id, request)
            slo = getattr(self, "slo", None)
            if slo is not None:
                slo.routed(replica_id, len(request.prompt_token_ids))

    def _release(self, replica_id: str, num_tokens: int) -> None:
        counts = self._ongoing.get(replica_id)
        if counts is not None:
            counts[0] = max(0, counts[0] - 1)
            counts[1] = max(0, counts[1] - num_tokens)


def _avoiding(ranked: list[list[str]], pending: Optional[PendingRequest]) -> list[list[str]]:
    """A migrated request's continuation skips the replicas that failed it (router.routing.migration),
    unless no other replica is left."""
    body = pending.args[0] if pending is not None and pending.args else None
    avoid = body.get(AVOID_KEY) if isinstance(body, dict) else None
    if not avoid:
        return ranked
    kept = [[rid for rid in tier if rid not in avoid] for tier in ranked]
    kept = [tier for tier in kept if tier]
    return kept or ranked


def _avoiding_ids(ranked: list[list[str]], body: dict) -> list[list[str]]:
    avoid = body.get(AVOID_KEY)
    if not avoid:
        return ranked
    kept = [t for t in ([rid for rid in tier if rid not in avoid] for tier in ranked) if t]
    return kept or ranked


def _slo_pick(pending: Optional[PendingRequest]) -> Optional[str]:
    body = pending.args[0] if pending is not None and pending.args else None
    return body.get(SLO_PICK_KEY) if isinstance(body, dict) else None


def _traced_body(pending: Optional[PendingRequest]) -> Optional[dict]:
    """The body of a traced call (it carries router.tracing.TRACE_KEY), else None."""
    if pending is None or not pending.args:
        return None
    body = pending.args[0]
    return body if isinstance(body, dict) and TRACE_KEY in body else None


def _route_request(pending: Optional[PendingRequest]) -> Optional[RouteRequest]:
    if pending is None or not pending.args or not isinstance(pending.args[0], dict):
        return None
    return _request_of(pending.args[0])


def _request_of(body: dict) -> Optional[RouteRequest]:
    token_ids = body.get("prompt_token_ids")
    if not isinstance(token_ids, list):
        return None
    return RouteRequest(
        request_id=str(body.get("request_id", "")),
        prompt_token_ids=token_ids,
        cache_salt=prefix_salt(body.get("cache_salt"), body.get("lora_key")),
        lora_name=body.get("lora_name") or None,
    )
