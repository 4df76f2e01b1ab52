"""Speculative decoding in the scheduler: drafts in the budget, rollback, stops, caching."""

from __future__ import annotations

from fleetserve.scheduler import ModelRunnerOutput, Request, SamplingParams
from tests.scheduler.utils import (
    EOS,
    FakeModelRunner,
    FakeProposer,
    assert_invariants,
    assert_serves_and_no_leaks,
    create_requests,
    create_scheduler,
    reference_tokens,
    run_to_completion,
)


def _step(sched, sampled: dict, drafts: dict | None = None):
    so = sched.schedule()
    ids = list(so.num_scheduled_tokens)
    ro = ModelRunnerOutput(ids, [list(sampled.get(i, [])) for i in ids], spec_token_ids=drafts)
    outs = {o.request_id: o for o in sched.update_from_output(so, ro)}
    assert_invariants(sched)
    return so, outs


def _prefilled(max_tokens=20, **kw):
    kw.setdefault("adaptive_draft_length", False)
    sched = create_scheduler(num_spec_tokens=3, block_size=4, **kw)
    (req,) = create_requests(1, num_tokens=6, max_tokens=max_tokens)
    sched.add_request(req)
    _step(sched, {"r0": [50]}, {"r0": [51, 52, 53]})
    return sched, req


def test_drafts_are_scheduled_in_the_budget_and_rejected_ones_rolled_back():
    sched, req = _prefilled()
    assert req.spec_token_ids == [51, 52, 53] and req.num_tokens == 7
    so, outs = _step(sched, {"r0": [51, 60]})  # draft 1 accepted, then the target's own token
    assert so.num_scheduled_tokens == {"r0": 4}  # the last token + 3 drafts
    assert so.scheduled_spec_decode_tokens == {"r0": [51, 52, 53]}
    assert outs["r0"].new_token_ids == [51, 60]
    # Two drafts rejected: their slots count as not computed.
    assert req.num_tokens == 9 and req.num_computed_tokens == 8
    stats = sched.get_stats().spec_decoding
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    assert stats.num_accepted_tokens_per_pos == [1, 0, 0]
    so, _ = _step(sched, {"r0": [61]})  # no drafts this time: a plain decode
    assert so.num_scheduled_tokens == {"r0": 1} and not so.scheduled_spec_decode_tokens


def test_stop_conditions_apply_to_every_accepted_token():
    sched = create_scheduler(num_spec_tokens=3, block_size=4, adaptive_draft_length=False)
    req = Request("s", list(range(1, 7)), SamplingParams(max_tokens=20, stop_token_ids=[52]), eos_token_id=EOS)
    sched.add_request(req)
    _step(sched, {"s": [50]}, {"s": [51, 52, 53]})
    _, outs = _step(sched, {"s": [51, 52, 53, 54]})
    assert outs["s"].new_token_ids == [51, 52] and outs["s"].finish_reason == "stop"
    assert outs["s"].stop_reason == 52
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_drafts_never_pass_max_tokens():
    sched, req = _prefilled(max_tokens=3)  # one output so far: room for 2 more
    assert req.spec_token_ids == [51]  # a step yields drafts + 1 tokens
    _, outs = _step(sched, {"r0": [51, 70]})
    assert outs["r0"].new_token_ids == [51, 70] and outs["r0"].finish_reason == "length"


def test_budget_cuts_drafts():
    sched = create_scheduler(num_spec_tokens=3, block_size=4, max_num_batched_tokens=2, adaptive_draft_length=False)
    (req,) = create_requests(1, num_tokens=6, max_tokens=20)
    sched.add_request(req)
    for _ in range(2):  # prefill chunks: drafts offered mid-prefill are ignored
        _step(sched, {"r0": [50]}, {"r0": [51, 52, 53]})
        assert req.spec_token_ids == []
    _step(sched, {"r0": [50]}, {"r0": [51, 52, 53]})
    so, _ = _step(sched, {"r0": [51, 80]})
    assert so.scheduled_spec_decode_tokens == {"r0": [51]}
    assert req.num_computed_tokens == req.num_tokens - 1


def test_blocks_holding_drafts_are_never_cached():
    sched, req = _prefilled()  # 7 known tokens; 3 drafts fill block 1 (tokens 4..7) and spill
    _step(sched, {"r0": [99]})  # every draft rejected
    # Block 1 held drafts at schedule time: it was not registered then; now
    # that 8 tokens are known it holds one wrong KV slot (position 7 is the
    # rejected draft's), so it must still not be cached.
    assert sched.kv.num_cached_blocks["r0"] == 1
    _step(sched, {"r0": [100]})  # position 7 recomputed with the real token
    assert sched.kv.num_cached_blocks["r0"] == 2


def test_preemption_drops_drafts_and_tokens_stay_exact():
    # Few blocks: requests preempt each other while they speculate.
    sched = create_scheduler(num_spec_tokens=4, num_blocks=10, block_size=2, max_model_len=40)
    runner = FakeModelRunner(10, 2, proposer=FakeProposer(4, seed=3))
    reqs = create_requests(4, num_tokens=5, max_tokens=12)
    for r in reqs:
        sched.add_request(r)
    tokens, _ = run_to_completion(sched, runner)
    assert sched.num_preemptions > 0 and sched.spec_stats.num_accepted_tokens > 0
    for r in reqs:
        assert tokens[r.request_id] == reference_tokens(r, 40)
    assert_serves_and_no_leaks(sched, runner)


