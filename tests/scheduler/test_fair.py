"""policy="fair": the Virtual Token Counter (scheduler/fair.py), its queue order, its lift,
its weights, its preemption choice, and the service gap between two backlogged tenants
against the bound the module docstring derives."""

from __future__ import annotations

import pytest

from fleetserve.scheduler import Request, SamplingParams
from fleetserve.scheduler.fair import FairQueue, VirtualTokenCounter

from .utils import (
    EOS,
    VOCAB,
    FakeModelRunner,
    assert_serves_and_no_leaks,
    create_scheduler,
    reference_tokens,
    run_to_completion,
    step,
)


def make(rid: str, tenant: str, num_tokens: int = 8, max_tokens: int = 4, arrival: float = 0.0, weight: float = 1.0):
    seed = sum(map(ord, rid))
    prompt = [(seed + 7 * j) % (VOCAB - 1) + 1 for j in range(num_tokens)]
    return Request(
        rid,
        prompt,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        eos_token_id=EOS,
        arrival_time=arrival,
        tenant=tenant,
        tenant_weight=weight,
    )


def test_counters_charge_prompt_once_and_weigh_output_and_tenant():
    vtc = VirtualTokenCounter(input_weight=1.0, output_weight=2.0)
    a, b = make("a", "A", num_tokens=10), make("b", "B", num_tokens=10, weight=2.0)
    vtc.arrive(a)
    vtc.arrive(b)
    vtc.charge_prompt(a, 6)  # tokens 0..5
    a.num_computed_tokens = 6
    vtc.charge_prompt(a, 8)  # 6..13: only 6..9 are prompt
    assert vtc.counter("A") == 10
    a.num_computed_tokens = 0  # preempted: recomputing its prompt costs nothing again
    vtc.charge_prompt(a, 10)
    assert vtc.counter("A") == 10
    vtc.charge_output(a, 3)
    assert vtc.counter("A") == 16
    vtc.charge_prompt(b, 10)
    vtc.charge_output(b, 3)
    assert vtc.counter("B") == 8  # (10 + 2 * 3) / weight 2


def test_prefix_hits_are_not_charged():
    vtc = VirtualTokenCounter()
    r = make("r", "A", num_tokens=12)
    vtc.arrive(r)
    r.num_computed_tokens = 8  # 8 tokens hit the prefix cache
    vtc.charge_prompt(r, 4)
    assert vtc.counter("A") == 4


def test_lift_on_arrival_banks_no_idle_credit():
    vtc = VirtualTokenCounter()
    a1, b1 = make("a1", "A"), make("b1", "B")
    vtc.arrive(a1)
    vtc.arrive(b1)
    vtc.charge_output(a1, 50)  # A: 100
    vtc.charge_output(b1, 20)  # B: 40
    vtc.leave(a1)  # A idle at 100
    # A newcomer starts at the active minimum (B's 40), not at 0.
    c1 = make("c1", "C")
    vtc.arrive(c1)
    assert vtc.counter("C") == 40
    vtc.charge_output(b1, 100)  # B: 240; C still 40
    # A comes back: lifted to the active minimum only if that is above its own.
    a2 = make("a2", "A")
    vtc.arrive(a2)
    assert vtc.counter("A") == 100
    vtc.leave(c1)  # C at 40 <= min active (A 100): forgotten, it would be lifted anyway
    assert "C" not in vtc.counters
    # An active tenant is not lifted by another arrival of its own.
    vtc.charge_output(a2, 200)  # A: 500
    vtc.arrive(make("a3", "A"))
    assert vtc.counter("A") == 500
    # Everyone leaves: the next tenant starts at the last one that left.
    for r in (b1, a2):
        vtc.leave(r)
    vtc.leave(make("a3", "A"))
    d = make("d", "D")
    vtc.arrive(d)
    assert vtc.counter("D") == 500


def test_queue_orders_by_counter_then_arrival_and_prepends_within_tenant():
    vtc = VirtualTokenCounter()
    q = FairQueue(vtc)
    reqs = [make(f"a{i}", "A", arrival=i) for i in range(3)] + [make(f"b{i}", "B", arrival=10 + i) for i in range(2)]
    for r in reqs:
        vtc.arrive(r)
        q.add(r)
    assert q.peek().request_id == "a0"  # counters equal: the earliest head
    first = q.pop()
    vtc.charge_prompt(first, 8)
    assert [q.pop().request_id for _ in range(2)] == ["b0", "b1"]  # A is ahead now, B empties
    assert q.pop().request_id == "a1"
    q.prepend(first)
    assert q.peek() is first
    q.remove_many([first])
    assert len(q) == 1 and [r.request_id for r in q] == ["a2"]


