"""OpenTelemetry traces of requests, across the ingress, the router and the engine replicas.

One trace per request (the client's, when it sends a W3C `traceparent`). The ingress opens
the request's SERVER span (`POST /v1/...`, from the first byte to the last of the
response) and, under it, `ingress` (parse, tokenize or render the chat template,
validate). Each call to an engine pool adds a `route` span (the policy, the candidates'
loads, the chosen replica and why: router/routing/request_router.py) and, in the engine
replica that served it, the replica's spans (router/replica.py): `queue` (arrival to first
scheduled; preemptions as events), `prefill` (first scheduled to the first token; chunk
events and the prefix-cache hit tokens), `kv_transfer` (a P/D or reuse hand-off: the load
on the loading side, the export on the producing side), `decode` (first token to the
last). A stream that moves to another replica adds `migration`. The replica's spans hang
from the request span, carried to it in the request body (`TRACE_KEY`: the W3C carrier).

The replica builds its spans once the request has ended, from the timings the engine
recorded (monotonic clock: one per machine, shared by the engine-core process), so a
traced request costs the engine's step loop nothing beyond its scheduling events
(scheduler.Request.events), and an untraced one nothing at all.

Exports go over OTLP (HTTP/protobuf or gRPC) from the OpenTelemetry SDK's exporters,
through `BoundedSpanProcessor`: finished spans queue up to a bound and one thread exports
them in batches; past the bound, or when an export fails, spans are dropped and counted
(`fleetserve:trace_spans_dropped_total`). A collector that is down or slow never blocks
or fails a request.

Settings: `--otlp-traces-endpoint` (vLLM's flag; also the standard
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`), `--otlp-traces-protocol`, `--collect-detailed-traces`
(the route span's per-candidate loads and every prefill chunk as an event: more bytes per
trace). Off (no endpoint) nothing here is built.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional, Sequence

from prometheus_client.core import CounterMetricFamily, Metric

logger = logging.getLogger("ray.serve")

# The request body's field with the W3C carrier of the span an engine call hangs from.
TRACE_KEY = "trace"
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
SCOPE = "fleetserve"


@dataclass(frozen=True)
class TracingSettings:
    """What a process needs to export spans (from cluster/config.py's `TracingOptions`)."""

    endpoint: Optional[str] = None
    protocol: str = "http/protobuf"
    service_name: str = "fleetserve"
    detailed: bool = False
    max_queue_spans: int = 4096
    max_export_batch: int = 512
    export_interval_s: float = 1.0
    export_timeout_s: float = 5.0

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint)

    @classmethod
    def of(cls, options: Optional[Mapping[str, Any]]) -> "TracingSettings":
        options = dict(options or {})
        known = {k: v for k, v in options.items() if k in cls.__dataclass_fields__}
        return cls(**known)


class ExportCounts:
    """This process's span exports, for /metrics (the ingress's registry; an engine replica
    appends them to its report): exported, and dropped by reason."""

    def __init__(self) -> None:
        self.exported = 0
        self.dropped = {"queue_full": 0, "export_failed": 0}

    def collector(self, prefix: str) -> Any:
        """A prometheus_client collector of these counts under `prefix`: the ingress's are
        fleetserve:router_trace_spans_*, an engine replica's fleetserve:trace_spans_* (the
        two parts of /metrics never share a family name)."""
        counts = self

        class _Collector:
            def collect(self) -> Iterator[Metric]:
                return counts.families(prefix)

        return _Collector()

    def families(self, prefix: str) -> Iterator[Metric]:
        yield CounterMetricFamily(
            f"{prefix}_exported", "Spans this process exported to the OTLP endpoint.", value=self.exported
        )
        dropped = CounterMetricFamily(
            f"{prefix}_dropped",
            "Spans this process dropped: its export queue was full (a slow or absent collector), "
            "or their export failed.",
            labels=["reason"],
        )
        for reason, n in sorted(self.dropped.items()):
            dropped.add_metric([reason], n)
        yield dropped


EXPORTS = ExportCounts()


