"""/metrics answers from the replicas' pushed reports (router/metrics_hub.py): a scrape calls
no replica, a burst of scrapes shares one hub read, a blocked replica's last report is still
answered (then left out once stale, its age still exported), and the keyed /metrics.

A real local Ray for the hub actor, a real EngineReplica (tiny model) reporting to it, and the
real Ingress class (outside Serve) answering /metrics."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetserve.router.auth import ApiKeyAuth
from fleetserve.router.ingress import Ingress
from fleetserve.router.metrics_hub import STALE_INTERVALS, MetricsHub, ReplicaReports, get_hub, hub_name
from fleetserve.router.replica import EngineReplica
from fleetserve.router.settings import IngressSettings

INTERVAL_S = 0.2
AGE = "fleetserve:replica_metrics_age_seconds"


def run(coro, timeout_s: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


# -- the hub on its own -------------------------------------------------------------


def test_hub_keeps_the_latest_report_of_each_replica_and_sends_only_new_texts(monkeypatch):
    from fleetserve.router import metrics_hub

    async def go():
        hub = MetricsHub()
        assert await hub.report("r1", "engine", 1.0, None) is False  # no text held: send it whole
        assert await hub.report("r1", "engine", 1.0, "a 1\n")
        assert await hub.report("r1", "engine", 1.0, "a 2\n")
        assert await hub.report("p1", "prefill", 2.0, "b 1\n")
        got = await hub.reports()
        assert {rid: (e["deployment"], e["text"], e["interval_s"]) for rid, e in got.items()} == {
            "r1": ("engine", "a 2\n", 1.0),
            "p1": ("prefill", "b 1\n", 2.0),
        }
        seq = got["r1"]["seq"]
        await asyncio.sleep(0.05)
        assert await hub.report("r1", "engine", 1.0, None)  # unchanged: only its time renews
        again = await hub.reports({"r1": seq, "p1": -1})
        assert "text" not in again["r1"] and again["r1"]["seq"] == seq
        assert again["r1"]["age_s"] < 0.05 <= again["p1"]["age_s"]
        assert again["p1"]["text"] == "b 1\n"
        monkeypatch.setattr(metrics_hub, "FORGET_S", 0.05)
        await asyncio.sleep(0.06)
        assert await hub.reports() == {}  # forgotten: a replica gone for good
        assert (await hub.stats())["num_reads"] == 3

    run(go())


# -- with Ray ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_ray():
    import os

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = not ray.is_initialized()
    if started:
        ray.init(
            address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1"
        )
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def replica(tiny_model_dir):
    r = EngineReplica(
        {"model": str(tiny_model_dir), "max_model_len": 128, "num_threads": 1, "num_gpu_blocks_override": 32},
        "fleetserve.replica.engine.async_engine:AsyncEngine",
    )
    yield r
    r.engine.shutdown()


class CountingHandle:
    """The engine deployment's handle, counting every call made through it (there must be
    none: /metrics calls no replica)."""

    app_name = "unused"
    deployment_name = "engine"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def options(self, **kwargs) -> "CountingHandle":
        return self

    def __getattr__(self, method: str):
        handle = self

        class Method:
            def remote(self, *args, **kwargs):
                handle.calls.append(method)
                raise RuntimeError("no replica here")

            def options(self, **kwargs):
                return self

        return Method()


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def replica_samples(text: str, rid: str) -> list:
    """The samples of `rid`'s own report (its age is the router's)."""
    fams = text_string_to_metric_families(text)
    return [s for f in fams if f.name != AGE for s in f.samples if s.labels.get("replica") == rid]


def ages(text: str) -> dict[str, float]:
    fam = families(text).get(AGE)
    return {s.labels["replica"]: s.value for s in fam.samples} if fam else {}


async def wait_for(check, timeout_s: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def make_ingress(app: str) -> tuple[Ingress, CountingHandle]:
    engine = CountingHandle()
    ingress = Ingress(engine, IngressSettings(served_model_name="m"))
    ingress.pools.reports = ReplicaReports(app, ingress.pools.live_replicas)  # outside Serve: named here
    return ingress, engine


def test_a_burst_of_scrapes_calls_no_replica_and_shares_one_hub_read(local_ray, replica):
    app = f"burst-{uuid.uuid4().hex[:6]}"

    ingress, engine = make_ingress(app)  # outside a loop: no warm-up call to the engines

    async def go():
        replica.report_metrics(app, "engine", INTERVAL_S)
        reporter = replica.metrics_reporter
        hub = get_hub(app)
        try:
            await wait_for(lambda: _reported(hub, replica.replica_id), what="the first report")
            before_reads = (await hub.stats.remote())["num_reads"]
            before_reports, t0 = reporter.num_reports, time.monotonic()
            answers = await asyncio.gather(*(ingress.metrics() for _ in range(64)))
            elapsed = time.monotonic() - t0
            assert engine.calls == []  # not one call to a replica
            assert (await hub.stats.remote())["num_reads"] - before_reads == 1  # 64 scrapes, one read
            # The replica did its reports, no more: one per interval, whatever the scrapes.
            assert reporter.num_reports - before_reports <= elapsed / INTERVAL_S + 1
            for a in answers:
                assert a.status_code == 200
                text = a.body.decode()
                fams = families(text)
                running = [s for s in fams["vllm:num_requests_running"].samples]
                assert [s.labels["replica"] for s in running] == [replica.replica_id]
                assert 0 <= ages(text)[replica.replica_id] < STALE_INTERVALS * INTERVAL_S
                assert "fleetserve:request_migrations_total" in text  # the router's own part
        finally:
            await reporter.stop()

    run(go())


async def _reported(hub, rid: str) -> bool:
    return rid in (await hub.stats.remote())["replicas"]


class LoopThread:
    """An event loop of its own on a thread: the replica's, which a test can block."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def block(self, seconds: float) -> None:
        self.loop.call_soon_threadsafe(time.sleep, seconds)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def test_a_blocked_replica_s_last_report_is_answered_then_marked_stale(local_ray, replica):
    """The replica's event loop is blocked (it answers nothing, reports nothing): /metrics
    still answers at once with its last report; once that is STALE_INTERVALS old its samples
    are left out and its age stays exported; when the replica runs again, so do its reports."""
    app = f"blocked-{uuid.uuid4().hex[:6]}"
    side = LoopThread()

    async def start() -> None:
        replica.report_metrics(app, "engine", INTERVAL_S)

    async def stop() -> None:
        await replica.metrics_reporter.stop()

    ingress, engine = make_ingress(app)

    async def go():
        rid = replica.replica_id

        async def scrape() -> tuple[str, float]:
            t = time.monotonic()
            r = await ingress.metrics()
            assert r.status_code == 200
            return r.body.decode(), time.monotonic() - t

        async def has_samples() -> bool:
            return bool(replica_samples((await scrape())[0], rid))

        await wait_for(has_samples, what="the first report")
        side.block(STALE_INTERVALS * INTERVAL_S + 2.0)  # the replica's loop: stuck
        await asyncio.sleep(0.3)
        text, took = await scrape()
        assert took < 1.0, took  # answered at once, from the last report (a blocked call: 10 s, then 503)
        assert replica_samples(text, rid) and ages(text)[rid] >= 0.2
        await asyncio.sleep(STALE_INTERVALS * INTERVAL_S)
        text, took = await scrape()
        assert took < 1.0, took
        assert replica_samples(text, rid) == []  # stale: left out
        assert ages(text)[rid] > STALE_INTERVALS * INTERVAL_S  # and marked by its age
        assert "fleetserve:request_migrations_total" in text
        await wait_for(has_samples, what="reports after the block")  # it runs again: back
        assert engine.calls == []

    try:
        side.call(start())
        run(go())
    finally:
        side.call(stop())
        side.close()


