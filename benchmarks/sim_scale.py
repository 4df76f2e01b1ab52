"""Fleet simulator speed: simulated requests per wall second at fleet sizes.

Each point replays a seeded Poisson trace (lognormal prompts of median 512 tokens, outputs
of median 128) on N replicas through the real scheduler and the chosen routing policy
(fleetserve/sim), with a step-cost profile (`--profile`, default the shipped analytic
h100-llama-3.1-8b: fleetserve/sim/profile.py). The cost model only sets how many steps a
run takes; the simulator's own speed is what is measured.
Prints one row per point: wall seconds, simulated requests and output tokens per wall
second, virtual duration, utilization, TTFT p50.

    OMP_NUM_THREADS=1 python benchmarks/sim_scale.py                      # 16x5k, 64x20k
    OMP_NUM_THREADS=1 python benchmarks/sim_scale.py --points 128x100000  # the issue's target
    python benchmarks/sim_scale.py --points 16x5000 --cprofile             # cProfile, top 25
    python benchmarks/sim_scale.py --profile h200-llama-3.1-8b              # another profile
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import sys
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from fleetserve.sim.cluster import run_simulation  # noqa: E402
from fleetserve.sim.generators import poisson  # noqa: E402
from fleetserve.sim.profile import load_profile  # noqa: E402


def run_point(replicas: int, requests: int, rate_per_replica: float, policy: str, seed: int, cost) -> dict:
    t0 = time.perf_counter()
    trace = poisson(num_requests=requests, rate=rate_per_replica * replicas, seed=seed)
    gen_s = time.perf_counter() - t0
    args = {"max_model_len": 8192, "kv_cache_memory_bytes": 60 * 2**30, "max_num_seqs": 128}
    result = run_simulation(trace, cost, replicas, policy, args, seed=seed)
    util = result.utilization
    return {
        "replicas": replicas,
        "requests": requests,
        "policy": policy,
        "trace_s": round(gen_s, 2),
        "wall_s": round(result.wall_s, 2),
        "req_per_wall_s": round(requests / result.wall_s),
        "tokens_per_wall_s": round(result.output_tokens / result.wall_s),
        "virtual_s": round(result.duration_s, 1),
        "util_mean": round(sum(util) / len(util), 3),
        "ttft_p50_s": round(result.ttft_s["p50"], 4),
        "completed": result.completed,
        "preemptions": result.preemptions,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", nargs="+", default=["16x5000", "64x20000"], help="REPLICASxREQUESTS")
    ap.add_argument("--rate-per-replica", type=float, default=8.0, help="requests/s per replica")
    ap.add_argument("--policy", default="power_of_two")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default="h100-llama-3.1-8b", help="a step-cost profile: shipped name or JSON path")
    ap.add_argument("--cprofile", action="store_true", help="cProfile the points; print the top 25 functions")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--plot", default=str(Path(HERE) / "results" / "sim_scale.png"), help="the PNG plot's path")
    args = ap.parse_args(argv)
    rows = []
    prof = cProfile.Profile() if args.cprofile else None
    cost = load_profile(args.profile).cost_model()
    machine = platform.processor() or platform.machine()
    print(f"# {machine}, Python {platform.python_version()}, policy {args.policy}, profile {args.profile}")
    cols = ["replicas", "requests", "wall_s", "req_per_wall_s", "tokens_per_wall_s", "virtual_s", "util_mean"]
    cols += ["ttft_p50_s", "completed", "preemptions"]
    print(" ".join(f"{c:>17}" for c in cols))
    for point in args.points:
        n_rep, n_req = (int(x) for x in point.lower().split("x"))
        if prof is not None:
            prof.enable()
        row = run_point(n_rep, n_req, args.rate_per_replica, args.policy, args.seed, cost)
        if prof is not None:
            prof.disable()
        rows.append(row)
        print(" ".join(f"{row[c]:>17}" for c in cols), flush=True)
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    png = Path(args.plot)
    plot(rows, png, args.policy)
    print(f"wrote {png}")
    return 0


def plot(rows: list[dict], path: Path, policy: str) -> None:
    """Simulated requests per wall second at each point, one bar per point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    labels = [f"{r['replicas']} x {r['requests']}" for r in rows]
    bars = ax.bar(labels, [r["req_per_wall_s"] for r in rows], color="#48c")
    for bar, r in zip(bars, rows):
        ax.annotate(
            f"{r['wall_s']:.0f} s", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom"
        )
    ax.set_xlabel("replicas x requests")
    ax.set_ylabel("simulated requests / wall s")
    ax.set_title(f"Fleet simulator speed ({policy}), {platform.processor() or platform.machine()}", fontsize=9)
    ax.margins(y=0.2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
