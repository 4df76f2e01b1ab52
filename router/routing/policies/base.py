"""The routing-policy interface: rank replicas for one request, without Ray.

A policy sees plain `ReplicaLoad` snapshots and a `RouteRequest`, and returns
ranked tiers of replica ids (first tier preferred; later tiers are fallbacks
when Serve finds every replica of a tier full). `router/routing/request_router.py`
adapts this to Ray Serve's `RequestRouter`, so policies stay unit-testable.

Load a router can know:
- `num_ongoing`: requests this router sent and that have not finished (exact
  and instant for this router; another ingress replica's traffic shows up only
  through the replica's reported stats).
- `num_running` / `num_waiting` / `kv_cache_usage`: what the engine reported in
  its last routing-stats snapshot (about a second old); `loras`, the LoRA adapters it
  held then.

Every policy's order then goes through `prefer_adapter_holders` for a request that
names a LoRA adapter.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Optional


@dataclass(slots=True)
class ReplicaLoad:
    replica_id: str
    num_ongoing: int = 0  # this router's in-flight requests on it
    ongoing_tokens: int = 0  # prompt tokens of those requests
    num_running: int = 0  # engine-reported (stale by up to one stats period)
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    loras: frozenset = frozenset()  # LoRA adapters the engine holds (engine-reported)

    @property
    def score(self) -> tuple:
        """Smaller is less loaded: requests first, then queued tokens, then KV."""
        requests = max(self.num_ongoing, self.num_running + self.num_waiting)
        return (requests, self.ongoing_tokens, self.kv_cache_usage)


@dataclass(slots=True)
class RouteRequest:
    request_id: str
    prompt_token_ids: list[int] = field(default_factory=list)
    cache_salt: Optional[str] = None
    lora_name: Optional[str] = None  # the LoRA adapter it runs with


class RoutingPolicy(ABC):
    name: str = "base"
    # True: the policy reads a `kv_index` that the ingress keeps fed with the engines'
    # KV events (router.routing.kv_subscriber), and replicas must publish them.
    uses_kv_events: bool = False

    @abstractmethod
    def rank(self, replicas: list[ReplicaLoad], request: Optional[RouteRequest]) -> list[list[str]]:
        """Ranked tiers of replica ids for `request` (non-empty when `replicas` is)."""

    def set_hashing(self, block_size: int, hash_algo: str = "builtin") -> None:  # noqa: B027 (an optional hook: doing nothing is the default)
        """The engines' KV block size and prefix-caching hash function, from their info
        (the ingress calls this once it has it); only prefix policies hash prompts."""

    def on_routed(self, replica_id: str, request: RouteRequest) -> None:  # noqa: B027 (an optional hook: doing nothing is the default)
        """The request was sent to `replica_id` (the first tier's pick)."""

    def on_completed(self, request_id: str) -> None:  # noqa: B027 (an optional hook: doing nothing is the default)
        """The request routed with `RouteRequest.request_id` finished (its stream ended)."""

    def on_replicas_changed(self, replica_ids: set[str]) -> None:  # noqa: B027 (an optional hook: doing nothing is the default)
        """Forget state about replicas that are gone."""


def by_load(replicas: list[ReplicaLoad]) -> list[ReplicaLoad]:
    return sorted(replicas, key=lambda r: r.score)


def tiers(ordered: list[ReplicaLoad]) -> list[list[str]]:
    """One replica per tier, in order: Serve then tries exactly this order."""
    return [[r.replica_id] for r in ordered]


def prefer_adapter_holders(
    ranked: list[list[str]], loads: dict[str, ReplicaLoad], lora_name: Optional[str], slack: int
) -> list[list[str]]:
    """A request for a LoRA adapter goes to a replica that holds it rather than to the
    policy's pick that does not, unless the holder has more than `slack` requests more than
    that pick: with `--max-cpu-loras`, replicas hold different adapters, and a replica that
    lacks one must read it from disk first (and may evict another that requests then miss).
    The least loaded holder moves to the front; the rest keep the policy's order. Unchanged
    when the pick holds the adapter, when no replica does, and for the base model."""
    if not lora_name or not ranked:
        return ranked
    first = loads.get(ranked[0][0])
    if first is None or lora_name in first.loras:
        return ranked
    holders = [loads[rid] for tier in ranked for rid in tier if rid in loads and lora_name in loads[rid].loras]
    if not holders:
        return ranked
    best = min(holders, key=lambda r: r.score)
    if best.score[0] > first.score[0] + slack:
        return ranked
    rest = [[rid for rid in tier if rid != best.replica_id] for tier in ranked]
    return [[best.replica_id]] + [tier for tier in rest if tier]
