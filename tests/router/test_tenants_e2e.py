"""Two tenants through the HTTP and gRPC APIs of the shared server (tests/router/conftest.py:
`--api-keys-file` with acme and beta beside the shared key, `--scheduling-policy fair`): the
key names the tenant and cannot claim another, the shared key names one by x-tenant-id,
acme's limit holds, and /metrics counts each tenant."""

from __future__ import annotations

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetserve.router.grpc.proto import fleetserve_pb2 as pb
from fleetserve.router.grpc.proto import fleetserve_pb2_grpc as pb_grpc

from .conftest import ACME_MAX_TOKENS, TENANT_KEYS


def _tenant_samples(text: str) -> dict[tuple[str, str], float]:
    return {
        (s.name, s.labels["tenant"]): s.value
        for fam in text_string_to_metric_families(text)
        if fam.name.startswith("fleetserve:tenant_")
        for s in fam.samples
        if s.name.endswith("_total")
    }


def test_tenants_by_key_or_header_never_another_tenant(server):
    base, body = server.base_url, {"model": server.model, "prompt": "hi", "max_tokens": 2, "ignore_eos": True}
    acme = {"Authorization": f"Bearer {TENANT_KEYS['acme']}"}
    beta = {"Authorization": f"Bearer {TENANT_KEYS['beta']}"}
    with httpx.Client(timeout=60) as c:
        before = _tenant_samples(c.get(base + "/metrics").text)
        r = c.post(base + "/v1/completions", headers=acme, json=body)
        assert r.status_code == 200, r.text
        chat = {
            "model": server.model,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "ignore_eos": True,
        }
        r = c.post(base + "/v1/chat/completions", headers={**beta, "x-tenant-id": "beta"}, json=chat)
        assert r.status_code == 200, r.text
        r = c.post(base + "/v1/completions", headers={**server.headers(), "x-tenant-id": "free-1"}, json=body)
        assert r.status_code == 200, r.text
        # A key cannot claim another tenant, nor the shared key a keyed one.
        for headers in ({**acme, "x-tenant-id": "beta"}, {**server.headers(), "x-tenant-id": "acme"}):
            r = c.post(base + "/v1/completions", headers=headers, json=body)
            assert r.status_code == 403 and r.json()["error"]["code"] == "tenant_mismatch", r.text
        r = c.post(base + "/v1/completions", headers={**server.headers(), "x-tenant-id": "a b"}, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-tenant-id"
        r = c.post(base + "/v1/completions", headers=acme, json={**body, "max_tokens": ACME_MAX_TOKENS + 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "tenant_limit_exceeded"
        r = c.post(base + "/v1/completions", headers={"Authorization": "Bearer nope"}, json=body)
        assert r.status_code == 401
        after = _tenant_samples(c.get(base + "/metrics").text)

    def grew(name: str, tenant: str) -> float:
        return after.get((f"fleetserve:tenant_{name}_total", tenant), 0) - before.get(
            (f"fleetserve:tenant_{name}_total", tenant), 0
        )

    for tenant in ("acme", "beta", "free-1"):
        assert grew("requests", tenant) == 1, (tenant, after)
        assert grew("prompt_tokens", tenant) >= 1
        assert grew("generation_tokens", tenant) == 2
    # gRPC: the same rule on metadata.
    req = pb.GenerateRequest(prompt="hi", sampling_params=pb.SamplingParams(max_tokens=2, ignore_eos=True))
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.FleetServeStub(channel)
        meta = (("application", server.app), ("authorization", acme["Authorization"]))
        assert list(stub.Generate(req, metadata=meta, timeout=60))[-1].completion_tokens == 2
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, metadata=(*meta, ("x-tenant-id", "beta")), timeout=30))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    server.wait_idle()
