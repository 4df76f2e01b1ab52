"""API keys (Bearer only, every path but the open ones, gRPC metadata), internal fields
refused, the key kept out of the runtime_env, /metrics and the engines' view."""

from __future__ import annotations

import grpc
import httpx
import pytest

from fleetserve.router.api.errors import APIError
from fleetserve.router.auth import API_KEY_ENV, ApiKeyAuth, resolve_api_key
from fleetserve.router.grpc.proto import fleetserve_pb2 as pb
from fleetserve.router.grpc.proto import fleetserve_pb2_grpc as pb_grpc

BODY = {"prompt": "hi", "max_tokens": 2}


@pytest.mark.parametrize(
    "header,ok",
    [
        ("Bearer test-key", True),
        ("bearer test-key", True),
        ("Bearer  test-key ", True),
        ("test-key", False),
        ("Basic test-key", False),
        ("Bearer test-keyX", False),
        ("Bearer", False),
        ("", False),
        (None, False),
    ],
)
def test_bearer_only(header, ok):
    auth = ApiKeyAuth("test-key")
    if ok:
        auth.check(header)
    else:
        with pytest.raises(APIError) as e:
            auth.check(header)
        assert e.value.status == 401


def test_key_from_file_or_env(tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert resolve_api_key(None, None) is None
    f = tmp_path / "key"
    f.write_text("from-file\n")
    assert resolve_api_key(None, str(f)) == "from-file"
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert resolve_api_key(None, None) == "from-env"
    assert resolve_api_key("flag", str(f)) == "flag"
    with pytest.raises(ValueError, match="cannot be read"):
        resolve_api_key(None, str(tmp_path / "missing"))


def test_key_env_stays_out_of_the_runtime_env(monkeypatch):
    from fleetserve.cluster.deploy import serve_env

    monkeypatch.setenv(API_KEY_ENV, "secret-value")
    monkeypatch.setenv("FLEETSERVE_SOMETHING", "1")
    env = serve_env()
    assert API_KEY_ENV not in env and env["FLEETSERVE_SOMETHING"] == "1"


def test_every_path_but_the_open_ones_needs_the_key(server):
    base = server.base_url
    assert httpx.get(base + "/health", timeout=30).status_code == 200
    assert httpx.get(base + "/metrics", timeout=60).status_code == 200  # open by default
    for method, path in (
        ("GET", "/openapi.json"),
        ("GET", "/v1/models"),
        ("POST", "/tokenize"),
        ("POST", "/v1/completions"),
        ("GET", "/docs"),
        ("GET", "/no-such-path"),
    ):
        for headers in ({}, {"Authorization": server.api_key}, {"Authorization": "Bearer nope"}):
            r = httpx.request(method, base + path, headers=headers, json=BODY, timeout=30)
            assert r.status_code == 401, (path, headers, r.status_code, r.text[:200])
            assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(base + "/openapi.json", headers=server.headers(), timeout=30).status_code == 200
    r = httpx.post(
        base + "/v1/completions", headers={"Authorization": f"bearer {server.api_key}"}, json=BODY, timeout=60
    )
    assert r.status_code == 200


def test_key_never_shows_in_metrics(server):
    text = httpx.get(server.base_url + "/metrics", headers=server.headers(), timeout=60).text
    assert server.api_key not in text


@pytest.mark.parametrize("field", ["kv_transfer_params", "_fleetserve_avoid_replicas", "_fleetserve_target"])
def test_internal_fields_refused(server, field):
    r = httpx.post(
        server.base_url + "/v1/completions",
        headers=server.headers(),
        timeout=30,
        json={**BODY, field: {"do_remote_decode": True}},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_grpc_needs_bearer_metadata(server):
    # ignore_eos: a temperature-1 draw may end on EOS after one token (it did once).
    req = pb.GenerateRequest(prompt="hi", sampling_params=pb.SamplingParams(max_tokens=2, ignore_eos=True))
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.FleetServeStub(channel)
        for value in (server.api_key, "Bearer wrong"):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, metadata=(("application", server.app), ("authorization", value)), timeout=30))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ok = list(
            stub.Generate(
                req, metadata=(("application", server.app), ("authorization", f"Bearer {server.api_key}")), timeout=60
            )
        )
        assert ok[-1].completion_tokens == 2
    server.wait_idle()