class BoundedSpanProcessor:
    """The SDK's span-processor interface over one exporter: `on_end` only appends to a
    bounded queue (or counts a drop); one daemon thread exports batches every
    `interval_s`, or sooner once a batch is full. An export that fails or times out loses
    its batch (counted), never retried: a request must not wait on a collector."""

    def __init__(
        self,
        exporter: Any,
        max_queue: int = 4096,
        max_batch: int = 512,
        interval_s: float = 1.0,
        counts: ExportCounts = EXPORTS,
    ) -> None:
        self._exporter = exporter
        self._max_queue, self._max_batch, self._interval_s = max_queue, max_batch, interval_s
        self._queue: deque = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._flushed = threading.Condition(self._lock)
        self._exporting = 0
        self._stopped = False
        self.counts = counts
        self._thread = threading.Thread(target=self._run, name="fleetserve-otlp-export", daemon=True)
        self._thread.start()

    # The SDK's SpanProcessor interface (duck-typed: TracerProvider only calls these).
    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def _on_ending(self, span: Any) -> None:
        pass

    def on_end(self, span: Any) -> None:
        if not span.context.trace_flags.sampled:
            return
        with self._lock:
            if self._stopped or len(self._queue) >= self._max_queue:
                self.counts.dropped["queue_full"] += 1
                return
            self._queue.append(span)
            full = len(self._queue) >= self._max_batch
        if full:
            self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval_s)
            self._wake.clear()
            while self._export_batch():
                pass
            if self._stopped:
                return

    def _export_batch(self) -> bool:
        with self._lock:
            if not self._queue:
                self._flushed.notify_all()
                return False
            batch = [self._queue.popleft() for _ in range(min(len(self._queue), self._max_batch))]
            self._exporting += 1
        ok = False
        try:
            from opentelemetry.sdk.trace.export import SpanExportResult

            ok = self._exporter.export(batch) == SpanExportResult.SUCCESS
        except Exception as e:  # noqa: BLE001 - a collector's failure is counted, never raised
            logger.debug("OTLP export failed: %r", e)
        with self._lock:
            self._exporting -= 1
            if ok:
                self.counts.exported += len(batch)
            else:
                self.counts.dropped["export_failed"] += len(batch)
            self._flushed.notify_all()
        return True

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        deadline = time.monotonic() + timeout_millis / 1000
        self._wake.set()
        with self._lock:
            while self._queue or self._exporting:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._flushed.wait(min(left, 0.1))
                self._wake.set()
        return True

    def shutdown(self) -> None:
        self.force_flush(5000)
        with self._lock:
            self._stopped = True
        self._wake.set()
        self._thread.join(timeout=5)
        try:
            self._exporter.shutdown()
        except Exception:  # noqa: BLE001
            pass


def make_exporter(settings: TracingSettings) -> Any:
    if settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        endpoint = settings.endpoint or ""
        insecure = not endpoint.startswith("https://")
        return GrpcExporter(endpoint=endpoint, insecure=insecure, timeout=settings.export_timeout_s)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=settings.endpoint, timeout=settings.export_timeout_s)


