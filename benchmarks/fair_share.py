"""Per-tenant fair share on a real cluster: a light tenant beside a heavy tenant's backlog.

A 2-replica app of the default SmolLM2 model (`--api-keys-file` with tenants heavy and
light, each named by its key), redeployed per run with `--scheduling-policy fcfs` or `fair`:

* heavy: a closed loop keeping `--heavy-in-flight` (48) streaming requests in flight, each
  a long prompt and `--heavy-tokens` output tokens (with `--max-num-seqs` 16 per replica,
  16 of them wait in the replicas' queues at any time);
* light: one short request per second (Poisson), `--light-tokens` output tokens;
* alone: the light tenant by itself (fcfs);
* fair+seat: fair with `--fair-preemption-gap 0` (a heavy request gives its seat to a
  light one that trails it).

Prints the light tenant's TTFT p50/p90, the heavy tenant's and everyone's output tokens per
second over the window, and writes a PNG (benchmarks/results/fair_share.png).

    PYTHONPATH=. python benchmarks/fair_share.py                 # 60 s per run
    PYTHONPATH=. python benchmarks/fair_share.py --seconds 30    # shorter
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
KEYS = {"heavy": "heavy-key", "light": "light-key"}
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda omicron sigma tau".split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


async def stream(client, url: str, key: str, prompt: str, max_tokens: int, on_token) -> tuple[float, int]:
    """(TTFT in s, or -1 on failure; tokens received) of one streamed completion;
    `on_token()` at each token."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    t0, ttft, tokens = time.perf_counter(), -1.0, 0
    async with client.stream(
        "POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as r:
        if r.status_code != 200:
            await r.aread()
            return -1.0, 0
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:]).get("choices"):
                tokens += 1
                on_token()
                if ttft < 0:
                    ttft = time.perf_counter() - t0
    return ttft, tokens


async def run_load(url: str, args, heavy: bool) -> dict:
    import httpx

    rng = random.Random(0)
    counts = {"heavy": 0, "light": 0}
    light_ttft: list[float] = []
    heavy_ttft: list[float] = []
    window = {"open": False, "heavy": True}  # heavy: its loops keep going until the light ones end

    def counter(tenant: str):
        def on_token() -> None:
            if window["open"]:
                counts[tenant] += 1

        return on_token

    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:

        async def heavy_loop(i: int) -> None:
            while window["heavy"]:
                prompt = " ".join(rng.choice(WORDS) for _ in range(args.heavy_words)) + f" {i}"
                in_window = window["open"]
                ttft, _ = await stream(client, url, KEYS["heavy"], prompt, args.heavy_tokens, counter("heavy"))
                if in_window and ttft >= 0:
                    heavy_ttft.append(ttft)

        async def light_one(j: int) -> None:
            prompt = f"question {j}: " + " ".join(rng.choice(WORDS) for _ in range(8))
            ttft, _ = await stream(client, url, KEYS["light"], prompt, args.light_tokens, counter("light"))
            if ttft >= 0:
                light_ttft.append(ttft)

        heavies = [asyncio.create_task(heavy_loop(i)) for i in range(args.heavy_in_flight if heavy else 0)]
        await asyncio.sleep(args.warmup if heavy else 0)  # let the heavy backlog form
        t0 = time.perf_counter()
        stop = t0 + args.seconds
        window["open"] = True  # tokens count from here
        lights, j = [], 0
        while time.perf_counter() < stop:
            lights.append(asyncio.create_task(light_one(j)))
            j += 1
            await asyncio.sleep(rng.expovariate(args.light_rate))
        await asyncio.sleep(max(0.0, stop - time.perf_counter()))
        window["open"] = False
        elapsed = time.perf_counter() - t0
        await asyncio.gather(*lights)
        window["heavy"] = False
        for t in heavies:
            t.cancel()
        await asyncio.gather(*heavies, return_exceptions=True)
    return {
        "light_requests": len(light_ttft),
        "light_ttft_p50_s": round(pct(light_ttft, 0.5), 3),
        "light_ttft_p90_s": round(pct(light_ttft, 0.9), 3),
        "heavy_ttft_p50_s": round(pct(heavy_ttft, 0.5), 2) if heavy_ttft else None,
        "heavy_tok_per_s": round(counts["heavy"] / elapsed, 1),
        "light_tok_per_s": round(counts["light"] / elapsed, 1),
    }


