"""SLO-aware admission under 2x overload in the fleet simulator: goodput with and without it.

Per fleet size N it writes one trace and runs `fleetserve sim` on it three times (the real
scheduler in every replica, the real router and the router's own admission code,
router/routing/slo.py; a step-cost profile for the model):

* off: today's behaviour, every request queued;
* profile: `--slo-ttft-ms/--slo-itl-ms` with `--slo-profile` the same profile the simulator
  prices steps with (the router knows the hardware);
* online: the same targets, no profile (the router estimates each replica from its load
  reports alone).

The trace: Poisson arrivals at `--per-replica-rate` requests/s per replica for `--seconds`,
prompts uniform in 256-3072 tokens, outputs in 32-512; one H100 replica of Llama-3.1-8B with
--max-num-seqs 64 serves about 12 of these a second, so the default 24/s is 2x overload (the
table's `offered/served` column is the measured ratio: offered rate over what the off run
served per second). Goodput counts requests meeting TTFT <= --ttft-ms and mean inter-token
time (TPOT) <= --itl-ms, per second of the run; refused requests count as not meeting it.
Every figure is simulated.

    PYTHONPATH=. python benchmarks/slo_admission_sim.py --replicas 16 128 --out /tmp/slo
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = Path(HERE) / "results"

PROMPT, OUTPUT = (256, 3072), (32, 512)
ENGINE_FLAGS = ["--max-model-len", "8192", "--max-num-seqs", "64", "--kv-cache-memory-bytes", str(60 * 2**30)]
MODES = ("off", "profile", "online")


def trace(replicas: int, rate_per_replica: float, seconds: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rate = rate_per_replica * replicas
    t, rows = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t > seconds:
            return rows
        rows.append(
            {"arrival_s": round(t, 6), "prompt_tokens": rng.randint(*PROMPT), "output_tokens": rng.randint(*OUTPUT)}
        )


def profile_path(name: str) -> str:
    p = Path(name)
    return str(p if p.suffix == ".json" else Path(ROOT) / "sim" / "profiles" / f"{name}.json")


def sim(trace_path: Path, replicas: int, mode: str, args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "fleetserve.cluster.cli", "sim", "--trace", str(trace_path)]
    cmd += ["--profile", args.profile, "--num-replicas", str(replicas), *ENGINE_FLAGS]
    cmd += ["--slo-ttft-s", str(args.ttft_ms / 1e3), "--slo-itl-s", str(args.itl_ms / 1e3)]
    if mode != "off":
        cmd += ["--slo-ttft-ms", str(args.ttft_ms), "--slo-itl-ms", str(args.itl_ms)]
    if mode == "profile":
        cmd += ["--slo-profile", profile_path(args.profile)]
    if mode != "off" and args.headroom is not None:
        cmd += ["--slo-headroom", str(args.headroom)]
    cmd += ["--no-progress", "-o", str(out)]
    print("$ fleetserve " + " ".join(cmd[3:]).replace(ROOT + "/", ""), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": ROOT})
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - t0
    return result


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["replicas"] for r in rows})
    fig, ax = plt.subplots(figsize=(6.4, 4))
    width = 0.8 / len(MODES)
    for i, mode in enumerate(MODES):
        vals = [next(r["goodput_per_replica"] for r in rows if r["replicas"] == n and r["run"] == mode) for n in sizes]
        ax.bar([j + i * width for j in range(len(sizes))], vals, width, label=mode)
    ax.set_xticks([j + width for j in range(len(sizes))], [f"{n} replicas" for n in sizes])
    ax.set_ylabel("goodput per replica (req/s meeting TTFT and ITL SLOs)")
    ax.set_title("SLO-aware admission under 2x overload (simulated, H100 Llama-3.1-8B)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, nargs="+", default=[16])
    ap.add_argument("--profile", default="h100-llama-3.1-8b")
    ap.add_argument("--per-replica-rate", type=float, default=24.0, help="arrivals/s per replica [default: 24]")
    ap.add_argument("--seconds", type=float, default=30.0, help="arrivals for this long [default: 30]")
    ap.add_argument("--ttft-ms", type=float, default=1000.0)
    ap.add_argument("--itl-ms", type=float, default=100.0)
    ap.add_argument("--headroom", type=float, help="--slo-headroom [default: the flag's, 0.6]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--out", default="slo_admission_sim", help="folder for the traces and result JSONs")
    ap.add_argument("--png", default=str(RESULTS / "slo_admission_sim.png"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in args.replicas:
        rows_n = trace(n, args.per_replica_rate, args.seconds, args.seed)
        tpath = out / f"trace-{n}.jsonl"
        tpath.write_text("".join(json.dumps(r) + "\n" for r in rows_n))
        offered = len(rows_n) / args.seconds
        served_off = None
        for mode in args.modes:
            r = sim(tpath, n, mode, args, out / f"{mode}-{n}.json")
            slo = r["slo"]
            if mode == "off":
                served_off = r["completed"] / r["duration_s"]
            rows.append(
                {
                    "replicas": n,
                    "run": mode,
                    "requests": r["requests"],
                    "offered/served": round(offered / served_off, 2) if served_off else "-",
                    "refused": r["refused"],
                    "met_slo": slo["met"],
                    "attainment": round(slo["attainment"], 3),
                    "goodput": round(slo["goodput"], 1),
                    "goodput_per_replica": round(slo["goodput"] / n, 2),
                    "ttft_p50": round(r["ttft_s"]["p50"], 3),
                    "ttft_p90": round(r["ttft_s"]["p90"], 3),
                    "tpot_p90": round(r["tpot_s"]["p90"], 4),
                    "duration_s": round(r["duration_s"], 1),
                    "wall_s": round(r["wall_s"], 1),
                }
            )
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in cols) + " |")
    (out / "rows.json").write_text(json.dumps(rows, indent=2))
    if set(args.modes) == set(MODES):
        plot(rows, Path(args.png))
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
