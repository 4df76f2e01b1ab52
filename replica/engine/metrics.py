"""Per-engine Prometheus metrics with vLLM's names.

Each engine owns its own `CollectorRegistry`, so several engines in one process
(tests, one Serve replica per engine) never collide; the router merges the
text of every replica and adds a `replica` label.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from fleetserve.kv_transfer.metrics import KVTransferMetrics

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        self.model_name = model_name

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def hist(name, doc):
            return Histogram(name, doc, labels, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)

        self.num_running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).")
        self.num_free_blocks = gauge("fleetserve:kv_cache_free_blocks", "Free KV blocks.")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions (recompute).")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self._success = Counter("vllm:request_success", "Finished requests by reason.",
                                labels + ["finished_reason"], registry=r)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.")
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between output tokens.")
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency.")
        self.queue_time = hist("vllm:request_queue_time_seconds", "Time from arrival to first schedule.")
        self._last_queries = self._last_hits = self._last_preemptions = 0
        self.kv_transfer = KVTransferMetrics(r, model_name)

    def request_finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def update_scheduler_stats(self, stats) -> None:
        """Mirror a `scheduler.SchedulerStats` snapshot (counters advance by the delta)."""
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting + stats.num_waiting_for_remote_kvs)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.num_free_blocks.set(stats.num_free_blocks)
        self.prefix_queries.inc(stats.prefix_cache_queries - self._last_queries)
        self.prefix_hits.inc(stats.prefix_cache_hits - self._last_hits)
        self.preemptions.inc(stats.num_preemptions - self._last_preemptions)
        self._last_queries = stats.prefix_cache_queries
        self._last_hits = stats.prefix_cache_hits
        self._last_preemptions = stats.num_preemptions

    def text(self) -> str:
        return generate_latest(self.registry).decode()