def deploy(args, policy: str, port: int, keys_file: str, gap=None):
    from ray import serve

    from fleetserve.cluster.config import AppConfig
    from fleetserve.cluster.deploy import deploy as deploy_app

    config = AppConfig.model_validate(
        {
            "name": "fair",
            "engine": {
                "model": args.model,
                "max_model_len": 2048,
                "num_threads": 1,
                "max_num_seqs": args.max_num_seqs,
                "scheduling_policy": policy,
                "fair_preemption_gap": gap,
            },
            "num_replicas": 2,
            "http": {"port": port},
            "grpc": {"enabled": False},
            "num_cpus_per_replica": 0,
            "api_keys_file": keys_file,
        }
    )
    try:
        serve.delete(config.name)
    except Exception as e:  # nothing deployed yet
        print(f"(no previous app: {e})", file=sys.stderr)
    deploy_app(config)
    return config


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--seconds", type=float, default=60.0, help="measured window per run")
    ap.add_argument("--warmup", type=float, default=15.0, help="heavy load before the window")
    ap.add_argument("--heavy-in-flight", type=int, default=48)
    ap.add_argument("--heavy-words", type=int, default=300)
    ap.add_argument("--heavy-tokens", type=int, default=256)
    ap.add_argument("--light-rate", type=float, default=1.0)
    ap.add_argument("--light-tokens", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--json", default=str(HERE / "results" / "fair_share.json"))
    ap.add_argument("--plot", default=str(HERE / "results" / "fair_share.png"))
    args = ap.parse_args(argv)

    from fleetserve.cluster.config import AppConfig
    from fleetserve.cluster.deploy import connect_ray, start_serve

    keys = Path(tempfile.mkdtemp()) / "keys.yaml"
    keys.write_text("".join(f"{t}: {{key: {k}}}\n" for t, k in KEYS.items()))
    port = free_port()
    base = AppConfig.model_validate({"name": "fair", "http": {"port": port}, "grpc": {"enabled": False}})
    connect_ray(base, num_cpus=2, log_to_driver=False)
    start_serve(base)
    url = f"http://127.0.0.1:{port}"
    rows = []
    runs = [("alone", "fcfs", False, None), ("fcfs", "fcfs", True, None), ("fair", "fair", True, None)]
    runs.append(("fair+seat", "fair", True, 0.0))  # --fair-preemption-gap 0
    for name, policy, heavy, gap in runs:
        deploy(args, policy, port, str(keys), gap)
        row = {"run": name, "policy": policy, **asyncio.run(run_load(url, args, heavy))}
        row["total_tok_per_s"] = round(row["heavy_tok_per_s"] + row["light_tok_per_s"], 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    plot(rows, Path(args.plot))
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.2))
    names = [r["run"] for r in rows]
    x = range(len(rows))
    a.bar([i - 0.2 for i in x], [r["light_ttft_p50_s"] for r in rows], 0.4, label="p50")
    a.bar([i + 0.2 for i in x], [r["light_ttft_p90_s"] for r in rows], 0.4, label="p90")
    a.set_xticks(list(x), names)
    a.set_ylabel("light tenant TTFT (s)")
    a.legend()
    b.bar(names, [r["total_tok_per_s"] for r in rows], color="#888")
    b.set_ylabel("output tokens/s (all tenants)")
    fig.suptitle("2 replicas of SmolLM2-135M: light tenant beside 48 heavy requests", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
