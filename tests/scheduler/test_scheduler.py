"""The scheduling rules of issue 2, one test each, through the public API."""

from __future__ import annotations

import pytest

from fleetserve.scheduler import Request, RequestStatus, SamplingParams, Scheduler
from tests.scheduler.utils import (
    EOS,
    FakeModelRunner,
    assert_serves_and_no_leaks,
    create_requests,
    create_scheduler,
    reference_tokens,
    run_to_completion,
    step,
)


# ---- the step: new/cached split, optimistic advance, budget ------------------------
def test_new_then_cached_and_optimistic_advance():
    sched = create_scheduler()
    reqs = create_requests(2, num_tokens=6)
    for r in reqs:
        sched.add_request(r)
    so, _ = step(sched, sampled={"r0": [11], "r1": [12]})
    assert [n.req_id for n in so.scheduled_new_reqs] == ["r0", "r1"]
    assert so.scheduled_cached_reqs == []
    assert so.num_scheduled_tokens == {"r0": 6, "r1": 6}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    assert so.scheduled_new_reqs[0].block_ids == sched.kv.get_block_ids("r0")

    so = sched.schedule()
    # Advanced at schedule time, before the model ran.
    assert reqs[0].num_computed_tokens == 7
    assert so.scheduled_new_reqs == []
    cached = {c.req_id: c for c in so.scheduled_cached_reqs}
    assert cached["r0"].new_token_ids == [11] and cached["r0"].num_computed_tokens == 6
    assert cached["r1"].new_token_ids == [12]
    assert so.num_scheduled_tokens == {"r0": 1, "r1": 1}


def test_chunked_prefill_respects_budget_and_samples_only_at_the_end():
    sched = create_scheduler(max_num_batched_tokens=8)
    (r,) = create_requests(1, num_tokens=20)
    sched.add_request(r)
    chunks = []
    for _ in range(3):
        so, outs = step(sched, sampled={"r0": [5]})
        chunks.append(so.num_scheduled_tokens["r0"])
        if len(chunks) < 3:
            assert "r0" not in outs  # a partial prefill yields no token
    assert chunks == [8, 8, 4]
    assert r.output_token_ids == [5]


def test_running_first_then_waiting_gets_the_rest():
    sched = create_scheduler(max_num_batched_tokens=10)
    (a,) = create_requests(1, num_tokens=4)
    sched.add_request(a)
    step(sched)
    (b,) = create_requests(1, num_tokens=30, start=1)
    sched.add_request(b)
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"r0": 1, "r1": 9}
    assert so.total_num_scheduled_tokens == 10


def test_non_chunked_skips_a_prompt_that_does_not_fit_instead_of_cutting_it():
    sched = create_scheduler(
        enable_chunked_prefill=False, max_num_batched_tokens=32, max_model_len=32, long_prefill_token_threshold=5
    )
    big, mid, small = (create_requests(1, num_tokens=n, start=i)[0] for i, n in enumerate((28, 20, 3)))
    for r in (big, mid, small):
        sched.add_request(r)
    so, _ = step(sched)
    # The threshold does not cut prompts when chunking is off.
    assert so.num_scheduled_tokens == {"r0": 28, "r2": 3}
    assert [r.request_id for r in sched.waiting] == ["r1"]
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"r0": 1, "r2": 1, "r1": 20}


def test_long_prefill_token_threshold_caps_each_chunk():
    sched = create_scheduler(long_prefill_token_threshold=5)
    (r,) = create_requests(1, num_tokens=12)
    sched.add_request(r)
    got = [step(sched)[0].num_scheduled_tokens["r0"] for _ in range(3)]
    assert got == [5, 5, 2]


def test_max_num_seqs_bounds_running():
    sched = create_scheduler(max_num_seqs=2)
    for r in create_requests(4, num_tokens=3, max_tokens=2):
        sched.add_request(r)
    so, _ = step(sched)
    assert set(so.num_scheduled_tokens) == {"r0", "r1"}
    assert len(sched.running) == 2 and len(sched.waiting) == 2
    step(sched)  # r0, r1 finish (max_tokens=2)
    so, _ = step(sched)
    assert set(so.num_scheduled_tokens) == {"r2", "r3"}


