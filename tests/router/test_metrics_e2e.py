"""/metrics on the running app (2 replicas, Serve): a flood of scrapes through HTTP answers
from the replicas' reports (router/metrics_hub.py) and costs the replicas nothing; requests
keep being served meanwhile."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from fleetserve.router.metrics_hub import HUB_NAMESPACE, STALE_INTERVALS, hub_name
from tests.fresh_metrics import AGE, fresh_metrics_text


def ages(text: str) -> dict[str, float]:
    return {
        s.labels["replica"]: s.value for f in text_string_to_metric_families(text) if f.name == AGE for s in f.samples
    }


def test_a_scrape_flood_costs_the_replicas_nothing_and_requests_keep_going(server):
    import ray

    interval = server.config.reliability.metrics_report_interval_s
    replicas = set(ages(fresh_metrics_text(server.base_url)))
    assert len(replicas) == 2, replicas  # both replicas report, under their Serve ids
    hub = ray.get_actor(hub_name(server.app), namespace=HUB_NAMESPACE)
    before, t0 = ray.get(hub.stats.remote(), timeout=30), time.monotonic()
    body = {"model": server.model, "prompt": "during the flood", "max_tokens": 4}
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        scrapes = [pool.submit(httpx.get, server.base_url + "/metrics", timeout=30) for _ in range(100)]
        r = httpx.post(server.base_url + "/v1/completions", headers=server.headers(), json=body, timeout=60)
        answers = [f.result() for f in scrapes]
    elapsed = time.monotonic() - t0
    after = ray.get(hub.stats.remote(), timeout=30)
    assert r.status_code == 200, r.text
    for a in answers:
        assert a.status_code == 200, a.text
        running = [
            s.labels["replica"]
            for f in text_string_to_metric_families(a.text)
            if f.name == "vllm:num_requests_running"
            for s in f.samples
        ]
        assert set(running) == replicas
        assert all(age < STALE_INTERVALS * interval for age in ages(a.text).values())
    # 100 scrapes: the ingress read the hub at most once per half interval, and the replicas
    # reported once per interval each, as they do with no scrape at all.
    assert after["num_reads"] - before["num_reads"] <= elapsed / (interval / 2) + 2
    assert after["num_reports"] - before["num_reports"] <= len(replicas) * (elapsed / interval + 2)
    server.wait_idle()
