"""KV transfer metrics, vLLM-style names, on the engine's own Prometheus registry.

    vllm:kv_transfer_bytes_sent / _received            histograms, bytes per transfer
    vllm:kv_transfer_send_seconds / _receive_seconds   histograms (gather/export; fetch to promotion)
    vllm:kv_transfer_failed_loads / _expired_loads     counters (refused or missing; past deadline)
    vllm:kv_transfer_dropped_saves                     counter: saves that never reached their
                                                       store (the export failed, or it was still
                                                       pending past kv_save_timeout_s at shutdown)
    vllm:kv_transfer_staging_refused                   counter: saves dropped and loads failed
                                                       because staging them would pass the
                                                       staging pool's cap (staging_max_bytes)
    vllm:prompt_tokens_by_source{source=...}           counter: local_compute, local_cache_hit,
                                                       external_kv_transfer
    vllm:kv_transfer_blocks_held                       gauge: KV blocks held for transfers
                                                       (being received, or kept for a send)

The worker halves report what moved each step (`ModelRunnerOutput.kv_connector_stats`,
merged across TP ranks); the EngineCore adds the blocks held and ships it with the
step result to the process that owns the metrics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from fleetserve.scheduler import ModelRunnerOutput

if TYPE_CHECKING:
    from prometheus_client.metrics import Counter as CounterChild
    from prometheus_client.metrics import Histogram as HistogramChild

    from fleetserve.kv_transfer.base import KVConnectorBase
    from fleetserve.scheduler.scheduler import Scheduler

_BYTES = tuple(float(2**k) for k in range(12, 34, 2))  # 4 KiB .. 8 GiB
_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def step_kv_stats(scheduler: Scheduler, connector: KVConnectorBase, runner_output: ModelRunnerOutput) -> dict[str, Any]:
    """This step's transfer stats for the metrics: the workers' (merged across ranks), the
    scheduler half's counts added, and the blocks held for transfers."""
    stats: dict[str, Any] = dict(runner_output.kv_connector_stats or {})
    own: dict[str, Any] = dict(connector.take_stats() or {})  # counts only (expired loads)
    for key, value in own.items():
        stats[key] = stats.get(key, 0) + value
    kv = scheduler.kv
    held = sum(len(kv.get_block_ids(rid)) for rid in scheduler.sending)
    held += sum(len(kv.get_block_ids(rid)) for rid in scheduler.waiting_for_remote_kvs)
    stats["blocks_held"] = held
    return stats


class KVTransferMetrics:
    def __init__(self, registry: CollectorRegistry, labels: list[str], values: Sequence[str]) -> None:
        """`labels`/`values`: the engine's own label names and values (model_name, engine)."""
        self._values = tuple(values)

        def hist(name: str, doc: str, buckets: Sequence[float]) -> HistogramChild:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry).labels(*values)

        def counter(name: str, doc: str) -> CounterChild:
            return Counter(name, doc, labels, registry=registry).labels(*values)

        self.bytes_sent = hist("vllm:kv_transfer_bytes_sent", "Bytes of KV exported per transfer.", _BYTES)
        self.bytes_recv = hist("vllm:kv_transfer_bytes_received", "Bytes of KV loaded per transfer.", _BYTES)
        self.seconds_sent = hist("vllm:kv_transfer_send_seconds", "Seconds to export a transfer.", _SECONDS)
        self.seconds_recv = hist(
            "vllm:kv_transfer_receive_seconds", "Seconds from starting a load to its blocks being usable.", _SECONDS
        )
        self.failed = counter(
            "vllm:kv_transfer_failed_loads", "KV loads refused or incomplete (missing, corrupt, stale, foreign)."
        )
        self.expired = counter("vllm:kv_transfer_expired_loads", "KV loads past their deadline.")
        self.dropped_saves = counter(
            "vllm:kv_transfer_dropped_saves",
            "KV saves that never reached their store (export failed, or "
            "still pending past kv_save_timeout_s when the engine stopped).",
        )
        self.staging_refused = counter(
            "vllm:kv_transfer_staging_refused",
            "KV transfers refused by the staging pool's cap (staging_max_bytes): recomputed instead.",
        )
        self.blocks_held = Gauge(
            "vllm:kv_transfer_blocks_held",
            "KV blocks held for transfers (being received or kept for a send).",
            labels,
            registry=registry,
        ).labels(*values)
        self._by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "Prompt tokens by where their KV came from.",
            list(labels) + ["source"],
            registry=registry,
        )

    def observe_step(self, stats: Optional[Mapping[str, Any]]) -> None:
        """One step's stats (step_kv_stats, or a count the engine adds: dropped saves)."""
        if not stats:
            return
        for hist, key in (
            (self.bytes_sent, "bytes_sent"),
            (self.bytes_recv, "bytes_recv"),
            (self.seconds_sent, "seconds_sent"),
            (self.seconds_recv, "seconds_recv"),
        ):
            for value in stats.get(key, ()):
                hist.observe(value)
        self.failed.inc(stats.get("failed_loads", 0))
        self.expired.inc(stats.get("expired_loads", 0))
        self.dropped_saves.inc(stats.get("dropped_saves", 0))
        self.staging_refused.inc(stats.get("staging_refused", 0))
        if "blocks_held" in stats:
            self.blocks_held.set(stats["blocks_held"])

    def observe_request(self, num_prompt: int, num_cached: int, num_remote: int) -> None:
        """A finished request: where its prompt tokens' KV came from."""
        src, v = self._by_source, self._values
        src.labels(*v, "external_kv_transfer").inc(num_remote)
        src.labels(*v, "local_cache_hit").inc(max(0, num_cached - num_remote))
        src.labels(*v, "local_compute").inc(max(0, num_prompt - num_cached))
