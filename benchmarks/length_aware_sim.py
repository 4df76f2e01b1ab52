"""Output-length-aware scheduling in the fleet simulator, and the predictor's error.

Two parts, every figure simulated or computed from generated traces (no model runs):

1. Predictor error. Each request of a generated trace is predicted from what is known
   before it runs (tenant, max_tokens, prompt length, the session's earlier turns), then
   learned from, in arrival order (online). MAE and Spearman rank correlation against the
   truth, for the plain running mean (capped by max_tokens) and for the bucketed predictor
   (scheduler/length_predictor.py) with its parts taken away one by one. Traces: length_mix
   (per-tenant task mixes, sessions; the structure the predictor is for), long_tail
   (independent Pareto lengths: nothing to learn but the distribution) and multiturn.

2. Scheduling. A length_mix trace of `--per-replica` requests a replica arriving at
   `--rate-per-replica` a second (150 at 12/s by default: about twice what a replica with
   64 seats and 4 GiB of KV serves, for 12.5 s), per fleet size, run with `fleetserve sim`
   (the real scheduler in every replica, the real router, the analytic H100 profile of a
   Llama-3.1-8B shape) under fcfs, sjf, and sjf with
   --capacity-policy reserve_predicted: TTFT and E2E p50/p90, preemptions, throughput, and the
   online predictor's MAE inside the replicas (each replica's own predictor, learning only
   from its own finished requests).

    PYTHONPATH=. python benchmarks/length_aware_sim.py --replicas 16 128 --out /tmp/len
    # or one fleet size / policy per process, then one table and plot:
    PYTHONPATH=. python benchmarks/length_aware_sim.py --replicas 128 --skip-predictor --policies sjf --out /tmp/a
    PYTHONPATH=. python benchmarks/length_aware_sim.py --merge /tmp/len/rows.json /tmp/a/rows.json

Prints the tables, writes rows.json under --out and benchmarks/results/length_aware_sim.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from fleetserve.scheduler.length_predictor import LengthFeatures, OutputLengthPredictor, RunningMean  # noqa: E402
from fleetserve.sim.generators import generate  # noqa: E402
from fleetserve.sim.traces import write_trace  # noqa: E402

RESULTS = Path(HERE) / "results"
# KV for ~32k tokens a replica (4 GiB of Llama-8B KV, 128 KiB a token) and 64 seats: small
# enough that ~150 requests a replica at 12/s (twice what a replica serves) fill it, so the
# queue and preemptions appear within a trace the simulator runs in minutes at 128 replicas.
ENGINE_FLAGS = [
    "--max-model-len",
    "8192",
    "--max-num-seqs",
    "64",
    "--kv-cache-memory-bytes",
    str(4 * 2**30),
]
POLICIES = {
    "fcfs": ["--scheduling-policy", "fcfs"],
    "sjf": ["--scheduling-policy", "sjf"],
    "sjf+reserve": ["--scheduling-policy", "sjf", "--capacity-policy", "reserve_predicted"],
}


# ---- 1. the predictor's error ---------------------------------------------------------------
def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x: list[float]) -> list[float]:
        idx = sorted(range(len(x)), key=x.__getitem__)
        r = [0.0] * len(x)
        i = 0
        while i < len(x):
            j = i
            while j + 1 < len(x) and x[idx[j + 1]] == x[idx[i]]:
                j += 1
            for k in range(i, j + 1):
                r[idx[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    return cov / (va * vb) ** 0.5 if va and vb else 0.0


PREDICTORS = {
    "running mean": lambda: RunningMean(),
    "global median (+max_tokens prior)": lambda: OutputLengthPredictor(levels=1, use_session=False),
    "+ max_tokens bucket": lambda: OutputLengthPredictor(levels=2, use_session=False),
    "+ model, tenant": lambda: OutputLengthPredictor(levels=4, use_session=False),
    "+ prompt length": lambda: OutputLengthPredictor(levels=5, use_session=False),
    "+ session turns (full)": lambda: OutputLengthPredictor(),
    "full, no shrinkage (k=0.01)": lambda: OutputLengthPredictor(prior_strength=0.01),
}


def predictor_rows(num_requests: int, seed: int) -> list[dict]:
    rows = []
    for kind in ("length_mix", "long_tail", "multiturn"):
        trace = generate(kind, num_requests=num_requests, rate=10.0, seed=seed)
        truth = [r.output_tokens for r in trace]
        for name, make in PREDICTORS.items():
            p = make()
            preds = []
            t0 = time.perf_counter()
            for r in trace:
                f = LengthFeatures(r.num_prompt_tokens, r.max_tokens, r.tenant or "default", "", r.session)
                preds.append(p.predict(f))
                p.observe(f, r.output_tokens)
            us = (time.perf_counter() - t0) / len(trace) * 1e6
            mae = sum(abs(a - b) for a, b in zip(preds, truth)) / len(truth)
            rows.append(
                {
                    "trace": kind,
                    "predictor": name,
                    "mae_tokens": round(mae, 1),
                    "spearman": round(spearman(preds, truth), 3),
                    "us_per_request": round(us, 1),
                }
            )
    return rows


# ---- 2. scheduling in the simulator --------------------------------------------------------------
def sim(trace: Path, replicas: int, flags: list[str], profile: str, out: Path) -> dict:
    cmd = [sys.executable, "-m", "fleetserve.cluster.cli", "sim", "--trace", str(trace), "--profile", profile]
    cmd += ["--num-replicas", str(replicas), *ENGINE_FLAGS, *flags, "--no-progress", "-o", str(out)]
    print("$ fleetserve " + " ".join(cmd[3:]), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": ROOT})
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - t0
    return result


def sched_rows(
    replicas: list[int], per_replica: int, rate_per_replica: float, profile: str, seed: int, out: Path, policies
):
    rows = []
    for n in replicas:
        trace = generate("length_mix", num_requests=per_replica * n, rate=rate_per_replica * n, seed=seed)
        path = out / f"length_mix-{n}.jsonl"
        write_trace(path, trace)
        for name in policies:
            flags = POLICIES[name]
            r = sim(path, n, flags, profile, out / f"{name}-{n}.json")
            lp = r.get("length_prediction") or {}
            rows.append(
                {
                    "replicas": n,
                    "policy": name,
                    "completed": r["completed"],
                    "ttft_p50": round(r["ttft_s"]["p50"], 2),
                    "ttft_p90": round(r["ttft_s"]["p90"], 2),
                    "e2e_p50": round(r["e2e_s"]["p50"], 2),
                    "e2e_p90": round(r["e2e_s"]["p90"], 2),
                    "preemptions": r["preemptions"],
                    "tok_per_s": round(r["output_tokens_per_s"]),
                    "duration_s": round(r["duration_s"], 1),
                    "pred_mae": round(lp["mae_tokens"], 1) if lp else "-",
                    "wall_s": round(r["wall_s"], 1),
                }
            )
            print(rows[-1], flush=True)
    return rows


def table(rows: list[dict]) -> str:
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(row[c]) for c in cols) + " |" for row in rows]
    return "\n".join(lines)


def plot(pred: list[dict], sched: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    mix = [r for r in pred if r["trace"] == "length_mix"]
    ax = axes[0]
    ax.barh([r["predictor"] for r in mix], [r["mae_tokens"] for r in mix], color="tab:blue")
    ax.invert_yaxis()
    ax.set_xlabel("MAE (tokens), length_mix, online")
    for i, r in enumerate(mix):
        ax.text(r["mae_tokens"], i, f"  rho={r['spearman']}", va="center", fontsize=8)
    for ax, metric in ((axes[1], "ttft"), (axes[2], "e2e")):
        fleets = sorted({r["replicas"] for r in sched})
        width = 0.8 / len(POLICIES)
        for k, name in enumerate(POLICIES):
            for q, hatch in (("p50", ""), ("p90", "//")):
                pts = [
                    (i + k * width, r[f"{metric}_{q}"])
                    for i, f in enumerate(fleets)
                    for r in sched
                    if r["replicas"] == f and r["policy"] == name
                ]
                if not pts:
                    continue
                xs, ys = [x for x, _ in pts], [y for _, y in pts]
                ax.bar(
                    xs,
                    ys,
                    width * (0.9 if q == "p90" else 0.5),
                    label=f"{name} {q}",
                    color=f"C{k}",
                    alpha=1.0 if q == "p50" else 0.35,
                    hatch=hatch,
                )
        ax.set_xticks([i + width for i in range(len(fleets))], [f"{f} replicas" for f in fleets])
        ax.set_ylabel(f"{metric.upper()} (s, simulated)")
        ax.legend(fontsize=7)
    fig.suptitle("Output-length-aware scheduling (simulated: H100 profile, Llama-3.1-8B shape)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, nargs="+", default=[16])
    ap.add_argument("--profile", default="h100-llama-3.1-8b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--per-replica", type=int, default=150, help="requests per replica")
    ap.add_argument("--rate-per-replica", type=float, default=12.0, help="arrivals per second per replica")
    ap.add_argument("--predictor-requests", type=int, default=20000)
    ap.add_argument("--out", default="length_aware_sim", help="folder for the traces and result JSONs")
    ap.add_argument("--skip-sim", action="store_true", help="the predictor table only")
    ap.add_argument("--skip-predictor", action="store_true", help="the scheduling runs only")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument(
        "--merge", nargs="+", metavar="ROWS_JSON", help="print and plot the rows.json of earlier runs (run nothing)"
    )
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pred: list[dict] = []
    sched: list[dict] = []
    if args.merge:
        for path in args.merge:
            got = json.loads(Path(path).read_text())
            pred = pred or got["predictor"]
            sched += got["scheduling"]
        sched.sort(key=lambda r: (r["replicas"], list(POLICIES).index(r["policy"])))
        print(table(pred))
        print(table(sched))
        plot(pred, sched, RESULTS / "length_aware_sim.png")
        return 0
    if not args.skip_predictor:
        pred = predictor_rows(args.predictor_requests, args.seed)
        print(table(pred), flush=True)
    if not args.skip_sim:
        sched = sched_rows(
            args.replicas, args.per_replica, args.rate_per_replica, args.profile, args.seed, out, args.policies
        )
        print(table(sched))
        if pred:
            plot(pred, sched, RESULTS / "length_aware_sim.png")
    (out / "rows.json").write_text(json.dumps({"predictor": pred, "scheduling": sched}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