def test_scheduler_admits_the_tenant_served_least():
    # One seat at a time: the order of admission is the queue's.
    sched = create_scheduler(policy="fair", max_num_seqs=1)
    for i in range(4):
        sched.add_request(make(f"h{i}", "heavy", num_tokens=16, max_tokens=4, arrival=i))
    for i in range(2):
        sched.add_request(make(f"l{i}", "light", num_tokens=4, max_tokens=2, arrival=10 + i))
    order = []
    for _ in range(200):
        if not sched.has_requests():
            break
        so, _ = step(sched)
        order.extend(r.req_id for r in so.scheduled_new_reqs)
    # h0 costs 16 + 2*4 = 24, a light request 4 + 2*2 = 8: both light ones go before h1.
    assert order == ["h0", "l0", "l1", "h1", "h2", "h3"]


def test_weights_split_service_in_proportion():
    # Equal requests, one seat: tenant A (weight 3) is charged a third of what B is.
    sched = create_scheduler(policy="fair", max_num_seqs=1)
    for i in range(40):
        sched.add_request(make(f"a{i}", "A", num_tokens=8, max_tokens=4, arrival=i, weight=3.0))
        sched.add_request(make(f"b{i}", "B", num_tokens=8, max_tokens=4, arrival=i + 0.5, weight=1.0))
    done = {"A": 0, "B": 0}
    for _ in range(2000):
        _, outs = step(sched)
        for rid, o in outs.items():
            if o.finished:
                done["A" if rid[0] == "a" else "B"] += 1
        if done["A"] + done["B"] == 40:
            break
    assert abs(done["A"] - 30) <= 1 and abs(done["B"] - 10) <= 1, done


def test_preemption_takes_from_the_tenant_most_over_its_share():
    # 9 blocks of 4 tokens. After the first step A (a 24-token prompt) has been charged 26,
    # B (two 4-token prompts) 12; the next step's growth needs 3 blocks and 1 is free. FCFS
    # would preempt the last admitted (s2, B's); fair preempts A's request.
    sched = create_scheduler(policy="fair", num_blocks=9, max_num_batched_tokens=64, enable_prefix_caching=False)
    runner = FakeModelRunner(9, 4)
    sched.add_request(make("big", "A", num_tokens=24, max_tokens=4))
    sched.add_request(make("s1", "B", num_tokens=4, max_tokens=8))
    sched.add_request(make("s2", "B", num_tokens=4, max_tokens=8))
    preempted = []
    for _ in range(100):
        if not sched.has_requests():
            break
        so = sched.schedule()
        preempted.extend(so.preempted_req_ids)
        sched.update_from_output(so, runner.execute(so))
    assert preempted == ["big"]
    assert_serves_and_no_leaks(sched, runner)


@pytest.mark.parametrize("gap", [None, 0.0, 1e9])
def test_a_seat_for_the_tenant_served_least_only_with_a_gap(gap):
    # Two seats, both taken by heavy's long requests; a light request arrives.
    sched = create_scheduler(policy="fair", max_num_seqs=2, num_blocks=64, fair_preemption_gap=gap)
    runner = FakeModelRunner(64, 4)
    heavy = [make(f"h{i}", "heavy", num_tokens=8, max_tokens=40, arrival=i) for i in range(3)]
    for r in heavy:
        sched.add_request(r)
    for _ in range(3):
        step(sched, runner)
    light = make("l0", "light", num_tokens=4, max_tokens=2, arrival=10)
    sched.add_request(light)
    # Lifted to heavy's counter on arrival: not behind yet, so it waits this step.
    so, _ = step(sched, runner)
    assert not so.preempted_req_ids and not so.scheduled_new_reqs
    so, _ = step(sched, runner)  # heavy decoded one more step: light trails it now
    if gap == 0.0:
        # h1, heavy's last admitted, gives its seat; light runs at once.
        assert so.preempted_req_ids == {"h1"}
        assert [r.req_id for r in so.scheduled_new_reqs] == ["l0"]
    else:
        assert not so.preempted_req_ids and not so.scheduled_new_reqs
    run_to_completion(sched, runner)
    for r in (*heavy, light):  # the preempted one recomputed to the same tokens
        assert r.output_token_ids == reference_tokens(r, sched.config.max_model_len)
    assert_serves_and_no_leaks(sched, runner)


