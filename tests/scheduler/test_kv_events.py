"""KV cache events: a subscriber that applies every batch holds exactly the engine's cache.

Random workloads over a small pool (so blocks are evicted and reused), shared
prefixes, salts, aborts, connector loads that fail (their blocks are uncached) and
prefix-cache resets; after every step the batch is applied to a `KVCacheMirror`
and compared with the pool's hash map. Every `BlockStored` must also describe its
blocks truthfully: re-hashing its parent and tokens gives its hashes.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetserve.scheduler import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheMirror,
    KVEventBatch,
    Request,
    SamplingParams,
    SequenceGap,
)
from fleetserve.scheduler.kv_cache_manager import NONE_HASH, hash_token_blocks, salt_to_int
from tests.scheduler.utils import EOS, VOCAB, ConnectorPlan, FakeModelRunner, TestConnector, create_scheduler, step

PREFIXES = [[(5 * k + j) % (VOCAB - 1) + 1 for j in range(20)] for k in range(3)]


def check_stored(ev: BlockStored, salts: set) -> None:
    """The event's hashes are the chain hashes of its tokens under its parent."""
    bs = ev.block_size
    assert len(ev.token_ids) == len(ev.block_hashes) * bs
    parent = NONE_HASH if ev.parent_block_hash is None else ev.parent_block_hash
    for i, h in enumerate(ev.block_hashes):
        tokens = tuple(ev.token_ids[i * bs : (i + 1) * bs])
        if ev.parent_block_hash is None and i == 0:
            # A first block carries the request's salt: one of them must match.
            assert any(hash((NONE_HASH, tokens, salt_to_int(s))) == h for s in salts), ev
        else:
            assert hash((parent, tokens, 0)) == h, ev
        parent = h


@st.composite
def workloads(draw):
    config = dict(
        block_size=draw(st.sampled_from([2, 4])),
        num_blocks=draw(st.integers(4, 24)),
        max_num_batched_tokens=64,
        max_num_seqs=draw(st.integers(1, 6)),
        max_model_len=48,
        enable_kv_cache_events=True,
    )
    reqs = []
    for i in range(draw(st.integers(2, 12))):
        plen = draw(st.integers(1, 36))
        shared = draw(st.sampled_from([None, 0, 1, 2]))
        tail = [(13 * i + j) % (VOCAB - 1) + 1 for j in range(plen)]
        prompt = tail if shared is None else (PREFIXES[shared] + tail)[:plen]
        plan = None
        if draw(st.booleans()):
            plan = ConnectorPlan(
                num_external=draw(st.integers(0, 24)),
                is_async=draw(st.booleans()),
                load_delay=draw(st.integers(0, 2)),
                fail_block=draw(st.one_of(st.none(), st.integers(0, 4))),
            )
        reqs.append(
            dict(
                rid=f"q{i}",
                prompt=prompt,
                max_tokens=draw(st.integers(1, 10)),
                salt=draw(st.sampled_from([None, None, "s"])),
                arrive=draw(st.integers(0, 12)),
                abort=draw(st.one_of(st.none(), st.none(), st.integers(0, 30))),
                plan=plan,
            )
        )
    resets = draw(st.lists(st.integers(0, 40), max_size=2))
    return config, reqs, resets


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_mirror_equals_cache_after_every_step(workload):
    config, reqs, resets = workload
    connector = TestConnector({r["rid"]: r["plan"] for r in reqs if r["plan"] is not None})
    sched = create_scheduler(connector=connector, **config)
    runner = FakeModelRunner(config["num_blocks"], config["block_size"], connector)
    mirror = KVCacheMirror()
    salts = {r["salt"] for r in reqs}
    last_arrival = max(r["arrive"] for r in reqs)

    def deliver() -> None:
        batch = sched.take_kv_events()
        if batch is not None:
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    check_stored(ev, salts)
            mirror.apply(batch)
        assert mirror.hashes == sched.kv.cached_block_hashes()

    for t in range(3000):
        for r in reqs:
            if r["arrive"] == t:
                sched.add_request(
                    Request(
                        r["rid"],
                        r["prompt"],
                        SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True),
                        eos_token_id=EOS,
                        cache_salt=r["salt"],
                    )
                )
            if r["abort"] == t:
                sched.abort_requests([r["rid"]])
        if t in resets:
            sched.reset_prefix_cache()  # refused (no event) while blocks are in use
        deliver()  # commands between steps may change the cache too
        if t > last_arrival and not sched.has_requests():
            break
        step(sched, runner)
        deliver()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    # An idle engine can drop its whole cache: one AllBlocksCleared.
    assert sched.reset_prefix_cache()
    batch = sched.take_kv_events()
    if mirror.hashes:
        assert [type(e) for e in batch.events] == [AllBlocksCleared]
        mirror.apply(batch)
    assert mirror.hashes == set()


def test_batches_coalesce_chains_and_number_without_holes():
    sched = create_scheduler(block_size=4, num_blocks=6, enable_kv_cache_events=True)
    prompt = list(range(1, 14))  # 3 full blocks + 1 token
    sched.add_request(Request("a", prompt, SamplingParams(max_tokens=1, ignore_eos=True), eos_token_id=EOS))
    step(sched)
    batch = sched.take_kv_events()
    assert batch.seq == 1
    assert len(batch.events) == 1  # one chain, one event
    ev = batch.events[0]
    assert ev.parent_block_hash is None and ev.block_size == 4
    assert ev.block_hashes == hash_token_blocks(prompt, 4)
    assert ev.token_ids == prompt[:12]
    assert sched.take_kv_events() is None  # nothing new: no batch, no sequence number used
    # Fill the pool with other prompts: the first chain's blocks are evicted.
    for i in range(2):
        sched.add_request(
            Request(
                f"b{i}",
                [50 + 10 * i + j for j in range(13)],
                SamplingParams(max_tokens=1, ignore_eos=True),
                eos_token_id=EOS,
            )
        )
        step(sched)
    batch = sched.take_kv_events()
    assert batch.seq == 2
    removed = [h for e in batch.events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert set(removed) & set(ev.block_hashes)  # the first chain was evicted


def test_mirror_refuses_a_gap_and_resyncs_from_a_snapshot():
    mirror = KVCacheMirror()
    mirror.apply(KVEventBatch(1, 0.0, [BlockStored([1, 2], None, [0] * 8, 4)]))
    with pytest.raises(SequenceGap):
        mirror.apply(KVEventBatch(3, 0.0, [BlockRemoved([1])]))
    assert mirror.hashes == {1, 2} and mirror.seq == 1  # untouched by the refused batch
    mirror.reset(5, {2, 9})
    mirror.apply(KVEventBatch(6, 0.0, [BlockRemoved([2])]))
    assert mirror.hashes == {9} and mirror.seq == 6


def test_events_off_by_default_cost_nothing():
    sched = create_scheduler(block_size=4, num_blocks=6)
    sched.add_request(Request("a", list(range(1, 10)), SamplingParams(max_tokens=1), eos_token_id=EOS))
    step(sched)
    assert sched.take_kv_events() is None
    assert sched.kv.pool.events is None
