"""Tenant identity (router/tenants.py): the keys file, who a request belongs to (a key can
never claim another tenant), what its body carries to the engine, the bounded metric
labels, and the auth check that lets tenants' keys in beside the single --api-key."""

from __future__ import annotations

import hashlib
import json

import pytest

from fleetserve.router.api.errors import APIError
from fleetserve.router.auth import ApiKeyAuth
from fleetserve.router.replica import _tenant_kwargs
from fleetserve.router.tenants import (
    OTHER_TENANTS,
    TenantDirectory,
    TenantMetrics,
    TenantSettings,
    load_keys_file,
    stamp,
)

KEYS = """
acme: {key: acme-key, weight: 3, priority: 1, limits: {max_tokens: 8}}
beta: {key_sha256: %s}
""" % hashlib.sha256(b"beta-key").hexdigest()


@pytest.fixture
def directory(tmp_path) -> TenantDirectory:
    f = tmp_path / "keys.yaml"
    f.write_text(KEYS)
    return TenantDirectory(TenantSettings.from_keys_file(str(f), max_labels=4))


def test_keys_file_yaml_or_json(tmp_path):
    f = tmp_path / "keys.json"
    f.write_text(json.dumps({"t1": {"key": "k1", "weight": 2.5}}))
    (tenant,) = load_keys_file(str(f)).values()
    assert (tenant.name, tenant.weight, tenant.priority, tenant.keyed) == ("t1", 2.5, 0, True)
    assert hashlib.sha256(b"k1").hexdigest() in load_keys_file(str(f))


@pytest.mark.parametrize(
    "text,message",
    [
        ("a: {weight: 2}", "exactly one of key and key_sha256"),
        ("a: {key: sekrit, key_sha256: '" + "0" * 64 + "'}", "exactly one of key and key_sha256"),
        ("a: {key_sha256: xyz}", "64 hexadecimal digits"),
        ("a: {key: sekrit, weight: 0}", "weight"),
        ("a: {key: sekrit, limit: {}}", "limit"),
        ("'bad name': {key: sekrit}", "tenant name"),
        ("a: {key: sekrit}\nb: {key: sekrit}", "the same key"),
        ("[1, 2]", "must map tenant names"),
        ("a: {key: sekrit", "not valid YAML"),
    ],
)
def test_keys_file_errors_name_the_file_and_entry_never_the_key(tmp_path, text, message):
    f = tmp_path / "keys.yaml"
    f.write_text(text)
    with pytest.raises(ValueError, match=message) as e:
        load_keys_file(str(f))
    assert str(f) in str(e.value)
    assert "sekrit" not in str(e.value)


def test_missing_keys_file(tmp_path):
    with pytest.raises(ValueError, match="cannot be read"):
        load_keys_file(str(tmp_path / "nope.yaml"))


def test_the_key_names_the_tenant_and_cannot_claim_another(directory):
    acme = directory.identify("Bearer acme-key", None)
    assert (acme.name, acme.weight, acme.priority, acme.max_tokens) == ("acme", 3.0, 1, 8)
    assert directory.identify("Bearer beta-key", "beta").name == "beta"  # naming its own: fine
    for claimed in ("beta", "someone-else"):
        with pytest.raises(APIError) as e:
            directory.identify("Bearer acme-key", claimed)
        assert e.value.status == 403 and e.value.body["error"]["code"] == "tenant_mismatch"


def test_without_a_tenant_key_the_header_names_the_tenant_but_not_a_keyed_one(directory):
    assert directory.identify("Bearer shared-key", None).name == "default"
    free = directory.identify("Bearer shared-key", "team-7")
    assert (free.name, free.weight, free.priority, free.keyed) == ("team-7", 1.0, 0, False)
    with pytest.raises(APIError) as e:
        directory.identify("Bearer shared-key", "acme")
    assert e.value.status == 403
    assert TenantDirectory().identify(None, "x").name == "x"  # no keys configured at all


@pytest.mark.parametrize("claimed", ["", "a b", "-x", "x" * 65, "é", "a\nb"])
def test_malformed_tenant_header_is_400(directory, claimed):
    with pytest.raises(APIError) as e:
        directory.identify(None, claimed)
    assert e.value.status == 400 and e.value.body["error"]["param"] == "x-tenant-id"


def test_stamp_carries_tenant_priority_class_and_limits(directory):
    acme = directory.identify("Bearer acme-key", None)
    body = stamp({"prompt_token_ids": [1], "sampling_params": {"max_tokens": 8}, "priority": 0}, acme)
    assert (body["tenant"], body["tenant_weight"], body["priority"]) == ("acme", 3.0, 1)
    # A request may ask for a worse priority than its class, never a better one.
    assert stamp({"sampling_params": {}, "priority": 5}, acme)["priority"] == 5
    with pytest.raises(APIError) as e:
        stamp({"sampling_params": {"max_tokens": 9}}, acme)
    assert e.value.status == 400 and e.value.body["error"]["param"] == "max_tokens"
    # What the engine replica passes on to AsyncEngine.generate.
    assert _tenant_kwargs(body) == {"tenant": "acme", "tenant_weight": 3.0}
    assert _tenant_kwargs({"prompt_token_ids": [1]}) == {}


def test_metric_labels_are_bounded():
    m = TenantMetrics(max_labels=3, known=["acme"])
    for t in ["acme", "t1", "t2", "t3", "t4", OTHER_TENANTS]:
        m.observe_request(t, 10)
    m.observe_generated("t4", 5)
    samples = {
        (s.name, s.labels["tenant"]): s.value for fam in m.collect() for s in fam.samples if s.name.endswith("_total")
    }
    assert samples[("fleetserve:tenant_requests_total", "acme")] == 1
    assert samples[("fleetserve:tenant_requests_total", "t2")] == 1
    assert samples[("fleetserve:tenant_requests_total", OTHER_TENANTS)] == 3  # t3, t4, and "other" itself
    assert samples[("fleetserve:tenant_prompt_tokens_total", OTHER_TENANTS)] == 30
    assert samples[("fleetserve:tenant_generation_tokens_total", OTHER_TENANTS)] == 5
    assert {t for _, t in samples} == {"acme", "t1", "t2", OTHER_TENANTS}


def test_tenant_keys_open_the_api_beside_the_single_key(directory):
    both = ApiKeyAuth("shared-key", tenant_digests=directory.digests)
    only_tenants = ApiKeyAuth(None, tenant_digests=directory.digests)
    for auth in (both, only_tenants):
        assert auth.enabled
        auth.check("Bearer acme-key")
        auth.check("bearer beta-key")
        for bad in ("Bearer nope", "acme-key", None):
            with pytest.raises(APIError) as e:
                auth.check(bad)
            assert e.value.status == 401
    both.check("Bearer shared-key")
    with pytest.raises(APIError):
        only_tenants.check("Bearer shared-key")
    ApiKeyAuth(None).check(None)  # no key configured: open, as before


def test_access_log_line_names_the_tenant_the_handler_left_in_the_request_state():
    from starlette.requests import Request as StarletteRequest

    from fleetserve.router.access_log import request_line

    scope = {"type": "http", "client": ("10.0.0.1", 5), "method": "POST", "path": "/v1/completions", "headers": []}
    assert "tenant=" not in request_line(scope, 200, 0.01)
    StarletteRequest(scope).state.tenant = "acme"  # what Ingress._http_tenant does
    assert request_line(scope, 200, 0.01).endswith("200 10.0 ms tenant=acme")
