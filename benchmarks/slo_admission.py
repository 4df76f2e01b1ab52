"""SLO-aware admission on a real cluster: goodput under 2x overload, with and without it.

A 2-replica app of the default SmolLM2 model, redeployed per run:

* capacity: a closed loop of `--concurrency` clients for `--calibrate-s` seconds measures
  the requests/s the app completes (each a `--prompt-words`-word prompt, `--max-tokens`
  output tokens, ignore_eos);
* off / online / profile: Poisson arrivals at `--overload` (2) times that rate for
  `--seconds`, the same arrival times and prompts each run; off is today's app, online is
  `--slo-ttft-ms` (and `--slo-itl-ms` when given) with the router's online estimate, profile
  adds `--slo-profile` (default: the shipped calibrated profile of SmolLM2 on this kind of
  CPU, one thread per replica).

A request meets its SLO when its TTFT (client-measured, to the first streamed token) is at
most the target and its mean time per output token after the first is at most the ITL
target; a 429 counts as refused (the client does not retry). Goodput = met / the window.
Prints a table and writes benchmarks/results/slo_admission.{json,png}.

    PYTHONPATH=. python benchmarks/slo_admission.py                      # 60 s per run
    PYTHONPATH=. python benchmarks/slo_admission.py --seconds 30 --ttft-ms 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
HERE = Path(__file__).parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda omicron sigma tau".split()
DEFAULT_PROFILE = ROOT / "sim" / "profiles" / "cpu-amd-epyc-avx2-smollm2-135m-1t.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


async def one(client, url: str, prompt: str, max_tokens: int) -> dict:
    """One streamed completion: status, TTFT, tokens, mean time per token after the first."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    first = last = -1.0
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            return {"status": r.status_code, "retry_after": r.headers.get("retry-after"), "error": text[:300]}
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:]).get("choices"):
                now = time.perf_counter()
                tokens += 1
                last = now
                if first < 0:
                    first = now
    ttft = first - t0 if first >= 0 else None
    tpot = (last - first) / (tokens - 1) if tokens > 1 else 0.0
    return {"status": 200, "ttft": ttft, "tpot": tpot, "tokens": tokens}


def prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(n)]


async def calibrate(url: str, args) -> float:
    import httpx

    ps = prompts(100_000, args.prompt_words, 1)
    done, stop = 0, time.perf_counter() + args.calibrate_s
    async with httpx.AsyncClient(timeout=600) as client:

        async def loop(k: int) -> None:
            nonlocal done
            i = k
            while time.perf_counter() < stop:
                r = await one(client, url, ps[i % len(ps)], args.max_tokens)
                i += args.concurrency
                if r["status"] != 200:
                    raise RuntimeError(f"capacity run: a request failed: {r}")
                done += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(loop(k) for k in range(args.concurrency)))
        elapsed = time.perf_counter() - t0  # every loop's last request included
        print(f"capacity run: {done} requests in {elapsed:.1f} s", flush=True)
        return done / elapsed


async def open_loop(url: str, args, arrivals: list[float], ps: list[str]) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        t0 = time.perf_counter()
        tasks = []
        for at, p in zip(arrivals, ps):
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            tasks.append(asyncio.create_task(one(client, url, p, args.max_tokens)))
        results = await asyncio.gather(*tasks)
    ok = [r for r in results if r["status"] == 200 and r["ttft"] is not None]
    refused = [r for r in results if r["status"] == 429]
    ttft_max, itl_max = args.ttft_ms / 1e3, (args.itl_ms / 1e3 if args.itl_ms else None)
    met = [r for r in ok if r["ttft"] <= ttft_max and (itl_max is None or r["tpot"] <= itl_max)]
    return {
        "requests": len(results),
        "served": len(ok),
        "refused": len(refused),
        "failed": len(results) - len(ok) - len(refused),
        "met_slo": len(met),
        "goodput": round(len(met) / args.seconds, 2),
        "ttft_p50": round(pct([r["ttft"] for r in ok], 0.5), 3),
        "ttft_p90": round(pct([r["ttft"] for r in ok], 0.9), 3),
        "tpot_p90": round(pct([r["tpot"] for r in ok], 0.9), 4),
        "retry_after_p50": pct([int(r["retry_after"]) for r in refused if r.get("retry_after")], 0.5),
    }


