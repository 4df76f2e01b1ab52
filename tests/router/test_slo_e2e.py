"""SLO-aware admission through the shared server's HTTP API (tests/router/conftest.py: tenant
slo-strict has a 5 ms TTFT target, and --slo-profile prices any step on that server above it):
its requests get 429 with Retry-After and an OpenAI error body before any engine work, the
refusals are counted in /metrics, other tenants are served as before, and no KV block leaks."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .conftest import SLO_TENANT, SLO_TENANT_TTFT_MS, TENANT_KEYS


def _slo_samples(text: str) -> dict[tuple, float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        if fam.name.startswith("fleetserve:slo_")
        for s in fam.samples
    }


def test_a_request_that_cannot_meet_its_slo_is_refused_early(server):
    base = server.base_url
    strict = {"Authorization": f"Bearer {TENANT_KEYS[SLO_TENANT]}"}
    body = {"model": server.model, "prompt": "a prompt with several tokens in it", "max_tokens": 4}
    chat = {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    with httpx.Client(timeout=60) as c:
        before = _slo_samples(c.get(base + "/metrics").text)
        for path, payload in (("/v1/completions", body), ("/v1/chat/completions", chat)):
            r = c.post(base + path, headers=strict, json=payload)
            assert r.status_code == 429, r.text
            assert int(r.headers["retry-after"]) >= 1
            err = r.json()["error"]
            assert err["type"] == "rate_limit_error" and err["code"] == "slo_ttft_unattainable", err
            assert f"time-to-first-token SLO of {SLO_TENANT_TTFT_MS:g} ms" in err["message"]
        # Everyone else is served as before (no targets: not judged), right after.
        r = c.post(base + "/v1/completions", headers=server.headers(), json={**body, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        after = _slo_samples(c.get(base + "/metrics").text)

    def grew(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert grew("fleetserve:slo_requests_total", slo_class=SLO_TENANT, outcome="refused") == 2, after
    assert grew("fleetserve:slo_refusals_total", slo_class=SLO_TENANT, reason="ttft") == 2, after
    assert grew("fleetserve:slo_requests_total", slo_class="default", outcome="met") == 0
    server.wait_idle()  # nothing queued, every KV block free
