"""Least loaded: fewest requests in flight, then fewest queued tokens, then KV usage."""

from __future__ import annotations

import random
from typing import Optional

from fleetserve.router.routing.policies.base import ReplicaLoad, RouteRequest, RoutingPolicy, by_load, tiers


class LeastLoadedPolicy(RoutingPolicy):
    name = "least_loaded"

    def __init__(self, seed: Optional[int] = None, **_: object) -> None:
        self._rng = random.Random(seed)

    def rank(self, replicas: list[ReplicaLoad], request: Optional[RouteRequest]) -> list[list[str]]:
        shuffled = list(replicas)
        self._rng.shuffle(shuffled)  # sorted() is stable: ties go to a random replica
        return tiers(by_load(shuffled))