class Tracing:
    """One process's tracer (the ingress's or an engine replica's): its own TracerProvider
    (the global one stays Ray's), resource `service.name` and `fleetserve.role`."""

    def __init__(self, settings: TracingSettings, role: str, exporter: Any = None) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.settings = settings
        self.role = role
        resource = Resource.create(
            {"service.name": os.environ.get("OTEL_SERVICE_NAME") or settings.service_name, "fleetserve.role": role}
        )
        self.provider = TracerProvider(resource=resource)
        self.processor = BoundedSpanProcessor(
            exporter if exporter is not None else make_exporter(settings),
            max_queue=settings.max_queue_spans,
            max_batch=settings.max_export_batch,
            interval_s=settings.export_interval_s,
        )
        self.provider.add_span_processor(self.processor)  # type: ignore[arg-type]
        self.tracer = self.provider.get_tracer(SCOPE)
        self.propagator = TraceContextTextMapPropagator()

    # -- context ------------------------------------------------------------------

    def extract(self, carrier: Optional[Mapping[str, str]]) -> Any:
        """The OpenTelemetry Context of a W3C carrier (an empty one: a new trace)."""
        return self.propagator.extract(dict(carrier or {}))

    def carrier(self, span: Any) -> dict[str, str]:
        from opentelemetry import trace

        out: dict[str, str] = {}
        self.propagator.inject(out, context=trace.set_span_in_context(span))
        return out

    # -- spans ----------------------------------------------------------------------

    def start(self, name: str, parent: Any = None, kind: str = "internal", start_ns: Optional[int] = None, **attrs):
        """A span to end later (`span.end()`). `parent`: a Context or a span."""
        return self.tracer.start_span(
            name, context=_as_context(parent), kind=_kind(kind), attributes=_clean(attrs), start_time=start_ns
        )

    def record(
        self,
        name: str,
        parent: Any,
        start_ns: int,
        end_ns: int,
        attributes: Optional[Mapping[str, Any]] = None,
        events: Sequence[tuple[str, int, Mapping[str, Any]]] = (),
        error: Optional[str] = None,
        kind: str = "internal",
    ) -> Any:
        """A span that already happened (its times measured elsewhere), ended at once."""
        span = self.tracer.start_span(
            name,
            context=_as_context(parent),
            kind=_kind(kind),
            attributes=_clean(attributes or {}),
            start_time=start_ns,
        )
        for ev_name, ev_ns, ev_attrs in events:
            span.add_event(ev_name, _clean(ev_attrs), timestamp=ev_ns)
        if error:
            set_error(span, error)
        span.end(end_time=max(end_ns, start_ns))
        return span

    def shutdown(self) -> None:
        self.provider.shutdown()


def set_error(span: Any, message: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, message))


def _as_context(parent: Any) -> Any:
    if parent is None:
        return None
    from opentelemetry import trace
    from opentelemetry.trace import Span

    if isinstance(parent, Span):
        return trace.set_span_in_context(parent)
    return parent


def _kind(kind: str) -> Any:
    from opentelemetry.trace import SpanKind

    return {"server": SpanKind.SERVER, "client": SpanKind.CLIENT}.get(kind, SpanKind.INTERNAL)


def _clean(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """OpenTelemetry attribute values: str, bool, int, float or sequences of one of them;
    None is left out and anything else is written as text."""
    out: dict[str, Any] = {}
    for k, v in attrs.items():
        if v is None:
            continue
        if isinstance(v, (str, bool, int, float)):
            out[k] = v
        elif isinstance(v, (list, tuple)) and all(isinstance(x, (str, bool, int, float)) for x in v):
            out[k] = list(v)
        else:
            out[k] = str(v)
    return out


# -- the process's tracer -------------------------------------------------------------

_current: Optional[Tracing] = None
_current_lock = threading.Lock()


def setup(options: Optional[Mapping[str, Any]], role: str) -> Optional[Tracing]:
    """This process's tracer for `role` (built once; None when tracing is off). The
    endpoint defaults to the standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT."""
    global _current
    settings = TracingSettings.of(options)
    if not settings.enabled and os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        settings = TracingSettings.of(
            {**dict(options or {}), "endpoint": os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]}
        )
    if not settings.enabled:
        return None
    with _current_lock:
        if _current is None:
            _current = Tracing(settings, role)
        return _current


def current() -> Optional[Tracing]:
    return _current


def shutdown() -> None:
    global _current
    with _current_lock:
        tracing, _current = _current, None
    if tracing is not None:
        tracing.shutdown()


# -- clocks -----------------------------------------------------------------------------


