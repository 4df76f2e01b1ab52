"""/metrics as of now: the replicas' part of /metrics is their latest reports
(router/metrics_hub.py, one every `reliability.metrics_report_interval_s`), so a test that
reads a counter right after the requests it counts waits for reports made after them."""

from __future__ import annotations

import time
from typing import Optional

import httpx
from prometheus_client.parser import text_string_to_metric_families

AGE = "fleetserve:replica_metrics_age_seconds"
TRANSIT_S = 0.05  # a report's text is made this long at most before the hub has it


def fresh_metrics_text(base_url: str, headers: Optional[dict] = None, timeout_s: float = 15.0) -> str:
    """/metrics once every replica it lists reported after this call began (fails past
    `timeout_s`)."""
    t0 = time.time()
    deadline = t0 + timeout_s
    while True:
        sent = time.time()
        r = httpx.get(base_url + "/metrics", headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        ages = [s.value for f in text_string_to_metric_families(r.text) if f.name == AGE for s in f.samples]
        # The report a scrape sent at `sent` answers with came at `sent - age` or later.
        if ages and max(ages) < sent - t0 - TRANSIT_S:
            return r.text
        assert time.time() < deadline, f"no fresh reports within {timeout_s} s: ages {ages}"
        time.sleep(0.1)