def test_max_model_len_caps_tokens_and_finishes_with_length():
    sched = create_scheduler(max_model_len=10)
    (r,) = create_requests(1, num_tokens=7, max_tokens=100)
    sched.add_request(r)
    runner = FakeModelRunner(64, 4)
    tokens, reasons = run_to_completion(sched, runner)
    assert len(tokens["r0"]) == 3 and reasons["r0"] == "length"
    assert r.num_tokens == 10


# ---- preemption ----------------------------------------------------------------------
def test_fcfs_preempts_last_running_puts_it_first_and_admits_nobody_that_step():
    sched = create_scheduler(num_blocks=4, enable_prefix_caching=False)
    a, b = create_requests(2, num_tokens=8, max_tokens=4)
    for r in (a, b):
        sched.add_request(r)
    step(sched)  # each holds 2 full blocks: the pool is full
    (c,) = create_requests(1, num_tokens=1, start=2)
    sched.add_request(c)
    so, _ = step(sched)
    assert so.preempted_req_ids == {"r1"}
    assert so.num_scheduled_tokens == {"r0": 1}
    assert "r2" not in so.num_scheduled_tokens  # no admission in a step that preempted
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert [r.request_id for r in sched.waiting] == ["r1", "r2"]
    assert sched.get_stats().num_preemptions == 1
    assert_serves_and_no_leaks(sched)


def test_a_request_that_must_preempt_itself_stops_the_running_pass():
    sched = create_scheduler(num_blocks=3, enable_prefix_caching=False)
    a, b = create_requests(2, num_tokens=4, max_tokens=8)
    sched.add_request(a)
    step(sched)
    step(sched)  # a: 6 tokens, 2 blocks
    sched.add_request(b)
    step(sched)  # b admitted with 1 block: the pool is full
    # a and b each fill their last block; then b needs a block and preempts itself.
    for _ in range(10):
        so = sched.schedule()
        if so.preempted_req_ids:
            break
        sched.update_from_output(so, FakeModelRunner(3, 4).execute(so))
        assert b.status == RequestStatus.RUNNING
    assert so.preempted_req_ids == {"r1"} and list(so.num_scheduled_tokens) == ["r0"]


def test_priority_preempts_largest_priority_even_if_already_scheduled():
    sched = create_scheduler(num_blocks=5, policy="priority", long_prefill_token_threshold=5)
    runner = FakeModelRunner(5, 4)
    (a,) = create_requests(1, num_tokens=20, max_tokens=2, priority=1)
    sched.add_request(a)
    step(sched, runner)  # a: tokens 0-4
    (b,) = create_requests(1, num_tokens=4, max_tokens=4, priority=0, start=1)
    sched.add_request(b)
    step(sched, runner)  # a: tokens 5-9 (3 blocks), b: 4 tokens (1 block); 1 block free
    so = sched.schedule()
    # a (running[0]) is scheduled first for tokens 10-14 and takes the last
    # block; then b needs one: the victim is a, the larger (priority, arrival),
    # whose tokens go back to the budget.
    assert so.preempted_req_ids == {"r0"}
    assert so.num_scheduled_tokens == {"r1": 1}
    assert so.total_num_scheduled_tokens == 1
    assert a.status == RequestStatus.PREEMPTED
    # a's block 2 (tokens 8-11) became "full" when a was scheduled, but tokens
    # 10-11 were never computed: it must not be a prefix-cache hit.
    assert sched.kv.get_computed_blocks(Request("probe", a.prompt_token_ids))[1] == 8
    sched.update_from_output(so, runner.execute(so))
    run_to_completion(sched, runner)
    assert a.output_token_ids == reference_tokens(a, 64)
    assert b.output_token_ids == reference_tokens(b, 64)
    assert_serves_and_no_leaks(sched, runner)


