"""The engine replicas' metrics, pushed: what /metrics answers from without asking a replica.

Each engine replica reports its Prometheus text (`AsyncEngine.metrics_text()`) every
`reliability.metrics_report_interval_s` (`--reliability-metrics-report-interval-s`, 1 s by
default) to its app's **metrics hub**: one small named Ray actor per app (`MetricsHub`,
`fleetserve-metrics-hub:<app>` in the Ray namespace `fleetserve`), which holds only the
latest report of each replica and when it came. A report whose text has not changed since
the last one carries none (the hub keeps the text and renews its time).

    engine replica --(MetricsReporter: a task on its event loop, every interval)--> MetricsHub
    GET /metrics --(ReplicaReports: at most one hub read per half interval, shared)--> MetricsHub

What this guarantees:

- A scrape costs the replicas nothing: it never calls one, and it is never queued behind
  their requests (the reports do not go through Serve's request path on either side), so
  /metrics answers while every replica is saturated or its engine is blocked, with the
  latest reports. Scrapes at once share one hub read, and a read younger than half the
  shortest report interval is reused; the hub sends only texts that changed since this
  ingress's last read, and the merge (router/metrics.py) is redone only when one did.
- Every report's age is exported: `fleetserve:replica_metrics_age_seconds{replica}` (time
  since the hub last heard from that replica). A report older than `STALE_INTERVALS` of its
  replica's intervals is stale: its samples are left out of /metrics, its age stays. A
  replica the ingress's request router no longer lists (Serve replaced or removed it) is
  left out altogether, and the hub forgets a report `FORGET_S` after it came.
- A hub that is gone (killed, its node lost) is made again by the next report (the name is
  taken with `get_if_exists`); until then /metrics answers with the reports it last read,
  aging. The hub is detached: it outlives a redeploy of its app, whose replicas report to
  it again (the old replicas' reports age out).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

logger = logging.getLogger("ray.serve")

HUB_NAMESPACE = "fleetserve"
DEFAULT_INTERVAL_S = 1.0
STALE_INTERVALS = 5  # a report this many of its intervals old is stale: left out
FORGET_S = 300.0  # the hub drops a report this long after it came
HUB_CALL_TIMEOUT_S = 2.0  # a report or read the hub has not answered by then is given up
HUB_MAX_CONCURRENCY = 1000


def hub_name(app: str) -> str:
    return f"fleetserve-metrics-hub:{app}"


# -- the hub ----------------------------------------------------------------------


@dataclass
class Report:
    deployment: str
    interval_s: float
    text: str
    seq: str  # renewed only when the text changes; never the same in another hub
    at: float  # time.monotonic() in the hub when it last heard from the replica


class MetricsHub:
    """The latest report of each engine replica of one app (a Ray actor: `get_hub`); all of
    its methods are cheap and never wait, so a flood of callers costs it little."""

    def __init__(self) -> None:
        self._reports: dict[str, Report] = {}
        self._id, self._seq = uuid.uuid4().hex[:12], 0  # a new hub's seqs never match an old one's
        self.num_reads = self.num_reports = 0  # answered (tests check that scrapes cost no reports)

    async def report(self, replica: str, deployment: str, interval_s: float, text: Optional[str]) -> bool:
        """`text` None: unchanged since this replica's last report (only its time renews).
        False: the hub holds no text of that replica (a new hub): send the whole text."""
        now = time.monotonic()
        self.num_reports += 1
        held = self._reports.get(replica)
        if text is None:
            if held is None:
                return False
            held.at, held.interval_s = now, interval_s
            return True
        self._seq += 1
        self._reports[replica] = Report(deployment, interval_s, text, f"{self._id}-{self._seq}", now)
        self._forget(now)
        return True

    async def reports(self, known: Optional[dict[str, str]] = None) -> dict[str, dict]:
        """replica -> {deployment, interval_s, seq, age_s, text}; `text` left out where the
        caller already holds that `seq` (`known`: replica -> seq)."""
        now = time.monotonic()
        self._forget(now)
        self.num_reads += 1
        known = known or {}
        out = {}
        for rid, r in self._reports.items():
            entry: dict[str, Any] = {
                "deployment": r.deployment,
                "interval_s": r.interval_s,
                "seq": r.seq,
                "age_s": now - r.at,
            }
            if known.get(rid) != r.seq:
                entry["text"] = r.text
            out[rid] = entry
        return out

    async def stats(self) -> dict:
        return {"num_reads": self.num_reads, "num_reports": self.num_reports, "replicas": sorted(self._reports)}

    def _forget(self, now: float) -> None:
        for rid in [rid for rid, r in self._reports.items() if now - r.at > FORGET_S]:
            del self._reports[rid]


def get_hub(app: str) -> Any:
    """The app's hub (an actor handle), made if there is none yet. Only with Ray running
    (never starts one)."""
    import ray

    if not ray.is_initialized():
        raise RuntimeError("no Ray here: no metrics hub")
    return (
        ray.remote(MetricsHub)
        .options(
            name=hub_name(app),
            namespace=HUB_NAMESPACE,
            get_if_exists=True,
            lifetime="detached",
            num_cpus=0,
            max_concurrency=HUB_MAX_CONCURRENCY,
        )
        .remote()
    )


# -- a replica's side -------------------------------------------------------------


class MetricsReporter:
    """Reports `text()` to the app's hub every `interval_s`, from a task on the event loop
    that calls `start` (the replica's: `text()` runs where the engine's own calls do)."""

    def __init__(
        self,
        app: str,
        deployment: str,
        replica_id: str,
        text: Callable[[], str],
        interval_s: float = DEFAULT_INTERVAL_S,
        hub: Callable[[str], Any] = get_hub,
    ) -> None:
        self.app, self.deployment, self.replica_id = app, deployment, replica_id
        self.interval_s = interval_s
        self._text, self._get_hub = text, hub
        self._hub: Any = None
        self._last: Optional[str] = None  # the text the hub holds
        self._task: Optional[asyncio.Task] = None
        self._failing = False  # the last report failed (logged once per run of failures)
        self.num_reports = 0  # reports the hub took

    def start(self) -> bool:
        """Start reporting (idempotent); False when there is no running loop here yet."""
        if self._task is not None and not self._task.done():
            return True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        self._task = loop.create_task(self._run(), name=f"metrics-reporter-{self.replica_id}")
        return True

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await self.report_once()
            await asyncio.sleep(self.interval_s)

    async def report_once(self) -> bool:
        """One report; False (logged, retried next interval with a fresh hub) if it failed."""
        try:
            text = self._text()
            if self._hub is None:
                self._hub = self._get_hub(self.app)
                self._last = None  # maybe a new hub: send the whole text
            if not await self._send(None if text == self._last else text):
                await self._send(text)  # the hub lacked this replica's text
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the hub is gone or slow: a new one next time
            if not self._failing:
                logger.warning("metrics report to the hub failed (retrying every %g s): %r", self.interval_s, e)
            self._hub, self._last, self._failing = None, None, True
            return False
        self._last, self._failing = text, False
        self.num_reports += 1
        return True

    async def _send(self, text: Optional[str]) -> bool:
        call = self._hub.report.remote(self.replica_id, self.deployment, self.interval_s, text)
        return bool(await asyncio.wait_for(call, HUB_CALL_TIMEOUT_S))


# -- the ingress's side -----------------------------------------------------------


@dataclass
class Snapshot:
    texts: dict[str, str]  # replica -> its latest report's text, of the reports exported
    ages: dict[str, float]  # replica -> seconds since its last report, of every report kept
    version: tuple  # (replica, seq) of the texts: equal versions, equal texts


class ReplicaReports:
    """The reports /metrics answers from. `app` None (outside Serve): there are none.
    `live()`: deployment -> the replica ids its request router lists, for the deployments
    whose router exists (a replica another deployment's router does not list is kept)."""

    def __init__(
        self,
        app: Optional[str],
        live: Callable[[], dict[str, set[str]]] = dict,
        hub: Callable[[str], Any] = get_hub,
    ) -> None:
        self.app = app
        self._live, self._get_hub = live, hub
        self._hub: Any = None
        self._held: dict[str, dict] = {}  # replica -> the hub's entry, with its text
        self._read_at = 0.0  # time.monotonic() of the last answer read
        self._next_read = -float("inf")  # no hub read before then (one per half interval)
        self._reading: Optional[asyncio.Future] = None
        self._last_warning = -float("inf")

    async def current(self) -> "Snapshot":
        """The reports to export and the ages of all kept, reading the hub first when the
        last read is older than half the shortest report interval (else that read's)."""
        if self.app is not None and (self._reading is not None or time.monotonic() >= self._next_read):
            if self._reading is None:
                self._next_read = time.monotonic() + self._min_read_interval()
                self._reading = asyncio.ensure_future(self._read(self.app))
            await asyncio.shield(self._reading)  # a scrape that goes away leaves the read to the others
        now = time.monotonic()
        live = self._live()
        snap = Snapshot({}, {}, ())
        for rid, entry in sorted(self._held.items()):
            listed = live.get(entry["deployment"])
            if listed is not None and rid not in listed:
                continue  # Serve replaced or removed it
            age = entry["age_s"] + (now - self._read_at)
            snap.ages[rid] = age
            if age <= STALE_INTERVALS * entry["interval_s"]:
                snap.texts[rid] = entry["text"]
                snap.version += ((rid, entry["seq"]),)
        return snap

    def _min_read_interval(self) -> float:
        intervals = [e["interval_s"] for e in self._held.values()]
        return min(intervals, default=DEFAULT_INTERVAL_S) / 2

    async def _read(self, app: str) -> None:
        try:
            if self._hub is None:
                self._hub = self._get_hub(app)
            known = {rid: e["seq"] for rid, e in self._held.items()}
            got = await asyncio.wait_for(self._hub.reports.remote(known), HUB_CALL_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - answer with what was read last (aging)
            self._hub = None
            if time.monotonic() - self._last_warning > 60:
                self._last_warning = time.monotonic()
                logger.warning("/metrics: the metrics hub did not answer; serving the last reports: %r", e)
            return
        finally:
            self._reading = None
        held = {}
        for rid, entry in got.items():
            if "text" not in entry:
                entry["text"] = self._held[rid]["text"]
            held[rid] = entry
        self._held, self._read_at = held, time.monotonic()
