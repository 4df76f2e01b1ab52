"""What a simulation reports: per-request records and the summary written as JSON.

Latencies are measured as a client would see them from the router: TTFT from the trace
arrival to the first token, ITL between consecutive token deliveries of one request (one
gap per delivery; a delivery of several tokens, as with speculative decoding, is one gap),
E2E from arrival to the last token. Goodput (DistServe) counts the completed requests per
second that meet both SLOs, a request's ITL being judged by its TPOT: the mean gap between
its tokens after the first, `(last - first) / (tokens - 1)`.

ITL percentiles come from counts of each distinct gap (`GapHistogram`), so a run of 100k
requests with hundreds of tokens each does not keep every gap; they are exact unless a run
has more than a million distinct gaps (then 0.5% bins). TTFT and E2E are exact.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence


class Record:
    """One request's life in the simulation."""

    __slots__ = (
        "index",
        "request_id",
        "trace_id",
        "arrival_s",
        "prompt_tokens",
        "output_tokens",
        "tenant",
        "priority",
        "replica",
        "first_token_s",
        "last_token_s",
        "finish_s",
        "num_output",
        "num_cached_tokens",
        "num_preemptions",
        "finish_reason",
        "refused",
        "path",
        "prefill_replica",
        "num_remote_tokens",
        "session",
        "max_tokens",
        "predicted_output_tokens",
    )

    def __init__(
        self,
        index: int,
        trace_id: Optional[str],
        arrival_s: float,
        output_tokens: int,
        tenant: Optional[str],
        priority: int = 0,
    ) -> None:
        self.index = index
        self.request_id = f"r{index}"
        self.trace_id = trace_id
        self.arrival_s = arrival_s
        self.prompt_tokens = 0
        self.output_tokens = output_tokens
        self.tenant = tenant
        self.priority = priority
        self.replica: Optional[str] = None
        self.first_token_s = -1.0
        self.last_token_s = -1.0
        self.finish_s = -1.0
        self.num_output = 0
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.finish_reason: Optional[str] = None
        self.refused: Optional[str] = None  # why the request was refused (None: it was served)
        # P/D only: "pd", "decode_only" or "prefill_failed" (as PDRouter counts them), the
        # prefill replica, and the prompt tokens the decode replica loaded through the connector.
        self.path: Optional[str] = None
        self.prefill_replica: Optional[str] = None
        self.num_remote_tokens = 0
        # The trace's session and client max_tokens (None: it asks for exactly its output
        # length), and the scheduler's prediction of its output length (length-aware runs).
        self.session: Optional[str] = None
        self.max_tokens: Optional[int] = None
        self.predicted_output_tokens: Optional[int] = None

    @property
    def done(self) -> bool:
        return self.refused is not None or self.finish_s >= 0

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.last_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        """Mean gap between tokens after the first (0 for a single token)."""
        if self.num_output < 2:
            return 0.0
        return (self.last_token_s - self.first_token_s) / (self.num_output - 1)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "request_id": self.trace_id or self.request_id,
            "arrival_s": self.arrival_s,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.num_output,
            "replica": self.replica,
        }
        if self.path is not None:
            d.update(path=self.path, prefill_replica=self.prefill_replica, remote_tokens=self.num_remote_tokens)
        if self.refused is not None:
            d["refused"] = self.refused
            return d
        d.update(
            ttft_s=self.ttft_s,
            e2e_s=self.e2e_s,
            tpot_s=self.tpot_s,
            cached_tokens=self.num_cached_tokens,
            preemptions=self.num_preemptions,
            finish_reason=self.finish_reason,
        )
        return d


