"""Approximate prefix-aware routing: guesses where a prefix is from routing history.

What `prefix_aware` did before engines published KV events (and what Ray Serve
LLM's and SGLang's prefix routers do): a local LRU table `block hash -> replicas
that were recently sent a prompt containing it`, updated when a request is routed.
The table says where a prefix was *sent*, which is where its KV blocks most likely
still are; it cannot know about evictions or restarts. Kept as
`prefix_aware_approx` so benchmarks can compare it with the precise policy.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from fleetserve.router.routing.policies.base import RouteRequest
from fleetserve.router.routing.policies.prefix_aware import PrefixAwareBase


class ApproxPrefixPolicy(PrefixAwareBase):
    name = "prefix_aware_approx"

    def __init__(
        self,
        block_size: int = 16,
        imbalance_threshold: int = 4,
        min_match_fraction: float = 0.5,
        max_table_entries: int = 200_000,
        seed: Optional[int] = None,
        **kwargs: object,
    ) -> None:
        super().__init__(block_size, imbalance_threshold, min_match_fraction, seed, **kwargs)
        self.max_table_entries = max_table_entries
        self._table: OrderedDict[int, set[str]] = OrderedDict()

    def match_lengths(self, hashes: list, replica_ids: set[str]) -> dict[str, int]:
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

    def on_routed(self, replica_id: str, request: RouteRequest) -> None:
        hashes = self.block_hashes(request)
        self.count_routed(replica_id, hashes)
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
