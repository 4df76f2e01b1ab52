"""The prefix index and the precise prefix policy as plain objects (no Ray)."""

from __future__ import annotations

import pytest

from fleetserve.router.routing.kv_index import KVIndex
from fleetserve.router.routing.policies import PrefixAwarePolicy, ReplicaLoad, RouteRequest
from fleetserve.scheduler import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, hash_token_blocks

BS = 4


def stored(seq: int, hashes: list, parent=None) -> KVEventBatch:
    return KVEventBatch(seq, 0.0, [BlockStored(list(hashes), parent, [0] * (BS * len(hashes)), BS)])


def test_index_applies_batches_in_order_and_resyncs_on_a_gap_or_a_new_instance():
    idx = KVIndex()
    assert idx.cursor("a") == (None, -1)  # never read: ask for a snapshot
    idx.update("a", {"instance": "i1", "snapshot": (2, [1, 2])})
    assert idx.cursor("a") == ("i1", 2) and idx.hashes_of("a") == {1, 2}
    idx.update("a", {"instance": "i1", "batches": [stored(3, [3], 2), KVEventBatch(4, 0.0, [BlockRemoved([1])])]})
    assert idx.hashes_of("a") == {2, 3} and idx.cursor("a") == ("i1", 4)
    idx.update("a", {"instance": "i1", "batches": [stored(6, [9])]})  # batch 5 is missing
    assert idx.num_gaps == 1 and idx.cursor("a") == (None, -1)  # next read: a snapshot
    idx.update("a", {"instance": "i2", "snapshot": (0, [])})  # the engine restarted: empty
    assert idx.hashes_of("a") == set() and len(idx) == 0
    idx.update("a", {"instance": "i1", "batches": [stored(1, [5])]})  # a stale reply: ignored
    assert idx.hashes_of("a") == set() and idx.cursor("a") == (None, -1)


def test_index_match_is_a_chain_over_holders_and_forgets_gone_replicas():
    idx = KVIndex()
    h = hash_token_blocks(list(range(16)), BS)
    idx.update("a", {"instance": "x", "snapshot": (1, h)})
    idx.update("b", {"instance": "y", "snapshot": (1, h[:2])})
    assert idx.match_lengths(h, {"a", "b", "c"}) == {"a": 4, "b": 2}
    assert idx.match_lengths(h[1:], {"a", "b"}) == {"a": 3, "b": 1}  # index only: no chain check
    idx.update("b", {"instance": "y", "batches": [KVEventBatch(2, 0.0, [AllBlocksCleared()])]})
    assert idx.match_lengths(h, {"a", "b"}) == {"a": 4}
    idx.retain({"b"})
    assert idx.match_lengths(h, {"a", "b"}) == {} and idx.replicas() == ["b"]


def test_precise_policy_routes_on_what_engines_cache_not_on_where_prompts_went():
    idx = KVIndex()
    p = PrefixAwarePolicy(block_size=BS, imbalance_threshold=3, kv_index=idx, linger_s=0.0, seed=0)
    prompt = list(range(100, 132)) + [1, 2, 3]
    req = RouteRequest("r1", prompt)
    idx.update("b", {"instance": "y", "snapshot": (1, p.block_hashes(req))})
    reps = [ReplicaLoad("a", num_ongoing=0), ReplicaLoad("b", num_ongoing=2)]
    assert p.rank(reps, req)[0] == ["b"]  # b caches it, a little busier: the prefix wins
    reps = [ReplicaLoad("a", num_ongoing=0), ReplicaLoad("b", num_ongoing=3)]
    assert p.rank(reps, req)[0] == ["a"]  # b is overloaded: load wins
    # b evicted the blocks (its events say so): no match any more, whatever was routed there.
    p.on_routed("b", RouteRequest("r0", prompt))
    p.on_completed("r0")
    idx.update("b", {"instance": "y", "batches": [KVEventBatch(2, 0.0, [AllBlocksCleared()])]})
    reps = [ReplicaLoad("a", num_ongoing=1), ReplicaLoad("b", num_ongoing=0)]
    assert p.match_lengths(p.block_hashes(req), {"a", "b"}) == {}
    assert p.rank(reps, req)[0] == ["b"]  # least loaded


def test_precise_policy_counts_requests_in_flight_and_lingers_after_completion():
    p = PrefixAwarePolicy(block_size=BS, linger_s=60.0, seed=0)
    prompt = list(range(200, 232))
    h = p.block_hashes(RouteRequest("x", prompt))
    p.on_routed("a", RouteRequest("r1", prompt))
    assert p.match_lengths(h, {"a", "b"}) == {"a": len(h)}  # computing it now
    p.on_completed("r1")
    assert p.match_lengths(h, {"a"}) == {"a": len(h)}  # its events may not have arrived yet
    p.linger_s = 0.0
    p.on_routed("a", RouteRequest("r2", prompt))
    p.on_completed("r2")
    p._lingering = type(p._lingering)((0.0, r, hs) for _, r, hs in p._lingering)  # time passes
    assert p.match_lengths(h, {"a"}) == {}  # from now on only the index decides