def test_priority_ties_do_not_livelock():
    # Found by hypothesis: with equal (priority, arrival) the victim must be the
    # request the queue ranks last, never the one being scheduled.
    sched = create_scheduler(
        num_blocks=6, enable_prefix_caching=False, policy="priority", long_prefill_token_threshold=3, max_num_seqs=2
    )
    a, b = create_requests(2, num_tokens=21, max_tokens=2, arrival_time=0.0)
    for r in (a, b):
        sched.add_request(r)
    tokens, _ = run_to_completion(sched, FakeModelRunner(6, 4), max_steps=300)
    assert tokens["r0"] == reference_tokens(a, 64) and tokens["r1"] == reference_tokens(b, 64)


def test_preempted_request_finishes_with_the_same_tokens():
    sched = create_scheduler(num_blocks=6, block_size=2)
    reqs = create_requests(3, num_tokens=5, max_tokens=6)
    for r in reqs:
        sched.add_request(r)
    tokens, _ = run_to_completion(sched, FakeModelRunner(6, 2))
    assert sched.get_stats().num_preemptions > 0
    for r in reqs:
        assert tokens[r.request_id] == reference_tokens(r, 64)


# ---- capacity policy ---------------------------------------------------------------
def _workload():
    return create_requests(4, num_tokens=6, max_tokens=10)


def test_guaranteed_no_evict_admits_only_with_room_to_completion_and_never_preempts():
    sched = create_scheduler(num_blocks=8, capacity_policy="guaranteed_no_evict")
    reqs = _workload()  # each needs cdiv(6 + 10 - 1, 4) = 4 blocks to completion
    for r in reqs:
        sched.add_request(r)
    runner = FakeModelRunner(8, 4)
    so, _ = step(sched, runner)
    assert set(so.num_scheduled_tokens) == {"r0", "r1"}
    for _ in range(200):
        if not sched.has_requests():
            break
        so = sched.schedule()
        assert not so.preempted_req_ids
        sched.update_from_output(so, runner.execute(so))
    assert sched.get_stats().num_preemptions == 0
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in reqs)

    other = create_scheduler(num_blocks=8)  # max_utilization on the same work preempts
    for r in _workload():
        other.add_request(r)
    run_to_completion(other, FakeModelRunner(8, 4))
    assert other.get_stats().num_preemptions > 0


def test_a_request_bigger_than_the_pool_is_length_capped_not_livelocked():
    sched = create_scheduler(num_blocks=3)  # 12 tokens of KV
    (r,) = create_requests(1, num_tokens=6, max_tokens=50)
    sched.add_request(r)
    tokens, reasons = run_to_completion(sched, FakeModelRunner(3, 4))
    assert len(tokens["r0"]) == 7 and reasons["r0"] == "length"


# ---- stop conditions -----------------------------------------------------------------
def _run_with_tokens(sampling: dict, tokens: list[int], max_model_len: int = 64):
    sched = create_scheduler(max_model_len=max_model_len)
    sched.add_request(Request("s", [1, 2, 3], SamplingParams(**sampling), eos_token_id=EOS))
    got, reason, stop_reason = [], None, None
    for t in tokens:
        _, outs = step(sched, sampled={"s": [t]})
        if "s" in outs:
            got += outs["s"].new_token_ids
            reason, stop_reason = outs["s"].finish_reason, outs["s"].stop_reason
            if reason:
                break
    return got, reason, stop_reason


def test_eos_stops_unless_ignored():
    assert _run_with_tokens(dict(max_tokens=10), [5, EOS, 6]) == ([5, EOS], "stop", None)
    got, reason, _ = _run_with_tokens(dict(max_tokens=3, ignore_eos=True), [5, EOS, 6, 7])
    assert got == [5, EOS, 6] and reason == "length"


def test_stop_token_ids_and_min_tokens():
    assert _run_with_tokens(dict(max_tokens=10, stop_token_ids=[9]), [5, 9]) == ([5, 9], "stop", 9)
    got, reason, _ = _run_with_tokens(dict(max_tokens=10, stop_token_ids=[9], min_tokens=3), [9, EOS, 9, 4])
    assert got == [9, EOS, 9] and reason == "stop"


