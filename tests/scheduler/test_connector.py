"""The scheduler side of the KV connector, driven by TestConnector on every path."""

from __future__ import annotations

import pytest

from fleetserve.scheduler import RequestStatus
from tests.scheduler.utils import (
    ConnectorPlan,
    FakeModelRunner,
    TestConnector,
    assert_serves_and_no_leaks,
    create_requests,
    create_scheduler,
    reference_tokens,
    run_to_completion,
    step,
)


def setup(plans, **overrides):
    connector = TestConnector(plans)
    sched = create_scheduler(connector=connector, **overrides)
    runner = FakeModelRunner(sched.kv.num_blocks, sched.block_size, connector)
    return sched, runner, connector


def test_sync_external_hit_skips_those_tokens():
    sched, runner, conn = setup({"r0": ConnectorPlan(num_external=8)})
    (r,) = create_requests(1, num_tokens=10, max_tokens=3)
    sched.add_request(r)
    so, _ = step(sched, runner)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    assert so.num_scheduled_tokens == {"r0": 2}
    assert r.num_cached_tokens == 8 and r.num_external_computed_tokens == 8
    assert ("update_state_after_alloc", "r0") in conn.calls
    tokens, _ = run_to_completion(sched, runner)
    assert r.output_token_ids == reference_tokens(r, 64)
    assert_serves_and_no_leaks(sched, runner)


def test_external_tokens_never_include_the_last_prompt_token():
    sched, runner, _ = setup({"r0": ConnectorPlan(num_external=100)})
    (r,) = create_requests(1, num_tokens=10, max_tokens=2)
    sched.add_request(r)
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"r0": 1}
    run_to_completion(sched, runner)
    assert r.output_token_ids == reference_tokens(r, 64)


def test_async_load_parks_without_budget_and_blocks_nobody():
    sched, runner, conn = setup(
        {"r0": ConnectorPlan(num_external=8, is_async=True, load_delay=2)}, max_num_batched_tokens=12
    )
    a, b = create_requests(2, num_tokens=12, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    so, _ = step(sched, runner)
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert "r0" in sched.waiting_for_remote_kvs and "r0" not in so.num_scheduled_tokens
    assert so.num_scheduled_tokens == {"r1": 12}  # the whole budget went to r1
    assert sched.kv.get_block_ids("r0")  # blocks held for the load
    step(sched, runner)
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    step(sched, runner)  # the worker reports finished_recving
    assert a.status == RequestStatus.WAITING
    so, _ = step(sched, runner)
    assert a.status == RequestStatus.RUNNING
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    assert so.num_scheduled_tokens["r0"] == 4
    run_to_completion(sched, runner)
    assert a.output_token_ids == reference_tokens(a, 64)
    assert b.output_token_ids == reference_tokens(b, 64)
    assert_serves_and_no_leaks(sched, runner)


def test_failed_async_load_recomputes_from_the_first_bad_block():
    sched, runner, _ = setup({"r0": ConnectorPlan(num_external=12, is_async=True, fail_block=1)})
    (r,) = create_requests(1, num_tokens=14, max_tokens=4)
    sched.add_request(r)
    step(sched, runner)  # parked; the load finishes (with a bad block) in the same step
    assert r.status == RequestStatus.WAITING and r.num_computed_tokens == 4
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"r0": 10}
    run_to_completion(sched, runner)
    assert r.output_token_ids == reference_tokens(r, 64)
    assert_serves_and_no_leaks(sched, runner)


def test_failed_sync_load_drops_the_token_and_recomputes():
    sched, runner, _ = setup({"r0": ConnectorPlan(num_external=8, fail_block=1)})
    (r,) = create_requests(1, num_tokens=10, max_tokens=4)
    sched.add_request(r)
    _, outs = step(sched, runner)
    assert "r0" not in outs  # sampled over bad KV: discarded
    assert r.num_computed_tokens == 4 and r.output_token_ids == []
    # The bad blocks are not served as prefix hits to anyone.
    (twin,) = create_requests(1, num_tokens=10, prefix="twin")
    assert sched.kv.get_computed_blocks(twin)[1] <= 4
    run_to_completion(sched, runner)
    assert r.output_token_ids == reference_tokens(r, 64)
    assert_serves_and_no_leaks(sched, runner)


def test_none_means_ask_again_later_without_blocking_others():
    sched, runner, conn = setup({"r0": ConnectorPlan(num_external=4, ask_later=2)})
    a, b = create_requests(2, num_tokens=6, max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"r1": 6}
    assert [r.request_id for r in sched.waiting] == ["r0"]
    so, _ = step(sched, runner)
    assert "r0" not in so.num_scheduled_tokens
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens["r0"] == 2  # 4 external tokens
    asked = [c for c in conn.calls if c == ("get_num_new_matched_tokens", "r0")]
    assert len(asked) == 3
    run_to_completion(sched, runner)
    assert a.output_token_ids == reference_tokens(a, 64)
    assert_serves_and_no_leaks(sched, runner)


