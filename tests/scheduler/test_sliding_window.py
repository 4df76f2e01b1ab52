"""A model whose every layer has a sliding window of W tokens: a running request's blocks wholly
at or before position p - W (p: its next token) go back to the pool as it advances
(scheduler/kv_cache_manager.py). The fake model runner, given the window, reads every slot
of a new token's window, so a block given back while still inside it (and handed to another
request, which writes it) changes the tokens."""

from __future__ import annotations

import pytest

from fleetserve.scheduler.kv_cache_manager import NULL_BLOCK, KVCacheManager
from tests.scheduler.utils import (
    FakeModelRunner,
    FakeProposer,
    assert_serves_and_no_leaks,
    create_requests,
    create_scheduler,
    reference_tokens,
    step,
)

BS, W = 4, 8


def _held(sched, rid: str) -> int:
    return sum(1 for b in sched.kv.req_to_blocks.get(rid, ()) if b is not NULL_BLOCK)


def _step(sched, runner):
    """One step, then: every running request still holds each block its next token's window
    reads (positions next - W + 1 .. next - 1)."""
    so, outs = step(sched, runner)
    for r in sched.running:
        blocks, p = sched.kv.req_to_blocks[r.request_id], r.num_computed_tokens
        for i in range(max(0, p - W + 1) // BS, -(-p // BS)):
            assert blocks[i] is not NULL_BLOCK, f"{r.request_id} gave back block {i} at position {p}"
    return so, outs


def _run(sched, runner, max_steps: int = 2000) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_requests():
            break
        _, outs = _step(sched, runner)
        for rid, o in outs.items():
            tokens.setdefault(rid, []).extend(o.new_token_ids)
    else:
        raise AssertionError(f"not idle after {max_steps} steps: {sched.get_stats()}")
    return tokens


def test_blocks_outside_the_window_go_back_and_make_room():
    """Three 10-token prompts decoding 40 tokens (13 blocks each to completion) in a pool of 12:
    keeping every block preempts; freeing what the window left behind runs them side by side,
    each holding at most the window's blocks plus the one being written and one partly read."""
    runs = {}
    for window in (None, W):
        sched = create_scheduler(num_blocks=12, block_size=BS, sliding_window=window)
        reqs = create_requests(3, num_tokens=10, max_tokens=40)
        for r in reqs:
            sched.add_request(r)
        runner = FakeModelRunner(12, BS, window=W)
        tokens: dict[str, list[int]] = {}
        peak = 0
        while sched.has_requests():
            _, outs = _step(sched, runner)  # checks the pool's invariants each step
            peak = max([peak] + [_held(sched, r.request_id) for r in sched.running])
            for rid, o in outs.items():
                tokens.setdefault(rid, []).extend(o.new_token_ids)
        for r in reqs:
            assert tokens[r.request_id] == reference_tokens(r, 64)
        runs[window] = (sched.get_stats().num_preemptions, peak, sched.kv.num_window_freed_blocks)
        assert_serves_and_no_leaks(sched, runner)
    assert runs[None][0] > 0 and runs[None][2] == 0
    preemptions, peak, freed = runs[W]
    assert preemptions == 0
    assert peak <= W // BS + 2
    assert freed >= 3 * (50 // BS - (W // BS + 2))


def test_a_freed_full_block_stays_a_prefix_hit():
    """Blocks given back keep their hashes: the same prompt again hits all of them (nothing else
    asked for blocks in between), and its tokens are still right."""
    sched = create_scheduler(num_blocks=32, block_size=BS, sliding_window=W)
    runner = FakeModelRunner(32, BS, window=W)
    (a,) = create_requests(1, num_tokens=21, max_tokens=12)
    sched.add_request(a)
    _run(sched, runner)
    assert sched.kv.num_window_freed_blocks > 0
    (b,) = create_requests(1, num_tokens=21, max_tokens=12, prefix="again")
    b.prompt_token_ids[:] = a.prompt_token_ids
    sched.add_request(b)
    so, outs = _step(sched, runner)
    assert b.num_cached_tokens == 20  # five full blocks; the last prompt token is computed
    assert so.num_scheduled_tokens["again0"] == 1
    first = list(outs["again0"].new_token_ids)
    assert first + _run(sched, runner)["again0"] == reference_tokens(b, 64)
    assert_serves_and_no_leaks(sched, runner)


def test_chunked_prefill_longer_than_the_window():
    """A 40-token prompt in 8-token chunks frees the blocks each chunk leaves behind."""
    sched = create_scheduler(num_blocks=16, block_size=BS, sliding_window=W, max_num_batched_tokens=8)
    runner = FakeModelRunner(16, BS, window=W)
    (r,) = create_requests(1, num_tokens=40, max_tokens=4)
    sched.add_request(r)
    peak = 0
    tokens: list[int] = []
    while sched.has_requests():
        _, outs = _step(sched, runner)
        peak = max(peak, _held(sched, r.request_id))
        if r.request_id in outs:
            tokens.extend(outs[r.request_id].new_token_ids)
    assert tokens == reference_tokens(r, 64)
    assert peak <= (W + 8) // BS + 1
    assert_serves_and_no_leaks(sched, runner)


def test_speculative_decoding_with_a_window():
    """Drafts verified past the window; rejected drafts roll back only inside it."""
    sched = create_scheduler(num_blocks=24, block_size=BS, sliding_window=W, num_spec_tokens=3)
    runner = FakeModelRunner(24, BS, proposer=FakeProposer(3, seed=5), window=W)
    reqs = create_requests(2, num_tokens=9, max_tokens=30)
    for r in reqs:
        sched.add_request(r)
    tokens = _run(sched, runner)
    for r in reqs:
        assert tokens[r.request_id] == reference_tokens(r, 64)
    assert sched.kv.num_window_freed_blocks > 0
    assert_serves_and_no_leaks(sched, runner)


def test_a_request_longer_than_the_pool_runs_to_its_max_tokens():
    """48 tokens of KV, a window of 8 and 8-token steps: a request holds at most 24 tokens' worth,
    so it may run to 70 tokens (without a window: capped at 49, finish reason length)."""
    for window, want in ((None, 49 - 10), (W, 60)):
        sched = create_scheduler(
            num_blocks=12, block_size=BS, sliding_window=window, max_num_batched_tokens=8, max_model_len=128
        )
        runner = FakeModelRunner(12, BS, window=W)
        (r,) = create_requests(1, num_tokens=10, max_tokens=60)
        sched.add_request(r)
        tokens = _run(sched, runner)["r0"]
        assert len(tokens) == want
        assert tokens == reference_tokens(r, 128)[:want]
        assert sched.get_stats().num_preemptions == 0
        assert_serves_and_no_leaks(sched, runner)


def test_a_prefix_hit_as_large_as_the_pool_is_admitted():
    """A 48-token prompt leaves all 12 blocks of the pool cached; the same prompt and 10 more
    tokens hits all 12, which with its first chunk would need more blocks than the pool has.
    Only the hits that leave room for a step are taken (the rest is recomputed), so it runs."""
    sched = create_scheduler(
        num_blocks=12, block_size=BS, sliding_window=W, max_num_batched_tokens=8, max_model_len=128
    )
    runner = FakeModelRunner(12, BS, window=W)
    (a,) = create_requests(1, num_tokens=48, max_tokens=1)
    sched.add_request(a)
    _run(sched, runner)
    (b,) = create_requests(1, num_tokens=58, max_tokens=20, prefix="longer")
    b.prompt_token_ids[:48] = a.prompt_token_ids
    b.all_token_ids[:48] = a.prompt_token_ids
    sched.add_request(b)
    tokens = _run(sched, runner)
    assert tokens["longer0"] == reference_tokens(b, 128)
    assert 0 < b.num_cached_tokens < 48
    assert_serves_and_no_leaks(sched, runner)


def test_guaranteed_no_evict_keeps_the_pool_cap_under_a_window():
    """That policy reserves blocks to completion at admission: a request longer than the pool
    would wait forever, so the pool still caps it (49 tokens), and it completes unpreempted."""
    sched = create_scheduler(
        num_blocks=12,
        block_size=BS,
        sliding_window=W,
        max_num_batched_tokens=8,
        max_model_len=128,
        capacity_policy="guaranteed_no_evict",
    )
    runner = FakeModelRunner(12, BS, window=W)
    reqs = create_requests(2, num_tokens=10, max_tokens=60)
    for r in reqs:
        sched.add_request(r)
    tokens = _run(sched, runner)
    for r in reqs:
        assert tokens[r.request_id] == reference_tokens(r, 128)[: 49 - 10]
    assert sched.get_stats().num_preemptions == 0
    assert sched.kv.num_window_freed_blocks > 0
    assert_serves_and_no_leaks(sched, runner)


def test_bad_window_is_refused():
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheManager(8, BS, sliding_window=0)