class GapHistogram:
    """Counts of inter-token gaps by exact value: the gaps of one step's decode rows mostly
    repeat (the step's length), so there are far fewer distinct values than gaps. Past
    `max_keys` distinct values the counts fold into logarithmic bins 0.5% wide (geometric
    middles), bounding memory for very long runs; `approximate` then says so."""

    _LOG_BASE = math.log(1.005)

    def __init__(self, max_keys: int = 1_000_000) -> None:
        self.counts: dict[float, int] = {}
        self.max_keys = max_keys
        self.approximate = False

    def add(self, x: float) -> None:
        self.counts[x] = self.counts.get(x, 0) + 1

    def maybe_fold(self) -> None:
        if len(self.counts) <= self.max_keys:
            return
        folded: dict[float, int] = {}
        base = self._LOG_BASE
        for x, c in self.counts.items():
            key = 0.0 if x <= 0.0 else math.exp((math.floor(math.log(x) / base) + 0.5) * base)
            folded[key] = folded.get(key, 0) + c
        self.counts = folded
        self.approximate = True

    @property
    def count(self) -> int:
        return sum(self.counts.values())

    def quantiles(self, qs: Sequence[float]) -> list[float]:
        """Values at quantiles `qs` (0..1), interpolated between closest ranks as `quantile`."""
        n = self.count
        if not n:
            return [0.0 for _ in qs]
        keys = sorted(self.counts)
        cum: list[int] = []
        total = 0
        for k in keys:
            total += self.counts[k]
            cum.append(total)

        def order_stat(i: int) -> float:  # the i-th smallest gap, 0-based
            return keys[bisect.bisect_right(cum, i)]

        out = []
        for q in qs:
            pos = q * (n - 1)
            lo = int(pos)
            a, b = order_stat(lo), order_stat(min(lo + 1, n - 1))
            out.append(a + (b - a) * (pos - lo))
        return out


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); 0 for no values."""
    n = len(sorted_values)
    if not n:
        return 0.0
    pos = q * (n - 1)
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def percentiles(values: Sequence[float]) -> dict[str, float]:
    s = sorted(values)
    return {"p50": quantile(s, 0.5), "p90": quantile(s, 0.9), "p99": quantile(s, 0.99)}


def hist_percentiles(h: GapHistogram) -> dict[str, float]:
    p50, p90, p99 = h.quantiles((0.5, 0.9, 0.99))
    return {"p50": p50, "p90": p90, "p99": p99}


@dataclass
class SimResult:
    """A run's summary (`to_dict()` is the JSON) plus its per-request records."""

    requests: int
    completed: int
    refused: int
    refused_reasons: dict[str, int]
    truncated: int  # completed with fewer output tokens than asked (max_model_len capped them)
    duration_s: float
    output_tokens: int
    prompt_tokens: int
    cached_prompt_tokens: int
    output_tokens_per_s: float
    requests_per_s: float
    ttft_s: dict[str, float]
    itl_s: dict[str, float]
    tpot_s: dict[str, float]
    e2e_s: dict[str, float]
    prefix_hit_rate: float
    preemptions: int
    kv_bytes_moved: int
    replicas: list[dict[str, Any]]
    config: dict[str, Any]
    slo: Optional[dict[str, Any]] = None
    pd: Optional[dict[str, Any]] = None  # P/D runs: paths taken, KV moved, per-pool utilization
    # Traces that name tenants: each one's requests, output tokens and TTFT / E2E percentiles.
    tenants: Optional[dict[str, dict[str, Any]]] = None
    # Length-aware runs: the output-length predictions against what the requests produced.
    length_prediction: Optional[dict[str, Any]] = None
    wall_s: float = 0.0  # host seconds the run took (not in the JSON: it is not deterministic)
    records: list[Record] = field(default_factory=list, repr=False)

    @property
    def utilization(self) -> list[float]:
        return [r["utilization"] for r in self.replicas]

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "requests": self.requests,
            "completed": self.completed,
            "refused": self.refused,
            "refused_reasons": dict(sorted(self.refused_reasons.items())),
            "truncated": self.truncated,
            "duration_s": self.duration_s,
            "output_tokens": self.output_tokens,
            "output_tokens_per_s": self.output_tokens_per_s,
            "requests_per_s": self.requests_per_s,
            "ttft_s": self.ttft_s,
            "itl_s": self.itl_s,
            "tpot_s": self.tpot_s,
            "e2e_s": self.e2e_s,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "prefix_hit_rate": self.prefix_hit_rate,
            "preemptions": self.preemptions,
            "kv_bytes_moved": self.kv_bytes_moved,
            "utilization": self.utilization,
            "replicas": self.replicas,
            "config": self.config,
        }
        if self.pd is not None:
            d["pd"] = self.pd
        if self.tenants is not None:
            d["tenants"] = self.tenants
        if self.slo is not None:
            d["slo"] = self.slo
            d["goodput"] = self.slo["goodput"]
        if self.length_prediction is not None:
            d["length_prediction"] = self.length_prediction
        return d

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json() + "\n")


