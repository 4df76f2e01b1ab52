"""SLO-aware admission: route a request to a replica that can meet its TTFT/ITL SLO, or refuse
it early (429 with Retry-After) when none can, instead of queueing it to miss its SLO and
delay every request behind it (Mooncake's early rejection; issue 53).

A request's class is its tenant: each tenant may have its own targets (the `slo` key of its
entry in `--api-keys-file`), the others take the app's (`--slo-ttft-ms`, `--slo-itl-ms`).

What the router predicts, per candidate replica, from the replica's last load report
(`EngineCore.get_load`, about `stats_period_s` old) and what this router sent it since:

* the prefill work ahead of the request: `num_queued_tokens` (running requests' rest and
  waiting prompts) plus the prompt tokens routed there since that report, plus its own prompt;
* with a step-cost profile (`--slo-profile`, the JSON of `sim/profiles/*.json` or `fleetserve
  profile`, evaluated by `scheduler/step_cost.py`, the simulator's own formulas): a step with
  `num_running` decode rows (their mean context from the KV cache's use) and a prefill chunk
  of the rest of `max_num_batched_tokens`; TTFT = the full steps that work takes (work //
  chunk) times that step's seconds, plus a step computing what is left; ITL = the step's
  seconds with the request decoding in it (with a prefill chunk while a prefill backlog is
  left, as chunked prefill runs it);
* online, with or without a profile: the rate at which the replica drained its queued tokens
  between two reports while it was backlogged at both (requests waiting with every seat taken,
  or more than a step's work queued): its real capacity, seats and KV cache included, which a
  profile alone does not know; TTFT = work / that rate; and its mean
  step seconds between reports (the engine's step counters), which is the ITL estimate when
  there is no profile.

With both, the larger TTFT is taken (a profile gives the compute bound, the drain rate the
seat and KV bounds). A replica with no drain estimate of its own (no report yet, or never
backlogged) takes the mean of the replicas that have one (they run one engine config); a
replica with no report yet counts as idle. Without a profile and before any replica has been
backlogged, every replica is predicted to meet the SLO: an idle fleet admits everything.

The decision takes the policy's order of candidates and admits to the first whose prediction
meets every target the request has (times `headroom`); when none does, it refuses with the
reason of the closest one (`ttft` or `itl`) and a Retry-After of the time that replica's
prediction is over the TTFT target (1 s at least). The same object decides in the ingress
(router/routing/request_router.py, router/engine_pools.py) and in the simulator
(sim/cluster.py's SimRouter): pure Python, no Ray, its clock injected.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from fleetserve.scheduler.step_cost import StepCost, StepShape, step_cost_from_profile

SLO_PICK_KEY = "_fleetserve_slo_pick"  # a generate body's replica the SLO admission chose
EWMA_WEIGHT = 0.5  # of a new sample in the online estimates (reports are ~1 s apart)
MAX_RETRY_AFTER_S = 60


@dataclass(frozen=True)
class SloTarget:
    """A class's targets in seconds (None: no such target)."""

    ttft_s: Optional[float] = None
    itl_s: Optional[float] = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "itl_s"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"SLO {name} must be a positive number of seconds, got {v!r}")

    @property
    def active(self) -> bool:
        return self.ttft_s is not None or self.itl_s is not None

    def to_dict(self) -> dict[str, Optional[float]]:
        return {"ttft_s": self.ttft_s, "itl_s": self.itl_s}


