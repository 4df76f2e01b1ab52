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

import threading
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
from fleetserve.scheduler import prefix_salt

TARGET_KWARG = "_fleetserve_target"


class FleetRequestRouter(RequestRouter):
    # Serve declares `initialize_state(**kwargs)`; it calls it with the deployment's
    # request_router_kwargs as keywords, which these name.
    def initialize_state(  # type: ignore[override]
        self, deployment: str, policy: str = "power_of_two", **policy_kwargs: Any
    ) -> None:
        """Serve's call with the deployment's `request_router_kwargs` (cluster/deploy.py):
        `deployment`, the deployment's name (what the registry keys this router by, with the
        public `app_name`), the policy's name and its settings."""
        self.policy: RoutingPolicy = make_policy(policy, **policy_kwargs)
        # How many more requests a replica holding a request's LoRA adapter may have than the
        # policy's pick that lacks it, and still be preferred (prefer_adapter_holders).
        self._lora_slack = int(policy_kwargs.get("imbalance_threshold", 4))
        # internal request id -> (replica id, prompt tokens, request id) for requests in flight.
        self._inflight: dict[str, tuple[str, int, str]] = {}
        self._ongoing: dict[str, list[int]] = {}  # replica id -> [requests, tokens]
        self._lock = threading.Lock()
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

    # -- Serve's hooks ---------------------------------------------------------

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: Optional[PendingRequest] = None
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if not by_id:
            return []
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
        if request is not None and pending_request is not None and ranked:
            self._record(ranked[0][0], request, pending_request)
        return [[by_id[rid] for rid in tier] for tier in ranked]

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
        self.policy.on_replicas_changed({r.replica_id.unique_id for r in replicas})

    # -- bookkeeping -----------------------------------------------------------

    def _rank(self, loads: dict[str, ReplicaLoad], request: Optional[RouteRequest]) -> list[list[str]]:
        ranked = self.policy.rank(list(loads.values()), request)
        if request is not None and request.lora_name:
            ranked = prefer_adapter_holders(ranked, loads, request.lora_name, self._lora_slack)
        return ranked

    def _load(self, r: RunningReplica) -> ReplicaLoad:
        rid = r.replica_id.unique_id
        stats = r.routing_stats or {}
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


def _route_request(pending: Optional[PendingRequest]) -> Optional[RouteRequest]:
    if pending is None or not pending.args or not isinstance(pending.args[0], dict):
        return None
    body = pending.args[0]
    token_ids = body.get("prompt_token_ids")
    if not isinstance(token_ids, list):
        return None
    return RouteRequest(
        request_id=str(body.get("request_id", "")),
        prompt_token_ids=token_ids,
        cache_salt=prefix_salt(body.get("cache_salt"), body.get("lora_key")),
        lora_name=body.get("lora_name") or None,
    )
