"""A real OTLP/HTTP trace receiver for tests and benchmarks: what a collector sees.

Not the SDK's in-memory exporter: the spans cross a socket as the protobuf an OpenTelemetry
Collector (or Jaeger, Tempo) receives, so what is tested is what an operator's collector gets
from `fleetserve serve --otlp-traces-endpoint ...`, exporter, batching and all.

    with OTLPReceiver() as rx:                      # 127.0.0.1, a free port
        start_server(otlp_traces_endpoint=rx.endpoint)   # http://127.0.0.1:PORT/v1/traces
        ...
        spans = rx.wait_for(lambda s: any(x.name == "decode" for x in s), timeout_s=10)

- `POST /v1/traces` with `Content-Type: application/x-protobuf` (gzip or deflate
  `Content-Encoding` too) is decoded as an `ExportTraceServiceRequest` and answered 200 with
  an empty `ExportTraceServiceResponse`; other paths 404, other content types 415, bodies that
  do not decode 400.
- Every span is kept as a frozen `Span` (ids in hex, attributes decoded to Python values,
  `service_name` from its resource); `spans(trace_id=...)`, `by_name(name)`, `wait_for(...)`,
  `clear()`.
- Faults, settable while it runs: `delay_s` (each request waits that long before it is
  answered and its spans are kept: a slow collector) and `status` (e.g. 503: a failing
  collector; the request's spans are not kept). `requests` counts every export request
  received, `rejected` those answered with a non-200 `status`.

The `otlp_receiver` pytest fixture (import it into a test module or a conftest) yields a
started receiver and stops it after the test.
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, NamedTuple, Optional

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

TRACES_PATH = "/v1/traces"
PROTOBUF = "application/x-protobuf"


class SpanEvent(NamedTuple):
    """One span event: unpacks as `(name, time_ns, attributes)`."""

    name: str
    time_ns: int
    attributes: dict[str, Any]


class SpanLink(NamedTuple):
    trace_id: str
    span_id: str
    attributes: dict[str, Any]


@dataclass(frozen=True)
class Span:
    """One received span. `kind` is the OTLP enum (0 unspecified, 1 internal, 2 server,
    3 client, 4 producer, 5 consumer); `status_code` too (0 unset, 1 ok, 2 error)."""

    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: Optional[str]  # 16 hex digits, None for a root span
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(hash=False)
    events: tuple[SpanEvent, ...] = field(hash=False)
    service_name: Optional[str] = None
    status_code: int = 0
    status_message: str = ""
    links: tuple[SpanLink, ...] = field(default=(), hash=False)
    trace_state: str = ""
    scope_name: str = ""
    resource_attributes: dict[str, Any] = field(default_factory=dict, hash=False, repr=False)

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    def event_names(self) -> list[str]:
        return [e.name for e in self.events]


def any_value(v: AnyValue) -> Any:
    """An OTLP AnyValue as Python: str, bool, int, float, bytes, list, dict or None."""
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return attributes_of(v.kvlist_value.values)
    return getattr(v, which)


def attributes_of(kvs) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}


def spans_of(request: ExportTraceServiceRequest) -> list[Span]:
    """Every span of an export request, flattened out of its resource and scope groups."""
    out = []
    for rs in request.resource_spans:
        resource = attributes_of(rs.resource.attributes)
        service = resource.get("service.name")
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    Span(
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex() or None,
                        name=s.name,
                        kind=int(s.kind),
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        attributes=attributes_of(s.attributes),
                        events=tuple(
                            SpanEvent(e.name, e.time_unix_nano, attributes_of(e.attributes)) for e in s.events
                        ),
                        service_name=service,
                        status_code=int(s.status.code),
                        status_message=s.status.message,
                        links=tuple(
                            SpanLink(link.trace_id.hex(), link.span_id.hex(), attributes_of(link.attributes))
                            for link in s.links
                        ),
                        trace_state=s.trace_state,
                        scope_name=ss.scope.name,
                        resource_attributes=resource,
                    )
                )
    return out


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the SDK's requests session expects
    timeout = 30  # an idle kept-alive connection is closed after this
    receiver: "OTLPReceiver"  # set on the per-receiver subclass

    def setup(self) -> None:
        super().setup()
        self.receiver._track(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.receiver._track(self.connection, False)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # quiet: tests print what they assert on

    def _answer(self, code: int, body: bytes = b"", content_type: str = PROTOBUF) -> None:
        try:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:  # the exporter gave up waiting (timeout) and closed: fine for a slow collector
            self.close_connection = True

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        rx = self.receiver
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with rx._lock:
            rx.requests += 1
        if self.path.split("?")[0] != TRACES_PATH:
            return self._answer(404, b"not found", "text/plain")
        if (self.headers.get("Content-Type") or "").split(";")[0].strip() != PROTOBUF:
            return self._answer(415, b"only application/x-protobuf", "text/plain")
        delay = rx.delay_s
        if delay > 0 and rx._stopping.wait(delay):
            self.close_connection = True
            return None  # stopped while delaying: no answer
        status = rx.status
        if status != 200:
            with rx._lock:
                rx.rejected += 1
            return self._answer(status, b"", "text/plain")
        try:
            encoding = (self.headers.get("Content-Encoding") or "").strip().lower()
            if encoding == "gzip":
                body = gzip.decompress(body)
            elif encoding == "deflate":
                body = zlib.decompress(body)
            elif encoding not in ("", "identity"):
                return self._answer(415, f"unknown Content-Encoding {encoding}".encode(), "text/plain")
            request = ExportTraceServiceRequest.FromString(body)
        except Exception as e:  # noqa: BLE001 - a malformed body is the client's error
            return self._answer(400, f"undecodable: {type(e).__name__}: {e}".encode(), "text/plain")
        rx._add(spans_of(request))
        return self._answer(200, ExportTraceServiceResponse().SerializeToString())


class OTLPReceiver:
    """An OTLP/HTTP trace receiver on `host:port` (port 0: a free one), serving from a
    background thread between `start()` and `stop()` (or as a context manager)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, delay_s: float = 0.0, status: int = 200) -> None:
        self.host, self._port = host, port
        self.delay_s = delay_s  # each request waits this long before it is answered
        self.status = status  # answer every request with this (spans kept only on 200)
        self.requests = 0  # export requests received (any answer)
        self.rejected = 0  # answered with a non-200 `status`
        self._spans: list[Span] = []
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._conns: set[Any] = set()
        self._stopping = threading.Event()
        self._server: Optional[ThreadingHTTPServer] = None
        self._thread: Optional[threading.Thread] = None

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> "OTLPReceiver":
        if self._server is not None:
            return self
        handler = type("Handler", (_Handler,), {"receiver": self})
        server = ThreadingHTTPServer((self.host, self._port), handler)
        server.daemon_threads = True  # a request delayed or kept alive never blocks stop()
        self._stopping.clear()
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.name = f"otlp-receiver-{self.port}"
        self._thread.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        self._stopping.set()  # wakes delayed requests
        server.shutdown()
        server.server_close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:  # kept-alive connections: closed now, not at their timeout
            try:
                conn.shutdown(2)  # socket.SHUT_RDWR
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> "OTLPReceiver":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def port(self) -> int:
        return self._server.server_address[1] if self._server is not None else self._port

    @property
    def endpoint(self) -> str:
        """The URL an OTLP/HTTP exporter is given: `http://127.0.0.1:PORT/v1/traces`."""
        if self._server is None:
            raise RuntimeError("OTLPReceiver not started")
        return f"http://{self.host}:{self.port}{TRACES_PATH}"

    # -- what arrived --------------------------------------------------------------

    def spans(self, trace_id: Optional[str] = None) -> list[Span]:
        """The spans received so far, in arrival order; only `trace_id`'s when given (hex)."""
        with self._lock:
            spans = list(self._spans)
        if trace_id is not None:
            trace_id = trace_id.lower()
            spans = [s for s in spans if s.trace_id == trace_id]
        return spans

    def by_name(self, name: str, trace_id: Optional[str] = None) -> list[Span]:
        return [s for s in self.spans(trace_id) if s.name == name]

    def wait_for(
        self,
        predicate: Callable[[list[Span]], Any],
        timeout_s: float = 10.0,
        trace_id: Optional[str] = None,
    ) -> list[Span]:
        """The spans (of `trace_id` when given) once `predicate(spans)` is true; an
        AssertionError listing what did arrive when it is not within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans(trace_id)
            if predicate(spans):
                return spans
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"OTLP receiver: condition not met within {timeout_s:g} s; "
                    f"{self.requests} requests, {len(spans)} spans{' of trace ' + trace_id if trace_id else ''}:\n"
                    + self.describe(spans)
                )
            with self._changed:
                self._changed.wait(min(left, 0.1))

    def clear(self) -> None:
        """Forget the spans and the counters (the fault settings stay)."""
        with self._lock:
            self._spans.clear()
            self.requests = 0
            self.rejected = 0

    @staticmethod
    def describe(spans: list[Span]) -> str:
        """One line per span, children indented under their parents: for failure messages."""
        by_id = {s.span_id: s for s in spans}
        children: dict[Optional[str], list[Span]] = {}
        for s in spans:
            parent = s.parent_span_id if s.parent_span_id in by_id else None
            children.setdefault(parent, []).append(s)
        lines: list[str] = []

        def walk(parent: Optional[str], depth: int) -> None:
            for s in sorted(children.get(parent, []), key=lambda x: x.start_ns):
                lines.append(
                    f"{'  ' * depth}{s.name} [{s.service_name}] trace={s.trace_id[:8]} span={s.span_id} "
                    f"parent={s.parent_span_id} {s.duration_s * 1e3:.1f} ms {s.attributes}"
                )
                walk(s.span_id, depth + 1)

        walk(None, 0)
        return "\n".join(lines) or "(none)"

    # -- the handler's side ----------------------------------------------------------

    def _add(self, spans: list[Span]) -> None:
        with self._changed:
            self._spans.extend(spans)
            self._changed.notify_all()

    def _track(self, conn: Any, alive: bool) -> None:
        with self._lock:
            if alive:
                self._conns.add(conn)
            else:
                self._conns.discard(conn)


try:
    import pytest
except ImportError:  # a benchmark importing the receiver without pytest installed
    pass
else:

    @pytest.fixture
    def otlp_receiver():
        """A started OTLPReceiver, stopped after the test."""
        with OTLPReceiver() as rx:
            yield rx