def test_max_tokens_and_max_model_len():
    assert _run_with_tokens(dict(max_tokens=2), [5, 6, 7])[:2] == ([5, 6], "length")
    assert _run_with_tokens(dict(max_tokens=None), [5, 6, 7], max_model_len=5)[:2] == ([5, 6], "length")


# ---- prefix caching --------------------------------------------------------------------
def test_prefix_cache_hits_never_the_last_token_and_counts():
    sched = create_scheduler()
    (a,) = create_requests(1, num_tokens=10, max_tokens=2, same_prompt=True)
    sched.add_request(a)
    run_to_completion(sched, FakeModelRunner(64, 4))
    (b,) = create_requests(1, num_tokens=10, max_tokens=2, same_prompt=True, start=1)
    sched.add_request(b)
    so, _ = step(sched)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    assert so.num_scheduled_tokens == {"r1": 2} and b.num_cached_tokens == 8
    stats = sched.get_stats()
    assert stats.prefix_cache_queries == 20 and stats.prefix_cache_hits == 8
    # A prompt of exactly two blocks hits only one: the last token is computed.
    (c,) = create_requests(1, num_tokens=8, same_prompt=True, start=2)
    assert sched.kv.get_computed_blocks(c)[1] == 4


def test_cache_salt_separates():
    sched = create_scheduler()
    (a,) = create_requests(1, num_tokens=10, max_tokens=1, same_prompt=True)
    sched.add_request(a)
    run_to_completion(sched, FakeModelRunner(64, 4))
    salted = Request("x", a.prompt_token_ids, cache_salt="tenant-b")
    assert sched.kv.get_computed_blocks(salted)[1] == 0
    assert sched.kv.get_computed_blocks(Request("y", a.prompt_token_ids))[1] == 8


def test_lru_eviction_takes_least_recently_freed_blocks_tail_first():
    sched = create_scheduler(num_blocks=7)
    runner = FakeModelRunner(7, 4)
    prompt_a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    prompt_b = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    for rid, prompt in (("a", prompt_a), ("b", prompt_b)):
        sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=1)))
        run_to_completion(sched, runner)
    # Free queue now: 3 never used, then a's blocks (tail first), then b's.
    sched.add_request(Request("c", [21 + i for i in range(12)], SamplingParams(max_tokens=1)))
    run_to_completion(sched, runner)
    # c took 3 blocks: one unused... then a's partial tail and a's second full block.
    assert sched.kv.get_computed_blocks(Request("a2", prompt_a))[1] == 4
    assert sched.kv.get_computed_blocks(Request("b2", prompt_b))[1] == 8


def test_reset_prefix_cache_refused_while_busy():
    sched = create_scheduler()
    (a,) = create_requests(1, num_tokens=10, max_tokens=3, same_prompt=True)
    sched.add_request(a)
    runner = FakeModelRunner(64, 4)
    step(sched, runner)
    assert sched.reset_prefix_cache() is False
    run_to_completion(sched, runner)
    assert sched.reset_prefix_cache() is True
    assert sched.kv.get_computed_blocks(Request("z", a.prompt_token_ids))[1] == 0


# ---- scheduler_cls ---------------------------------------------------------------------
class MyScheduler(Scheduler):
    pass


def test_scheduler_cls_resolution():
    assert type(create_scheduler()) is Scheduler
    for name in ("tests.scheduler.test_scheduler:MyScheduler", "tests.scheduler.test_scheduler.MyScheduler"):
        assert type(create_scheduler(scheduler_cls=name)) is MyScheduler
    for bad in ("no.such.module:X", "builtins:dict", "noqualname"):
        with pytest.raises(ValueError, match="scheduler_cls"):
            create_scheduler(scheduler_cls=bad)


