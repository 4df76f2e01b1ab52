"""Soak: minutes of mixed load with faults, on a local cluster (issue 15).

Three phases of `--phase-s` seconds each, the same mixed load throughout (streaming and
not, some clients that disconnect at a random point):
  before  - nothing wrong;
  during  - one replica's engine core is SIGKILLed at the start (its streams migrate,
            Serve replaces the replica) and an overload burst of `--burst` concurrent
            requests arrives;
  after   - nothing wrong again.
With `--hostile`, 'during' has no fault: hostile clients of every class the hardening
review found (fleetserve/router/hostile.py: huge prompt lists, huge bias maps, long prompts
with truncation, slow grammars, contradictory masks, bogus LoRA paths, a flood of /metrics
scrapes) send concurrently with the normal load, from a process of their own (building and
reading their megabyte bodies on the normal clients' event loop would delay those clients
and measure the benchmark, not the server), and the report adds, per class, how many
were sent and how many got a clean answer (must be all), and the normal clients' ITL p99
during the attack over before it (the target: at most 2x).
Reports requests completed / refused (429/503) / failed (anything else: must be 0),
client aborts, leaked KV blocks once idle, the serving processes' RSS (ingress, engine
replicas, engine cores) at each phase's end, and p50/p99 TTFT, ITL and /health latency
(polled every 0.5 s throughout) per phase. Table on stdout; PNG and JSON under
benchmarks/results/ (soak-<model>.png/.json).

    flock -x /tmp/fleetserve-heavy.lock python benchmarks/soak.py --phase-s 60
    python benchmarks/soak.py --model smollm2-135m --phase-s 120   # the real model
    python benchmarks/soak.py --hostile --phase-s 30                # the hostile mix
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
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

from fleetserve.router import hostile


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cluster(model: str, replicas: int, lora_root: str | None = None):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from fleetserve.cluster.config import AppConfig
    from fleetserve.cluster.deploy import connect_ray, deploy, start_serve

    spec = {
        "name": "soak",
        "num_replicas": replicas,
        "num_cpus_per_replica": 0,
        "engine": {
            "model": model,
            "max_model_len": 512,
            "num_gpu_blocks_override": 256,
            "max_num_seqs": 16,
            "max_waiting_requests": 32,
            "num_threads": 1,
        },
        "http": {"port": _free_port()},
        "grpc": {"port": _free_port()},
        "reliability": {"health_check_period_s": 2},
    }
    if lora_root is not None:  # --hostile: runtime LoRA loading on, under one root
        spec["allow_runtime_lora_updating"] = True
        spec["engine"].update(enable_lora=True, lora_roots=[lora_root])
    config = AppConfig.model_validate(spec)
    connect_ray(config, num_cpus=2, log_to_driver=False)
    start_serve(config)
    deploy(config)
    return config


async def control_all(app: str, op: str) -> dict:
    from ray import serve

    from fleetserve.router.routing.registry import get_router
    from fleetserve.router.routing.request_router import TARGET_KWARG

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
    body = {
        "prompt": f"soak {rng.randint(0, 10**6)} " * rng.randint(1, 20),
        "max_tokens": rng.randint(8, 64),
        "ignore_eos": True,
        "stream": stream,
    }
    start = time.monotonic()
    try:
        if not stream:
            r = await client.post("/v1/completions", json=body)
            outcome = "completed" if r.status_code == 200 else "refused" if r.status_code in (429, 503) else "failed"
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
                    now - (start if last is None else last)
                )
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


def server_processes() -> dict[int, tuple[str, float]]:
    """pid -> (what, RSS MiB) of the serving processes this run started: the ingress, the
    engine replicas and their engine cores (Ray's own daemons left out)."""
    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            if "core_process" in cmd:
                what = "engine cores"
            elif "ServeReplica:" in cmd:
                what = "ingress" if ":ingress" in cmd else "engine replicas"
            else:
                continue
            out[p.pid] = (what, p.memory_info().rss / 2**20)
        except psutil.NoSuchProcess:
            continue
    return out


async def poll_health(base: str, phase_of, samples: list, stop: asyncio.Event) -> None:
    """GET /health every 0.5 s on a connection of its own: (phase, seconds, status)."""
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        while not stop.is_set():
            phase, s = phase_of(), time.monotonic()
            try:
                status = (await client.get("/health")).status_code
            except httpx.HTTPError:
                status = 0
            samples.append((phase, time.monotonic() - s, status))
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except asyncio.TimeoutError:
                pass


async def run(args) -> dict:
    config = start_cluster(args.model, args.replicas, tempfile.mkdtemp() if args.hostile else None)
    base = f"http://127.0.0.1:{config.http.port}"
    stats = Stats()
    outcomes: list[hostile.Outcome] = []
    phases = ("before", "during", "after")
    memory = {"start": server_processes()}
    t0 = time.monotonic()

    def phase_of():
        return phases[min(2, int((time.monotonic() - t0) // args.phase_s))]

    health: list = []
    stop_health = asyncio.Event()
    prober = asyncio.ensure_future(poll_health(base, phase_of, health, stop_health))
    limits = httpx.Limits(max_connections=args.concurrency + args.burst + 10)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        stop_at = t0 + 3 * args.phase_s
        tasks = [asyncio.ensure_future(worker(client, stats, phase_of, stop_at, i)) for i in range(args.concurrency)]
        await asyncio.sleep(args.phase_s)
        memory["before"] = server_processes()
        victim, burst = None, []
        attackers = None
        if args.hostile:
            target = await hostile_target(config)
            attackers = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
            stop_attack = t0 + 2 * args.phase_s
            burst = [asyncio.get_running_loop().run_in_executor(attackers, hostile_mix, base, target, stop_attack)]
        else:
            replicas = await control_all(config.name, "health")
            victim = sorted(h["core_pid"] for h in replicas.values() if h.get("core_pid"))[0]
            os.kill(victim, signal.SIGKILL)
            rng = random.Random(99)
            burst = [asyncio.ensure_future(one_request(client, stats, phase_of, rng)) for _ in range(args.burst)]
        await asyncio.sleep(max(0.0, t0 + 2 * args.phase_s - time.monotonic()))
        memory["during"] = server_processes()
        done = await asyncio.gather(*burst, *tasks)
        if attackers is not None:
            outcomes.extend(done[0])
            attackers.shutdown()
        memory["after"] = server_processes()
    stop_health.set()
    await prober
    leaked = None
    for _ in range(60):  # idle: every block back in every replica's pool
        loads = await control_all(config.name, "get_load")
        leaked = sum(r["load"]["num_blocks"] - r["load"]["num_free_blocks"] for r in loads.values() if "load" in r)
        if leaked == 0:
            break
        await asyncio.sleep(1)
    memory["idle"] = server_processes()
    return {
        "stats": stats,
        "leaked_blocks": leaked,
        "memory": memory,
        "health": health,
        "victim": victim,
        "hostile": hostile.summary(outcomes) if args.hostile else None,
    }


def hostile_mix(base: str, target: hostile.Target, stop_at: float) -> list[hostile.Outcome]:
    """Every hostile class at once until `stop_at` (time.monotonic(), the same clock in every
    process), on a loop and client of its own: run in a process of its own."""

    async def attack() -> list[hostile.Outcome]:
        outcomes: list[hostile.Outcome] = []
        async with httpx.AsyncClient(base_url=base, timeout=120, limits=httpx.Limits(max_connections=32)) as client:
            await asyncio.gather(
                *(
                    hostile.hostile_worker(client, target, cls, stop_at, outcomes, seed=i * 10 + w)
                    for i, cls in enumerate(hostile.CLASSES)
                    for w in range(2 if cls == "scrape_flood" else 1)
                )
            )
        return outcomes

    return asyncio.run(attack())


async def hostile_target(config) -> hostile.Target:
    """What the hostile clients need: the served name, eos (from an engine's tokenizer)."""
    from ray import serve

    info = await serve.get_deployment_handle("engine", config.name).get_info.remote()
    return hostile.Target(
        model=config.served_model_name,
        eos_token_id=info["tokenizer"].eos_token_id,
        max_body_bytes=config.http.max_body_bytes,
    )


def memory_table(memory: dict) -> list[dict]:
    """Per kind of process: total RSS at each snapshot, and the growth of the processes that
    lived through the whole run (the replaced replica and core excluded)."""
    rows = []
    survivors = set(memory["start"]) & set(memory["idle"])
    for what in ("ingress", "engine replicas", "engine cores"):
        row = {"what": what}
        for snap, procs in memory.items():
            row[snap] = sum(rss for w, rss in procs.values() if w == what)
            row[snap + "_n"] = sum(1 for w, _ in procs.values() if w == what)
        pids = [pid for pid in survivors if memory["start"][pid][0] == what]
        row["survivor_growth"] = sum(memory["idle"][p][1] - memory["start"][p][1] for p in pids)
        row["survivors"] = len(pids)
        rows.append(row)
    return rows


def _pct(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def report(result: dict, out_png: Path, title: str) -> dict:
    stats = result["stats"]
    summary = {"phases": {}, "leaked_blocks": result["leaked_blocks"]}
    print(
        f"{'phase':8} {'completed':>9} {'refused':>8} {'failed':>7} {'aborted':>8} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
        f"{'health p50':>10} {'p99':>7} {'max':>7}"
    )
    for phase in ("before", "during", "after"):
        c = stats.counts[phase]
        h = [s for p, s, _ in result["health"] if p == phase]
        row = {k: c[k] for k in ("completed", "refused", "failed", "aborted")}
        row.update(
            ttft_p50_ms=_pct(stats.ttft[phase], 50) * 1e3,
            ttft_p99_ms=_pct(stats.ttft[phase], 99) * 1e3,
            itl_p50_ms=_pct(stats.itl[phase], 50) * 1e3,
            itl_p99_ms=_pct(stats.itl[phase], 99) * 1e3,
            health_p50_ms=_pct(h, 50) * 1e3,
            health_p99_ms=_pct(h, 99) * 1e3,
            health_max_ms=max(h, default=float("nan")) * 1e3,
            health_non_200=sum(1 for p, _, st in result["health"] if p == phase and st != 200),
        )
        summary["phases"][phase] = row
        print(
            f"{phase:8} {row['completed']:9d} {row['refused']:8d} {row['failed']:7d} "
            f"{row['aborted']:8d} {row['ttft_p50_ms']:8.0f}ms {row['ttft_p99_ms']:8.0f}ms "
            f"{row['itl_p50_ms']:7.1f}ms {row['itl_p99_ms']:7.1f}ms "
            f"{row['health_p50_ms']:8.0f}ms {row['health_p99_ms']:5.0f}ms {row['health_max_ms']:5.0f}ms"
        )
    non_200 = {p: r["health_non_200"] for p, r in summary["phases"].items()}
    print(
        f"leaked KV blocks once idle: {result['leaked_blocks']}; /health answers other than "
        f"200 per phase: {non_200} (503 only if no engine were healthy)"
    )
    mem = memory_table(result["memory"])
    summary["memory_mib"] = mem
    print(
        f"{'RSS MiB':16} {'start':>7} {'before':>7} {'during':>7} {'after':>7} {'idle':>7} {'growth of survivors':>20}"
    )
    for row in mem:
        print(
            f"{row['what']:16} "
            + " ".join(f"{row[k]:7.0f}" for k in ("start", "before", "during", "after", "idle"))
            + f" {row['survivor_growth']:+12.0f} ({row['survivors']} processes)"
        )
    for f in stats.failures[:10]:
        print("failure:", f)
    if result.get("hostile") is not None:
        summary["hostile"] = result["hostile"]
        ph = summary["phases"]
        summary["itl_p99_ratio"] = ph["during"]["itl_p99_ms"] / ph["before"]["itl_p99_ms"]
        print(f"{'hostile class':14} {'sent':>6} {'clean':>6} {'worst s':>8}  statuses / first unclean")
        for cls, h in result["hostile"].items():
            print(f"{cls:14} {h['sent']:6d} {h['clean']:6d} {h['worst_s']:8.2f}  {h['statuses']} {h['unclean'] or ''}")
        print(f"normal clients' ITL p99 under attack / before: {summary['itl_p99_ratio']:.2f}x (target <= 2x)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    phases = ("before", "during", "after")
    for ax, series, name in ((axes[0], stats.ttft, "TTFT"), (axes[1], stats.itl, "ITL")):
        for q, style in ((50, "o-"), (99, "s--")):
            ax.plot(phases, [_pct(series[p], q) * 1e3 for p in phases], style, label=f"p{q}")
        ax.set_title(f"{name} (ms)")
        ax.set_yscale("log")
        ax.legend()
    for q, style in ((50, "o-"), (99, "s--")):
        axes[2].plot(
            phases,
            [_pct([s for p, s, _ in result["health"] if p == ph], q) * 1e3 for ph in phases],
            style,
            label=f"p{q}",
        )
    axes[2].set_title("/health (ms)")
    axes[2].legend()
    what = "the hostile mix" if result.get("hostile") is not None else "an engine core SIGKILLed + an overload burst"
    fig.suptitle(f"soak ({title}): {what} in 'during'")
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100, bbox_inches="tight")
    print(f"plot: {out_png}")
    return summary


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return "unknown"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model (default: a tiny random Llama)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--phase-s", type=float, default=60)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--burst", type=int, default=150)
    p.add_argument("--hostile", action="store_true", help="'during': the hostile mix instead of a fault and a burst")
    args = p.parse_args()
    tiny = args.model is None
    if tiny:
        from fleetserve.replica.testing import make_tiny_llama

        args.model = str(make_tiny_llama(Path(tempfile.mkdtemp()) / "tiny"))
    name = "tiny" if tiny else Path(args.model).name
    result = asyncio.run(run(args))
    results = Path(__file__).parent / "results"
    name += "-hostile" if args.hostile else ""
    summary = report(result, results / f"soak-{name}.png", name)
    summary.update(model=name, args=vars(args), cpu=_cpu_name(), failures=result["stats"].failures[:50])
    (results / f"soak-{name}.json").write_text(json.dumps(summary, indent=1))
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    failed = sum(c["failed"] for c in result["stats"].counts.values())
    unclean = sum(h["sent"] - h["clean"] for h in (result.get("hostile") or {}).values())
    return 0 if failed == 0 and unclean == 0 and result["leaked_blocks"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