def test_a_replica_its_router_no_longer_lists_is_left_out_and_a_lost_hub_is_made_again(local_ray):
    """Reports of a replica Serve replaced are dropped at once (its deployment's router no
    longer lists it); a replica of a deployment with no router here yet is kept. The hub
    killed: /metrics answers with the last reports, and the next report makes a new hub."""
    import ray

    app = f"live-{uuid.uuid4().hex[:6]}"
    live = {"engine": {"r1"}}

    async def go():
        hub = get_hub(app)
        for rid, dep in (("r1", "engine"), ("r2", "engine"), ("p1", "prefill")):
            await hub.report.remote(rid, dep, INTERVAL_S, f'x{{k="{rid}"}} 1.0\n')
        reports = ReplicaReports(app, lambda: live)
        snap = await reports.current()
        assert set(snap.texts) == set(snap.ages) == {"r1", "p1"}
        seqs = {rid: e["seq"] for rid, e in (await hub.reports.remote()).items()}
        assert snap.version == (("p1", seqs["p1"]), ("r1", seqs["r1"]))  # (replica, seq), by replica
        ray.kill(hub)
        await asyncio.sleep(INTERVAL_S)  # past the half interval: the next scrape reads
        snap = await reports.current()  # the read fails: the last reports, aging
        assert set(snap.texts) == {"r1", "p1"} and min(snap.ages.values()) >= INTERVAL_S
        from fleetserve.router.metrics_hub import MetricsReporter

        reporter = MetricsReporter(app, "engine", "r1", lambda: 'x{k="r1"} 2.0\n', INTERVAL_S)
        await wait_for(reporter.report_once, what="a report to a new hub")

        async def new_hub_read() -> bool:
            snap = await reports.current()  # (the new hub's seqs are its own: never taken for old ones)
            return snap.texts == {"r1": 'x{k="r1"} 2.0\n'} and snap.ages["r1"] < INTERVAL_S * 2

        await wait_for(new_hub_read, what="the new hub's reports (r1's only)")

    run(go())
    assert ray.get_actor(hub_name(app), namespace="fleetserve") is not None


def test_metrics_is_open_by_default_and_keyed_when_api_key_open_paths_leave_it_out():
    """`api_key_open_paths` (router/auth.py): /metrics needs no key by default; an operator
    who lists only /health makes /metrics take the API key (401 without it)."""
    from fleetserve.router import auth

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def get(path: str, headers: dict) -> int:
        scope = {
            "type": "http",
            "method": "GET",
            "path": path,
            "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        }
        sent = []

        async def receive():
            return {"type": "http.request", "body": b""}

        async def send(message):
            sent.append(message)

        await auth.RequireApiKey(app)(scope, receive, send)
        return sent[0]["status"]

    before = auth._installed
    try:
        auth.install(ApiKeyAuth("k"))
        assert run(get("/metrics", {})) == 200
        auth.install(ApiKeyAuth("k", ("/health",)))
        assert run(get("/metrics", {})) == 401
        assert run(get("/metrics", {"Authorization": "Bearer k"})) == 200
        assert run(get("/health", {})) == 200
    finally:
        auth.install(before)