@dataclass(frozen=True)
class SloSettings:
    """The admission's configuration (cluster/config.py's `SloOptions` builds it; the request
    router gets it as a dict through Serve's `request_router_kwargs`: `to_dict`/`from_dict`)."""

    default: SloTarget = SloTarget()
    tenants: Mapping[str, SloTarget] = field(default_factory=dict)  # a tenant's own targets
    profile: Optional[dict[str, Any]] = None  # a step-cost profile's JSON (None: online only)
    max_num_batched_tokens: int = 2048  # the engines' step token budget
    max_num_seqs: int = 256
    block_size: int = 16
    # Admit when the prediction is at most this times the target: a queue held right at the
    # target misses half the time (measured in the simulator at 2x overload: 1.0 met 57% of the
    # admitted, 0.6 met 94% and served 1.2x the goodput of 0.8).
    headroom: float = 0.6

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.block_size < 1:
            raise ValueError("max_num_batched_tokens, max_num_seqs and block_size must be positive")
        if not (math.isfinite(self.headroom) and self.headroom > 0):
            raise ValueError(f"SLO headroom must be positive, got {self.headroom!r}")
        if self.profile is not None:
            step_cost_from_profile(self.profile, "slo profile")  # raises naming the field

    @property
    def enabled(self) -> bool:
        return self.default.active or any(t.active for t in self.tenants.values())

    def target_for(self, tenant: Optional[str]) -> SloTarget:
        if tenant is not None and tenant in self.tenants:
            return self.tenants[tenant]
        return self.default

    def to_dict(self) -> dict[str, Any]:
        return {
            "default": self.default.to_dict(),
            "tenants": {k: v.to_dict() for k, v in self.tenants.items()},
            "profile": self.profile,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
            "block_size": self.block_size,
            "headroom": self.headroom,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SloSettings":
        d = dict(d)
        d["default"] = SloTarget(**(d.get("default") or {}))
        d["tenants"] = {k: SloTarget(**v) for k, v in (d.get("tenants") or {}).items()}
        return cls(**d)


@dataclass(frozen=True, slots=True)
class Prediction:
    ttft_s: Optional[float]  # None: no estimate
    itl_s: Optional[float]


@dataclass(frozen=True, slots=True)
class SloDecision:
    """`replica_id`: where to send the request (None: refused). A refusal's `reason` is
    `ttft` or `itl`; `retry_after_s` what the 429 tells the client."""

    replica_id: Optional[str]
    slo_class: str = "default"
    reason: Optional[str] = None
    message: str = ""
    retry_after_s: int = 0
    prediction: Optional[Prediction] = None

    @property
    def refused(self) -> bool:
        return self.reason is not None


class _Replica:
    __slots__ = ("stats", "at", "routed", "drain_tps", "step_s")

    def __init__(self) -> None:
        self.stats: Optional[Mapping[str, Any]] = None  # the last report
        self.at = 0.0  # when it came (the predictor's clock)
        self.routed = 0  # prompt tokens routed here since that report
        self.drain_tps: Optional[float] = None  # queued tokens drained per second, while backlogged
        self.step_s: Optional[float] = None  # mean step seconds


def _ewma(old: Optional[float], sample: float) -> float:
    return sample if old is None else (1.0 - EWMA_WEIGHT) * old + EWMA_WEIGHT * sample


class TtftPredictor:
    """Per-replica TTFT and ITL predictions (the module docstring has the model)."""

    def __init__(self, settings: SloSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self.cost: Optional[StepCost] = (
            step_cost_from_profile(settings.profile, "slo profile") if settings.profile is not None else None
        )
        self._replicas: dict[str, _Replica] = {}
        # The mean drain rate of the replicas that have one: what a replica not measured yet is
        # taken to do (they run one engine config). Without it, a replica with no estimate is
        # predicted to meet every target and the SLO pick sends it everything.
        self._fleet_drain: Optional[float] = None

    def _state(self, replica_id: str) -> _Replica:
        st = self._replicas.get(replica_id)
        if st is None:
            st = self._replicas[replica_id] = _Replica()
        return st

    def report(self, replica_id: str, stats: Mapping[str, Any], now: Optional[float] = None) -> None:
        """A new load report from `replica_id` (`EngineCore.get_load`'s fields)."""
        now = self.clock() if now is None else now
        st = self._state(replica_id)
        prev = st.stats
        if prev is not None:
            dt = now - st.at
            q_prev = int(prev.get("num_queued_tokens", 0))
            # Backlogged at both ends (requests waiting while every seat is taken, or more than a
            # step's work queued): what the replica drained is its capacity, not the arrivals'.
            q_now = int(stats.get("num_queued_tokens", 0))
            if dt > 0 and self._backlogged(prev) and self._backlogged(stats):
                drained = q_prev + st.routed - q_now
                st.drain_tps = _ewma(st.drain_tps, max(drained, 0) / dt)
                rates = [r.drain_tps for r in self._replicas.values() if r.drain_tps is not None]
                self._fleet_drain = sum(rates) / len(rates)
            steps = int(stats.get("num_steps", 0)) - int(prev.get("num_steps", 0))
            if steps > 0:
                busy = float(stats.get("busy_s", 0.0)) - float(prev.get("busy_s", 0.0))
                if busy > 0:
                    st.step_s = _ewma(st.step_s, busy / steps)
        st.stats = stats
        st.at = now
        st.routed = 0

    def _backlogged(self, stats: Mapping[str, Any]) -> bool:
        if int(stats.get("num_waiting", 0)) <= 0:
            return False
        s = self.settings
        return (
            int(stats.get("num_running", 0)) >= s.max_num_seqs
            or int(stats.get("num_queued_tokens", 0)) >= s.max_num_batched_tokens
        )

    def routed(self, replica_id: str, prompt_tokens: int) -> None:
        self._state(replica_id).routed += prompt_tokens

    def forget(self, keep: set[str]) -> None:
        for rid in [r for r in self._replicas if r not in keep]:
            del self._replicas[rid]

    def predict(self, replica_id: str, prompt_tokens: int) -> Prediction:
        st = self._replicas.get(replica_id)
        if st is None or st.stats is None:
            if self.cost is None and self._fleet_drain is None:
                return Prediction(None, None)
            st = _Replica()  # no report yet: an idle replica, as the profile prices it
            st.stats, st.at = {}, self.clock()
        s = self.settings
        stats = st.stats
        assert stats is not None
        ttft: Optional[float] = None
        itl: Optional[float] = st.step_s
        drain = st.drain_tps if st.drain_tps is not None else self._fleet_drain
        rate: Optional[float] = drain  # queued tokens computed per second
        chunk = step = 0.0
        decodes = ctx = 0
        if self.cost is not None:
            decodes = min(int(stats.get("num_running", 0)), s.max_num_seqs)
            used = float(stats.get("kv_cache_usage", 0.0)) * int(stats.get("num_blocks", 0)) * s.block_size
            ctx = int(used / decodes) if decodes else 0
            chunk = float(max(s.max_num_batched_tokens - decodes, 1))
            step = self.cost.step_seconds(StepShape(int(chunk), 1, chunk * chunk / 2, decodes, decodes, decodes * ctx))
            rate = chunk / step if rate is None else min(rate, chunk / step)
        if rate is None:  # no profile, never backlogged: no TTFT estimate
            return Prediction(None, itl)
        # The report's queue and what was routed since, less what the replica has computed
        # since the report (at `rate`): the requests routed a second ago are mostly done.
        elapsed = max(self.clock() - st.at, 0.0)
        queued = max(int(stats.get("num_queued_tokens", 0)) + st.routed - rate * elapsed, 0.0)
        work = queued + prompt_tokens
        if self.cost is not None:
            # Full chunks, then the step that computes the rest with the request's last token.
            full = int(work // chunk)
            rest = work - full * chunk
            ttft = full * step
            if rest > 0:
                ttft += self.cost.step_seconds(
                    StepShape(int(math.ceil(rest)), 1, rest * rest / 2, decodes, decodes, decodes * ctx)
                )
            rows = min(decodes + 1, s.max_num_seqs)
            backlog = max(queued - decodes, 0.0)  # prefill tokens still queued besides the decodes
            p_tok = int(min(backlog, max(s.max_num_batched_tokens - rows, 0)))
            itl = self.cost.step_seconds(
                StepShape(p_tok, 1 if p_tok else 0, p_tok * p_tok / 2, rows, rows, (rows - 1) * ctx + prompt_tokens)
            )
        if drain is not None:
            online = work / drain if drain > 0 else math.inf
            ttft = online if ttft is None else max(ttft, online)
        return Prediction(ttft, itl)


class SloAdmission:
    """The decision (module docstring), with its own counts of what it decided. Thread-safe:
    the ingress's event loop and Serve's routing loop both call it."""

    def __init__(self, settings: SloSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.predictor = TtftPredictor(settings, clock)
        self._lock = threading.Lock()
        self.admitted: dict[str, int] = {}  # class -> requests admitted with a target
        self.refused: dict[tuple[str, str], int] = {}  # (class, reason) -> refusals

    def slo_class(self, tenant: Optional[str]) -> str:
        return tenant if tenant is not None and tenant in self.settings.tenants else "default"

    def report(self, replica_id: str, stats: Mapping[str, Any], now: Optional[float] = None) -> None:
        with self._lock:
            self.predictor.report(replica_id, stats, now)

    def routed(self, replica_id: str, prompt_tokens: int) -> None:
        with self._lock:
            self.predictor.routed(replica_id, prompt_tokens)

    def forget(self, keep: set[str]) -> None:
        with self._lock:
            self.predictor.forget(keep)

    def choose(self, candidates: Sequence[str], prompt_tokens: int, tenant: Optional[str] = None) -> SloDecision:
        """The first of `candidates` (the policy's order) predicted to meet the request's
        targets, or a refusal when none is (an empty list: no decision, replica None)."""
        target = self.settings.target_for(tenant)
        cls = self.slo_class(tenant)
        if not candidates:
            return SloDecision(None, cls)
        if not target.active:
            return SloDecision(candidates[0], cls)
        headroom = self.settings.headroom
        ttft_max = target.ttft_s * headroom if target.ttft_s is not None else None
        itl_max = target.itl_s * headroom if target.itl_s is not None else None
        best: Optional[tuple[float, str, Prediction]] = None  # (how far over, reason, prediction)
        with self._lock:
            for rid in candidates:
                p = self.predictor.predict(rid, prompt_tokens)
                over_ttft = p.ttft_s / ttft_max if ttft_max is not None and p.ttft_s is not None else 0.0
                over_itl = p.itl_s / itl_max if itl_max is not None and p.itl_s is not None else 0.0
                if over_ttft <= 1.0 and over_itl <= 1.0:
                    self.admitted[cls] = self.admitted.get(cls, 0) + 1
                    return SloDecision(rid, cls, prediction=p)
                over = max(over_ttft, over_itl)
                if best is None or over < best[0]:
                    best = (over, "ttft" if over_ttft >= over_itl else "itl", p)
            assert best is not None
            _, reason, p = best
            self.refused[(cls, reason)] = self.refused.get((cls, reason), 0) + 1
        if reason == "ttft" and p.ttft_s is not None and target.ttft_s is not None:
            wait = p.ttft_s - target.ttft_s
            message = (
                f"no replica can meet the time-to-first-token SLO of {target.ttft_s * 1e3:g} ms now "
                f"(predicted at best {p.ttft_s * 1e3:.0f} ms); retry later"
            )
        else:
            wait = 1.0
            itl = (p.itl_s or 0.0) * 1e3
            message = (
                f"no replica can meet the inter-token latency SLO of {(target.itl_s or 0) * 1e3:g} ms now "
                f"(predicted at best {itl:.0f} ms); retry later"
            )
        retry = min(MAX_RETRY_AFTER_S, max(1, math.ceil(wait))) if math.isfinite(wait) else MAX_RETRY_AFTER_S
        return SloDecision(None, cls, reason, message, retry, p)
