"""Per-engine Prometheus metrics with vLLM's names, types, labels and buckets.

A vLLM Grafana dashboard works unchanged: every family vLLM v1's
`PrometheusStatLogger` exports for one engine is here under the same name and
type, labelled `model_name` and `engine` (each replica runs one engine, index 0),
with vLLM's buckets; the router adds a `replica` label when it merges them. The
deprecated aliases vLLM still exports (`vllm:gpu_cache_usage_perc`,
`vllm:gpu_prefix_cache_*`, `vllm:time_per_output_token_seconds`) are kept for
older dashboards. No `*_created` series (prometheus_client's default, which vLLM
does not export either).

Each engine owns its own `CollectorRegistry`, so several engines in one process
(tests, one Serve replica per engine) never collide.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from fleetserve.kv_transfer.metrics import KVTransferMetrics
from fleetserve.scheduler import SchedulerStats
from fleetserve.scheduler.length_predictor import ERROR_BUCKETS
from fleetserve.scheduler.spec_decode import SpecDecodingStats

try:  # prometheus_client >= 0.17
    from prometheus_client import disable_created_metrics
except ImportError:  # pragma: no cover - older prometheus_client: nothing to disable
    pass
else:
    disable_created_metrics()

# vLLM's buckets (vllm/v1/metrics/loggers.py).
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_TPOT_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
_PREFILL_TOKEN_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISH_REASONS = ("stop", "length", "abort")
ENGINE_INDEX = "0"


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class _Family:
    """Makes the engine's metrics in one registry, each bound to the engine's own labels."""

    def __init__(self, registry: CollectorRegistry, labels: list[str], values: tuple[str, ...]) -> None:
        self.registry, self.labels, self.values = registry, labels, values

    def gauge(self, name: str, doc: str) -> Any:
        return Gauge(name, doc, self.labels, registry=self.registry).labels(*self.values)

    def counter(self, name: str, doc: str) -> Any:
        return Counter(name, doc, self.labels, registry=self.registry).labels(*self.values)

    def hist(self, name: str, doc: str, buckets: Any) -> Any:
        return Histogram(name, doc, self.labels, buckets=buckets, registry=self.registry).labels(*self.values)


class EngineMetrics:
    _lora_info = None  # vllm:lora_requests_info, made with the first LoRA stats
    _lora_labels = None

    def __init__(self, model_name: str, max_model_len: int = 8192) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        labels = ["model_name", "engine"]
        self.model_name = model_name
        values = (model_name, ENGINE_INDEX)
        family = _Family(r, labels, values)
        self._declare_state(family)
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels + ["finished_reason"],
            registry=r,
        )
        self._success = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}
        self._success_family = success
        self._declare_token_histograms(family, build_1_2_5_buckets(max(1, max_model_len)))
        self._declare_latency_histograms(family)
        self._cache_info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ["engine", "block_size", "num_gpu_blocks", "enable_prefix_caching"],
            registry=r,
        )
        self._last_queries = self._last_hits = self._last_preemptions = 0
        # Speculative decoding (vLLM's names), created on the first stats that carry it.
        self._spec: Optional[dict[str, Counter]] = None
        self._last_spec = SpecDecodingStats()
        self.kv_transfer = KVTransferMetrics(r, labels, values)

    def _declare_state(self, family: "_Family") -> None:
        """The scheduler's gauges and counters (requests, KV cache, prefix cache, tokens)."""
        gauge, counter = family.gauge, family.counter
        self.num_running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.num_waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.gpu_cache_usage = gauge(
            "vllm:gpu_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage. DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
        )
        self.num_free_blocks = gauge("fleetserve:kv_cache_free_blocks", "Free KV blocks.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.gpu_prefix_queries = counter(
            "vllm:gpu_prefix_cache_queries",
            "Prefix cache queries in tokens. DEPRECATED: Use vllm:prefix_cache_queries instead.",
        )
        self.gpu_prefix_hits = counter(
            "vllm:gpu_prefix_cache_hits", "Prefix cache hits in tokens. DEPRECATED: Use vllm:prefix_cache_hits instead."
        )
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        # Output-length prediction (--scheduling-policy sjf, --fair-shortest-first,
        # --capacity-policy reserve_predicted): |actual - predicted| output tokens of each
        # request that finished by itself or at its length. Bucket counts are exact; the
        # sum counts each error at its bucket's upper bound (the scheduler counts by bucket).
        self.length_error = family.hist(
            "fleetserve:output_length_prediction_error_tokens",
            "Absolute error of the predicted output length, in tokens (length-aware scheduling).",
            list(ERROR_BUCKETS),
        )
        self._last_length_errors: Optional[list[int]] = None
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")

    def _declare_token_histograms(self, family: "_Family", token_buckets: list) -> None:
        """Per-request token counts and request parameters."""
        hist = family.hist
        self.request_prompt_tokens = hist(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = hist(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.iteration_tokens = hist(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", _ITERATION_BUCKETS
        )
        self.max_num_generation_tokens = hist(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            token_buckets,
        )
        self.params_n = hist("vllm:request_params_n", "Histogram of the n request parameter.", (1, 2, 5, 10, 20))
        self.params_max_tokens = hist(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets
        )

    def _declare_latency_histograms(self, family: "_Family") -> None:
        """Per-token and per-request latencies, by phase."""
        hist = family.hist
        self.ttft = hist(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT_BUCKETS
        )
        self.tpot = hist(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds. DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
            _TPOT_BUCKETS,
        )
        self.itl = hist(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _TPOT_BUCKETS
        )
        self.request_tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            _TPOT_BUCKETS,
        )
        self.prefill_token_time = hist(
            "vllm:time_per_prefill_token_request_seconds",
            "Time spent per token during prefill phase in seconds",
            _PREFILL_TOKEN_BUCKETS,
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _REQUEST_LATENCY_BUCKETS
        )
        self.queue_time = hist(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.inference_time = hist(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_time = hist(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.decode_time = hist(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            _REQUEST_LATENCY_BUCKETS,
        )

    def _update_lora_info(self, stats: SchedulerStats) -> None:
        """vllm:lora_requests_info, vLLM's: one series whose labels name the adapters of the
        running and the waiting requests and --max-loras, set to the time it was last true
        (what LoRA-aware gateways, e.g. the Gateway API inference extension, read). The
        previous series goes when the labels change."""
        if self._lora_info is None:
            self._lora_info = Gauge(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=self.registry,
            )
        labels = (
            str(stats.max_loras),
            ",".join(sorted(stats.lora_waiting or ())),
            ",".join(sorted(stats.lora_running or ())),
        )
        if self._lora_labels is not None and self._lora_labels != labels:
            self._lora_info.remove(*self._lora_labels)
        self._lora_labels = labels
        self._lora_info.labels(*labels).set_to_current_time()

    def cache_config(self, block_size: int, num_blocks: int, enable_prefix_caching: bool) -> None:
        """vllm:cache_config_info: an info gauge (always 1) whose labels carry the settings."""
        self._cache_info.labels(ENGINE_INDEX, str(block_size), str(num_blocks), str(enable_prefix_caching)).set(1)

    def token_gap(self, seconds: float) -> None:
        """Time between two output tokens of one request."""
        self.itl.observe(seconds)
        self.tpot.observe(seconds)

    def request_finished(
        self, reason: str, metrics=None, num_prompt_tokens: int = 0, max_tokens: int = 0, n: int = 1
    ) -> None:
        """One finished request (`metrics`: its RequestMetrics; None for an abort before any output)."""
        counter = self._success.get(reason)
        if counter is None:
            counter = self._success[reason] = self._success_family.labels(self.model_name, ENGINE_INDEX, reason)
        counter.inc()
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.params_n.observe(n)
        if max_tokens:
            self.params_max_tokens.observe(max_tokens)
            self.max_num_generation_tokens.observe(max_tokens)
        if metrics is None:
            return
        self.request_generation_tokens.observe(metrics.num_generation_tokens)
        end = metrics.finished_time or metrics.last_token_time
        if end is not None:
            self.e2e.observe(end - metrics.arrival_time)
        start = metrics.first_scheduled_time
        if start is None:
            return
        self.queue_time.observe(start - metrics.arrival_time)
        if end is not None:
            self.inference_time.observe(end - start)
        first, last = metrics.first_token_time, metrics.last_token_time
        if first is not None:
            self.prefill_time.observe(first - start)
            if num_prompt_tokens:
                self.prefill_token_time.observe((first - start) / num_prompt_tokens)
            if last is not None:
                self.decode_time.observe(last - first)
                if metrics.num_generation_tokens > 1:
                    self.request_tpot.observe((last - first) / (metrics.num_generation_tokens - 1))

    def update_scheduler_stats(self, stats: SchedulerStats) -> None:
        """Mirror a `scheduler.SchedulerStats` snapshot (counters advance by the delta)."""
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting + stats.num_waiting_for_remote_kvs)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.gpu_cache_usage.set(stats.kv_cache_usage)
        self.num_free_blocks.set(stats.num_free_blocks)
        queries = stats.prefix_cache_queries - self._last_queries
        hits = stats.prefix_cache_hits - self._last_hits
        self.prefix_queries.inc(queries)
        self.gpu_prefix_queries.inc(queries)
        self.prefix_hits.inc(hits)
        self.gpu_prefix_hits.inc(hits)
        self.preemptions.inc(stats.num_preemptions - self._last_preemptions)
        self._last_queries = stats.prefix_cache_queries
        self._last_hits = stats.prefix_cache_hits
        self._last_preemptions = stats.num_preemptions
        if stats.length_error_counts is not None:
            self._update_length_errors(stats.length_error_counts)
        if stats.spec_decoding is not None:
            self._update_spec_decoding(stats.spec_decoding)
        if stats.max_loras:
            self._update_lora_info(stats)

    def _update_length_errors(self, counts: list[int]) -> None:
        last = self._last_length_errors or [0] * len(counts)
        bounds = (*ERROR_BUCKETS, 2 * ERROR_BUCKETS[-1])
        for bound, now, before in zip(bounds, counts, last):
            for _ in range(now - before):
                self.length_error.observe(bound)
        self._last_length_errors = list(counts)

    def _update_spec_decoding(self, spec: SpecDecodingStats) -> None:
        """Counters advance by the delta since the last snapshot; acceptance
        rate = accepted / draft tokens, per position from the `position` label."""
        if self._spec is None:
            r, labels, values = self.registry, ["model_name", "engine"], (self.model_name, ENGINE_INDEX)

            def counter(name: str, doc: str, extra: Sequence[str] = ()) -> Counter:
                c = Counter(name, doc, labels + list(extra), registry=r)
                return c if extra else c.labels(*values)

            self._spec = {
                "num_drafts": counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
                "num_draft_tokens": counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
                "num_accepted_tokens": counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
                "per_pos": counter(
                    "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.", ["position"]
                ),
            }
            self._last_spec = SpecDecodingStats()
        last, m = self._last_spec, self._spec
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            m[name].inc(getattr(spec, name) - getattr(last, name))
        prev = last.num_accepted_tokens_per_pos
        for pos, count in enumerate(spec.num_accepted_tokens_per_pos):
            m["per_pos"].labels(self.model_name, ENGINE_INDEX, str(pos)).inc(
                count - (prev[pos] if pos < len(prev) else 0)
            )
        self._last_spec = spec

    def text(self) -> str:
        return generate_latest(self.registry).decode()