def test_lookahead_slots_for_a_draft_model():
    sched, req = _prefilled(num_lookahead_tokens=3)
    _step(sched, {"r0": [51, 52, 53, 54]})
    # Positions 6..9 (last token + 3 drafts) and 3 slots ahead: 13 slots, 4 blocks
    # (3 without lookahead); drafts and lookahead are both uncached.
    assert len(sched.kv.get_block_ids("r0")) == 4
    assert sched.kv.num_cached_blocks["r0"] == 1


def test_adaptive_draft_length_earns_and_backs_off():
    sched = create_scheduler(num_spec_tokens=6, block_size=4, max_model_len=200)
    (req,) = create_requests(1, num_tokens=6, max_tokens=100)
    sched.add_request(req)
    drafts = list(range(50, 56))
    _step(sched, {"r0": [49]}, {"r0": drafts})
    assert req.spec_token_ids == [50, 51]  # a fresh request starts with 2
    _step(sched, {"r0": [50, 51, 9]}, {"r0": drafts})  # all accepted: 2 more
    assert req.spec_token_ids == drafts[:4]
    _step(sched, {"r0": drafts[:4] + [9]}, {"r0": drafts})
    assert req.spec_token_ids == drafts  # capped at k
    _step(sched, {"r0": [50, 9]}, {"r0": drafts})  # 1 of 6 accepted: next time 2
    assert req.spec_token_ids == drafts[:2]
    # Nothing accepted: one draft token next time, after skipping 2, then 4 proposals.
    for wait in (2, 4):
        _step(sched, {"r0": [9]}, {"r0": drafts})
        for _ in range(wait):
            assert req.spec_token_ids == []
            _step(sched, {"r0": [9]}, {"r0": drafts})
        assert req.spec_token_ids == [50]


def test_free_drafts_fill_a_small_step_up_to_k():
    """A lone request sends all k drafts while the step stays under
    free_draft_tokens, though it has earned only 2 (or, after a miss, none)."""
    sched = create_scheduler(num_spec_tokens=6, block_size=4, max_model_len=200, free_draft_tokens=8)
    (req,) = create_requests(1, num_tokens=6, max_tokens=100)
    sched.add_request(req)
    drafts = list(range(50, 56))
    _step(sched, {"r0": [49]}, {"r0": drafts})
    assert req.spec_token_ids == drafts  # 1 + 6 tokens <= 8
    so, _ = _step(sched, {"r0": [9]}, {"r0": drafts})  # nothing accepted: earned wait...
    assert so.scheduled_spec_decode_tokens == {"r0": drafts}
    assert req.spec_token_ids == drafts  # ...but the step is still free
    # The stats count every draft sent: 6 sent, none accepted.
    assert sched.spec_stats.num_draft_tokens == 6 and sched.spec_stats.num_accepted_tokens == 0


def test_free_drafts_share_the_room_and_stop_for_a_big_step():
    sched = create_scheduler(num_spec_tokens=6, block_size=4, max_model_len=200, free_draft_tokens=8)
    reqs = create_requests(2, num_tokens=6, max_tokens=100)
    for r in reqs:
        sched.add_request(r)
    drafts = list(range(50, 56))
    _step(sched, {"r0": [49], "r1": [49]}, {"r0": drafts, "r1": drafts})
    # Room 8 - 2 running tokens - 2 x 2 earned = 2 extra, to the first in order.
    assert reqs[0].spec_token_ids == drafts[:4]
    assert reqs[1].spec_token_ids == drafts[:2]
    # A waiting request's prefill will join the next step: earned drafts only.
    (late,) = create_requests(1, num_tokens=6, max_tokens=100, start=2)
    sched.add_request(late)
    so = sched.schedule()
    assert so.scheduled_spec_decode_tokens == {"r0": drafts[:4], "r1": drafts[:2]}
    ids = list(so.num_scheduled_tokens)
    sampled = {"r0": drafts[:4] + [9], "r1": drafts[:2] + [9], "r2": [49]}
    sched.update_from_output(
        so, ModelRunnerOutput(ids, [sampled[i] for i in ids], spec_token_ids={"r0": drafts, "r1": drafts})
    )
    assert_invariants(sched)
    # Three decoding now (3 tokens) plus earned drafts 6 + 4 (+ 2 for r2's first):
    # over 8, no top-up; every request keeps what it earned.
    assert reqs[0].spec_token_ids == drafts[:6] and reqs[1].spec_token_ids == drafts[:4]


def test_free_drafts_off_keeps_earned_lengths():
    sched = create_scheduler(num_spec_tokens=6, block_size=4, max_model_len=200, free_draft_tokens=0)
    (req,) = create_requests(1, num_tokens=6, max_tokens=100)
    sched.add_request(req)
    _step(sched, {"r0": [49]}, {"r0": list(range(50, 56))})
    assert req.spec_token_ids == [50, 51]


def test_a_traced_request_ends_with_its_drafts_and_acceptances():
    """What the decode span reports (router/tracing.py): drafts verified and accepted over the
    request's life, as one summary event on its final output."""
    sched = create_scheduler(num_spec_tokens=3, block_size=4, adaptive_draft_length=False)
    (req,) = create_requests(1, num_tokens=6, max_tokens=7)
    req.events = []
    sched.add_request(req)
    _step(sched, {"r0": [50]}, {"r0": [51, 52, 53]})
    _step(sched, {"r0": [51, 60]}, {"r0": [61, 62, 63]})  # 1 of 3 accepted
    _, outs = _step(sched, {"r0": [61, 62, 63, 64]})  # 3 of 3: 7 tokens, done
    assert outs["r0"].finished
    (spec,) = [a for n, _, a in outs["r0"].events if n == "spec_decode"]
    assert spec == {"draft_tokens": 6, "accepted_tokens": 4}
    assert (req.num_draft_tokens, req.num_accepted_draft_tokens) == (6, 4)