def summarize(
    records: list[Record],
    duration_s: float,
    replicas: list[dict[str, Any]],
    itl: GapHistogram,
    config: dict[str, Any],
    slo_ttft_s: Optional[float] = None,
    slo_itl_s: Optional[float] = None,
    kv_bytes_moved: int = 0,
) -> SimResult:
    served = [r for r in records if r.refused is None]
    refused: dict[str, int] = {}
    for r in records:
        if r.refused is not None:
            key = r.refused.split(":", 1)[0]
            refused[key] = refused.get(key, 0) + 1
    out_tokens = sum(r.num_output for r in served)
    prompt_tokens = sum(r.prompt_tokens for r in served)
    # The engine counts KV loaded through the connector among a request's cached tokens (as
    # vLLM's num_cached_tokens does); the prefix hit rate is the local cache's hits only.
    cached = sum(max(0, r.num_cached_tokens - r.num_remote_tokens) for r in served)
    dur = duration_s if duration_s > 0 else 0.0
    slo = None
    if slo_ttft_s is not None or slo_itl_s is not None:
        met = 0
        for r in served:
            if slo_ttft_s is not None and r.ttft_s > slo_ttft_s:
                continue
            if slo_itl_s is not None and r.tpot_s > slo_itl_s:
                continue
            met += 1
        slo = {
            "ttft_s": slo_ttft_s,
            "itl_s": slo_itl_s,
            "itl_judged_by": "tpot_mean",
            "met": met,
            "attainment": met / len(records) if records else 0.0,
            "goodput": met / dur if dur else 0.0,
        }
    return SimResult(
        requests=len(records),
        completed=len(served),
        refused=len(records) - len(served),
        refused_reasons=refused,
        truncated=sum(1 for r in served if r.num_output < r.output_tokens),
        duration_s=dur,
        output_tokens=out_tokens,
        prompt_tokens=prompt_tokens,
        cached_prompt_tokens=cached,
        output_tokens_per_s=out_tokens / dur if dur else 0.0,
        requests_per_s=len(served) / dur if dur else 0.0,
        ttft_s=percentiles([r.ttft_s for r in served]),
        itl_s=hist_percentiles(itl),
        tpot_s=percentiles([r.tpot_s for r in served if r.num_output > 1]),
        e2e_s=percentiles([r.e2e_s for r in served]),
        prefix_hit_rate=cached / prompt_tokens if prompt_tokens else 0.0,
        preemptions=sum(int(r["preemptions"]) for r in replicas),
        kv_bytes_moved=kv_bytes_moved,
        replicas=replicas,
        config=config,
        slo=slo,
        tenants=by_tenant(records, dur),
        length_prediction=length_prediction(served),
        records=records,
    )


def length_prediction(served: list[Record]) -> Optional[dict[str, Any]]:
    """The scheduler's output-length predictions (made at each request's arrival at its
    replica) against the output lengths: mean absolute error and the percentiles of the
    absolute error, in tokens. None when nothing was predicted."""
    pairs = [(r.predicted_output_tokens, r.num_output) for r in served if r.predicted_output_tokens is not None]
    if not pairs:
        return None
    errors = [abs(p - n) for p, n in pairs]
    return {
        "requests": len(pairs),
        "mae_tokens": sum(errors) / len(errors),
        "abs_error_tokens": percentiles([float(e) for e in errors]),
        "mean_output_tokens": sum(n for _, n in pairs) / len(pairs),
    }


def by_tenant(records: list[Record], duration_s: float) -> Optional[dict[str, dict[str, Any]]]:
    """Per tenant (a trace that names none: None): requests, completed, output tokens per
    second over the run, TTFT and E2E percentiles of its served requests."""
    if all(r.tenant is None for r in records):
        return None
    groups: dict[str, list[Record]] = {}
    for r in records:
        groups.setdefault(r.tenant or "default", []).append(r)
    out = {}
    for tenant, rs in sorted(groups.items()):
        served = [r for r in rs if r.refused is None]
        out[tenant] = {
            "requests": len(rs),
            "completed": len(served),
            "output_tokens_per_s": sum(r.num_output for r in served) / duration_s if duration_s else 0.0,
            "ttft_s": percentiles([r.ttft_s for r in served]),
            "e2e_s": percentiles([r.e2e_s for r in served]),
        }
    return out
