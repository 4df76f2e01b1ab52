"""Trace generators for what we benchmark, seeded and deterministic (standard library only).

Arrivals are Poisson (exponential gaps) or bursty (gamma gaps with a coefficient of
variation above 1 at the same mean rate). Lengths are drawn from a `Lengths`
distribution (lognormal by default, long-tailed, clipped). Shared system prompts and
multi-turn chats are expressed as `hash_ids` of `block_tokens`-token blocks, so the
simulator's prefix cache sees exactly which blocks repeat; generated traces default to
16-token blocks (a KV block) rather than Mooncake's 512 so little sharing is lost at
block edges. Multi-turn arrivals are open loop: each turn arrives a think time after
the previous one, not after its completion.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fleetserve.sim.traces import TraceRequest, format_trace

GENERATED_BLOCK_TOKENS = 16


@dataclass(frozen=True)
class Lengths:
    """A token-length distribution clipped to [lo, hi]: lognormal (median, sigma), Pareto
    (scale `median`, shape `alpha`) or fixed (sigma 0)."""

    median: float
    sigma: float = 0.0
    lo: int = 1
    hi: int = 1 << 20
    kind: str = "lognormal"
    alpha: float = 1.5

    def sample(self, rng: random.Random) -> int:
        if self.kind == "pareto":
            x = self.median * rng.paretovariate(self.alpha)
        elif self.sigma > 0:
            x = rng.lognormvariate(math.log(self.median), self.sigma)
        else:
            x = self.median
        return max(self.lo, min(self.hi, int(round(x))))


DEFAULT_PROMPT = Lengths(median=512, sigma=1.0, lo=16, hi=8192)
DEFAULT_OUTPUT = Lengths(median=128, sigma=1.0, lo=1, hi=2048)
LONG_TAIL_PROMPT = Lengths(median=256, lo=16, hi=32768, kind="pareto", alpha=1.2)
LONG_TAIL_OUTPUT = Lengths(median=64, lo=1, hi=4096, kind="pareto", alpha=1.3)


def poisson_arrivals(rng: random.Random, n: int, rate: float) -> list[float]:
    """`n` arrival times (s) of a Poisson process at `rate` requests/s, starting at 0."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(round(t, 6))
    return out


def gamma_arrivals(rng: random.Random, n: int, rate: float, cv: float) -> list[float]:
    """`n` arrival times with gamma gaps: mean 1/rate, coefficient of variation `cv`."""
    if rate <= 0 or cv <= 0:
        raise ValueError(f"rate and cv must be positive, got rate={rate}, cv={cv}")
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate * shape)
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.gammavariate(shape, scale)
        out.append(round(t, 6))
    return out


def _arrivals(rng: random.Random, n: int, rate: float, arrivals: str, cv: float) -> list[float]:
    if arrivals == "poisson":
        return poisson_arrivals(rng, n, rate)
    if arrivals == "bursty":
        return gamma_arrivals(rng, n, rate, cv)
    raise ValueError(f"arrivals must be 'poisson' or 'bursty', got {arrivals!r}")


def poisson(
    *,
    num_requests: int,
    rate: float,
    seed: int = 0,
    prompt: Lengths = DEFAULT_PROMPT,
    output: Lengths = DEFAULT_OUTPUT,
) -> list[TraceRequest]:
    """Independent requests (prompt counts, nothing shared) arriving as a Poisson process."""
    rng = random.Random(seed)
    times = poisson_arrivals(rng, num_requests, rate)
    return [
        TraceRequest(arrival_s=t, prompt_tokens=prompt.sample(rng), output_tokens=output.sample(rng), request_id=str(i))
        for i, t in enumerate(times)
    ]


def bursty(
    *,
    num_requests: int,
    rate: float,
    seed: int = 0,
    cv: float = 3.0,
    prompt: Lengths = DEFAULT_PROMPT,
    output: Lengths = DEFAULT_OUTPUT,
) -> list[TraceRequest]:
    """Independent requests with gamma inter-arrivals (CV `cv` > 1) at mean rate `rate`."""
    rng = random.Random(seed)
    times = gamma_arrivals(rng, num_requests, rate, cv)
    return [
        TraceRequest(arrival_s=t, prompt_tokens=prompt.sample(rng), output_tokens=output.sample(rng), request_id=str(i))
        for i, t in enumerate(times)
    ]


