"""Output-length-aware scheduling (scheduler/length_aware.py): shortest predicted first, its
aging bound (no starvation), the preemption victim, fair_shortest_first inside a tenant's
share, the scheduler's own predictor learning from finished requests, the error counts it
reports, and KV reservation by predicted length (fewer preemptions)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from fleetserve.scheduler import ModelRunnerOutput, Request, SamplingParams, SchedulerConfig
from fleetserve.scheduler.fair import VirtualTokenCounter
from fleetserve.scheduler.length_aware import FairShortestFirstQueue, ShortestFirstQueue, sjf_victim

from .utils import (
    EOS,
    VOCAB,
    FakeModelRunner,
    assert_serves_and_no_leaks,
    create_scheduler,
    reference_tokens,
    run_to_completion,
)


def make(rid, pred=None, arrival=0.0, tenant=None, num_tokens=8, max_tokens=40, ignore_eos=True):
    seed = sum(map(ord, rid))
    prompt = [(seed + 7 * j) % (VOCAB - 1) + 1 for j in range(num_tokens)]
    r = Request(
        rid,
        prompt,
        SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
        eos_token_id=EOS,
        arrival_time=arrival,
        tenant=tenant,
        predicted_output_tokens=pred,
    )
    r.max_tokens = max_tokens  # (the scheduler resolves it at add_request)
    return r


def test_shortest_predicted_first_and_ties_by_arrival():
    q = ShortestFirstQueue(aging_rate=10.0)
    for r in (make("long", 500, 0.0), make("short", 5, 1.0), make("mid", 50, 0.5), make("short2", 5, 2.0)):
        q.add(r)
    assert [r.request_id for r in q] == ["short", "short2", "mid", "long"]
    assert [q.pop().request_id for _ in range(4)] == ["short", "short2", "mid", "long"]


def serve_one_per_second(q, arrivals, until):
    """Requests arrive at their times; one leaves the queue each second. Returns (id, time)."""
    served, pending, t = [], sorted(arrivals, key=lambda r: r.arrival_time), 0.0
    while t <= until:
        while pending and pending[0].arrival_time <= t:
            q.add(pending.pop(0))
        if q:
            served.append((q.pop().request_id, t))
        t += 1.0
    return served


@pytest.mark.parametrize("rate", [100.0, 20.0])
def test_aging_bounds_how_long_shorter_requests_can_pass(rate):
    # A long request (predicted 1000 tokens) and a steady stream of short ones, two a second
    # while one is served: without aging the long one would wait for ever.
    long = make("long", 1000, 0.25)
    shorts = [make(f"s{i}", 5, 0.5 * i) for i in range(400)]
    served = serve_one_per_second(ShortestFirstQueue(rate), [long, *shorts], until=150)
    order = [rid for rid, _ in served]
    assert "long" in order
    t_long = dict(served)["long"]
    window = 1000 / rate  # the key's delay: no request arriving after this passes it
    arrival = {r.request_id: r.arrival_time for r in shorts}
    passed = order[: order.index("long")]
    assert passed  # shorter requests did go first
    assert all(arrival[rid] <= long.arrival_time + window for rid in passed)
    # Served once the requests that arrived within the window are: two a second of them.
    assert t_long <= 2 * window + 2


def test_without_aging_the_long_request_starves():
    # The check above can fail: a rate this small is pure shortest-first.
    long = make("long", 1000, 0.25)
    shorts = [make(f"s{i}", 5, 0.5 * i) for i in range(400)]
    served = serve_one_per_second(ShortestFirstQueue(1e-6), [long, *shorts], until=150)
    assert "long" not in dict(served)


def test_a_huge_rate_is_fcfs():
    q = ShortestFirstQueue(1e12)
    for i, pred in enumerate([900, 3, 50, 1]):
        q.add(make(f"r{i}", pred, float(i)))
    assert [q.pop().request_id for _ in range(4)] == ["r0", "r1", "r2", "r3"]


def test_victim_is_the_one_ranked_last_and_prediction_counts_what_is_left():
    a, b = make("a", 100, 0.0), make("b", 20, 1.0)
    assert sjf_victim([a, b], 10.0) is a  # keys 10 vs 3
    a.append_output_token_ids([1] * 95)  # 5 predicted left: key 0.5
    assert sjf_victim([a, b], 10.0) is b


def test_fair_shortest_first_orders_inside_a_tenant_only():
    vtc = VirtualTokenCounter()
    q = FairShortestFirstQueue(vtc, aging_rate=10.0)
    reqs = [make("a-long", 400, 0.0, "A"), make("a-short", 4, 1.0, "A"), make("b-long", 400, 0.5, "B")]
    for r in reqs:
        vtc.arrive(r)
        q.add(r)
    vtc.charge_output(reqs[0], 10)  # A was served more: B goes first, whatever its length
    assert q.pop().request_id == "b-long"
    assert q.pop().request_id == "a-short"
    assert q.pop().request_id == "a-long"


def test_config_refuses_fair_shortest_first_without_fair():
    with pytest.raises(ValidationError, match="fair_shortest_first"):
        SchedulerConfig(policy="fcfs", fair_shortest_first=True)
    SchedulerConfig(policy="fair", fair_shortest_first=True)


def test_the_scheduler_predicts_learns_and_counts_errors():
    sched = create_scheduler(policy="sjf", max_num_seqs=4, max_model_len=64, num_blocks=128)
    assert sched.lengths is not None
    for k in range(12):
        short = make(f"short{k}", tenant="A", ignore_eos=False)
        long = make(f"long{k}", tenant="B", max_tokens=30)
        short.predicted_output_tokens = long.predicted_output_tokens = None
        sched.add_request(short)
        sched.add_request(long)
        while sched.has_requests():
            so = sched.schedule()
            ids = list(so.num_scheduled_tokens)
            # A's requests end by EOS at their second token; B's run to max_tokens (30).
            done = {i for i in ids if i.startswith("short") and sched.requests[i].num_output_tokens >= 1}
            sampled = [[EOS] if i in done else [1] for i in ids]
            sched.update_from_output(so, ModelRunnerOutput(ids, sampled))
    a, b = make("shortN", tenant="A"), make("longN", tenant="B", max_tokens=30)
    a.predicted_output_tokens = b.predicted_output_tokens = None
    sched.add_request(a)
    sched.add_request(b)
    assert a.predicted_output_tokens <= 3
    assert 25 <= b.predicted_output_tokens <= 30
    stats = sched.get_stats()
    assert stats.length_num_predicted == 24 == sum(stats.length_error_counts)
    # The later predictions were close: most errors sit in the first buckets.
    assert sum(stats.length_error_counts[:3]) >= 16
    assert create_scheduler().get_stats().length_error_counts is None  # off by default


def pool_workload(sched, n=12):
    # Long outputs into a small pool: admitting all of them at once overflows it.
    for i in range(n):
        r = make(f"r{i}", num_tokens=8, max_tokens=40, arrival=float(i))
        r.predicted_output_tokens = 40  # an exact prediction
        sched.add_request(r)
    tokens, reasons = run_to_completion(sched, FakeModelRunner(sched.kv.num_blocks, sched.block_size))
    assert len(reasons) == n
    return sched.num_preemptions


def test_reserving_predicted_blocks_preempts_less():
    base = pool_workload(create_scheduler(num_blocks=40, max_num_seqs=12, max_model_len=64))
    reserve = create_scheduler(num_blocks=40, max_num_seqs=12, max_model_len=64, capacity_policy="reserve_predicted")
    assert base > 0
    assert pool_workload(reserve) == 0
    assert_serves_and_no_leaks(reserve)


@pytest.mark.parametrize(
    "config",
    [dict(policy="sjf"), dict(policy="fair", fair_shortest_first=True), dict(capacity_policy="reserve_predicted")],
)
def test_length_aware_settings_serve_everything_with_the_same_tokens(config):
    sched = create_scheduler(num_blocks=24, max_num_seqs=3, **config)
    reqs = [make(f"q{i}", max_tokens=5 + 4 * (i % 3), arrival=float(i), tenant="AB"[i % 2]) for i in range(8)]
    for r in reqs:
        sched.add_request(r)
    runner = FakeModelRunner(sched.kv.num_blocks, sched.block_size)
    tokens, reasons = run_to_completion(sched, runner)
    assert set(reasons) == {f"q{i}" for i in range(8)}
    # Whatever the order and the preemptions, each request's tokens are its own (greedy).
    for r in reqs:
        assert tokens[r.request_id] == reference_tokens(r, sched.config.max_model_len)
    assert_serves_and_no_leaks(sched, runner)


def test_errors_reach_the_engine_metrics_histogram():
    from fleetserve.replica.engine.metrics import EngineMetrics

    sched = create_scheduler(policy="sjf")
    for i, (pred, n) in enumerate([(4, 4), (4, 10), (30, 2)]):
        sched.add_request(make(f"m{i}", pred=pred, max_tokens=n))
    run_to_completion(sched, FakeModelRunner(sched.kv.num_blocks, sched.block_size))
    metrics = EngineMetrics("m")
    metrics.update_scheduler_stats(sched.get_stats())
    metrics.update_scheduler_stats(sched.get_stats())  # counted once, by the delta
    text = metrics.text()
    name = "fleetserve:output_length_prediction_error_tokens"
    # Errors 0, 6 and 0 (the last prediction, 30, is capped to its max_tokens, 2).
    assert f'{name}_count{{engine="0",model_name="m"}} 3.0' in text
    assert f'{name}_bucket{{engine="0",le="1.0",model_name="m"}} 2.0' in text
    assert f'{name}_bucket{{engine="0",le="8.0",model_name="m"}} 3.0' in text
