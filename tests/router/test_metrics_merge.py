"""Merging per-replica Prometheus text (no Ray)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fleetserve.router.metrics import merge_metrics


def replica_text(running: float, tokens: float) -> str:
    r = CollectorRegistry()
    Gauge("vllm:num_requests_running", "Running.", ["model_name"], registry=r).labels("m").set(running)
    Counter("vllm:prompt_tokens", "Prompt tokens.", ["model_name"], registry=r).labels("m").inc(tokens)
    h = Histogram("vllm:time_to_first_token_seconds", "TTFT.", ["model_name"], registry=r, buckets=[0.1, 1.0])
    h.labels("m").observe(0.05)
    return generate_latest(r).decode()


def test_merge_labels_every_sample_and_keeps_families_whole():
    text = merge_metrics({"r1": replica_text(1, 10), "r2": replica_text(3, 5)})
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    running = {s.labels["replica"]: s.value for s in fams["vllm:num_requests_running"].samples}
    assert running == {"r1": 1.0, "r2": 3.0}
    tokens = {s.labels["replica"]: s.value for s in fams["vllm:prompt_tokens"].samples if s.name.endswith("_total")}
    assert tokens == {"r1": 10.0, "r2": 5.0}
    hist = fams["vllm:time_to_first_token_seconds"]
    assert hist.type == "histogram"
    inf = [s for s in hist.samples if s.name.endswith("_bucket") and s.labels["le"] == "+Inf"]
    assert {s.labels["replica"] for s in inf} == {"r1", "r2"}
    assert all(s.labels["model_name"] == "m" for f in fams.values() for s in f.samples)
    assert text.count("# TYPE vllm:num_requests_running") == 1


def test_merge_of_nothing_is_empty_but_valid():
    assert list(text_string_to_metric_families(merge_metrics({}))) == []
