"""The simulator against the real system: one trace, replayed on `fleetserve serve` and in `fleetserve sim`.

For each of three traces (steady Poisson, bursty, shared system prompts with prefix
routing) this replays the trace against a real 2-replica app (the default model,
SmolLM2, one thread per replica, on this machine), measuring as a client does (TTFT and
ITL from the streamed chunks), then simulates the same trace with the same app config
and this machine's calibrated profile, and prints every metric side by side with the
relative error and the issue's target:

    throughput, TTFT p50            within 10%
    TTFT p90, ITL p50               within 15%

    python benchmarks/sim_validate.py --profile sim/profiles/<this machine's>.json
    python benchmarks/sim_validate.py --traces poisson --num-requests 60   # one, shorter

Nothing is fitted per trace. Three fixed inputs are measured once per run, before the
traces, and used for all three: the profile (made by `fleetserve profile` beforehand, which
times the engine core's steps alone); the request path's fixed latency (the median TTFT of
idle short requests minus the profile's time for that step), which the simulator takes as
`network_latency_s`; and the served step's overhead (the median ITL of those idle requests
minus the profile's decode step: streaming each step's tokens to the replica's AsyncEngine
and on through the ingress), added to every simulated step (`--no-step-overhead` leaves it
out). Results go to benchmarks/results/sim_validate.{json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import serving  # noqa: E402
from serving import Result, _client, _observe_sse_line, cpu_name, free_port, pct, redeploy, scrape  # noqa: E402

serving.CLIENT = "aiohttp"  # the load generator's client (serving.py's default)

from fleetserve.sim.generators import Lengths, generate  # noqa: E402

RESULTS = Path(__file__).parent / "results"
TARGETS = {"output_tokens_per_s": 0.10, "ttft_p50_s": 0.10, "ttft_p90_s": 0.15, "itl_p50_s": 0.15}
INFO = ("ttft_p99_s", "itl_p90_s", "e2e_p50_s", "prefix_hit_rate")
VOCAB = 49152  # SmolLM2's


PROMPT = Lengths(median=192, sigma=0.6, lo=16, hi=1024)  # sized for a 135M model on one core
OUTPUT = Lengths(median=48, sigma=0.5, lo=4, hi=160)


def traces(n: int, rate: float, seed: int) -> dict[str, tuple[list, str]]:
    """name -> (trace, routing policy)."""
    prompt, output = PROMPT, OUTPUT
    return {
        "poisson": (
            generate("poisson", num_requests=n, rate=rate, seed=seed, prompt=prompt, output=output),
            "power_of_two",
        ),
        "bursty": (
            generate("bursty", num_requests=n, rate=rate, seed=seed, cv=2.5, prompt=prompt, output=output),
            "power_of_two",
        ),
        "shared_prefix": (
            generate(
                "shared_prefix",
                num_requests=n,
                rate=rate,
                seed=seed,
                num_tenants=6,
                system_prompt_tokens=512,
                user=Lengths(median=64, sigma=0.5, lo=8, hi=256),
                output=output,
            ),
            "prefix_aware",
        ),
    }


def app_config(args, port: int, policy: str):
    from fleetserve.cluster.config import AppConfig

    return AppConfig.model_validate(
        {
            "name": "simval",
            "engine": {
                "model": args.model,
                "max_model_len": args.max_model_len,
                "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "num_gpu_blocks_override": args.num_blocks,
                "num_threads": 1,
            },
            "num_replicas": 2,
            "routing_policy": policy,
            "http": {"port": port},
            "grpc": {"enabled": False},
        }
    )


async def send(session, url: str, model: str, ids: list[int], max_tokens: int) -> Result:
    res, t0 = Result(), time.perf_counter()
    last = None
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            res.error = (await r.read()).decode()[:200]
            return res
        async for raw in r.content:
            last = _observe_sse_line(res, raw.decode().rstrip("\n"), t0, last)
    res.ok = res.tokens > 0
    return res


async def replay(url: str, model: str, trace: list) -> tuple[list[Result], float]:
    """Open loop at the trace's arrival times; returns results and the span from the first
    arrival to the last completion."""
    start = time.perf_counter()
    async with _client() as session:
        tasks = []
        for tr in trace:
            delay = start + tr.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(session, url, model, tr.token_ids(VOCAB), tr.output_tokens)))
        results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


async def idle_probe(url: str, model: str, n: int = 8, out_tokens: int = 32) -> tuple[float, float]:
    """Median TTFT and median ITL of short requests sent one at a time to an idle app."""
    async with _client() as session:
        ttfts, itls = [], []
        for i in range(n):
            r = await send(session, url, model, [100 + i, 200 + i], out_tokens)
            ttfts.append(r.ttft)
            itls.append(statistics.median(r.itl))
    return statistics.median(ttfts[2:]), statistics.median(itls[2:])


class WithStepOverhead:
    """A cost model plus a fixed per-step cost: what a served step costs beyond the engine
    step the profile timed (streaming each step's tokens to the replica's AsyncEngine and
    on through the ingress), measured once on idle requests."""

    def __init__(self, cost, extra_s: float) -> None:
        self.cost, self.extra_s = cost, extra_s
        self.kv_cache_memory_bytes = getattr(cost, "kv_cache_memory_bytes", None)

    def step_seconds(self, shape) -> float:
        return self.cost.step_seconds(shape) + self.extra_s

    def kv_transfer_seconds(self, nbytes: int, connector: str) -> float:
        return self.cost.kv_transfer_seconds(nbytes, connector)

    def kv_bytes_per_token(self) -> int:
        return self.cost.kv_bytes_per_token()


def real_metrics(results: list[Result], span: float, url: str, before: dict, after: dict) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok]
    itl = [x for r in ok for x in r.itl]
    e2e = [r.ttft + sum(r.itl) for r in ok]
    q = after.get("vllm:prefix_cache_queries_total", 0) - before.get("vllm:prefix_cache_queries_total", 0)
    h = after.get("vllm:prefix_cache_hits_total", 0) - before.get("vllm:prefix_cache_hits_total", 0)
    return {
        "completed": len(ok),
        "output_tokens_per_s": sum(r.tokens for r in ok) / span,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p90_s": pct(ttft, 90),
        "ttft_p99_s": pct(ttft, 99),
        "itl_p50_s": pct(itl, 50),
        "itl_p90_s": pct(itl, 90),
        "e2e_p50_s": pct(e2e, 50),
        "prefix_hit_rate": h / q if q else 0.0,
        "errors": sorted({r.error for r in results if not r.ok})[:3],
    }


def sim_metrics(config, trace: list, cost, latency_s: float) -> dict[str, Any]:
    from fleetserve.sim.cluster import run_simulation

    r = run_simulation(
        trace,
        cost,
        config.num_replicas,
        config.routing_policy,
        config.engine,
        network_latency_s=latency_s,
        stats_period_s=config.routing.stats_period_s,
        vocab_size=VOCAB,
    ).to_dict()
    # As the client measures it: from the first arrival to the last completion.
    span = r["duration_s"] - min(t.arrival_s for t in trace)
    return {
        "completed": r["completed"],
        "output_tokens_per_s": r["output_tokens"] / span,
        "ttft_p50_s": r["ttft_s"]["p50"],
        "ttft_p90_s": r["ttft_s"]["p90"],
        "ttft_p99_s": r["ttft_s"]["p99"],
        "itl_p50_s": r["itl_s"]["p50"],
        "itl_p90_s": r["itl_s"]["p90"],
        "e2e_p50_s": r["e2e_s"]["p50"],
        "prefix_hit_rate": r["prefix_hit_rate"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profile", required=True, help="this machine's calibrated profile (fleetserve profile)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--traces", default="poisson,bursty,shared_prefix")
    p.add_argument("--num-requests", type=int, default=150)
    p.add_argument("--request-rate", type=float, default=2.0, help="mean arrivals per second")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per replica (both sides)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-step-overhead",
        dest="step_overhead",
        action="store_false",
        help="price steps by the profile alone (no served per-step overhead from the idle probe)",
    )
    p.add_argument("--out", default=str(RESULTS / "sim_validate.json"))
    args = p.parse_args()

    import ray
    from ray import serve

    from fleetserve.cluster.deploy import connect_ray, start_serve
    from fleetserve.sim.profile import load_profile

    profile = load_profile(args.profile)
    cost = profile.cost_model()
    from fleetserve.sim.shape import StepShape

    all_traces = traces(args.num_requests, args.request_rate, args.seed)
    names = [t.strip() for t in args.traces.split(",") if t.strip()]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    rows: list[dict[str, Any]] = []
    config = app_config(args, port, "power_of_two")
    connect_ray(config, log_to_driver=False)
    start_serve(config)
    try:
        latency_s: float | None = None
        step_extra_s = 0.0
        for name in names:
            trace, policy = all_traces[name]
            config = app_config(args, port, policy)
            redeploy(config)
            model = config.served_model_name
            # Warm-up: every batch shape the kernels meet compiles once; then the idle probe.
            asyncio.run(
                replay(
                    url, model, generate("poisson", num_requests=16, rate=8.0, seed=99, prompt=PROMPT, output=OUTPUT)
                )
            )
            if latency_s is None:
                idle_ttft, idle_itl = asyncio.run(idle_probe(url, model))
                step = cost.step_seconds(StepShape(prefill_tokens=2, prefill_seqs=1, prefill_attn_tokens=2.0))
                decode = cost.step_seconds(StepShape(decode_seqs=1, decode_tokens=1, decode_context_tokens=18))
                latency_s = max(0.0, idle_ttft - step)
                step_extra_s = max(0.0, idle_itl - decode) if args.step_overhead else 0.0
                print(
                    f"idle: 2-token TTFT {idle_ttft * 1e3:.1f} ms (profile step {step * 1e3:.1f} ms): fixed latency "
                    f"{latency_s * 1e3:.1f} ms; ITL {idle_itl * 1e3:.1f} ms (profile step {decode * 1e3:.1f} ms): "
                    f"served step overhead {step_extra_s * 1e3:.1f} ms",
                    flush=True,
                )
            before = scrape(url)
            results, span = asyncio.run(replay(url, model, trace))
            after = scrape(url)
            real = real_metrics(results, span, url, before, after)
            sim = sim_metrics(config, trace, WithStepOverhead(cost, step_extra_s), latency_s)
            rows.append({"trace": name, "policy": policy, "real": real, "sim": sim})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    report(rows, args, profile, latency_s or 0.0, step_extra_s)
    return 0


def rel_err(real: float, sim: float) -> float:
    return (sim - real) / real if real else float("nan")


def report(rows: list[dict[str, Any]], args, profile, latency_s: float, step_extra_s: float) -> None:
    print(
        f"\n{cpu_name()}; profile {profile.name} ({profile.kind}); fixed latency {latency_s * 1e3:.1f} ms; "
        f"served step overhead {step_extra_s * 1e3:.1f} ms"
    )
    print(f"{'trace':<14}{'metric':<22}{'real':>10}{'sim':>10}{'error':>9}{'target':>8}  ok")
    verdicts = []
    for row in rows:
        for m in (*TARGETS, *INFO):
            real, sim = row["real"][m], row["sim"][m]
            err = rel_err(real, sim)
            target = TARGETS.get(m)
            ok = "" if target is None else ("yes" if abs(err) <= target else "NO")
            if target is not None:
                verdicts.append(ok == "yes")
            t = f"{target:.0%}" if target else "-"
            print(f"{row['trace']:<14}{m:<22}{real:>10.4g}{sim:>10.4g}{err:>+9.1%}{t:>8}  {ok}")
        row["errors"] = {m: rel_err(row["real"][m], row["sim"][m]) for m in (*TARGETS, *INFO)}
    print(f"\n{sum(verdicts)} of {len(verdicts)} targeted figures within target")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "cpu": cpu_name(),
                "profile": profile.name,
                "fixed_latency_s": latency_s,
                "served_step_overhead_s": step_extra_s,
                "args": vars(args),
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = list(TARGETS)
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.2 * len(metrics), 3.4))
    for ax, m in zip(axes, metrics):
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["real"][m] for r in rows], 0.4, label="real")
        ax.bar([x + 0.2 for x in xs], [r["sim"][m] for r in rows], 0.4, label="sim")
        ax.set_xticks(list(xs), [r["trace"] for r in rows], fontsize=7)
        ax.set_title(f"{m} (target {TARGETS[m]:.0%})", fontsize=8)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
