"""Prefix-aware routing on what the engines actually cache, with load as the guard.

The router hashes the prompt's full token blocks exactly as the engines' KV
caches do (`scheduler.hash_token_blocks`: chained, salted, deterministic across
processes) and looks the chain up in two places:

* the cluster-wide `KVIndex` (`router/routing/kv_index.py`), built from every engine's KV
  events: block hash -> replicas whose cache holds it *now*; and
* the requests this router has in flight: a replica that is computing a prompt
  will hold its blocks a step later, before its events arrive, so a burst of
  one prefix follows its first request. Released `linger_s` after the request
  completes: by then its events have reached the index (they are published at
  the step that schedules the prompt, and read every `poll_interval_s`), which alone
  decides from then on (eviction included).

Then, for a new prompt:

1. For every replica, count the leading blocks it holds (a chain: block i
   matches only if blocks 0..i-1 match too).
2. The replica with the longest match wins if the match covers at least
   `min_match_fraction` of the prompt's full blocks and that replica is not
   overloaded: it must not have `imbalance_threshold` or more requests in
   flight beyond the least loaded replica (load wins over a match).
3. Otherwise the least loaded replica wins. Other replicas follow as fallback
   tiers, by load. Among replicas equally loaded (requests and queued prompt
   tokens), the precise policy takes the one holding the longest part of the
   prompt (a match below `min_match_fraction` still saves its blocks), then the
   one whose cache holds the fewest blocks (SGLang's rule for a miss): new
   prefixes then split the cluster's cache evenly instead of by coin flip. At
   low load every replica ties at zero, and coin flips put 6 or more of 8 new
   conversations on one of two replicas 29% of the time; that replica's cache
   overflows and its conversations' next turns miss.

`PrefixAwareBase` holds that rule; subclasses say where matches come from
(`prefix_approx.ApproxPrefixPolicy` guesses from routing history, as Ray Serve
LLM and SGLang's routers do).
"""

from __future__ import annotations

import random
import time
from abc import abstractmethod
from collections import deque
from typing import Callable, Optional

from fleetserve.router.routing.kv_index import KVIndex
from fleetserve.router.routing.policies.base import ReplicaLoad, RouteRequest, RoutingPolicy, by_load, tiers
from fleetserve.scheduler import hash_token_blocks
from fleetserve.scheduler.kv_cache_manager import HASH_ALGOS


class PrefixAwareBase(RoutingPolicy):
    def __init__(
        self,
        block_size: int = 16,
        imbalance_threshold: int = 4,
        min_match_fraction: float = 0.5,
        seed: Optional[int] = None,
        **_: object,
    ) -> None:
        self.block_size = block_size
        self.hash_algo = "builtin"
        self.imbalance_threshold = imbalance_threshold
        self.min_match_fraction = min_match_fraction
        self._rng = random.Random(seed)
        # Counters for observability.
        self.num_routed = 0
        self.num_prefix_routed = 0  # the winner held at least one block of the prompt

    @abstractmethod
    def match_lengths(self, hashes: list, replica_ids: set[str]) -> dict[str, int]:
        """Leading blocks of `hashes` each replica holds (absent: none)."""

    def set_hashing(self, block_size: int, hash_algo: str = "builtin") -> None:
        """Hash as the engines do (`EngineReplica.get_info`): a prompt hashed with another
        block size or function never matches what their KV events report."""
        if hash_algo not in HASH_ALGOS:
            raise ValueError(f"unknown prefix_caching_hash_algo {hash_algo!r}")
        self.block_size, self.hash_algo = int(block_size), hash_algo

    def block_hashes(self, request: RouteRequest) -> list:
        return hash_token_blocks(request.prompt_token_ids, self.block_size, request.cache_salt, algo=self.hash_algo)

    def rank(self, replicas: list[ReplicaLoad], request: Optional[RouteRequest]) -> list[list[str]]:
        shuffled = list(replicas)
        self._rng.shuffle(shuffled)
        ordered = by_load(shuffled)
        if request is None or not ordered:
            return tiers(ordered)
        hashes = self.block_hashes(request)
        matched = self.match_lengths(hashes, {r.replica_id for r in ordered}) if hashes else {}
        preferred = self.preferred(ordered, hashes, matched)
        if preferred is not None:
            ordered.remove(preferred)
            ordered.insert(0, preferred)
        else:
            ordered = self.spread(ordered, matched)
        return tiers(ordered)

    def spread(self, ordered: list[ReplicaLoad], matched: dict[str, int]) -> list[ReplicaLoad]:
        """Where a prompt goes that no replica's match wins (`ordered` is by load; `matched`
        the leading blocks each replica holds)."""
        return ordered

    def preferred(
        self, ordered: list[ReplicaLoad], hashes: list, matched: Optional[dict[str, int]] = None
    ) -> Optional[ReplicaLoad]:
        """The replica whose prefix match beats load, if any (`ordered` is by load)."""
        if not hashes:
            return None
        if matched is None:
            matched = self.match_lengths(hashes, {r.replica_id for r in ordered})
        if not matched:
            return None
        # Longest match; among equals, the least loaded (ordered is by load).
        best = max(ordered, key=lambda r: matched.get(r.replica_id, 0))
        if matched.get(best.replica_id, 0) < self.min_match_fraction * len(hashes):
            return None
        if best.score[0] - ordered[0].score[0] >= self.imbalance_threshold:
            return None  # overloaded: load wins, the prefix gets a second home
        return best

    def count_routed(self, replica_id: str, hashes: list) -> None:
        self.num_routed += 1
        if hashes and self.match_lengths(hashes[:1], {replica_id}):
            self.num_prefix_routed += 1


