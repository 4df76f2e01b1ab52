"""An online predictor of a request's output length, from what is known before it runs.

Pure Python (no torch, no numpy): the replica scheduler, the router and the simulator all
run it. It learns from completed requests (`observe`) and answers `predict` in tens of
microseconds with bounded memory.

The model: bucketed quantiles with shrinkage. Each bucket holds a histogram of the output
lengths seen in it on a log scale (`BINS_PER_OCTAVE` bins per doubling, so a bin is
~19% wide whatever the length). The buckets form one chain, coarse to fine:

    half of max_tokens                          a prior: `prior_strength` observations
    ()                                          every request
    (max_tokens octave,)                        what the client expects (and caps)
    (max_tokens octave, model)                  the model or LoRA adapter
    (max_tokens octave, model, tenant)
    (max_tokens octave, model, tenant, prompt-length octave)
    the session's earlier turns                 (the chat's own output lengths)

The prediction is a quantile (the median by default: it minimizes the absolute error) of
the finest level's histogram with the level above it mixed in as `prior_strength`
pseudo-observations, recursively: a bucket with few observations answers mostly what its
parent answers, one with many answers for itself (the empirical-Bayes shrinkage of a
Dirichlet prior). The session's turns enter last, each as `session_weight` observations.
The answer is capped by the request's `max_tokens` (it cannot run longer) and is at least 1.

Why this and not a regression: benchmarks/length_aware_sim.py measures it against the plain
running mean (what a predictor with no features answers) on generated long-tailed traces:
the lengths are heavy-tailed and multiplicative (a mean is dragged by the tail; a log-scale
median is not), the useful features are categorical (tenant, adapter) or coarse (octaves
of lengths), and a bucket must answer sensibly from its first observation (shrinkage).

Memory is bounded: at most `max_buckets` histograms (least recently used dropped, the
global one is used by every call and so never is) and `max_sessions` sessions of at most
`SESSION_TURNS` lengths each; a histogram whose count passes `window` is halved, so old
observations fade and the predictor follows a drifting workload.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import OrderedDict, deque
from typing import Any, NamedTuple, Optional

BINS_PER_OCTAVE = 4
MAX_OCTAVES = 20  # lengths up to 2**20 tokens (longer ones share the last bin)
NUM_BINS = BINS_PER_OCTAVE * MAX_OCTAVES + 1
SESSION_TURNS = 8  # earlier turns remembered per session

# Each bin's representative length: the geometric middle of the lengths it holds.
_BIN_VALUE = [2.0 ** ((b + 0.5) / BINS_PER_OCTAVE) for b in range(NUM_BINS)]
_BIN_VALUE[0] = 1.0


def length_bin(n: int) -> int:
    """The histogram bin of an output length (>= 1)."""
    if n <= 1:
        return 0
    return min(NUM_BINS - 1, int(math.log2(n) * BINS_PER_OCTAVE))


def _octave(n: Optional[int]) -> int:
    return -1 if not n or n < 1 else int(n).bit_length()


class LengthFeatures(NamedTuple):
    """What the router (or the scheduler) knows of a request before it runs."""

    prompt_tokens: int
    max_tokens: Optional[int] = None
    tenant: str = "default"
    model: str = ""  # the model or the LoRA adapter's name
    session: Optional[str] = None  # a chat's id: its earlier turns' lengths are a feature


class _Hist:
    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0.0] * NUM_BINS
        self.total = 0.0


class OutputLengthPredictor:
    def __init__(
        self,
        *,
        quantile: float = 0.5,
        prior_strength: float = 4.0,
        session_weight: float = 2.0,
        max_buckets: int = 2048,
        max_sessions: int = 8192,
        window: float = 4096.0,
        use_session: bool = True,
        levels: int = 5,
    ) -> None:
        if not 0.0 < quantile < 1.0:
            raise ValueError(f"quantile must be in (0, 1), got {quantile}")
        if prior_strength <= 0 or session_weight < 0 or window < 2 or max_buckets < 1 or max_sessions < 0:
            raise ValueError("prior_strength > 0, session_weight >= 0, window >= 2, max_buckets >= 1 required")
        if not 1 <= levels <= 5:
            raise ValueError(f"levels must be 1..5, got {levels}")
        self.quantile = quantile
        self.prior_strength = prior_strength
        self.session_weight = session_weight
        self.max_buckets = max_buckets
        self.max_sessions = max_sessions
        self.window = window
        self.use_session = use_session
        self.levels = levels
        self._buckets: OrderedDict[tuple[Any, ...], _Hist] = OrderedDict()
        self._sessions: OrderedDict[str, deque[int]] = OrderedDict()
        self.num_observed = 0

    # ---- the chain of buckets -------------------------------------------------------
    def _keys(self, f: LengthFeatures) -> list[tuple[Any, ...]]:
        p, m = _octave(f.prompt_tokens), _octave(f.max_tokens)
        keys = [(), (m,), (m, f.model), (m, f.model, f.tenant), (m, f.model, f.tenant, p)]
        return keys[: self.levels]

    def _bucket(self, key: tuple[Any, ...]) -> _Hist:
        h = self._buckets.get(key)
        if h is None:
            h = self._buckets[key] = _Hist()
            if len(self._buckets) > self.max_buckets:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
        return h

    # ---- learn ------------------------------------------------------------------------
    def observe(self, features: LengthFeatures, output_tokens: int) -> None:
        """A request with `features` finished after `output_tokens` tokens."""
        n = max(1, int(output_tokens))
        b = length_bin(n)
        for key in self._keys(features):
            h = self._bucket(key)
            h.counts[b] += 1.0
            h.total += 1.0
            if h.total > self.window:
                h.counts = [c * 0.5 for c in h.counts]
                h.total *= 0.5
        self.num_observed += 1
        s = features.session
        if s is not None and self.use_session and self.max_sessions:
            turns = self._sessions.get(s)
            if turns is None:
                turns = self._sessions[s] = deque(maxlen=SESSION_TURNS)
                if len(self._sessions) > self.max_sessions:
                    self._sessions.popitem(last=False)
            else:
                self._sessions.move_to_end(s)
            turns.append(n)

    # ---- predict ----------------------------------------------------------------------
    def predict(self, features: LengthFeatures) -> int:
        """The predicted output length in tokens, in [1, max_tokens]."""
        k = self.prior_strength
        cap = features.max_tokens
        # The root prior, for a chain with little data: `prior_strength` observations at
        # half of max_tokens (what a request with nothing learned is predicted).
        dist: Optional[list[float]] = None
        total = 0.0
        if cap:
            dist = [0.0] * NUM_BINS
            dist[length_bin(max(1, cap // 2))] = total = k
        buckets = self._buckets
        for key in self._keys(features):
            h = buckets.get(key)
            if h is None or h.total <= 0:
                continue
            if dist is None:
                dist, total = list(h.counts), h.total
            else:
                scale = k / total
                dist = [c + scale * d for c, d in zip(h.counts, dist)]
                total = h.total + k
        if self.use_session and features.session is not None:
            turns = self._sessions.get(features.session)
            if turns:
                w = self.session_weight
                if dist is None:
                    dist, total = [0.0] * NUM_BINS, 0.0
                else:
                    scale = k / total
                    dist = [scale * d for d in dist]
                    total = k
                for n in turns:
                    dist[length_bin(n)] += w
                total += w * len(turns)
        if dist is None:
            # Nothing learned yet: the middle of what the request may produce.
            guess = 1 if not cap else max(1, cap // 2)
            return guess
        guess = self._quantile(dist, total)
        if cap:
            guess = min(guess, cap)
        return max(1, guess)

    def _quantile(self, dist: list[float], total: float) -> int:
        target = self.quantile * total
        acc = 0.0
        for b, c in enumerate(dist):
            if c <= 0:
                continue
            if acc + c >= target:
                # Log-linear inside the bin: from its lower edge to its upper edge.
                frac = (target - acc) / c
                lo = 2.0 ** (b / BINS_PER_OCTAVE)
                return int(round(lo * 2.0 ** (frac / BINS_PER_OCTAVE))) if b else 1
            acc += c
        return int(round(_BIN_VALUE[-1]))

    # ---- state ---------------------------------------------------------------------------
    def num_buckets(self) -> int:
        return len(self._buckets)

    def num_sessions(self) -> int:
        return len(self._sessions)


class RunningMean:
    """The baseline: the running mean of every output length seen (capped by max_tokens)."""

    def __init__(self) -> None:
        self.n = 0
        self.mean = 0.0

    def observe(self, features: LengthFeatures, output_tokens: int) -> None:
        self.n += 1
        self.mean += (output_tokens - self.mean) / self.n

    def predict(self, features: LengthFeatures) -> int:
        guess = max(1, int(round(self.mean))) if self.n else max(1, (features.max_tokens or 2) // 2)
        return min(guess, features.max_tokens) if features.max_tokens else guess


# Absolute prediction errors (tokens): the buckets of the error histograms (metrics, stats).
ERROR_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def error_bucket(abs_error: int) -> int:
    """The index in ERROR_BUCKETS of the first bound >= abs_error (len for larger ones)."""
    return bisect_left(ERROR_BUCKETS, abs_error)
