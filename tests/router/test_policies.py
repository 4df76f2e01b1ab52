"""Routing policies as plain objects (no Ray)."""

from __future__ import annotations

import collections

import pytest

from fleetserve.router.routing.policies import (
    ApproxPrefixPolicy,
    LeastLoadedPolicy,
    PowerOfTwoPolicy,
    PrefixAwarePolicy,
    ReplicaLoad,
    RouteRequest,
    make_policy,
)

BS = 4
# Both prefix policies: the precise one counts requests in flight (never completed here)
# as holding their prompt's blocks, so routing history alone drives both.
BOTH_PREFIX = pytest.mark.parametrize("cls", [PrefixAwarePolicy, ApproxPrefixPolicy])


def loads(**ongoing: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(rid, num_ongoing=n) for rid, n in ongoing.items()]


def req(tokens: list[int], rid: str = "r") -> RouteRequest:
    return RouteRequest(rid, tokens)


def route(policy, replicas, request) -> str:
    """What FleetRequestRouter does: rank, take the first tier, record it."""
    tiers = policy.rank(replicas, request)
    assert all(len(t) == 1 for t in tiers)
    assert sorted(t[0] for t in tiers) == sorted(r.replica_id for r in replicas)
    chosen = tiers[0][0]
    policy.on_routed(chosen, request)
    return chosen


def test_make_policy_names():
    assert isinstance(make_policy("power_of_two"), PowerOfTwoPolicy)
    assert isinstance(make_policy("least_loaded"), LeastLoadedPolicy)
    assert isinstance(make_policy("prefix_aware", block_size=8), PrefixAwarePolicy)
    assert isinstance(make_policy("prefix_aware_approx", block_size=8), ApproxPrefixPolicy)
    with pytest.raises(ValueError, match="routing_policy"):
        make_policy("random")


def test_least_loaded_orders_by_load_then_tokens_then_kv():
    p = LeastLoadedPolicy(seed=0)
    reps = [
        ReplicaLoad("a", num_ongoing=3),
        ReplicaLoad("b", num_ongoing=1, ongoing_tokens=900),
        ReplicaLoad("c", num_ongoing=1, ongoing_tokens=10),
    ]
    assert p.rank(reps, None) == [["c"], ["b"], ["a"]]
    # Engine-reported load counts when it is higher than what this router sent.
    reps = [ReplicaLoad("a", num_ongoing=0, num_running=5), ReplicaLoad("b", num_ongoing=2)]
    assert p.rank(reps, None)[0] == ["b"]


def test_power_of_two_picks_less_loaded_of_two_and_spreads():
    p = PowerOfTwoPolicy(seed=1)
    assert p.rank(loads(a=5, b=0), None)[0] == ["b"]
    firsts = collections.Counter(p.rank(loads(a=0, b=0, c=0, d=0), None)[0][0] for _ in range(400))
    assert set(firsts) == {"a", "b", "c", "d"} and min(firsts.values()) > 50
    # Among 4, the most loaded is never the first choice (it is in a pair with a lighter one).
    firsts = {p.rank(loads(a=0, b=1, c=2, d=9), None)[0][0] for _ in range(200)}
    assert "d" not in firsts


@BOTH_PREFIX
def test_prefix_aware_sticks_to_the_replica_holding_the_prefix(cls):
    p = cls(block_size=BS, imbalance_threshold=3, seed=0)
    prefix = list(range(100, 132))  # 8 blocks
    first = route(p, loads(a=0, b=0), req(prefix + [1, 2, 3, 4]))
    for i in range(10):
        other = "b" if first == "a" else "a"
        # even when the holder is a little busier, the prefix wins
        reps = [ReplicaLoad(first, num_ongoing=2), ReplicaLoad(other, num_ongoing=0)]
        assert route(p, reps, req(prefix + [i, i, i, i])) == first


@BOTH_PREFIX
def test_prefix_aware_spills_when_the_holder_is_overloaded(cls):
    p = cls(block_size=BS, imbalance_threshold=3, seed=0)
    prefix = list(range(100, 132))
    home = route(p, loads(a=0, b=0), req(prefix))
    other = "b" if home == "a" else "a"
    reps = [ReplicaLoad(home, num_ongoing=5), ReplicaLoad(other, num_ongoing=1)]
    assert route(p, reps, req(prefix + [7] * 8)) == other
    # Now both hold it: the less loaded holder wins.
    reps = [ReplicaLoad(home, num_ongoing=5), ReplicaLoad(other, num_ongoing=2)]
    assert route(p, reps, req(prefix + [9] * 8)) == other