def mono_to_ns(t: float, now_ns: Optional[int] = None, now_mono: Optional[float] = None) -> int:
    """Epoch nanoseconds of a `time.monotonic()` reading of this machine."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    now_mono = time.monotonic() if now_mono is None else now_mono
    return now_ns - int((now_mono - t) * 1e9)


def carrier_of(body: Mapping[str, Any]) -> Optional[dict[str, str]]:
    """The W3C carrier a request body brought (None: the request is not traced)."""
    carrier = body.get(TRACE_KEY)
    if isinstance(carrier, dict) and isinstance(carrier.get(TRACEPARENT), str):
        return {k: v for k, v in carrier.items() if k in (TRACEPARENT, TRACESTATE) and isinstance(v, str)}
    return None


# -- an engine replica's spans ----------------------------------------------------------


@dataclass
class EngineTimings:
    """One request's phases on one engine replica, in `time.monotonic()` seconds, from its
    RequestMetrics (the replica's process) and its scheduling events (the engine core's):
    what both its spans and the phase histograms are built from."""

    arrival: float
    end: float
    queue_end: Optional[float]  # first scheduled (after any remote KV load: the load is transfer)
    transfer: Optional[tuple[float, float, str]]  # a remote KV load: start, end, outcome
    first_token: Optional[float]
    last_token: Optional[float]
    events: list

    def phases(self) -> dict[str, float]:
        """Seconds per phase: queue, transfer, prefill, decode (those that happened)."""
        out: dict[str, float] = {}
        queue_end = self.queue_end if self.queue_end is not None else self.first_token
        if queue_end is not None:
            out["queue"] = max(0.0, queue_end - self.arrival)
        prefill_start = queue_end
        if self.transfer is not None:
            out["transfer"] = max(0.0, self.transfer[1] - self.transfer[0])
            prefill_start = self.transfer[1]
        if self.first_token is not None and prefill_start is not None:
            out["prefill"] = max(0.0, self.first_token - prefill_start)
            if self.last_token is not None:
                out["decode"] = max(0.0, self.last_token - self.first_token)
        return out


def engine_timings(metrics: Any, events: Optional[list], end: float) -> EngineTimings:
    """`metrics`: the request's RequestMetrics; `events`: its engine-core events or None."""
    events = list(events or ())
    queue_end = None
    transfer_start = transfer_end = None
    outcome = ""
    for name, t, attrs in events:
        if name == "scheduled" and queue_end is None:
            queue_end = t
            if attrs.get("remote_load"):
                transfer_start = t
        elif name in ("kv_loaded", "kv_load_failed") and transfer_start is not None and transfer_end is None:
            transfer_end, outcome = t, "loaded" if name == "kv_loaded" else "failed"
    if queue_end is None:
        queue_end = metrics.first_scheduled_time
    transfer = None
    if transfer_start is not None:
        transfer = (transfer_start, transfer_end if transfer_end is not None else end, outcome or "unfinished")
    return EngineTimings(
        arrival=metrics.arrival_time,
        end=end,
        queue_end=queue_end,
        transfer=transfer,
        first_token=metrics.first_token_time,
        last_token=metrics.last_token_time,
        events=events,
    )