class PrefixAwarePolicy(PrefixAwareBase):
    """Precise: matches come from the engines' KV events, plus requests in flight."""

    name = "prefix_aware"
    uses_kv_events = True

    def __init__(
        self,
        block_size: int = 16,
        imbalance_threshold: int = 4,
        min_match_fraction: float = 0.5,
        seed: Optional[int] = None,
        kv_index: Optional[KVIndex] = None,
        linger_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        **kwargs: object,
    ) -> None:
        super().__init__(block_size, imbalance_threshold, min_match_fraction, seed, **kwargs)
        self.kv_index = kv_index if kv_index is not None else KVIndex()
        self.linger_s = linger_s
        # What `linger_s` is measured on: the process's monotonic clock, or a simulator's
        # virtual one (fleetserve.sim), so lingering hints expire in the time requests run in.
        self.clock = clock
        # request id -> (replica, hashes); replica -> hash -> in-flight requests holding it.
        self._inflight: dict[str, tuple[str, list]] = {}
        self._inflight_hashes: dict[str, dict] = {}
        # Completed requests whose hints still count: (expiry, replica, hashes), in order.
        self._lingering: deque = deque()

    def match_lengths(self, hashes: list, replica_ids: set[str]) -> dict[str, int]:
        self._expire()
        matched = self.kv_index.match_lengths(hashes, replica_ids)
        for rid in replica_ids:
            pending = self._inflight_hashes.get(rid)
            if not pending:
                continue
            n = 0
            while n < len(hashes) and hashes[n] in pending:
                n += 1
            if n > matched.get(rid, 0):
                matched[rid] = n
        return matched

    def spread(self, ordered: list[ReplicaLoad], matched: dict[str, int]) -> list[ReplicaLoad]:
        """Among the least loaded: the one holding the longest part of the prompt first (a
        match too short to beat load still saves its blocks' prefill when loads tie: a
        conversation whose cache was partly evicted stays where the rest is), then the
        one caching the fewest blocks (blocks its in-flight prompts will add count too:
        their events have not arrived yet)."""
        head = ordered[0].score[:2]
        n = 1
        while n < len(ordered) and ordered[n].score[:2] == head:
            n += 1
        if n == 1:
            return ordered
        held = {
            r.replica_id: self.kv_index.num_blocks(r.replica_id) + len(self._inflight_hashes.get(r.replica_id, ()))
            for r in ordered[:n]
        }
        return sorted(ordered[:n], key=lambda r: (-matched.get(r.replica_id, 0), held[r.replica_id])) + ordered[n:]

    def on_routed(self, replica_id: str, request: RouteRequest) -> None:
        hashes = self.block_hashes(request)
        self.count_routed(replica_id, hashes)
        if not hashes or not request.request_id:
            return
        void = self._inflight.pop(request.request_id, None)  # re-routed (a retry)
        if void is not None:
            self._release(*void)
        self._inflight[request.request_id] = (replica_id, hashes)
        counts = self._inflight_hashes.setdefault(replica_id, {})
        for h in hashes:
            counts[h] = counts.get(h, 0) + 1

    def on_completed(self, request_id: str) -> None:
        entry = self._inflight.pop(request_id, None)
        if entry is not None:
            self._lingering.append((self.clock() + self.linger_s, *entry))

    def _expire(self) -> None:
        now = self.clock()
        while self._lingering and self._lingering[0][0] <= now:
            _, replica_id, hashes = self._lingering.popleft()
            self._release(replica_id, hashes)

    def _release(self, replica_id: str, hashes: list) -> None:
        counts = self._inflight_hashes.get(replica_id, {})
        for h in hashes:
            left = counts.get(h, 0) - 1
            if left > 0:
                counts[h] = left
            else:
                counts.pop(h, None)

    def on_replicas_changed(self, replica_ids: set[str]) -> None:
        self.kv_index.retain(replica_ids)
        for rid in [r for r in self._inflight_hashes if r not in replica_ids]:
            del self._inflight_hashes[rid]
        for req_id in [q for q, (r, _) in self._inflight.items() if r not in replica_ids]:
            del self._inflight[req_id]
        self._lingering = deque(e for e in self._lingering if e[1] in replica_ids)
