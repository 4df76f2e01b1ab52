"""`prefix_caching_hash_algo`: sha256 block hashes still give prefix-cache hits, a request's
`cache_salt` keeps tenants apart under either algorithm, and whole workloads finish with
the same tokens and no leaked block."""

from __future__ import annotations

import pytest

from fleetserve.scheduler import Request, SamplingParams
from fleetserve.scheduler.kv_cache_manager import KVCacheManager, hash_token_blocks
from tests.scheduler.utils import (
    EOS,
    FakeModelRunner,
    assert_serves_and_no_leaks,
    create_requests,
    create_scheduler,
    run_to_completion,
)


def _req(rid, prompt, salt=None):
    return Request(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True), eos_token_id=EOS, cache_salt=salt)


@pytest.mark.parametrize("algo", ["builtin", "sha256"])
def test_hits_and_salt_isolation(algo):
    kv = KVCacheManager(num_blocks=32, block_size=4, hash_algo=algo)
    prompt = list(range(1, 18))  # 4 full blocks + 1 token
    first = _req("a", prompt, salt="tenant-1")
    assert kv.allocate_slots(first, len(prompt)) is not None
    kv.free(first)
    same = _req("b", prompt, salt="tenant-1")
    blocks, hit_tokens = kv.get_computed_blocks(same)
    assert hit_tokens == 16 and len(blocks) == 4
    other = _req("c", prompt, salt="tenant-2")
    assert kv.get_computed_blocks(other) == ([], 0)
    unsalted = _req("d", prompt)
    assert kv.get_computed_blocks(unsalted) == ([], 0)


def test_sha256_chain_differs_from_builtin_and_is_deterministic():
    ids = list(range(40))
    sha = hash_token_blocks(ids, 8, algo="sha256")
    assert sha == hash_token_blocks(ids, 8, algo="sha256")
    assert sha != hash_token_blocks(ids, 8)
    assert len(set(sha)) == 5
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        KVCacheManager(num_blocks=4, block_size=4, hash_algo="md5")


def test_sha256_workload_same_tokens_no_leaks():
    results = {}
    for algo in ("builtin", "sha256"):
        sched = create_scheduler(prefix_caching_hash_algo=algo, num_blocks=40)
        runner = FakeModelRunner(sched.kv.num_blocks, sched.block_size)
        for r in create_requests(12, num_tokens=13, max_tokens=6, same_prompt=True):
            sched.add_request(r)
        done, _ = run_to_completion(sched, runner)
        results[algo] = sorted((rid, tuple(toks)) for rid, toks in done.items())
        assert_serves_and_no_leaks(sched, runner)
    assert results["builtin"] == results["sha256"]
