"""router/tracing.py without a cluster: spans go over OTLP/HTTP to a real receiver
(tests/otlp_receiver.py); a slow or failing collector never blocks the code that ends spans,
and what it cannot take is dropped and counted; the replica's spans are built from a request's
timings with the right parents; the ingress middleware continues a client's trace."""

from __future__ import annotations

import asyncio
import time

import httpx

from fleetserve.replica.engine.outputs import RequestMetrics
from fleetserve.router.tracing import (
    BoundedSpanProcessor,
    ExportCounts,
    Tracing,
    TracingSettings,
    engine_timings,
    make_exporter,
    record_engine_spans,
)
from tests.otlp_receiver import OTLPReceiver

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
CARRIER = {"traceparent": f"00-{TRACE_ID}-{PARENT}-01"}


def _tracing(rx: OTLPReceiver, **settings) -> Tracing:
    s = TracingSettings(endpoint=rx.endpoint, export_interval_s=0.05, export_timeout_s=1.0, **settings)
    tracing = Tracing(s, role="test")
    tracing.processor.counts = ExportCounts()  # this test's own counts
    return tracing


def test_engine_spans_have_the_phases_and_parents_and_a_remote_load_is_a_transfer_span():
    with OTLPReceiver() as rx:
        tracing = _tracing(rx)
        t0 = time.monotonic() - 1.0
        m = RequestMetrics(arrival_time=t0, first_scheduled_time=t0 + 0.1)
        m.first_token_time, m.last_token_time, m.finished_time = t0 + 0.5, t0 + 0.9, t0 + 0.9
        m.num_generation_tokens = 5
        events = [
            ("scheduled", t0 + 0.1, {"cached_tokens": 0, "external_tokens": 32, "remote_load": True}),
            ("kv_loaded", t0 + 0.3, {"tokens": 32}),
            ("scheduled", t0 + 0.31, {"cached_tokens": 32, "external_tokens": 0, "remote_load": False}),
            ("prefill_chunk", t0 + 0.45, {"tokens": 8, "computed": 40}),
            ("preempted", t0 + 0.7, {"num_preemptions": 1}),
            ("spec_decode", t0 + 0.9, {"draft_tokens": 8, "accepted_tokens": 6}),
        ]
        timings = engine_timings(m, events, m.finished_time)
        phases = timings.phases()
        assert abs(phases["queue"] - 0.1) < 1e-6 and abs(phases["transfer"] - 0.2) < 1e-6
        assert abs(phases["prefill"] - 0.2) < 1e-6 and abs(phases["decode"] - 0.4) < 1e-6
        record_engine_spans(
            tracing,
            CARRIER,
            timings,
            {
                "fleetserve.role": "decode",
                "fleetserve.remote_tokens": 32,
                "fleetserve.remote_kv_bytes": 98304,
                "gen_ai.usage.output_tokens": 5,
            },
        )
        spans = rx.wait_for(lambda s: len(s) >= 5, timeout_s=10, trace_id=TRACE_ID)
        by = {s.name: s for s in spans}
        assert set(by) == {"engine decode", "queue", "kv_transfer", "prefill", "decode"}, set(by)
        root = by["engine decode"]
        assert root.parent_span_id == PARENT and root.kind == 2  # SERVER
        for name in ("queue", "kv_transfer", "prefill", "decode"):
            assert by[name].parent_span_id == root.span_id, name
        assert abs((by["kv_transfer"].end_ns - by["kv_transfer"].start_ns) / 1e9 - 0.2) < 1e-3
        assert by["kv_transfer"].attributes["fleetserve.kv_transfer.outcome"] == "loaded"
        assert by["kv_transfer"].attributes["fleetserve.kv_transfer.bytes"] == 98304
        assert by["kv_transfer"].attributes["fleetserve.kv_transfer.verified"] is True
        assert by["queue"].end_ns <= by["kv_transfer"].start_ns + 1000 <= by["prefill"].start_ns + 2000
        assert by["prefill"].event_names() == ["prefill_chunk"]
        assert by["decode"].event_names() == ["preempted"]  # it came after the first token
        assert by["decode"].attributes["gen_ai.usage.output_tokens"] == 5
        assert by["decode"].attributes["fleetserve.spec_decode.draft_tokens"] == 8
        assert by["decode"].attributes["fleetserve.spec_decode.acceptance_rate"] == 0.75
        assert root.resource_attributes["fleetserve.role"] == "test"
        tracing.shutdown()