def test_delayed_free_until_finished_sending():
    sched, runner, conn = setup({"r0": ConnectorPlan(delay_free=2)})
    (r,) = create_requests(1, num_tokens=6, max_tokens=1)
    sched.add_request(r)
    _, outs = step(sched, runner)
    assert outs["r0"].finished
    assert outs["r0"].kv_transfer_params == {"remote_blocks": [0, 1]}
    held = sched.kv.num_blocks - sched.kv.num_free_blocks
    assert held == 2 and not sched.has_unfinished_requests() and sched.has_requests()
    step(sched, runner)
    step(sched, runner)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks - 2
    step(sched, runner)  # finished_sending arrives
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert not sched.has_requests()
    assert_serves_and_no_leaks(sched, runner)


def test_abort_while_loading_keeps_blocks_until_the_load_lands():
    sched, runner, conn = setup({"r0": ConnectorPlan(num_external=8, is_async=True, load_delay=3)})
    (r,) = create_requests(1, num_tokens=12, max_tokens=2)
    sched.add_request(r)
    step(sched, runner)
    assert sched.abort_requests(["r0"]) == ["r0"]
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks < sched.kv.num_blocks  # the worker still writes there
    run_to_completion(sched, runner)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert_serves_and_no_leaks(sched, runner)


def test_connector_call_order():
    sched, runner, conn = setup({"r0": ConnectorPlan(num_external=4)})
    (r,) = create_requests(1, num_tokens=6, max_tokens=1)
    sched.add_request(r)
    run_to_completion(sched, runner)
    assert conn.calls[:3] == [
        ("get_num_new_matched_tokens", "r0"),
        ("update_state_after_alloc", "r0"),
        ("build_connector_meta", ""),
    ]
    assert ("request_finished", "r0") in conn.calls
    # build_connector_meta once per schedule() call.
    assert sum(c[0] == "build_connector_meta" for c in conn.calls) >= 1


def test_a_request_back_from_a_load_cannot_deadlock_the_queue():
    # Found by hypothesis: r1's loaded block sat in waiting behind r2, which
    # needed the whole pool (r1's block included) and so could never be admitted.
    plans = {"r1": ConnectorPlan(num_external=1, is_async=True)}
    sched, runner, _ = setup(
        plans,
        block_size=2,
        num_blocks=13,
        enable_prefix_caching=False,
        max_num_batched_tokens=33,
        max_num_seqs=1,
        max_model_len=30,
        enable_chunked_prefill=False,
        policy="priority",
    )
    (r0,) = create_requests(1, num_tokens=3, max_tokens=1, priority=0)
    (r1,) = create_requests(1, num_tokens=2, max_tokens=1, priority=1, start=1)
    for r in (r0, r1):
        sched.add_request(r)
    step(sched, runner)
    step(sched, runner)  # r1 loads and comes back to waiting holding a block
    assert r1.status == RequestStatus.WAITING and sched.kv.get_block_ids("r1")
    (r2,) = create_requests(1, num_tokens=14, max_tokens=16, priority=0, start=2)
    sched.add_request(r2)
    tokens, reasons = run_to_completion(sched, runner, max_steps=200)
    assert reasons == {"r1": "length", "r2": "length"}  # r0 finished in the first step
    for r in (r0, r1, r2):
        assert r.output_token_ids == reference_tokens(r, 30)
    assert_serves_and_no_leaks(sched, runner)


@pytest.mark.parametrize("caller", ["running victim", "waiting holder"])
def test_both_preemption_callers_start_a_request_over_the_same_way(caller):
    """Preemption has two callers and one piece of bookkeeping: the running pass preempts a
    running victim (to the front of waiting, reported in preempted_req_ids so its worker drops
    it), and a request that would otherwise preempt itself first takes the blocks of requests
    back from a remote load that sit in waiting (they keep their place; no worker holds them).
    Either way the request holds no block, has nothing computed, is PREEMPTED in waiting and
    counted, and later finishes with the tokens it would have produced."""
    if caller == "running victim":
        sched, runner, _ = setup({}, num_blocks=4, enable_prefix_caching=False)
        reqs = create_requests(2, num_tokens=8, max_tokens=4)
        for r in reqs:
            sched.add_request(r)
        step(sched, runner)  # each holds 2 full blocks: the pool is full
        reqs += create_requests(1, num_tokens=1, start=2)
        sched.add_request(reqs[2])
        victim = reqs[1]
        so, _ = step(sched, runner)
        assert so.preempted_req_ids == {"r1"} and so.num_scheduled_tokens == {"r0": 1}
    else:
        sched, runner, _ = setup(
            {"r1": ConnectorPlan(num_external=7, is_async=True)}, num_blocks=3, enable_prefix_caching=False
        )
        reqs = create_requests(1, num_tokens=4, max_tokens=20) + create_requests(1, num_tokens=8, start=1)
        for r in reqs:
            sched.add_request(r)
        step(sched, runner)  # r0 runs in 1 block; r1 loads into 2 and comes back to waiting
        victim = reqs[1]
        assert victim.status == RequestStatus.WAITING and len(sched.kv.get_block_ids("r1")) == 2
        reqs += create_requests(1, num_tokens=8, start=2)
        sched.add_request(reqs[2])
        # r0 needs a block for token 4; the only running victim would be itself.
        so, _ = step(sched, runner)
        assert so.preempted_req_ids == set() and so.num_scheduled_tokens == {"r0": 1}
        assert reqs[0].status == RequestStatus.RUNNING
    assert victim.status == RequestStatus.PREEMPTED
    assert victim.num_computed_tokens == 0 and sched.kv.get_block_ids("r1") == []
    assert victim.num_preemptions == 1 and sched.get_stats().num_preemptions == 1
    assert [r.request_id for r in sched.waiting] == ["r1", "r2"]
    run_to_completion(sched, runner)
    for r in reqs:
        assert r.output_token_ids == reference_tokens(r, 64), r.request_id
    assert_serves_and_no_leaks(sched, runner)