# ---- bad input -------------------------------------------------------------------------
def test_prompt_longer_than_max_model_len_is_ignored_with_an_output():
    sched = create_scheduler(max_model_len=16)
    (r,) = create_requests(1, num_tokens=20)
    sched.add_request(r)
    assert r.status == RequestStatus.FINISHED_IGNORED
    so, outs = step(sched)
    assert outs["r0"].finish_reason == "length" and outs["r0"].new_token_ids == []
    assert so.total_num_scheduled_tokens == 0
    assert_serves_and_no_leaks(sched)


def test_max_tokens_below_one_is_rejected():
    for bad in (0, -3):
        with pytest.raises(ValueError, match="max_tokens"):
            SamplingParams(max_tokens=bad)


@pytest.mark.parametrize(
    "name", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]
)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), "0.5", None])
def test_float_params_must_be_finite_numbers(name, value):
    """NaN passes every range check (comparisons with NaN are False): a NaN temperature sampled
    garbage through LLM / `fleetserve generate` until this check."""
    with pytest.raises(ValueError, match=f"{name} must be a finite number"):
        SamplingParams(**{name: value})


def test_duplicate_ids_and_unknown_aborts_are_harmless():
    sched = create_scheduler()
    (r,) = create_requests(1)
    sched.add_request(r)
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_request(create_requests(1)[0])
    assert sched.abort_requests(["nope", "r0-x"]) == []
    step(sched)
    assert sched.abort_requests(["r0", "r0"]) == ["r0"]
    assert sched.abort_requests(["r0"]) == []
    so, _ = step(sched)
    assert so.finished_req_ids == {"r0"}
    assert_serves_and_no_leaks(sched)


def test_abort_in_every_queue_frees_blocks():
    sched = create_scheduler(num_blocks=4, enable_prefix_caching=False)
    reqs = create_requests(3, num_tokens=8, max_tokens=6)
    for r in reqs:
        sched.add_request(r)
    step(sched)
    step(sched)  # r1 preempted: waiting; r0 running; r2 waiting
    assert sched.abort_requests(["r1", "r0", "r2"]) == ["r1", "r0", "r2"]
    assert sched.kv.num_free_blocks == 4 and not sched.has_unfinished_requests()
    assert_serves_and_no_leaks(sched)


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", -1),
        ("block_size", 0),
        ("num_blocks", 0),
        ("policy", "lifo"),
        ("capacity_policy", "yolo"),
        ("long_prefill_token_threshold", -5),
        ("max_model_len", 1),
    ],
)
def test_invalid_configs_name_the_field(field, value):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=field):
        create_scheduler(**{field: value})


def test_non_chunked_needs_budget_for_a_whole_prompt():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="max_num_batched_tokens"):
        create_scheduler(enable_chunked_prefill=False, max_num_batched_tokens=16, max_model_len=64)


def test_unknown_config_field_rejected():
    from pydantic import ValidationError

    from fleetserve.scheduler import SchedulerConfig

    with pytest.raises(ValidationError, match="max_num_seq"):
        SchedulerConfig(max_num_seq=4)


def test_truncate_prompt_keeps_the_last_tokens():
    from fleetserve.scheduler.sampling_params import TRUNCATE_DEFAULT_ROOM, truncate_prompt

    ids = list(range(100))
    assert truncate_prompt(ids, None, 64) is ids
    assert truncate_prompt(ids, 10, 64) == list(range(90, 100))
    assert truncate_prompt(ids[:5], 10, 64) == ids[:5]
    # -1: as many as leave room for max_tokens (else the default room).
    assert truncate_prompt(ids, -1, 64, max_tokens=4) == list(range(40, 100))
    assert len(truncate_prompt(ids, -1, 64)) == 64 - TRUNCATE_DEFAULT_ROOM
    with pytest.raises(ValueError, match="at most this model's maximum context length"):
        truncate_prompt(ids, 65, 64)
    with pytest.raises(ValueError, match="leaves no room"):
        truncate_prompt(ids, -1, 64, max_tokens=64)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        truncate_prompt(ids, 0, 64)
