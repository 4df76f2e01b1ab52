"""Traces through the served app (issue 55): the router suite's server sends every request's
spans to a real OTLP/HTTP receiver (tests/router/conftest.py: `trace_receiver`). A request with
a W3C `traceparent` (HTTP header or gRPC metadata) gets spans of that trace for each phase,
with the right parents and nested times; a collector that fails or stalls slows and fails no
request, and what it cannot take is counted in /metrics. (P/D: tests/pd/test_pd_e2e.py;
migration: tests/router/test_failover.py.)"""

from __future__ import annotations

import secrets
import time

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from fleetserve.router.grpc.proto import fleetserve_pb2 as pb
from fleetserve.router.grpc.proto import fleetserve_pb2_grpc as pb_grpc

PHASES = {"ingress", "route", "engine", "queue", "prefill", "decode"}


def _ids() -> tuple[str, str]:
    return secrets.token_hex(16), secrets.token_hex(8)


def _check_tree(spans, root_name: str, parent: str, output_tokens: int) -> dict:
    by = {s.name: s for s in spans}
    assert PHASES | {root_name} <= set(by), sorted(by)
    root = by[root_name]
    assert root.parent_span_id == parent and root.kind == 2  # SERVER, under the client's span
    for name in ("ingress", "route", "engine"):
        assert by[name].parent_span_id == root.span_id, name
    for name in ("queue", "prefill", "decode"):
        assert by[name].parent_span_id == by["engine"].span_id, name
    # the route span names the replica whose engine span follows
    assert by["route"].attributes["fleetserve.route.replica"] == by["engine"].attributes["fleetserve.replica"]
    assert by["route"].attributes["fleetserve.route.policy"] == "prefix_aware"
    assert by["decode"].attributes["gen_ai.usage.output_tokens"] == output_tokens
    assert by["engine"].attributes["gen_ai.usage.output_tokens"] == output_tokens
    # times nest: the engine's part inside the request's, its phases in order
    slack = 5_000_000  # 5 ms: two processes' clocks read at different moments
    assert root.start_ns - slack <= by["engine"].start_ns and by["engine"].end_ns <= root.end_ns + slack
    assert by["queue"].end_ns <= by["prefill"].start_ns + 1000 and by["prefill"].end_ns <= by["decode"].start_ns + 1000
    assert by["ingress"].end_ns <= by["route"].end_ns
    return by


def test_a_traced_http_completion_has_every_phase_under_the_clients_span(server):
    trace_id, parent = _ids()
    r = httpx.post(
        server.base_url + "/v1/completions",
        headers={**server.headers(), "traceparent": f"00-{trace_id}-{parent}-01", "x-tenant-id": "tracer"},
        json={"model": server.model, "prompt": "Tracing a request through " * 6, "max_tokens": 6, "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    spans = server.traces.wait_for(lambda s: PHASES <= {x.name for x in s}, timeout_s=30, trace_id=trace_id)
    by = _check_tree(spans, "POST /v1/completions", parent, 6)
    root = by["POST /v1/completions"]
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["gen_ai.operation.name"] == "text_completion"
    assert root.attributes["fleetserve.tenant"] == by["engine"].attributes["fleetserve.tenant"] == "tracer"
    assert by["prefill"].attributes["gen_ai.usage.input_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert {s.resource_attributes["fleetserve.role"] for s in spans} == {"ingress", "engine"}
    # where no collector runs: the phase histograms
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(server.base_url + "/metrics").text)}
    phases = {s.labels["phase"] for s in fams["fleetserve:request_phase_seconds"].samples if s.name.endswith("_count")}
    assert {"queue", "prefill", "decode"} <= phases


def test_a_grpc_call_continues_the_trace_of_its_metadata(server):
    trace_id, parent = _ids()
    req = pb.GenerateRequest(
        prompt="A traced gRPC call", sampling_params=pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    )
    meta = (
        ("application", server.app),
        ("authorization", f"Bearer {server.api_key}"),
        ("traceparent", f"00-{trace_id}-{parent}-01"),
    )
    with grpc.insecure_channel(server.grpc_target) as channel:
        replies = list(pb_grpc.FleetServeStub(channel).Generate(req, metadata=meta, timeout=60))
    assert sum(len(m.token_ids) for m in replies) == 4
    spans = server.traces.wait_for(lambda s: PHASES <= {x.name for x in s}, timeout_s=30, trace_id=trace_id)
    by = _check_tree(spans, "fleetserve.v1.FleetServe/Generate", parent, 4)
    assert by["fleetserve.v1.FleetServe/Generate"].attributes["rpc.system"] == "grpc"


def _dropped(server, reason: str) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    for fam in text_string_to_metric_families(text):
        if fam.name == "fleetserve:router_trace_spans_dropped":
            return sum(s.value for s in fam.samples if s.labels.get("reason") == reason)
    raise AssertionError("no fleetserve:router_trace_spans_dropped family")


def _complete(server, i: int) -> float:
    t = time.perf_counter()
    r = httpx.post(
        server.base_url + "/v1/completions",
        headers=server.headers(),
        json={"model": server.model, "prompt": f"collector test {i}", "max_tokens": 3, "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return time.perf_counter() - t


def test_a_collector_that_fails_or_stalls_slows_and_fails_no_request(server):
    rx = server.traces
    try:
        rx.status = 503
        before = _dropped(server, "export_failed")
        for i in range(4):
            _complete(server, i)
        deadline = time.monotonic() + 20
        while _dropped(server, "export_failed") <= before:  # the ingress's spans of them, lost and counted
            assert time.monotonic() < deadline, "no failed export counted"
            time.sleep(0.3)
        rx.status, rx.delay_s = 200, 4.0
        _complete(server, 10)
        time.sleep(1.5)  # an export of that request's spans is now held by the collector
        took = [_complete(server, 20 + i) for i in range(4)]
        assert max(took) < 3.0, took  # none waited for the stalled collector
    finally:
        rx.status, rx.delay_s = 200, 0.0
    server.wait_idle()
