"""A traced request's scheduling events (scheduler.Request.events): what the replica turns into
its queue, prefill and decode spans (router/tracing.py). An untraced request records nothing and
its outputs carry none."""

from __future__ import annotations

from tests.scheduler.utils import FakeModelRunner, assert_serves_and_no_leaks, create_requests, create_scheduler, step


def _run(sched, runner, max_steps: int = 500) -> dict:
    finals = {}
    for _ in range(max_steps):
        if not sched.has_requests():
            return finals
        _, outs = step(sched, runner)
        for rid, o in outs.items():
            if o.finished:
                finals[rid] = o
            else:
                assert o.events is None, "events come on the final output only"
    raise AssertionError("not idle")


def test_chunked_prefill_then_decode_records_schedule_chunks_and_nothing_per_decode_step():
    sched = create_scheduler(max_num_batched_tokens=8, max_model_len=64, enable_chunked_prefill=True)
    runner = FakeModelRunner(sched.kv.num_blocks, sched.block_size)
    traced, plain = create_requests(2, num_tokens=20, max_tokens=6)
    traced.events = []
    sched.add_request(traced)
    sched.add_request(plain)
    finals = _run(sched, runner)
    assert finals[plain.request_id].events is None
    events = finals[traced.request_id].events
    names = [e[0] for e in events]
    assert names[0] == "scheduled" and names.count("scheduled") == 1, names
    chunks = [e[2] for e in events if e[0] == "prefill_chunk"]
    # 20 prompt tokens in chunks of at most 8 (the budget, shared with the other request)
    assert sum(c["tokens"] for c in chunks) == 20 and len(chunks) >= 3, chunks
    assert chunks[-1]["computed"] == 20
    assert all(c["tokens"] <= 8 for c in chunks)
    times = [e[1] for e in events]
    assert times == sorted(times)
    assert events[0][2] == {"cached_tokens": 0, "external_tokens": 0, "remote_load": False}
    assert traced.events is None and not sched._traced  # handed over with the output
    assert_serves_and_no_leaks(sched, runner)


def test_a_prefix_hit_and_a_preemption_are_recorded():
    # Room for one request at a time past a point: the second one preempts or waits.
    sched = create_scheduler(num_blocks=9, block_size=4, max_num_batched_tokens=64, max_model_len=64)
    runner = FakeModelRunner(sched.kv.num_blocks, sched.block_size)
    first = create_requests(1, num_tokens=16, max_tokens=2, prefix="a")[0]
    sched.add_request(first)
    _run(sched, runner)
    # Same prompt: its first full blocks hit the prefix cache.
    again = create_requests(1, num_tokens=16, max_tokens=2, prefix="b")[0]
    again.events = []
    sched.add_request(again)
    events = _run(sched, runner)[again.request_id].events
    assert events[0][0] == "scheduled" and events[0][2]["cached_tokens"] == 12, events

    # Two requests that together outgrow the pool while decoding: one is preempted.
    a, b = create_requests(2, num_tokens=8, max_tokens=14, prefix="p", start=3)
    a.events, b.events = [], []
    sched.add_request(a)
    sched.add_request(b)
    finals = _run(sched, runner)
    all_events = finals[a.request_id].events + finals[b.request_id].events
    preempted = [e for e in all_events if e[0] == "preempted"]
    assert preempted, [e[0] for e in all_events]
    victim = (
        finals[a.request_id] if any(e[0] == "preempted" for e in finals[a.request_id].events) else finals[b.request_id]
    )
    names = [e[0] for e in victim.events]
    # scheduled again after its preemption
    assert names.count("scheduled") >= 2 and names.index("preempted") < len(names) - 1 - names[::-1].index("scheduled")
    assert_serves_and_no_leaks(sched, runner)