def record_engine_spans(
    tracing: Tracing,
    carrier: Mapping[str, str],
    timings: EngineTimings,
    attributes: Mapping[str, Any],
    kv_export: Optional[Mapping[str, Any]] = None,
    error: Optional[str] = None,
) -> None:
    """The replica's spans of one request, under the span `carrier` names: `engine` (the
    replica's whole part) and its `queue`, `kv_transfer`, `prefill`, `decode`."""
    now_ns, now_mono = time.time_ns(), time.monotonic()

    def ns(t: float) -> int:
        return mono_to_ns(t, now_ns, now_mono)

    t = timings
    role = str(attributes.get("fleetserve.role", "engine"))
    parent = tracing.extract(carrier)
    name = "engine" if role == "engine" else f"engine {role}"
    engine = tracing.record(name, parent, ns(t.arrival), ns(t.end), attributes, error=error, kind="server")
    preempted = [(name, ns(ts), a) for name, ts, a in t.events if name == "preempted"]
    chunks = [(name, ns(ts), a) for name, ts, a in t.events if name == "prefill_chunk"]
    queue_end = t.queue_end if t.queue_end is not None else (t.first_token or t.end)
    tracing.record("queue", engine, ns(t.arrival), ns(queue_end), {"fleetserve.role": role})
    prefill_start = queue_end
    if t.transfer is not None:
        start, end, outcome = t.transfer
        tracing.record(
            "kv_transfer",
            engine,
            ns(start),
            ns(end),
            {
                "fleetserve.kv_transfer.direction": "load",
                "fleetserve.kv_transfer.outcome": outcome,
                "fleetserve.kv_transfer.tokens": attributes.get("fleetserve.remote_tokens"),
                "fleetserve.kv_transfer.bytes": attributes.get("fleetserve.remote_kv_bytes"),
                # a load is copied into its blocks only after every block matched its digest
                # (kv_transfer.base): loaded means verified; a mismatch fails the load
                "fleetserve.kv_transfer.verified": outcome == "loaded",
                "fleetserve.kv_transfer.connector": attributes.get("fleetserve.kv_connector"),
            },
            events=[(n, ns(ts), a) for n, ts, a in t.events if n in ("kv_loaded", "kv_load_failed")],
            error=None if outcome == "loaded" else f"remote KV load {outcome}: recomputed",
        )
        prefill_start = end
    first = t.first_token
    if first is not None:
        in_prefill = [e for e in preempted if e[1] <= ns(first)]
        tracing.record(
            "prefill",
            engine,
            ns(prefill_start),
            ns(first),
            {
                "gen_ai.usage.input_tokens": attributes.get("gen_ai.usage.input_tokens"),
                "fleetserve.cached_tokens": attributes.get("fleetserve.cached_tokens"),
                "fleetserve.prefill_chunks": len(chunks),
            },
            events=(chunks if tracing.settings.detailed or len(chunks) <= 32 else chunks[:32]) + in_prefill,
        )
        last = t.last_token if t.last_token is not None else first
        decode_attributes = {
            "gen_ai.usage.output_tokens": attributes.get("gen_ai.usage.output_tokens"),
            "gen_ai.response.finish_reasons": attributes.get("gen_ai.response.finish_reasons"),
        }
        spec = next((a for n, _, a in t.events if n == "spec_decode"), None)
        if spec is not None:  # speculative decoding: drafts verified and accepted over the request
            drafts, accepted = int(spec["draft_tokens"]), int(spec["accepted_tokens"])
            decode_attributes.update(
                {
                    "fleetserve.spec_decode.draft_tokens": drafts,
                    "fleetserve.spec_decode.accepted_tokens": accepted,
                    "fleetserve.spec_decode.acceptance_rate": accepted / drafts if drafts else None,
                }
            )
        tracing.record(
            "decode",
            engine,
            ns(first),
            ns(max(last, first)),
            decode_attributes,
            events=[e for e in preempted if e[1] > ns(first)],
        )
    if kv_export is not None:
        tracing.record(
            "kv_transfer",
            engine,
            ns(first if first is not None else t.end),
            ns(t.end),
            {
                "fleetserve.kv_transfer.direction": "export",
                **{f"fleetserve.kv_transfer.{k}": v for k, v in kv_export.items()},
            },
        )


# -- phase histograms (with or without a collector) -------------------------------------

