"""Prefix-aware routing on token blocks, with load as the tie-breaker and the guard.

The router hashes the prompt's full token blocks exactly as the engine's KV
cache does (`scheduler.hash_token_blocks`: chained, deterministic across
processes), and keeps a local LRU table `block hash -> replicas that were
recently sent a prompt containing it`. For a new prompt:

1. For every replica, count the leading blocks it holds (a chain: block i
   matches only if blocks 0..i-1 matched too).
2. The replica with the longest match wins if the match covers at least
   `min_match_fraction` of the prompt's full blocks and that replica is not
   overloaded: it must not have `imbalance_threshold` or more requests in
   flight beyond the least loaded replica.
3. Otherwise the least loaded replica wins (and becomes the home of this prefix).

The winner's blocks are recorded at routing time, so a burst of same-prefix
requests follows the first one before any of them has finished. Other
replicas follow as fallback tiers, by load. Everything is local to the router
(no actor round trip per request, unlike Ray Serve LLM's prefix tree actor);
the table only says where a prefix was *sent*, which is where its KV blocks
most likely still are.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Optional

from fleetserve.router.policies.base import ReplicaLoad, RouteRequest, RoutingPolicy, by_load, tiers
from fleetserve.scheduler import hash_token_blocks


class PrefixAwarePolicy(RoutingPolicy):
    name = "prefix_aware"

    def __init__(self, block_size: int = 16, imbalance_threshold: int = 4,
                 min_match_fraction: float = 0.5, max_table_entries: int = 200_000,
                 seed: Optional[int] = None, **_: object) -> None:
        self.block_size = block_size
        self.imbalance_threshold = imbalance_threshold
        self.min_match_fraction = min_match_fraction
        self.max_table_entries = max_table_entries
        self._table: OrderedDict[int, set[str]] = OrderedDict()
        self._rng = random.Random(seed)
        # Counters for observability (exported by the router as stats).
        self.num_routed = 0
        self.num_prefix_routed = 0

    # -- ranking ---------------------------------------------------------------

    def rank(self, replicas: list[ReplicaLoad], request: Optional[RouteRequest]) -> list[list[str]]:
        shuffled = list(replicas)
        self._rng.shuffle(shuffled)
        ordered = by_load(shuffled)
        if request is None or not ordered:
            return tiers(ordered)
        hashes = self.block_hashes(request)
        preferred = self._preferred(ordered, hashes)
        if preferred is not None:
            ordered.remove(preferred)
            ordered.insert(0, preferred)
        return tiers(ordered)

    def _preferred(self, ordered: list[ReplicaLoad], hashes: list[int]) -> Optional[ReplicaLoad]:
        if not hashes:
            return None
        matched = self.match_lengths(hashes, {r.replica_id for r in ordered})
        if not matched:
            return None
        # Longest match; among equals, the least loaded (ordered is by load).
        best = max(ordered, key=lambda r: matched.get(r.replica_id, 0))
        best_len = matched.get(best.replica_id, 0)
        if best_len < self.min_match_fraction * len(hashes):
            return None
        least = ordered[0]
        if best.score[0] - least.score[0] >= self.imbalance_threshold:
            return None  # overloaded: load wins, the prefix gets a second home
        return best

    def match_lengths(self, hashes: list[int], replica_ids: set[str]) -> dict[str, int]:
        """Leading blocks of `hashes` each replica is recorded as holding."""
        alive = set(replica_ids)
        matched: dict[str, int] = {}
        for i, h in enumerate(hashes):
            holders = self._table.get(h)
            if not holders:
                break
            alive &= holders
            if not alive:
                break
            for rid in alive:
                matched[rid] = i + 1
        return matched

    def block_hashes(self, request: RouteRequest) -> list[int]:
        return hash_token_blocks(request.prompt_token_ids, self.block_size, request.cache_salt)

    # -- state -----------------------------------------------------------------

    def on_routed(self, replica_id: str, request: RouteRequest) -> None:
        hashes = self.block_hashes(request)
        self.num_routed += 1
        if hashes and self.match_lengths(hashes[:1], {replica_id}):
            self.num_prefix_routed += 1
        for h in hashes:
            holders = self._table.get(h)
            if holders is None:
                self._table[h] = {replica_id}
            else:
                holders.add(replica_id)
                self._table.move_to_end(h)
        while len(self._table) > self.max_table_entries:
            self._table.popitem(last=False)

    def on_replicas_changed(self, replica_ids: set[str]) -> None:
        for h in list(self._table):
            holders = self._table[h]
            holders &= replica_ids
            if not holders:
                del self._table[h]