def deploy(args, port: int, slo: dict):
    from ray import serve

    from fleetserve.cluster.config import AppConfig
    from fleetserve.cluster.deploy import deploy as deploy_app

    config = AppConfig.model_validate(
        {
            "name": "slo",
            "engine": {
                "model": args.model,
                "max_model_len": 2048,
                "num_threads": 1,
                "max_num_seqs": args.max_num_seqs,
            },
            "num_replicas": 2,
            "http": {"port": port},
            "grpc": {"enabled": False},
            "num_cpus_per_replica": 0,
            "slo": slo,
        }
    )
    try:
        serve.delete(config.name)
    except Exception as e:  # nothing deployed yet
        print(f"(no previous app: {e})", file=sys.stderr)
    deploy_app(config)
    return config


def leaked_blocks(app: str) -> int:
    """KV blocks not free on the engine replicas once the load is over (0: none leaked)."""
    from ray import serve

    from fleetserve.router.routing.registry import get_router
    from fleetserve.router.routing.request_router import TARGET_KWARG

    handle = serve.get_deployment_handle("engine", app)

    async def go() -> int:
        await handle.get_info.remote()
        router = get_router(app, "engine")
        total = 0
        for rid in router.replica_ids():
            r = await handle.control.remote("get_load", **{TARGET_KWARG: rid})
            total += r["load"]["num_blocks"] - r["load"]["num_free_blocks"]
        return total

    for _ in range(50):
        n = asyncio.run(go())
        if n == 0:
            return 0
        time.sleep(0.2)
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--seconds", type=float, default=60.0, help="arrivals for this long per run")
    ap.add_argument("--calibrate-s", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=32, help="closed-loop clients of the capacity run")
    ap.add_argument("--overload", type=float, default=2.0, help="offered rate / measured capacity")
    ap.add_argument("--prompt-words", type=int, default=120)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--ttft-ms", type=float, default=2000.0)
    ap.add_argument("--itl-ms", type=float, default=None)
    ap.add_argument("--profile", default=str(DEFAULT_PROFILE), help="--slo-profile of the profile run")
    ap.add_argument("--runs", nargs="+", default=["off", "online", "profile"], choices=["off", "online", "profile"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=str(HERE / "results" / "slo_admission.json"))
    ap.add_argument("--plot", default=str(HERE / "results" / "slo_admission.png"))
    args = ap.parse_args(argv)

    from fleetserve.cluster.config import AppConfig
    from fleetserve.cluster.deploy import connect_ray, start_serve

    port = free_port()
    base = AppConfig.model_validate({"name": "slo", "http": {"port": port}, "grpc": {"enabled": False}})
    connect_ray(base, num_cpus=2, log_to_driver=False)
    start_serve(base)
    url = f"http://127.0.0.1:{port}"
    deploy(args, port, {})
    capacity = asyncio.run(calibrate(url, args))
    rate = args.overload * capacity
    print(f"capacity {capacity:.2f} req/s; offered {rate:.2f} req/s", flush=True)
    rng = random.Random(args.seed)
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t > args.seconds:
            break
        arrivals.append(t)
    ps = prompts(len(arrivals), args.prompt_words, args.seed + 2)
    targets = {"ttft_ms": args.ttft_ms, **({"itl_ms": args.itl_ms} if args.itl_ms else {})}
    rows = []
    for name in args.runs:
        slo = {} if name == "off" else dict(targets, **({"profile": args.profile} if name == "profile" else {}))
        config = deploy(args, port, slo)
        row = {"run": name, **asyncio.run(open_loop(url, args, arrivals, ps))}
        row["leaked_blocks"] = leaked_blocks(config.name)
        print(json.dumps(row), flush=True)
        rows.append(row)
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(
        json.dumps({"args": vars(args), "capacity_rps": capacity, "offered_rps": rate, "rows": rows}, indent=2)
    )
    plot(rows, Path(args.plot), capacity, rate)
    return 0


def plot(rows: list[dict], path: Path, capacity: float, rate: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.2))
    names = [r["run"] for r in rows]
    a.bar(names, [r["goodput"] for r in rows])
    a.set_ylabel("goodput (req/s meeting the SLO)")
    b.bar(names, [r["ttft_p90"] for r in rows], color="#888")
    b.set_ylabel("TTFT p90 of served requests (s)")
    fig.suptitle(f"2 SmolLM2 replicas, {rate:.1f} req/s offered ({rate / capacity:.1f}x capacity)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