def test_precise_policy_hashes_as_the_engines_do_sha256_and_their_block_size():
    """Engines started with `prefix_caching_hash_algo: sha256` publish sha256 block hashes:
    a policy told so (the ingress passes the engines' info) matches them; one hashing with
    the default function never would."""
    prompt = list(range(300, 340)) + [7]
    engine_hashes = hash_token_blocks(prompt, 8, algo="sha256")  # what the engine caches
    idx = KVIndex()
    idx.update("b", {"instance": "y", "snapshot": (1, engine_hashes)})
    p = PrefixAwarePolicy(kv_index=idx, linger_s=0.0, seed=0)  # the defaults: 16, builtin
    req = RouteRequest("r1", prompt)
    reps = [ReplicaLoad("a", num_ongoing=0), ReplicaLoad("b", num_ongoing=1)]
    assert p.match_lengths(p.block_hashes(req), {"a", "b"}) == {}
    p.set_hashing(8, "sha256")
    assert p.block_hashes(req) == engine_hashes
    assert p.match_lengths(p.block_hashes(req), {"a", "b"}) == {"b": 5}
    assert p.rank(reps, req)[0] == ["b"]
    with pytest.raises(ValueError, match="md5"):
        p.set_hashing(8, "md5")


def test_precise_policy_sends_a_miss_to_the_replica_caching_least_among_the_least_loaded():
    """New conversations at low load (every replica idle) split the cluster's cache evenly:
    each goes where fewer blocks are cached, not by coin flip; load still comes first."""
    idx = KVIndex()
    p = PrefixAwarePolicy(block_size=BS, kv_index=idx, linger_s=0.0, seed=0)
    seqs = {"a": 0, "b": 0}
    held = {"a": [], "b": []}
    for c in range(8):
        prompt = [1000 * (c + 1) + j for j in range(12)]  # 3 blocks of its own
        req = RouteRequest(f"c{c}", prompt)
        (chosen,), *_ = p.rank([ReplicaLoad("a"), ReplicaLoad("b")], req)
        p.on_routed(chosen, req)
        p.on_completed(req.request_id)
        # The engine caches the prompt; its events arrive.
        seqs[chosen] += 1
        held[chosen] += p.block_hashes(req)
        idx.update(chosen, {"instance": chosen, "snapshot": (seqs[chosen], list(held[chosen]))})
    assert idx.num_blocks("a") == idx.num_blocks("b") == 12
    # Equal loads but b caches more: a. A busier a: b, whatever it caches.
    idx.update("b", {"instance": "b", "snapshot": (99, held["b"] + [7, 8, 9])})
    miss = RouteRequest("m", [5] * 12)
    assert p.rank([ReplicaLoad("b"), ReplicaLoad("a")], miss)[0] == ["a"]
    assert p.rank([ReplicaLoad("b"), ReplicaLoad("a", num_ongoing=1)], miss)[0] == ["b"]
    # In-flight prompts count before their events arrive.
    p.on_routed("a", RouteRequest("f", [6] * 40))
    assert p.rank([ReplicaLoad("b"), ReplicaLoad("a")], miss)[0] == ["b"]


def test_precise_policy_keeps_a_partly_evicted_prefix_where_the_rest_of_it_is():
    """A conversation whose cache was partly evicted: a match too short to beat load still
    wins a tie on load (its blocks need no prefill there), even on the replica caching
    more; a busier holder loses to the least loaded."""
    idx = KVIndex()
    p = PrefixAwarePolicy(block_size=BS, kv_index=idx, linger_s=0.0, min_match_fraction=0.5, seed=0)
    prompt = list(range(500, 540))  # 10 blocks
    req = RouteRequest("t2", prompt)
    h = p.block_hashes(req)
    idx.update("a", {"instance": "a", "snapshot": (1, h[:3] + [77, 78, 79, 80])})  # 3 of 10 left
    idx.update("b", {"instance": "b", "snapshot": (1, [90, 91])})
    assert p.preferred([ReplicaLoad("a"), ReplicaLoad("b")], h) is None  # below the fraction
    for order in (("a", "b"), ("b", "a")):
        assert p.rank([ReplicaLoad(r) for r in order], req)[0] == ["a"]
    assert p.rank([ReplicaLoad("a", num_ongoing=1), ReplicaLoad("b")], req)[0] == ["b"]
    # Nothing matched anywhere: the least-caching rule as before.
    assert p.rank([ReplicaLoad("a"), ReplicaLoad("b")], RouteRequest("new", [3] * 40))[0] == ["b"]