def long_tail(
    *,
    num_requests: int,
    rate: float,
    seed: int = 0,
    arrivals: str = "poisson",
    cv: float = 3.0,
    prompt: Lengths = LONG_TAIL_PROMPT,
    output: Lengths = LONG_TAIL_OUTPUT,
) -> list[TraceRequest]:
    """Independent requests with Pareto (long-tailed, clipped) prompt and output lengths."""
    rng = random.Random(seed)
    times = _arrivals(rng, num_requests, rate, arrivals, cv)
    return [
        TraceRequest(arrival_s=t, prompt_tokens=prompt.sample(rng), output_tokens=output.sample(rng), request_id=str(i))
        for i, t in enumerate(times)
    ]


class _Ids:
    """Fresh hash ids, one counter per trace."""

    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _blocks(n_tokens: int, block: int) -> int:
    return -(-n_tokens // block)


def shared_prefix(
    *,
    num_requests: int,
    rate: float,
    seed: int = 0,
    num_tenants: int = 8,
    system_prompt_tokens: int = 2048,
    arrivals: str = "poisson",
    cv: float = 3.0,
    user: Lengths = Lengths(median=256, sigma=0.8, lo=16, hi=4096),
    output: Lengths = DEFAULT_OUTPUT,
    block_tokens: int = GENERATED_BLOCK_TOKENS,
) -> list[TraceRequest]:
    """Tenants each with a system prompt of `system_prompt_tokens` tokens, then a unique user
    part. A request's hash ids start with its tenant's full system-prompt blocks (the block
    holding the system/user boundary is unique); tenants are drawn uniformly."""
    rng = random.Random(seed)
    ids = _Ids()
    shared = [ids.take(system_prompt_tokens // block_tokens) for _ in range(num_tenants)]
    times = _arrivals(rng, num_requests, rate, arrivals, cv)
    out = []
    for i, t in enumerate(times):
        tenant = rng.randrange(num_tenants)
        n = system_prompt_tokens + user.sample(rng)
        sys_ids = shared[tenant]
        hids = sys_ids + ids.take(_blocks(n, block_tokens) - len(sys_ids))
        out.append(
            TraceRequest(
                arrival_s=t,
                prompt_tokens=n,
                hash_ids=tuple(hids),
                block_tokens=block_tokens,
                output_tokens=output.sample(rng),
                tenant=f"tenant-{tenant}",
                request_id=str(i),
            )
        )
    return out


def multiturn(
    *,
    num_requests: int,
    rate: float,
    seed: int = 0,
    turns: int = 4,
    think_s: float = 5.0,
    system_prompt_tokens: int = 0,
    user: Lengths = Lengths(median=128, sigma=0.8, lo=8, hi=2048),
    output: Lengths = Lengths(median=192, sigma=0.8, lo=8, hi=1024),
    block_tokens: int = GENERATED_BLOCK_TOKENS,
) -> list[TraceRequest]:
    """Chat sessions of `turns` turns; each turn resends the whole history, so turn k's
    prompt is turn k-1's prompt + output + a new user message, and its hash ids keep turn
    k-1's full prompt blocks. Sessions start as a Poisson process at `rate / turns` (so
    requests arrive at about `rate`); turns follow after exponential think times of mean
    `think_s`. Every session may share one system prompt of `system_prompt_tokens`."""
    rng = random.Random(seed)
    ids = _Ids()
    sys_ids = ids.take(system_prompt_tokens // block_tokens)
    n_sessions = _blocks(num_requests, turns)
    starts = poisson_arrivals(rng, n_sessions, rate / turns)
    out = []
    for s, start in enumerate(starts):
        t = start
        prev_prompt, prev_out, prev_ids = 0, 0, list(sys_ids)
        for k in range(turns):
            if k:
                t = round(t + rng.expovariate(1.0 / think_s), 6)
            n = (prev_prompt + prev_out if k else system_prompt_tokens) + user.sample(rng)
            keep = prev_ids[: (prev_prompt // block_tokens) if k else len(sys_ids)]
            hids = keep + ids.take(_blocks(n, block_tokens) - len(keep))
            n_out = output.sample(rng)
            out.append(
                TraceRequest(
                    arrival_s=t,
                    prompt_tokens=n,
                    hash_ids=tuple(hids),
                    block_tokens=block_tokens,
                    output_tokens=n_out,
                    session=f"session-{s}",
                    request_id=f"{s}.{k}",
                )
            )
            prev_prompt, prev_out, prev_ids = n, n_out, hids
    out.sort(key=lambda r: r.arrival_s)
    return out[:num_requests]


@dataclass(frozen=True)
class Task:
    """A kind of request in `length_mix`: its prompt lengths, its output lengths (before the
    tenant's and the session's verbosity), and the max_tokens its clients send."""

    name: str
    prompt: Lengths
    output: Lengths
    max_tokens: int


# Long-tailed output lengths whose distribution depends on what the request is: from
# one-word labels to long generations with a Pareto tail, each with a typical max_tokens.
LENGTH_MIX_TASKS = (
    Task("classify", Lengths(median=300, sigma=0.6, lo=16, hi=4096), Lengths(median=4, sigma=0.5, lo=1), 16),
    Task("chat", Lengths(median=200, sigma=0.8, lo=8, hi=4096), Lengths(median=150, sigma=0.8, lo=1), 1024),
    Task("summarize", Lengths(median=2000, sigma=0.5, lo=256, hi=8192), Lengths(median=120, sigma=0.5, lo=8), 512),
    Task(
        "code",
        Lengths(median=400, sigma=0.8, lo=16, hi=8192),
        Lengths(median=400, lo=16, kind="pareto", alpha=1.5),
        4096,
    ),
    Task(
        "essay",
        Lengths(median=150, sigma=0.7, lo=8, hi=2048),
        Lengths(median=700, lo=64, kind="pareto", alpha=1.3),
        4096,
    ),
)


def length_mix(
    *,
    num_requests: int,
    rate: float,
    seed: int = 0,
    num_tenants: int = 6,
    arrivals: str = "poisson",
    cv: float = 3.0,
    session_share: float = 0.5,
    turns: int = 4,
    tasks: tuple[Task, ...] = LENGTH_MIX_TASKS,
    tenant_sigma: float = 0.3,
    session_sigma: float = 0.5,
) -> list[TraceRequest]:
    """Long-tailed output lengths with the structure real traffic has: each tenant sends its
    own mix of tasks (`LENGTH_MIX_TASKS`: labels, chat, summaries, code, essays) and is more
    or less verbose (a lognormal factor, `tenant_sigma`); a share of the requests are chat
    sessions of up to `turns` turns of one task with a verbosity of their own
    (`session_sigma`). Each request carries its task's `max_tokens` and ends by itself
    (EOS) at its output length, at most max_tokens. Prompts are counts (nothing shared), so
    only the lengths matter. Used to measure output-length prediction and ordering
    (benchmarks/length_aware_sim.py)."""
    rng = random.Random(seed)
    times = _arrivals(rng, num_requests, rate, arrivals, cv)
    # Each tenant's task mix (random weights, one task favoured) and verbosity.
    mixes = []
    for _ in range(num_tenants):
        w = [rng.random() for _ in tasks]
        w[rng.randrange(len(tasks))] += 2.0
        mixes.append((w, rng.lognormvariate(0.0, tenant_sigma)))
    out: list[TraceRequest] = []
    open_sessions: list[tuple[str, int, Task, float, int]] = []  # id, tenant, task, verbosity, turns left
    n_sessions = 0
    for i, t in enumerate(times):
        if open_sessions and rng.random() < session_share:
            j = rng.randrange(len(open_sessions))
            sid, tenant, task, verb, left = open_sessions[j]
            if left <= 1:
                open_sessions.pop(j)
            else:
                open_sessions[j] = (sid, tenant, task, verb, left - 1)
            session: str | None = sid
        else:
            tenant = rng.randrange(num_tenants)
            task = rng.choices(tasks, weights=mixes[tenant][0])[0]
            verb = mixes[tenant][1]
            session = None
            if rng.random() < session_share:
                session = f"session-{n_sessions}"
                n_sessions += 1
                verb *= rng.lognormvariate(0.0, session_sigma)
                open_sessions.append((session, tenant, task, verb, turns - 1))
        n_out = max(1, min(task.max_tokens, int(round(task.output.sample(rng) * verb))))
        out.append(
            TraceRequest(
                arrival_s=t,
                prompt_tokens=task.prompt.sample(rng),
                output_tokens=n_out,
                max_tokens=task.max_tokens,
                tenant=f"tenant-{tenant}",
                session=session,
                request_id=str(i),
            )
        )
    return out


GENERATORS: dict[str, Callable[..., list[TraceRequest]]] = {
    "poisson": poisson,
    "bursty": bursty,
    "long_tail": long_tail,
    "shared_prefix": shared_prefix,
    "multiturn": multiturn,
    "length_mix": length_mix,
}


def generate(kind: str, *, num_requests: int, rate: float, seed: int = 0, **kwargs: Any) -> list[TraceRequest]:
    """A generated trace of `kind` (one of `GENERATORS`), sorted by arrival from 0."""
    if kind not in GENERATORS:
        raise ValueError(f"unknown trace kind {kind!r}; expected one of {', '.join(GENERATORS)}")
    return GENERATORS[kind](num_requests=num_requests, rate=rate, seed=seed, **kwargs)


# The shipped samples (samples/), rebuilt by `python -m fleetserve.sim.traces regenerate`.
def sample_traces() -> dict[str, str]:
    """File name -> text of every shipped sample trace."""
    small = Lengths(median=128, sigma=0.8, lo=16, hi=2048)
    return {
        "poisson.jsonl": format_trace(generate("poisson", num_requests=300, rate=4.0, seed=1)),
        "bursty.jsonl": format_trace(generate("bursty", num_requests=300, rate=4.0, seed=2)),
        "shared_prefix.jsonl": format_trace(
            generate("shared_prefix", num_requests=300, rate=4.0, seed=3, num_tenants=6, system_prompt_tokens=1024)
        ),
        "multiturn.jsonl": format_trace(generate("multiturn", num_requests=300, rate=4.0, seed=4, turns=4)),
        "mooncake_sample.jsonl": format_trace(
            generate(
                "shared_prefix",
                num_requests=20,
                rate=2.0,
                seed=5,
                num_tenants=3,
                system_prompt_tokens=1536,
                user=Lengths(median=600, sigma=0.8, lo=16, hi=4096),
                block_tokens=512,
            ),
            "mooncake",
        ),
        "azure_sample.csv": format_trace(
            generate("poisson", num_requests=20, rate=2.0, seed=6, prompt=Lengths(median=1024, sigma=1.0, lo=16)),
            "azure",
        ),
        "burstgpt_sample.csv": _burstgpt_sample(small),
    }


def _burstgpt_sample(prompt: Lengths) -> str:
    reqs = generate("bursty", num_requests=20, rate=0.2, seed=7, prompt=prompt)
    rng = random.Random(7)
    tagged = [
        TraceRequest(
            arrival_s=r.arrival_s,
            prompt_tokens=r.prompt_tokens,
            output_tokens=r.output_tokens,
            tenant=rng.choice(["ChatGPT", "GPT-4"]),
            session="c" if rng.random() < 0.5 else None,
        )
        for r in reqs
    ]
    text = format_trace(tagged, "burstgpt")
    # BurstGPT logs failed requests with 0 response tokens; the reader skips them.
    lines = text.splitlines(keepends=True)
    for i in (5, 13):
        cells = lines[i].rstrip("\n").split(",")
        cells[3], cells[4] = "0", cells[2]
        lines[i] = ",".join(cells) + "\n"
    return "".join(lines)