def test_the_gap_needs_policy_fair():
    with pytest.raises(ValueError, match="fair_preemption_gap is for policy 'fair'"):
        create_scheduler(policy="fcfs", fair_preemption_gap=0.0)


def test_fcfs_and_priority_ignore_tenants():
    sched = create_scheduler(policy="fcfs")
    assert sched.vtc is None
    r = make("x", "A")
    sched.add_request(r)
    step(sched)
    assert r.num_charged_prompt_tokens == 0


def service_gap(policy: str, w_in: float = 1.0, w_out: float = 2.0) -> tuple[float, float, float, float]:
    """Tenant f queues 40 long requests before tenant g queues 40 short ones; both stay
    backlogged. Service is counted here from the steps, independently of the counters.
    Returns (the largest |service_f - service_g| while both were backlogged, the largest
    gap over an interval: max - min of service_f - service_g, the per-instant bound
    w_in * L_in + max(w_in, w_out) * M, the paper's interval bound 2 * max(w_in * L_in,
    w_out * M)), M the KV pool's tokens, L_in the longest prompt."""
    block_size, num_blocks, l_in = 4, 32, 24
    sched = create_scheduler(
        policy=policy,
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        max_model_len=128,
        enable_prefix_caching=False,
        fair_input_weight=w_in,
        fair_output_weight=w_out,
    )
    runner = FakeModelRunner(num_blocks, block_size)
    for i in range(40):
        sched.add_request(make(f"f{i}", "f", num_tokens=l_in, max_tokens=16, arrival=i))
    for i in range(40):
        sched.add_request(make(f"g{i}", "g", num_tokens=6, max_tokens=6, arrival=100 + i))
    service = {"f": 0.0, "g": 0.0}
    charged: dict[str, int] = {}
    diffs = [0.0]
    for _ in range(5000):
        if {r.tenant for r in sched.waiting} != {"f", "g"}:
            break
        so = sched.schedule()
        for rid, n in so.num_scheduled_tokens.items():
            r = sched.requests[rid]
            start = max(r.num_computed_tokens - n, charged.get(rid, 0))  # (advanced by n already)
            end = min(r.num_computed_tokens, r.num_prompt_tokens)
            if end > start:
                service[r.tenant] += w_in * (end - start)
                charged[rid] = end
        ro = runner.execute(so)
        before = [(sched.requests[rid], sched.requests[rid].num_output_tokens) for rid in ro.req_ids]
        sched.update_from_output(so, ro)
        for r, n0 in before:
            service[r.tenant] += w_out * (r.num_output_tokens - n0)
        diffs.append(service["f"] - service["g"])
    m = num_blocks * block_size
    return (
        max(map(abs, diffs)),
        max(diffs) - min(diffs),
        w_in * l_in + max(w_in, w_out) * m,
        2 * max(w_in * l_in, w_out * m),
    )


@pytest.mark.parametrize("w_in,w_out", [(1.0, 2.0), (1.0, 1.0)])
def test_service_gap_of_backlogged_tenants_within_the_vtc_bound(w_in, w_out):
    gap, interval_gap, bound, paper_bound = service_gap("fair", w_in, w_out)
    assert 0 < gap <= bound
    assert interval_gap <= paper_bound
    # The same workload first come first served: g waits behind all of f, far past both.
    gap_fcfs, _, _, _ = service_gap("fcfs", w_in, w_out)
    assert gap_fcfs > 2 * paper_bound


def test_fair_runs_to_the_right_tokens_without_leaks():
    sched = create_scheduler(policy="fair", num_blocks=24)
    runner = FakeModelRunner(24, 4)
    for i in range(12):
        sched.add_request(make(f"r{i}", f"t{i % 3}", num_tokens=10, max_tokens=8, arrival=i))
    tokens, reasons = run_to_completion(sched, runner)
    assert len(tokens) == 12 and set(reasons.values()) == {"length"}
    assert not sched.vtc.counters or all(not sched.vtc.is_active(t) for t in sched.vtc.counters)
    assert_serves_and_no_leaks(sched, runner)