def test_blocks_being_received_are_no_prefix_hit_until_promoted():
    sched, runner, _ = setup({"r0": ConnectorPlan(num_external=8, is_async=True, load_delay=2)})
    (r,) = create_requests(1, num_tokens=12, max_tokens=2)
    sched.add_request(r)
    step(sched, runner)
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (twin,) = create_requests(1, num_tokens=12, prefix="twin")
    assert sched.kv.get_computed_blocks(twin)[1] == 0  # still being written
    sched.add_request(twin)
    so, _ = step(sched, runner)
    assert so.scheduled_new_reqs[0].req_id == "twin0"
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0  # computed itself, no hit
    run_to_completion(sched, runner)
    assert r.output_token_ids == reference_tokens(r, 64)
    assert twin.output_token_ids == reference_tokens(twin, 64)
    assert_serves_and_no_leaks(sched, runner)


def test_in_flight_loads_hold_a_seat_of_max_num_seqs():
    plans = {"r0": ConnectorPlan(num_external=8, is_async=True, load_delay=3)}
    sched, runner, _ = setup(plans, max_num_seqs=1)
    a, b = create_requests(2, num_tokens=12, max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(3):
        so, _ = step(sched, runner)
        assert so.num_scheduled_tokens == {}  # r0 loads; r1 may not take its seat
        assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS or a.status == RequestStatus.WAITING
    run_to_completion(sched, runner)
    assert a.output_token_ids == reference_tokens(a, 64)
    assert b.output_token_ids == reference_tokens(b, 64)
    assert_serves_and_no_leaks(sched, runner)


def test_failed_load_under_fail_policy_ends_with_an_error_and_frees_its_blocks():
    plans = {"r0": ConnectorPlan(num_external=8, is_async=True, fail_block=1, policy="fail")}
    sched, runner, _ = setup(plans)
    r, other = create_requests(2, num_tokens=12, max_tokens=3)
    sched.add_request(r)
    sched.add_request(other)
    _, outs = step(sched, runner)  # parks, loads (block 1 bad) within the step
    assert outs["r0"].finish_reason == "error" and outs["r0"].new_token_ids == []
    assert r.status == RequestStatus.FINISHED_ERROR and "r0" not in sched.requests
    assert outs["r0"].num_remote_tokens == 4  # block 0 arrived before the bad one
    # Its blocks, good and bad, are nobody's prefix hit.
    (twin,) = create_requests(1, num_tokens=12, prefix="twin")
    assert sched.kv.get_computed_blocks(twin)[1] == 0
    run_to_completion(sched, runner)
    assert other.output_token_ids == reference_tokens(other, 64)
    assert_serves_and_no_leaks(sched, runner)


def test_abort_while_loading_then_the_pool_serves_everyone():
    """The reservation/admission case: a load holds blocks the pool needs; aborting it
    returns them only after the worker's word, and then a request needing them runs."""
    plans = {"r0": ConnectorPlan(num_external=20, is_async=True, load_delay=4)}
    sched, runner, _ = setup(plans, num_blocks=8, block_size=4, max_model_len=40)
    (r,) = create_requests(1, num_tokens=24, max_tokens=2)
    sched.add_request(r)
    step(sched, runner)
    held = sched.kv.num_blocks - sched.kv.num_free_blocks
    assert held == 5  # the 20 external tokens
    (big,) = create_requests(1, num_tokens=24, max_tokens=4, start=1)
    sched.add_request(big)
    step(sched, runner)
    assert big.status == RequestStatus.WAITING  # no room while r0 loads
    sched.abort_requests(["r0"])
    assert sched.kv.num_blocks - sched.kv.num_free_blocks == held  # the worker may still write
    run_to_completion(sched, runner)
    assert big.output_token_ids == reference_tokens(big, 40)
    assert_serves_and_no_leaks(sched, runner)
