"""CORS (router/cors.py): which pages' scripts may call the API from a browser. The router
suite's app with the default (pages served from this machine), and the middleware alone
with other settings."""

from __future__ import annotations

import httpx
import pytest

from fleetserve.router import cors

PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}


def test_local_pages_may_call_the_api_and_other_sites_may_not(server):
    url = server.base_url + "/v1/completions"
    body = {"model": server.model, "prompt": "hi", "max_tokens": 2}
    for origin in ("http://localhost:3000", "http://127.0.0.1:5173", "http://localhost"):
        pre = httpx.options(url, headers={"Origin": origin, **PREFLIGHT}, timeout=30)  # no key: a browser sends none
        assert pre.status_code == 200, pre.text
        assert pre.headers["access-control-allow-origin"] == origin
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        r = httpx.post(url, headers={"Origin": origin, **server.headers()}, json=body, timeout=60)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    # A 401 is readable by the page (it says what is wrong), and a stream carries the header.
    r = httpx.post(url, headers={"Origin": "http://localhost:3000"}, json=body, timeout=30)
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    with httpx.stream(
        "POST",
        url,
        headers={"Origin": "http://localhost:3000", **server.headers()},
        json={**body, "stream": True},
        timeout=60,
    ) as s:
        assert s.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert any(line == "data: [DONE]" for line in s.iter_lines())
    for origin in ("https://evil.example", "http://localhost.evil.example", "https://localhost:3000"):
        pre = httpx.options(url, headers={"Origin": origin, **PREFLIGHT}, timeout=30)
        assert pre.status_code == 400 and "access-control-allow-origin" not in pre.headers, origin
        r = httpx.post(url, headers={"Origin": origin, **server.headers()}, json=body, timeout=60)
        assert "access-control-allow-origin" not in r.headers, origin  # the browser hides the answer
    server.wait_idle()


@pytest.fixture
def app_with(monkeypatch):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    def make(**settings):
        app = FastAPI()
        app.add_middleware(cors.Cors)

        @app.post("/v1/completions")
        async def completions():
            return {"ok": True}

        monkeypatch.setattr(cors, "_installed", cors.CorsSettings(**settings))
        return TestClient(app)

    return make


def test_the_first_request_from_a_refused_origin_is_logged(app_with):
    import logging

    class Keep(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.INFO)
            self.messages: list[str] = []

        def emit(self, record) -> None:
            self.messages.append(record.getMessage())

    client, keep = app_with(), Keep()
    cors.logger.addHandler(keep)  # ("ray.serve" does not propagate once Serve has set it up)
    level = cors.logger.level
    cors.logger.setLevel(logging.INFO)
    try:
        for _ in range(3):
            client.options("/v1/completions", headers={"Origin": "https://ui.example", **PREFLIGHT})
        client.post("/v1/completions", headers={"Origin": "http://localhost:3000"})
    finally:
        cors.logger.removeHandler(keep)
        cors.logger.setLevel(level)
    lines = [m for m in keep.messages if "CORS" in m]
    assert len(lines) == 1 and "'https://ui.example'" in lines[0] and "--allowed-origins" in lines[0], lines


def test_any_origin_credentials_and_subdomains(app_with):
    client = app_with(allowed_origins=("*",))
    r = client.post("/v1/completions", headers={"Origin": "https://anywhere.example"})
    assert r.headers["access-control-allow-origin"] == "*"
    client = app_with(allowed_origins=("*",), allow_credentials=True)  # browsers want the origin echoed
    r = client.post("/v1/completions", headers={"Origin": "https://anywhere.example"})
    assert r.headers["access-control-allow-origin"] == "https://anywhere.example"
    assert r.headers["access-control-allow-credentials"] == "true"
    client = app_with(allowed_origins=("https://*.example.com", "https://app.io"), allowed_methods=("POST",))
    for origin, ok in (
        ("https://chat.example.com", True),
        ("https://a.b.example.com", True),
        ("https://example.com", False),
        ("https://evilexample.com", False),
        ("https://app.io", True),
        ("https://app.io:8443", False),
    ):
        pre = client.options("/v1/completions", headers={"Origin": origin, **PREFLIGHT})
        assert (pre.status_code == 200) == ok, (origin, pre.status_code)
    pre = client.options(
        "/v1/completions", headers={"Origin": "https://app.io", "Access-Control-Request-Method": "DELETE"}
    )
    assert pre.status_code == 400
    client = app_with(allowed_origins=())  # CORS off: no headers at all
    r = client.post("/v1/completions", headers={"Origin": "http://localhost:3000"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize(
    "origin", ["localhost", "http://*", "http://a*b.example", "ftp://x", "http://x/", "https://*.*.example.com"]
)
def test_what_is_not_an_origin_is_refused_with_the_forms_that_are(origin):
    from pydantic import ValidationError

    from fleetserve.cluster.config import AppConfig

    with pytest.raises(ValidationError, match="allowed origin"):
        AppConfig.model_validate({"http": {"allowed_origins": [origin]}})
