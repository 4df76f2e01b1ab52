"""Power of two choices: the less loaded of two random replicas."""

from __future__ import annotations

import random
from typing import Optional

from fleetserve.router.routing.policies.base import ReplicaLoad, RouteRequest, RoutingPolicy, by_load, tiers


class PowerOfTwoPolicy(RoutingPolicy):
    name = "power_of_two"

    def __init__(self, seed: Optional[int] = None, **_: object) -> None:
        self._rng = random.Random(seed)

    def rank(self, replicas: list[ReplicaLoad], request: Optional[RouteRequest]) -> list[list[str]]:
        if len(replicas) <= 2:
            pair = list(replicas)
            self._rng.shuffle(pair)  # ties broken at random
        else:
            pair = self._rng.sample(replicas, 2)
        first = by_load(pair)
        chosen = {id(r) for r in first}  # (by identity: ReplicaLoad's == compares every field)
        rest = by_load([r for r in replicas if id(r) not in chosen])
        return tiers(first + rest)
