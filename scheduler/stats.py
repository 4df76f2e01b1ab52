"""What a scheduler reports of itself each step: queue lengths, KV cache use, prefix-cache
and preemption counters, speculative decoding, LoRA adapters in use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional, Protocol

from fleetserve.scheduler.config import SchedulerConfig
from fleetserve.scheduler.kv_cache_manager import KVCacheManager
from fleetserve.scheduler.policies import WaitingQueue
from fleetserve.scheduler.request import Request
from fleetserve.scheduler.spec_decode import SpecDecodingStats


@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_waiting_for_remote_kvs: int
    kv_cache_usage: float
    num_free_blocks: int
    num_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    spec_decoding: Optional[SpecDecodingStats] = None
    # With LoRA (max_loras > 0): requests per adapter name, running and waiting.
    max_loras: int = 0
    lora_running: Optional[dict[str, int]] = None
    lora_waiting: Optional[dict[str, int]] = None
    # With output-length prediction (scheduler/length_aware.py): cumulative counts of
    # |actual - predicted| output tokens per bucket of length_predictor.ERROR_BUCKETS (the
    # last: larger), their sum, and the number of finished requests they count.
    length_error_counts: Optional[list[int]] = None
    length_error_sum: int = 0
    length_num_predicted: int = 0


class Reporting(Protocol):
    """What `snapshot` reads of a scheduler (scheduler.Scheduler has it all)."""

    config: SchedulerConfig
    kv: KVCacheManager
    running: list[Request]
    waiting: WaitingQueue
    waiting_for_remote_kvs: dict[str, Request]
    num_preemptions: int
    spec_stats: SpecDecodingStats


def snapshot(scheduler: Reporting) -> SchedulerStats:
    max_loras = scheduler.config.max_loras
    parked = scheduler.waiting_for_remote_kvs.values()
    lora_running, lora_waiting = (
        (lora_counts(scheduler.running), lora_counts([*scheduler.waiting, *parked])) if max_loras else (None, None)
    )
    kv = scheduler.kv
    return SchedulerStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_waiting_for_remote_kvs=len(scheduler.waiting_for_remote_kvs),
        kv_cache_usage=kv.usage(),
        num_free_blocks=kv.num_free_blocks,
        num_blocks=kv.num_blocks,
        prefix_cache_queries=kv.prefix_cache_queries,
        prefix_cache_hits=kv.prefix_cache_hits,
        num_preemptions=scheduler.num_preemptions,
        spec_decoding=scheduler.spec_stats.snapshot() if scheduler.config.num_spec_tokens else None,
        max_loras=max_loras,
        lora_running=lora_running,
        lora_waiting=lora_waiting,
        **_length_stats(getattr(scheduler, "lengths", None)),
    )


def _length_stats(lengths: Any) -> dict[str, Any]:
    if lengths is None:
        return {}
    return {
        "length_error_counts": list(lengths.error_counts),
        "length_error_sum": lengths.error_sum,
        "length_num_predicted": lengths.num_predicted,
    }


def lora_counts(requests: Iterable[Request]) -> dict[str, int]:
    """Requests per adapter name."""
    counts: dict[str, int] = {}
    for r in requests:
        if r.lora_name:
            counts[r.lora_name] = counts.get(r.lora_name, 0) + 1
    return counts
