"""EngineArgs takes the scheduler's settings from the scheduler's own configs: one
declaration, one default, and every one reaches the scheduler."""

from __future__ import annotations

from fleetserve.replica.engine.engine_args import EngineArgs
from fleetserve.scheduler import CacheConfig, SchedulerConfig

SHARED = {
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "long_prefill_token_threshold": "long_prefill_token_threshold",
    "enable_chunked_prefill": "enable_chunked_prefill",
    "scheduling_policy": "policy",
    "capacity_policy": "capacity_policy",
    "scheduler_cls": "scheduler_cls",
}
SHARED_CACHE = ("block_size", "enable_prefix_caching", "enable_kv_cache_events", "prefix_caching_hash_algo")


def test_shared_fields_have_one_default_and_one_description():
    for ours, theirs in SHARED.items():
        a, b = EngineArgs.model_fields[ours], SchedulerConfig.model_fields[theirs]
        assert (a.default, a.description, a.metadata) == (b.default, b.description, b.metadata), ours
    for name in SHARED_CACHE:
        a, b = EngineArgs.model_fields[name], CacheConfig.model_fields[name]
        assert (a.default, a.description, a.metadata) == (b.default, b.description, b.metadata), name


def test_every_setting_reaches_the_scheduler():
    args = EngineArgs(
        max_num_seqs=7,
        max_num_batched_tokens=300,
        long_prefill_token_threshold=33,
        scheduling_policy="priority",
        capacity_policy="guaranteed_no_evict",
        block_size=8,
        enable_prefix_caching=False,
        enable_kv_cache_events=True,
        prefix_caching_hash_algo="sha256",
    )
    sched, cache = args.scheduler_config(256), args.cache_config(12)
    for ours, theirs in SHARED.items():
        assert getattr(sched, theirs) == getattr(args, ours), ours
    assert all(getattr(cache, name) == getattr(args, name) for name in SHARED_CACHE)
    assert (sched.max_model_len, cache.num_blocks) == (256, 12)
    # Without chunked prefill a step holds a whole prompt: the budget is raised to the context.
    unchunked = EngineArgs(enable_chunked_prefill=False, max_num_batched_tokens=100).scheduler_config(512)
    assert unchunked.max_num_batched_tokens == 512
