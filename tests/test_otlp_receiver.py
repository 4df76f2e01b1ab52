"""tests/otlp_receiver.py against the real OpenTelemetry SDK exporter (OTLP/HTTP protobuf):
the spans arrive with their ids, parents, attributes, events and resource; a slow and a
failing collector behave as such. Fast (well under 3 s): no Ray, no model."""

from __future__ import annotations

import gzip
import time

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.trace import SpanKind, Status, StatusCode

from tests.otlp_receiver import OTLPReceiver, otlp_receiver  # noqa: F401 - the fixture


def _provider(endpoint: str, timeout: float = 2.0, compression: Compression | None = None):
    exporter = OTLPSpanExporter(endpoint=endpoint, timeout=timeout, compression=compression)
    provider = TracerProvider(resource=Resource.create({"service.name": "fleetserve-test"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))  # exports at each span's end
    return provider, exporter


def _one_span(exporter: OTLPSpanExporter, name: str = "lonely"):
    """A finished span exported directly: the export's result and how long it took."""
    provider = TracerProvider(resource=Resource.create({"service.name": "direct"}))
    with provider.get_tracer("t").start_as_current_span(name) as span:
        pass
    t0 = time.perf_counter()
    result = exporter.export([span])  # type: ignore[list-item]
    return result, time.perf_counter() - t0


@pytest.mark.parametrize("compression", [None, Compression.Gzip])
def test_parent_and_child_arrive_as_sent(otlp_receiver, compression):  # noqa: F811
    provider, _ = _provider(otlp_receiver.endpoint, compression=compression)
    tracer = provider.get_tracer("fleetserve.tests")
    with tracer.start_as_current_span("ingress", kind=SpanKind.SERVER) as parent:
        parent.set_attribute("gen_ai.request.model", "smollm2-135m")
        parent.set_attribute("gen_ai.usage.input_tokens", 12)
        parent.set_attribute("fleetserve.ratio", 0.25)
        parent.set_attribute("fleetserve.streamed", True)
        parent.set_attribute("fleetserve.candidates", ["r0", "r1"])
        with tracer.start_as_current_span("queue") as child:
            child.add_event("preempted", {"fleetserve.blocks": 3})
            child.set_status(Status(StatusCode.ERROR, "evicted"))
    provider.shutdown()

    spans = otlp_receiver.wait_for(lambda s: len(s) == 2, timeout_s=2)
    by = {s.name: s for s in spans}
    p, c = by["ingress"], by["queue"]
    ctx_p, ctx_c = parent.get_span_context(), child.get_span_context()
    assert p.trace_id == c.trace_id == f"{ctx_p.trace_id:032x}"
    assert len(p.trace_id) == 32 and len(p.span_id) == 16
    assert (p.span_id, c.span_id) == (f"{ctx_p.span_id:016x}", f"{ctx_c.span_id:016x}")
    assert p.parent_span_id is None and c.parent_span_id == p.span_id
    assert p.kind == 2 and c.kind == 1  # SERVER, INTERNAL
    assert p.attributes == {
        "gen_ai.request.model": "smollm2-135m",
        "gen_ai.usage.input_tokens": 12,
        "fleetserve.ratio": 0.25,
        "fleetserve.streamed": True,
        "fleetserve.candidates": ["r0", "r1"],
    }
    [(name, t_ns, attrs)] = c.events
    assert (name, attrs) == ("preempted", {"fleetserve.blocks": 3})
    assert c.start_ns <= t_ns <= c.end_ns and p.start_ns <= c.start_ns <= c.end_ns <= p.end_ns
    assert p.service_name == c.service_name == "fleetserve-test"
    assert (c.status_code, c.status_message) == (2, "evicted")
    assert otlp_receiver.spans(trace_id=p.trace_id.upper()) == spans
    assert otlp_receiver.spans(trace_id="0" * 32) == []
    assert otlp_receiver.requests == 2  # SimpleSpanProcessor: one request per span
    otlp_receiver.clear()
    assert otlp_receiver.spans() == [] and otlp_receiver.requests == 0


def test_wait_for_says_what_it_has():
    with OTLPReceiver() as rx:
        provider, _ = _provider(rx.endpoint)
        with provider.get_tracer("t").start_as_current_span("route"):
            pass
        with pytest.raises(AssertionError, match=r"1 spans[\s\S]*route"):
            rx.wait_for(lambda s: any(x.name == "decode" for x in s), timeout_s=0.2)
        provider.shutdown()


def test_slow_collector_delays_answers_and_keeps_spans():
    with OTLPReceiver(delay_s=0.3) as rx:
        exporter = OTLPSpanExporter(endpoint=rx.endpoint, timeout=2)
        result, took = _one_span(exporter, "slow-but-ok")
        assert result is SpanExportResult.SUCCESS and took >= 0.3
        assert [s.name for s in rx.spans()] == ["slow-but-ok"]

        rx.delay_s = 0.6  # longer than the exporter waits: it gives up, the collector still keeps it
        impatient = OTLPSpanExporter(endpoint=rx.endpoint, timeout=0.2)
        result, took = _one_span(impatient, "given-up")
        assert result is SpanExportResult.FAILURE and took < 0.5
        rx.wait_for(lambda s: any(x.name == "given-up" for x in s), timeout_s=2)
        exporter.shutdown()
        impatient.shutdown()


def test_failing_collector_rejects_then_recovers():
    with OTLPReceiver(status=503) as rx:
        # 503 is retryable, but the first backoff (about 1 s) is past this timeout: one try
        exporter = OTLPSpanExporter(endpoint=rx.endpoint, timeout=0.3)
        result, took = _one_span(exporter, "dropped")
        assert result is SpanExportResult.FAILURE and took < 0.5
        assert (rx.requests, rx.rejected, rx.spans()) == (1, 1, [])

        rx.status = 200
        result, _ = _one_span(exporter, "kept")
        assert result is SpanExportResult.SUCCESS
        assert [s.name for s in rx.spans()] == ["kept"] and (rx.requests, rx.rejected) == (2, 1)
        exporter.shutdown()


def test_answers_like_a_collector():
    """Raw HTTP: the empty ExportTraceServiceResponse, gzip bodies, and refusals."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    with OTLPReceiver() as rx:
        req = ExportTraceServiceRequest()
        span = req.resource_spans.add().scope_spans.add().spans.add()
        span.trace_id, span.span_id, span.name = bytes(range(16)), bytes(range(8)), "raw"
        proto = {"Content-Type": "application/x-protobuf"}
        with httpx.Client() as client:
            r = client.post(
                rx.endpoint,
                content=gzip.compress(req.SerializeToString()),
                headers={**proto, "Content-Encoding": "gzip"},
            )
            assert r.status_code == 200 and r.headers["content-type"] == "application/x-protobuf"
            assert ExportTraceServiceResponse.FromString(r.content) == ExportTraceServiceResponse()
            [s] = rx.spans()
            assert (s.trace_id, s.span_id, s.parent_span_id, s.service_name) == (
                bytes(range(16)).hex(),
                bytes(range(8)).hex(),
                None,
                None,
            )
            json = {"Content-Type": "application/json"}
            assert client.post(rx.endpoint, content=b"{}", headers=json).status_code == 415
            assert client.post(rx.endpoint, content=b"\xff\xff", headers=proto).status_code == 400
            assert client.post(rx.endpoint.replace("traces", "metrics"), headers=proto).status_code == 404
        assert rx.requests == 4 and len(rx.spans()) == 1
    with pytest.raises(RuntimeError):
        rx.endpoint  # noqa: B018 - stopped
