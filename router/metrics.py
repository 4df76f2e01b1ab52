"""Every metric the router exports, and how /metrics puts them together.

/metrics (router/ingress.py) answers two parts, in this order:

1. the engine replicas' own metrics: each engine keeps its own registry
   (`AsyncEngine.metrics_text()`), each replica reports it every interval to its app's
   metrics hub, the ingress answers from the latest reports without calling a replica
   (router/metrics_hub.py), and `merge_metrics` relabels each sample with
   `replica="<id>"`, families of one name under one HELP/TYPE header (valid for
   Prometheus and `text_string_to_metric_families`), redone only when a report changed;
2. this ingress's own, in one prometheus_client `CollectorRegistry` (`RouterMetrics`):

   fleetserve:replica_metrics_age_seconds{replica}             gauge    since each replica's last report

   fleetserve:router_ongoing_requests{replica}                 gauge    requests in flight per replica
   fleetserve:router_kv_index_blocks{replica}                  gauge    block hashes the prefix index holds
   fleetserve:router_kv_index_resyncs_total                    counter  snapshots the prefix index loaded
   fleetserve:router_prefix_routed_requests_total{deployment,prefix_match}  counter
   fleetserve:router_feed_batches_total, _feed_items_total     counter  the per-step feed (router/feed.py)
   fleetserve:router_feeds_open                                gauge
   fleetserve:pd_*{path|stage|source}                          P/D (`PDMetrics`, router/routing/pd.py)
   fleetserve:prefix_reuse_*{outcome|source}                   reuse (`ReuseMetrics`, router/routing/prefix_reuse.py)
   fleetserve:request_migrations_total, fleetserve:request_migration_failures_total
   fleetserve:slo_requests_total{slo_class,outcome}, _slo_refusals_total{slo_class,reason},
   fleetserve:slo_goodput{slo_class}                           SLO admission (`SloMetrics`)

The router_* families are read from the request routers and the feed hub at scrape time
(a custom collector: the routers count for routing, not for us); the P/D and reuse ones
are prometheus_client counters and histograms counted as requests go; the migration
counts are this process's (`MIGRATIONS`, counted by router/routing/migration.py).
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from typing import Any, Callable, Hashable, Iterable, Iterator, Mapping, Optional, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from fleetserve.router.metrics_hub import STALE_INTERVALS

# /metrics' content type: Prometheus' text format 0.0.4, which both parts are written in.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


# -- the replicas' metrics ------------------------------------------------------


def merge_metrics(texts: Mapping[str, str], label: str = "replica") -> str:
    """`texts`: replica id -> that replica's exposition text."""
    families: dict[str, tuple[str, str, list[str]]] = {}  # name -> (type, help, sample lines)
    for replica_id, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text):
            if fam.name.endswith("_created"):  # prometheus_client's, which vLLM does not export
                continue
            kind, doc, lines = families.setdefault(fam.name, (fam.type, fam.documentation, []))
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue
                labels = dict(s.labels)
                labels[label] = replica_id
                lines.append(f"{s.name}{{{_labels(labels)}}} {_value(s.value)}")
    out = []
    for name, (kind, doc, lines) in families.items():
        if kind == "counter":  # the parser strips `_total`; the text format keeps it
            name += "_total"
        out.append(f"# HELP {name} {_escape_help(doc)}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(lines)
    return "\n".join(out) + "\n"


def _labels(labels: dict[str, str]) -> str:
    return ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n")


def _value(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if math.isnan(v):
        return "NaN"
    return repr(float(v))


# -- the router's own -------------------------------------------------------------


class _OwnRegistry:
    """Metrics kept in a registry of their own (one per P/D or reuse flow), collected into
    the ingress's registry as one collector."""

    registry: CollectorRegistry

    def collect(self) -> Iterator[Metric]:
        yield from self.registry.collect()

    def text(self) -> str:
        return generate_latest(self.registry).decode()


class PDMetrics(_OwnRegistry):
    """Router-side P/D counters (router/routing/pd.py counts them)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.prompt_tokens = Counter(
            "fleetserve:pd_decode_prompt_tokens",
            "Prompt tokens on the decode side by source: "
            "loaded (through the KV connector), cached (decode's own prefix cache), recomputed",
            ["source"],
            registry=self.registry,
        )
        self.requests = Counter(
            "fleetserve:pd_requests",
            "Requests by P/D path: pd (prefill, then load on decode), "
            "decode_only (decode's cache covered the prompt or it was short), prefill_failed "
            "(the decode replica recomputed after failed prefill calls), prefill_only (an "
            "embedding: prompt work alone, answered by the prefill pool)",
            ["path"],
            registry=self.registry,
        )
        self.retries = Counter(
            "fleetserve:pd_retries",
            "Calls tried again: a prefill call, or a decode call after its KV load failed",
            ["stage"],
            registry=self.registry,
        )
        self.prefill_seconds = Histogram(
            "fleetserve:pd_prefill_seconds",
            "Prefill call, sent to its final item received",
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.handoff_seconds = Histogram(
            "fleetserve:pd_handoff_seconds",
            "Prefill's final item received to the decode "
            "replica's first item (KV load + one token + the router's work)",
            buckets=BUCKETS,
            registry=self.registry,
        )


class SloMetrics(_OwnRegistry):
    """SLO-aware admission (router/routing/slo.py), per class (a tenant with its own targets,
    else `default`):

    fleetserve:slo_requests_total{slo_class,outcome}   counter  met / missed (finished requests,
                                                                judged at the ingress) / refused
    fleetserve:slo_refusals_total{slo_class,reason}    counter  early refusals (429) by reason: ttft, itl
    fleetserve:slo_goodput{slo_class}                  gauge    requests/s that met their SLO, over
                                                                the last `window_s` seconds

    Goodput is also `rate(fleetserve:slo_requests_total{outcome="met"}[1m])`."""

    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = CollectorRegistry()
        self.window_s = window_s
        self._clock = clock
        self._met: dict[str, collections.deque] = {}
        self.requests = Counter(
            "fleetserve:slo_requests",
            "Requests with an SLO by outcome: met or missed (finished), refused (429 before any work)",
            ["slo_class", "outcome"],
            registry=self.registry,
        )
        self.refusals = Counter(
            "fleetserve:slo_refusals",
            "Requests refused early because no replica was predicted to meet their SLO, by the target missed",
            ["slo_class", "reason"],
            registry=self.registry,
        )
        self.registry.register(_GoodputCollector(self))

    def refused(self, slo_class: str, reason: str) -> None:
        self.requests.labels(slo_class, "refused").inc()
        self.refusals.labels(slo_class, reason).inc()

    def finished(self, slo_class: str, met: bool) -> None:
        self.requests.labels(slo_class, "met" if met else "missed").inc()
        times = self._met.setdefault(slo_class, collections.deque())
        if met:
            times.append(self._clock())
        self._trim(times)

    def _trim(self, times: collections.deque) -> None:
        cutoff = self._clock() - self.window_s
        while times and times[0] < cutoff:
            times.popleft()

    def goodput(self) -> dict[str, float]:
        out = {}
        for cls, times in self._met.items():
            self._trim(times)
            out[cls] = len(times) / self.window_s
        return out


class _GoodputCollector:
    def __init__(self, metrics: SloMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(
            "fleetserve:slo_goodput",
            f"Requests per second that met their SLO, over the last {self._metrics.window_s:g} s",
            labels=["slo_class"],
        )
        for cls, v in sorted(self._metrics.goodput().items()):
            g.add_metric([cls], v)
        yield g


class ReuseMetrics(_OwnRegistry):
    """Cluster-wide prefix reuse counters (router/routing/prefix_reuse.py counts them)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "fleetserve:prefix_reuse_requests",
            "Requests whose prefix another replica cached: "
            "exported (the chosen replica was handed the peer's KV), export_failed (it computed "
            "the prefix), load_failed (sent again without the KV)",
            ["outcome"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "fleetserve:prefix_reuse_prompt_tokens",
            "Prompt tokens of reuse requests by source: loaded from a peer, cached locally, recomputed",
            ["source"],
            registry=self.registry,
        )
        self.export_seconds = Histogram(
            "fleetserve:prefix_reuse_export_seconds",
            "The holder's export call, sent to done",
            buckets=BUCKETS,
            registry=self.registry,
        )


class MigrationCounts:
    """This process's request migrations (router/routing/migration.py counts them):
    continuations started, and failed streams that were not continued (with tokens sent)."""

    def __init__(self) -> None:
        self.migrated = 0
        self.not_migrated = 0

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "fleetserve:request_migrations_total",
            "Streams continued on another replica after theirs failed.",
            value=self.migrated,
        )
        yield CounterMetricFamily(
            "fleetserve:request_migration_failures_total",
            "Failed streams that could not be continued.",
            value=self.not_migrated,
        )


MIGRATIONS = MigrationCounts()

# (deployment name, its FleetRequestRouter) for each engine pool whose router exists.
RoutersOf = Callable[[], Sequence[tuple[str, Any]]]


class RoutingCollector:
    """The request routers' state at scrape time: requests in flight, the prefix index, how
    prefix policies routed, and the per-step feed (`feeds`: a FeedHub, or None). Nothing
    before the first router exists (the engine handles route their first call)."""

    def __init__(self, routers: RoutersOf, feeds: Optional[Any] = None) -> None:
        self._routers, self._feeds = routers, feeds

    def collect(self) -> Iterator[Metric]:
        routers = list(self._routers())
        if not routers:
            return
        ongoing = GaugeMetricFamily(
            "fleetserve:router_ongoing_requests", "Requests this ingress has in flight per replica.", labels=["replica"]
        )
        for _, router in routers:
            for rid, n in sorted(router.ongoing().items()):
                ongoing.add_metric([rid], n)
        yield ongoing
        yield from _index_families(
            [i for i in (getattr(r.policy, "kv_index", None) for _, r in routers) if i is not None]
        )
        yield from _prefix_routed([(dep, r.policy) for dep, r in routers if hasattr(r.policy, "num_prefix_routed")])
        if self._feeds is not None:
            yield from _feed_families(self._feeds)


def _index_families(indexes: list) -> Iterable[Metric]:
    if not indexes:
        return
    blocks = GaugeMetricFamily(
        "fleetserve:router_kv_index_blocks",
        "Block hashes the router's prefix index holds per replica (from the engines' KV events).",
        labels=["replica"],
    )
    for index in indexes:
        for rid in sorted(index.replicas()):
            blocks.add_metric([rid], len(index.hashes_of(rid)))
    yield blocks
    yield CounterMetricFamily(
        "fleetserve:router_kv_index_resyncs_total",
        "Snapshots the prefix index loaded (first contact, restarts, sequence gaps).",
        value=sum(i.num_resyncs for i in indexes),
    )


def _prefix_routed(counted: list[tuple[str, Any]]) -> Iterable[Metric]:
    if not counted:
        return
    family = CounterMetricFamily(
        "fleetserve:router_prefix_routed_requests_total",
        "Requests a prefix policy routed, by whether "
        "the replica it chose caches (or is computing) the prompt's first block (prefix_match) or not.",
        labels=["deployment", "prefix_match"],
    )
    for deployment, policy in counted:
        family.add_metric([deployment, "true"], policy.num_prefix_routed)
        family.add_metric([deployment, "false"], policy.num_routed - policy.num_prefix_routed)
    yield family


def _feed_families(feeds: Any) -> Iterable[Metric]:
    yield CounterMetricFamily(
        "fleetserve:router_feed_batches_total",
        "Per-step feed messages this ingress received from engine replicas (router/feed.py).",
        value=feeds.batches,
    )
    yield CounterMetricFamily(
        "fleetserve:router_feed_items_total", "Request deltas those messages carried.", value=feeds.items
    )
    yield GaugeMetricFamily(
        "fleetserve:router_feeds_open", "Engine replicas this ingress has a feed from.", value=len(feeds.open_feeds())
    )


class RouterMetrics:
    """One ingress's registry: the routing state, its P/D or reuse flow's counters
    (`flows`: their PDMetrics / ReuseMetrics), and this process's migrations."""

    def __init__(self, routers: RoutersOf, feeds: Optional[Any] = None, flows: Sequence[_OwnRegistry] = ()) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(RoutingCollector(routers, feeds))
        self.report_ages = ReportAges()
        self.registry.register(self.report_ages)
        for flow in flows:
            self.registry.register(flow)
        self.registry.register(MIGRATIONS)
        self._merged: tuple[Optional[Hashable], str] = (None, "")
        self._merging: Optional[tuple[Hashable, asyncio.Future]] = None

    def text(self) -> str:
        return generate_latest(self.registry).decode()

    def exposition(
        self,
        replica_texts: Mapping[str, str],
        ages: Optional[Mapping[str, float]] = None,
        version: Optional[Hashable] = None,
    ) -> str:
        """/metrics' body: the replicas' metrics (replica id -> text), then the router's, with
        `ages` (replica id -> seconds since its report) as fleetserve:replica_metrics_age_seconds.
        `version` (None: always merge) names the texts: the same version, the same merge."""
        if version is None or version != self._merged[0]:
            self._merged = (version, merge_metrics(replica_texts))
        self.report_ages.ages = dict(ages or {})
        return self._merged[1] + self.text()

    async def render(self, replica_texts: Mapping[str, str], ages: Mapping[str, float], version: Hashable) -> str:
        """`exposition`, with a new version's merge done once (scrapes at once share it) on a
        worker thread: parsing the replicas' texts never holds the event loop for long."""
        if version != self._merged[0]:
            if self._merging is None or self._merging[0] != version:
                texts = dict(replica_texts)
                self._merging = (version, asyncio.ensure_future(asyncio.to_thread(merge_metrics, texts)))
            merging = self._merging
            merged = await asyncio.shield(merging[1])
            if self._merging is merging:
                self._merged, self._merging = (version, merged), None
        return self.exposition(replica_texts, ages, version)


class ReportAges:
    """fleetserve:replica_metrics_age_seconds{replica}: the ages of the reports the last
    scrape read (none: no family)."""

    def __init__(self) -> None:
        self.ages: dict[str, float] = {}

    def collect(self) -> Iterator[Metric]:
        if not self.ages:
            return
        family = GaugeMetricFamily(
            "fleetserve:replica_metrics_age_seconds",
            "Seconds since the engine replica's last metrics report; its samples are left out "
            f"of /metrics once it is {STALE_INTERVALS} report intervals old.",
            labels=["replica"],
        )
        for rid, age in sorted(self.ages.items()):
            family.add_metric([rid], round(age, 3))
        yield family