PHASES = ("queue", "transfer", "prefill", "decode")
_PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class PhaseHistograms:
    """fleetserve:request_phase_seconds{phase, role}: where each request's time went on an
    engine replica of `role` (engine, prefill or decode): queue (arrival to first
    scheduled), transfer (a remote KV load), prefill (to the first token), decode (first to
    last token). Counted for every request, traced or not."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Histogram

        self.registry = CollectorRegistry(auto_describe=False)
        self._hist = Histogram(
            "fleetserve:request_phase_seconds",
            "Seconds each request spent in each phase on an engine replica of this role.",
            ["phase", "role"],
            buckets=_PHASE_BUCKETS,
            registry=self.registry,
        )
        self._children: dict[tuple[str, str], Any] = {}
        self._exports_registered = False

    def observe(self, role: str, phases: Mapping[str, float]) -> None:
        for phase, seconds in phases.items():
            child = self._children.get((phase, role))
            if child is None:
                child = self._children[(phase, role)] = self._hist.labels(phase, role)
            child.observe(seconds)

    def text(self, role: str, exports: Optional[ExportCounts] = None) -> str:
        from prometheus_client import generate_latest

        if exports is not None and not self._exports_registered:
            self.registry.register(exports.collector("fleetserve:trace_spans"))
            self._exports_registered = True
        return generate_latest(self.registry).decode()


# -- the ingress: a request's span -----------------------------------------------------

_request_span: "contextvars.ContextVar[Any]" = contextvars.ContextVar("fleetserve_request_span", default=None)
TRACED_PATHS = ("/v1/", "/pooling", "/score", "/rerank", "/tokenize", "/detokenize")
_OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/responses": "chat",
    "/v1/embeddings": "embeddings",
}


class TraceRequests:
    """ASGI middleware of the ingress: each API request (not /health nor /metrics) gets its
    SERVER span, a child of the client's `traceparent` when it sent one, from its first byte
    to the end of its response (a stream's last event included). Pure ASGI, as the other
    middlewares (router/auth.py says why); with tracing off it only passes the call on."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        tracing = _current
        if tracing is None or scope["type"] != "http" or not scope["path"].startswith(TRACED_PATHS):
            await self.app(scope, receive, send)
            return
        carrier = {}
        for key, value in scope.get("headers") or ():
            if key in (b"traceparent", b"tracestate"):
                carrier[key.decode("latin-1")] = value.decode("latin-1")
        method, path = scope.get("method", "POST"), scope["path"]
        span = tracing.start(
            f"{method} {path}",
            tracing.extract(carrier),
            kind="server",
            **{
                "http.request.method": method,
                "url.path": path,
                "fleetserve.role": "ingress",
                "gen_ai.operation.name": _OPERATIONS.get(path),
            },
        )
        token = _request_span.set(span)

        async def traced_send(message) -> None:
            if message["type"] == "http.response.start":
                status = int(message["status"])
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    set_error(span, f"HTTP {status}")
            await send(message)

        try:
            await self.app(scope, receive, traced_send)
        except BaseException as e:
            set_error(span, repr(e))
            raise
        finally:
            _request_span.reset(token)
            span.end()


def annotate_request(attributes: Mapping[str, Any]) -> None:
    """Attributes on the current request span (a routing flow's decision); nothing when the
    request is not traced."""
    span = _request_span.get()
    if span is not None:
        span.set_attributes(_clean(attributes))


def request_span() -> Any:
    """The current request's span at the ingress (None: not traced)."""
    return _request_span.get()


def start_request_span(name: str, metadata: Mapping[str, str], **attrs: Any) -> tuple[Any, Any]:
    """A gRPC call's SERVER span (its metadata may carry `traceparent`), made the current
    request span; returns (span, token) for `end_request_span`, or (None, None) when off."""
    tracing = _current
    if tracing is None:
        return None, None
    carrier = {k: v for k, v in metadata.items() if k in (TRACEPARENT, TRACESTATE)}
    span = tracing.start(name, tracing.extract(carrier), kind="server", **{"fleetserve.role": "ingress", **attrs})
    return span, _request_span.set(span)


def end_request_span(span: Any, token: Any, error: Optional[str] = None) -> None:
    if span is None:
        return
    try:
        _request_span.reset(token)
    except ValueError:  # ended from another context (a generator closed elsewhere)
        pass
    if error:
        set_error(span, error)
    span.end()


@contextlib.contextmanager
def ingress_phase(name: str = "ingress", **attrs: Any) -> Iterator[Any]:
    """A child span of the current request span around ingress work (parse, tokenize or
    render, validate); yields it (None when not traced). An exception marks it failed."""
    parent = _request_span.get()
    tracing = _current
    if parent is None or tracing is None:
        yield None
        return
    span = tracing.start(name, parent, **attrs)
    try:
        yield span
    except BaseException as e:
        set_error(span, str(e) or repr(e))
        raise
    finally:
        span.end()


def attach_to_body(body: dict) -> None:
    """Put the current request span's W3C carrier in an engine call's body (TRACE_KEY), and
    the request's GenAI attributes on that span; nothing when the request is not traced."""
    span = _request_span.get()
    tracing = _current
    if span is None or tracing is None:
        return
    body[TRACE_KEY] = tracing.carrier(span)
    sp = body.get("sampling_params") or {}
    span.set_attributes(
        _clean(
            {
                "gen_ai.request.max_tokens": sp.get("max_tokens"),
                "gen_ai.request.temperature": sp.get("temperature"),
                "gen_ai.usage.input_tokens": len(body.get("prompt_token_ids") or ()),
                "fleetserve.request_id": body.get("request_id"),
                "fleetserve.tenant": body.get("tenant"),
            }
        )
    )
