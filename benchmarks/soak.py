"""Soak: minutes of mixed load with faults, on a local cluster (issue 15).

Three phases of `--phase-s` seconds each, the same mixed load throughout (streaming and
not, some clients that disconnect at a random point):
  before  - nothing wrong;
  during  - one replica's engine core is SIGKILLed at the start (its streams migrate,
            Serve replaces the replica) and an overload burst of `--burst` concurrent
            requests arrives;
  after   - nothing wrong again.
Reports requests completed / refused (429/503) / failed (anything else: must be 0),
client aborts, leaked KV blocks once idle, the replicas' RSS growth, and p50/p99 TTFT and
ITL per phase. Table on stdout, PNG under benchmarks/results/.

    flock -x /tmp/fleetserve-heavy.lock python benchmarks/soak.py --phase-s 60
    python benchmarks/soak.py --model smollm2-135m --phase-s 120   # the real model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx
import psutil


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cluster(model: str, replicas: int):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from fleetserve.cluster.config import AppConfig
    from fleetserve.cluster.deploy import connect_ray, deploy, start_serve

    config = AppConfig.model_validate({
        "name": "soak", "num_replicas": replicas, "num_cpus_per_replica": 0,
        "engine": {"model": model, "max_model_len": 512, "num_gpu_blocks_override": 256,
                   "max_num_seqs": 16, "max_waiting_requests": 32, "num_threads": 1},
        "http": {"port": _free_port()}, "grpc": {"port": _free_port()},
        "reliability": {"health_check_period_s": 2}})
    connect_ray(config, num_cpus=2, log_to_driver=False)
    start_serve(config)
    deploy(config)
    return config


async def control_all(app: str, op: str) -> dict:
    from ray import serve

    from fleetserve.router.registry import get_router
    from fleetserve.router.request_router import TARGET_KWARG

    handle = serve.get_deployment_handle("engine", app)
    await handle.get_info.remote()
    out = {}
    for rid in get_router(app, "engine").replica_ids():
        try:
            r = await asyncio.wait_for(handle.control.remote(op, **{TARGET_KWARG: rid}), 10)
            out[r["replica"]] = r
        except Exception as e:  # noqa: BLE001 - a replica being replaced
            out[rid] = {"error": repr(e)}
    return out


class Stats:
    def __init__(self) -> None:
        self.counts = defaultdict(lambda: defaultdict(int))
        self.ttft = defaultdict(list)
        self.itl = defaultdict(list)
        self.failures: list[str] = []


async def one_request(client: httpx.AsyncClient, stats: Stats, phase_of, rng: random.Random):
    phase = phase_of()
    stream = rng.random() < 0.7
    abort_after = rng.randint(1, 20) if stream and rng.random() < 0.15 else None
    body = {"prompt": f"soak {rng.randint(0, 10**6)} " * rng.randint(1, 20),
            "max_tokens": rng.randint(8, 64), "ignore_eos": True, "stream": stream}
    start = time.monotonic()
    try:
        if not stream:
            r = await client.post("/v1/completions", json=body)
            outcome = ("completed" if r.status_code == 200 else
                       "refused" if r.status_code in (429, 503) else "failed")
            if outcome == "failed":
                stats.failures.append(f"{r.status_code} {r.text[:200]}")
            stats.counts[phase][outcome] += 1
            return
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                outcome = "refused" if r.status_code in (429, 503) else "failed"
                if outcome == "failed":
                    stats.failures.append(f"{r.status_code} {r.text[:200]}")
                stats.counts[phase][outcome] += 1
                return
            last, chunks, done = None, 0, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                data = json.loads(line[6:])
                if "error" in data:
                    stats.failures.append(f"stream error {data['error']}")
                    stats.counts[phase]["failed"] += 1
                    return
                now = time.monotonic()
                (stats.ttft[phase] if last is None else stats.itl[phase]).append(
                    now - (start if last is None else last))
                last, chunks = now, chunks + 1
                if abort_after is not None and chunks >= abort_after:
                    stats.counts[phase]["aborted"] += 1
                    return  # leaving the block closes the connection mid-stream
            stats.counts[phase]["completed" if done else "failed"] += 1
            if not done:
                stats.failures.append("stream ended without [DONE]")
    except httpx.HTTPError as e:
        stats.counts[phase]["failed"] += 1
        stats.failures.append(repr(e))


async def worker(client, stats, phase_of, stop_at, seed):
    rng = random.Random(seed)
    while time.monotonic() < stop_at:
        await one_request(client, stats, phase_of, rng)


def replica_rss(pids) -> float:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def engine_pids() -> list[int]:
    me = psutil.Process()
    return [p.pid for p in me.children(recursive=True)
            if "core_process" in " ".join(p.cmdline()) or "ServeReplica" in p.name()]


async def run(args) -> dict:
    config = start_cluster(args.model, args.replicas)
    base = f"http://127.0.0.1:{config.http.port}"
    stats = Stats()
    phases = ("before", "during", "after")
    t0 = time.monotonic()

    def phase_of():
        return phases[min(2, int((time.monotonic() - t0) // args.phase_s))]

    rss_before = replica_rss(engine_pids())
    limits = httpx.Limits(max_connections=args.concurrency + args.burst + 10)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        stop_at = t0 + 3 * args.phase_s
        tasks = [asyncio.ensure_future(worker(client, stats, phase_of, stop_at, i))
                 for i in range(args.concurrency)]
        await asyncio.sleep(args.phase_s)
        health = await control_all(config.name, "health")
        victim = sorted(h["core_pid"] for h in health.values() if h.get("core_pid"))[0]
        os.kill(victim, signal.SIGKILL)
        rng = random.Random(99)
        burst = [asyncio.ensure_future(one_request(client, stats, phase_of, rng))
                 for _ in range(args.burst)]
        health_latency = []
        while time.monotonic() < t0 + 2 * args.phase_s:
            s = time.monotonic()
            await client.get("/health")
            health_latency.append(time.monotonic() - s)
            await asyncio.sleep(1)
        await asyncio.gather(*burst, *tasks)
    leaked = None
    for _ in range(60):  # idle: every block back in every replica's pool
        loads = await control_all(config.name, "get_load")
        leaked = sum(l["load"]["num_blocks"] - l["load"]["num_free_blocks"]
                     for l in loads.values() if "load" in l)
        if leaked == 0:
            break
        await asyncio.sleep(1)
    rss_after = replica_rss(engine_pids())
    return {"stats": stats, "leaked_blocks": leaked, "rss_before_mib": rss_before,
            "rss_after_mib": rss_after, "health_p99_s": _pct(health_latency, 99)}


def _pct(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def report(result: dict, out_png: Path) -> None:
    stats = result["stats"]
    print(f"{'phase':8} {'completed':>9} {'refused':>8} {'failed':>7} {'aborted':>8} "
          f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}")
    for phase in ("before", "during", "after"):
        c = stats.counts[phase]
        print(f"{phase:8} {c['completed']:9d} {c['refused']:8d} {c['failed']:7d} {c['aborted']:8d} "
              f"{_pct(stats.ttft[phase], 50) * 1e3:8.0f}ms {_pct(stats.ttft[phase], 99) * 1e3:8.0f}ms "
              f"{_pct(stats.itl[phase], 50) * 1e3:7.1f}ms {_pct(stats.itl[phase], 99) * 1e3:7.1f}ms")
    print(f"leaked KV blocks once idle: {result['leaked_blocks']}; replica RSS "
          f"{result['rss_before_mib']:.0f} -> {result['rss_after_mib']:.0f} MiB; "
          f"/health p99 during the faults {result['health_p99_s'] * 1e3:.0f} ms")
    for f in stats.failures[:10]:
        print("failure:", f)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    phases = ("before", "during", "after")
    for ax, series, name in ((axes[0], stats.ttft, "TTFT"), (axes[1], stats.itl, "ITL")):
        for q, style in ((50, "o-"), (99, "s--")):
            ax.plot(phases, [_pct(series[p], q) * 1e3 for p in phases], style, label=f"p{q}")
        ax.set_title(f"{name} (ms)")
        ax.legend()
    fig.suptitle("soak: replica engine killed + overload burst in 'during'")
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100, bbox_inches="tight")
    print(f"plot: {out_png}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model (default: a tiny random Llama)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--phase-s", type=float, default=60)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--burst", type=int, default=150)
    args = p.parse_args()
    if args.model is None:
        from fleetserve.replica.testing import make_tiny_llama

        args.model = str(make_tiny_llama(Path(tempfile.mkdtemp()) / "tiny"))
    result = asyncio.run(run(args))
    report(result, Path(__file__).parent / "results" / "soak.png")
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    failed = sum(c["failed"] for c in result["stats"].counts.values())
    return 0 if failed == 0 and result["leaked_blocks"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
