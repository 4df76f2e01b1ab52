"""vLLM's `/ping` (SageMaker's health path: /health's answer, open without a key, GET or
POST) and `/version`."""

from __future__ import annotations

import httpx

import fleetserve


def test_ping_answers_as_health_without_a_key_and_version_says_which(server):
    health = httpx.get(server.base_url + "/health", timeout=30)
    for method in ("GET", "POST"):
        r = httpx.request(method, server.base_url + "/ping", timeout=30)
        assert r.status_code == 200 == health.status_code, r.text
        assert r.json()["status"] == health.json()["status"] == "ok"
    assert httpx.get(server.base_url + "/version", timeout=30).status_code == 401  # as every other path
    r = httpx.get(server.base_url + "/version", headers=server.headers(), timeout=30)
    assert r.status_code == 200 and r.json() == {"version": fleetserve.__version__}
