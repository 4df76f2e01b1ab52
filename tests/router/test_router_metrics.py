"""The router's own metrics (router/metrics.py): one registry, the names and label sets
dashboards and the e2e tests read, values from the request routers at scrape time."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from fleetserve.router.metrics import MIGRATIONS, PDMetrics, ReuseMetrics, RouterMetrics


class Index:
    num_resyncs = 3

    def replicas(self):
        return ["r2", "r1"]

    def hashes_of(self, rid):
        return {1, 2} if rid == "r1" else {5}


class Router:
    def __init__(self, ongoing: dict, policy) -> None:
        self._ongoing, self.policy = ongoing, policy

    def ongoing(self) -> dict:
        return dict(self._ongoing)


def families(text: str) -> dict:
    """name -> (type, {(sample name, sorted labels): value})"""
    return {
        f.name: (f.type, {(s.name, tuple(sorted(s.labels.items()))): s.value for s in f.samples})
        for f in text_string_to_metric_families(text)
    }


def test_every_router_family_keeps_its_name_type_and_labels(monkeypatch):
    monkeypatch.setattr(MIGRATIONS, "migrated", 2)
    monkeypatch.setattr(MIGRATIONS, "not_migrated", 1)
    prefix = SimpleNamespace(kv_index=Index(), num_prefix_routed=4, num_routed=7)
    routers = [("decode", Router({"d1": 2, "d0": 1}, prefix)), ("prefill", Router({"p0": 0}, SimpleNamespace()))]
    feeds = SimpleNamespace(batches=5, items=9, open_feeds=lambda: ["d0"])
    pd = PDMetrics()
    pd.requests.labels("pd").inc()
    got = families(RouterMetrics(lambda: routers, feeds, [pd]).text())

    assert got["fleetserve:router_ongoing_requests"] == (
        "gauge",
        {
            ("fleetserve:router_ongoing_requests", (("replica", "d0"),)): 1,
            ("fleetserve:router_ongoing_requests", (("replica", "d1"),)): 2,
            ("fleetserve:router_ongoing_requests", (("replica", "p0"),)): 0,
        },
    )
    assert got["fleetserve:router_kv_index_blocks"] == (
        "gauge",
        {
            ("fleetserve:router_kv_index_blocks", (("replica", "r1"),)): 2,
            ("fleetserve:router_kv_index_blocks", (("replica", "r2"),)): 1,
        },
    )
    assert got["fleetserve:router_kv_index_resyncs"] == (
        "counter",
        {("fleetserve:router_kv_index_resyncs_total", ()): 3},
    )
    assert got["fleetserve:router_prefix_routed_requests"] == (
        "counter",
        {
            ("fleetserve:router_prefix_routed_requests_total", (("deployment", "decode"), ("prefix_match", "true"))): 4,
            (
                "fleetserve:router_prefix_routed_requests_total",
                (("deployment", "decode"), ("prefix_match", "false")),
            ): 3,
        },
    )
    assert got["fleetserve:router_feed_batches"] == ("counter", {("fleetserve:router_feed_batches_total", ()): 5})
    assert got["fleetserve:router_feed_items"] == ("counter", {("fleetserve:router_feed_items_total", ()): 9})
    assert got["fleetserve:router_feeds_open"] == ("gauge", {("fleetserve:router_feeds_open", ()): 1})
    assert got["fleetserve:pd_requests"][1][("fleetserve:pd_requests_total", (("path", "pd"),))] == 1
    assert got["fleetserve:request_migrations"] == ("counter", {("fleetserve:request_migrations_total", ()): 2})
    assert got["fleetserve:request_migration_failures"] == (
        "counter",
        {("fleetserve:request_migration_failures_total", ()): 1},
    )


def test_routing_families_wait_for_a_router_and_flows_are_their_own():
    """Before an engine handle has routed its first call there is no router to read: only
    the counters that exist on their own are exported (no family with no samples)."""
    reuse = ReuseMetrics()
    reuse.requests.labels("exported").inc()
    names = set(families(RouterMetrics(lambda: [], None, [reuse]).text()))
    assert not any(n.startswith("fleetserve:router_") for n in names)
    assert {"fleetserve:prefix_reuse_requests", "fleetserve:request_migrations"} <= names
    # Each flow counts in its own registry: a second P/D router starts from zero.
    assert families(PDMetrics().text())["fleetserve:pd_requests"] == ("counter", {})


def test_exposition_puts_the_replicas_first_relabelled():
    replica = "# HELP x_total A counter.\n# TYPE x_total counter\nx_total 4.0\n"
    text = RouterMetrics(lambda: []).exposition({"r1": replica})
    assert text.startswith('# HELP x_total A counter.\n# TYPE x_total counter\nx_total{replica="r1"} 4.0\n')
    assert "fleetserve:request_migrations_total" in text