def test_a_slow_collector_never_blocks_ending_spans_and_the_bound_drops_and_counts():
    with OTLPReceiver() as rx:
        rx.delay_s = 2.0
        tracing = _tracing(rx, max_queue_spans=20, max_export_batch=5)
        counts = tracing.processor.counts
        for i in range(5):  # a full batch: exported at once, into the slow collector
            tracing.start(f"first{i}").end()
        deadline = time.monotonic() + 10
        while rx.requests < 1:  # that export is in flight (the collector holds it 2 s)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        t = time.perf_counter()
        for i in range(200):
            tracing.start(f"s{i}").end()
        assert time.perf_counter() - t < 1.0  # the exporter thread waits, not us
        assert counts.dropped["queue_full"] == 200 - 20  # the queue holds 20
        rx.delay_s = 0.0
        assert tracing.processor.force_flush(15000)
        assert counts.exported + counts.dropped["export_failed"] + counts.dropped["queue_full"] == 205
        tracing.shutdown()


def test_a_failing_collector_loses_its_batches_counted_then_exports_resume():
    with OTLPReceiver() as rx:
        rx.status = 503
        tracing = _tracing(rx)
        counts = tracing.processor.counts
        for i in range(10):
            tracing.start(f"lost{i}").end()
        assert tracing.processor.force_flush(10000)
        assert counts.dropped["export_failed"] == 10 and counts.exported == 0
        rx.status = 200
        tracing.start("kept").end()
        assert tracing.processor.force_flush(10000)
        assert counts.exported == 1 and [s.name for s in rx.spans()] == ["kept"]
        tracing.shutdown()


def test_the_grpc_exporter_is_built_for_grpc_and_an_absent_collector_is_counted():
    exporter = make_exporter(TracingSettings(endpoint="127.0.0.1:1", protocol="grpc", export_timeout_s=0.5))
    counts = ExportCounts()
    processor = BoundedSpanProcessor(exporter, interval_s=0.05, counts=counts)

    from opentelemetry.sdk.trace import TracerProvider

    provider = TracerProvider()
    provider.add_span_processor(processor)  # type: ignore[arg-type]
    provider.get_tracer("t").start_span("x").end()
    assert processor.force_flush(20000)
    assert counts.dropped["export_failed"] == 1
    processor.shutdown()


def test_the_ingress_middleware_continues_the_clients_trace_and_records_the_status():
    import fleetserve.router.tracing as tr

    async def app(scope, receive, send):
        with tr.ingress_phase() as phase:
            assert phase is not None and tr.request_span() is not None
        body = {"request_id": "r1", "prompt_token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}}
        tr.attach_to_body(body)
        assert body[tr.TRACE_KEY]["traceparent"].startswith(f"00-{TRACE_ID}-")
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def call(path: str, headers: dict) -> int:
        transport = httpx.ASGITransport(app=tr.TraceRequests(app))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return (await client.post(path, headers=headers)).status_code

    with OTLPReceiver() as rx:
        previous, tr._current = tr._current, _tracing(rx)
        try:
            assert asyncio.run(call("/v1/completions", CARRIER)) == 201
            spans = rx.wait_for(lambda s: len(s) >= 2, timeout_s=10, trace_id=TRACE_ID)
            by = {s.name: s for s in spans}
            root = by["POST /v1/completions"]
            assert root.parent_span_id == PARENT
            assert root.attributes["http.response.status_code"] == 201
            assert root.attributes["gen_ai.operation.name"] == "text_completion"
            assert root.attributes["gen_ai.usage.input_tokens"] == 3
            assert by["ingress"].parent_span_id == root.span_id
        finally:
            tr._current.shutdown()
            tr._current = previous
    assert tr.request_span() is None