@BOTH_PREFIX
def test_prefix_aware_never_collapses_on_a_short_shared_header(cls):
    """Prompts sharing only a small header (a chat template) balance by load."""
    p = cls(block_size=BS, imbalance_threshold=4, min_match_fraction=0.5, seed=0)
    header = [1, 2, 3, 4]  # one block shared by everyone
    inflight = {"a": 0, "b": 0}
    for i in range(40):
        body = [1000 + i * 10 + j for j in range(12)]  # 3 distinct blocks
        chosen = route(p, loads(**inflight), req(header + body))
        inflight[chosen] += 1
    assert min(inflight.values()) >= 18, inflight


@BOTH_PREFIX
def test_prefix_aware_closed_loop_burst_uses_both_replicas(cls):
    """A burst of one prefix: the holder takes it until it is imbalance_threshold ahead."""
    p = cls(block_size=BS, imbalance_threshold=3, seed=0)
    prefix = list(range(200, 240))
    inflight = {"a": 0, "b": 0}
    for i in range(12):
        chosen = route(p, loads(**inflight), req(prefix + [i] * 4))
        inflight[chosen] += 1
    assert inflight["a"] > 0 and inflight["b"] > 0


@BOTH_PREFIX
def test_prefix_aware_match_is_a_chain_and_respects_salt(cls):
    p = cls(block_size=BS, seed=0)
    p.on_routed("a", req([1, 2, 3, 4, 5, 6, 7, 8]))
    h = p.block_hashes(req([1, 2, 3, 4, 5, 6, 7, 8]))
    assert p.match_lengths(h, {"a", "b"}) == {"a": 2}
    # same second block after a different first block: no match at all
    assert p.match_lengths(p.block_hashes(req([9, 9, 9, 9, 5, 6, 7, 8])), {"a"}) == {}
    salted = RouteRequest("s", [1, 2, 3, 4, 5, 6, 7, 8], cache_salt="tenant-1")
    assert p.match_lengths(p.block_hashes(salted), {"a"}) == {}


def test_prefix_aware_approx_forgets_removed_replicas_and_bounds_its_table():
    p = ApproxPrefixPolicy(block_size=BS, max_table_entries=16, seed=0)
    for i in range(20):
        p.on_routed("a" if i % 2 else "b", req([i] * 16))
    assert len(p._table) <= 16
    p.on_replicas_changed({"a"})
    assert all(holders == {"a"} for holders in p._table.values())


def test_block_hashes_match_the_engine_cache_hashes():
    """The router must hash exactly like the KV cache manager (same function, same chain)."""
    from fleetserve.scheduler import hash_token_blocks

    p = PrefixAwarePolicy(block_size=16)
    tokens = list(range(50))
    assert p.block_hashes(req(tokens)) == hash_token_blocks(tokens, 16)
    assert len(p.block_hashes(req(tokens))) == 3  # full blocks only


def test_a_lora_request_prefers_a_replica_that_holds_its_adapter():
    from fleetserve.router.routing.policies import prefer_adapter_holders

    loads = {
        "r0": ReplicaLoad("r0", num_ongoing=1),
        "r1": ReplicaLoad("r1", num_ongoing=3, loras=frozenset({"sql"})),
        "r2": ReplicaLoad("r2", num_ongoing=2, loras=frozenset({"sql", "chat"})),
        "r3": ReplicaLoad("r3", num_ongoing=9, loras=frozenset({"chat"})),
    }
    ranked = [["r0"], ["r2"], ["r1"], ["r3"]]  # the policy's order
    # r0 lacks sql: the least loaded holder (r2) goes first, the rest keep their order.
    assert prefer_adapter_holders(ranked, loads, "sql", slack=4) == [["r2"], ["r0"], ["r1"], ["r3"]]
    # Unchanged: the base model, a pick that holds it, an adapter no replica holds, and a
    # holder loaded beyond the slack (r3 has 8 more requests than r0).
    assert prefer_adapter_holders(ranked, loads, None, slack=4) == ranked
    assert prefer_adapter_holders([["r2"], ["r0"]], loads, "sql", slack=4) == [["r2"], ["r0"]]
    assert prefer_adapter_holders(ranked, loads, "new", slack=4) == ranked
    assert prefer_adapter_holders(ranked, loads, "chat", slack=4) == [["r2"], ["r0"], ["r1"], ["r3"]]
    assert prefer_adapter_holders([["r0"], ["r3"]], loads, "chat", slack=4) == [["r0"], ["r3"]]
    assert prefer_adapter_holders([["r0"], ["r3"]], loads, "chat", slack=8) == [["r3"], ["r0"]]
    # Tiers of several replicas keep their members; an emptied tier goes.
    assert prefer_adapter_holders([["r0", "r1"], ["r2"]], loads, "sql", slack=4) == [["r2"], ["r0", "r1"]]
