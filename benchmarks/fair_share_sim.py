"""Per-tenant fair share in the fleet simulator: a light tenant behind a heavy tenant's backlog.

Per point (N replicas) it writes two traces and runs `fleetserve sim` on them (the real
scheduler in every replica, the real router; a step-cost profile for the model):

* heavy: 160 requests per replica (prompts uniform in 2048-6144 tokens, outputs in
  256-1792, means 4096 and 1024) arriving in the first 2 s, a backlog of roughly 40 s of
  the fleet's capacity (varied lengths, so the running heavy requests do not all finish
  in one step, as a tenant that keeps requests in flight would not);
* light: 0.5 requests/s per replica (prompt 256, output 64), Poisson, from 1 s to 31 s,
  all while the heavy backlog lasts;
* "alone": the light trace by itself.

For each scheduling policy (fcfs, fair) it prints the light tenant's TTFT p50/p90, the
heavy tenant's, and the fleet's output tokens per second. Every figure is simulated.

    PYTHONPATH=. python benchmarks/fair_share_sim.py --replicas 16 128 --out /tmp/fair
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

HEAVY_PER_REPLICA, HEAVY_PROMPT, HEAVY_OUTPUT, HEAVY_SPAN_S = 160, (2048, 6144), (256, 1792), 2.0
LIGHT_RATE_PER_REPLICA, LIGHT_PROMPT, LIGHT_OUTPUT, LIGHT_START_S, LIGHT_SPAN_S = 0.5, 256, 64, 1.0, 30.0
ENGINE_FLAGS = ["--max-model-len", "8192", "--max-num-seqs", "64", "--kv-cache-memory-bytes", str(60 * 2**30)]


def traces(replicas: int, seed: int) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    n_heavy = HEAVY_PER_REPLICA * replicas
    heavy = [
        {
            "arrival_s": round(HEAVY_SPAN_S * i / n_heavy, 6),
            "prompt_tokens": rng.randint(*HEAVY_PROMPT),
            "output_tokens": rng.randint(*HEAVY_OUTPUT),
            "tenant": "heavy",
        }
        for i in range(n_heavy)
    ]
    light, t, rate = [], LIGHT_START_S, LIGHT_RATE_PER_REPLICA * replicas
    while True:
        t += rng.expovariate(rate)
        if t > LIGHT_START_S + LIGHT_SPAN_S:
            break
        light.append(
            {"arrival_s": round(t, 6), "prompt_tokens": LIGHT_PROMPT, "output_tokens": LIGHT_OUTPUT, "tenant": "light"}
        )
    return heavy, light


def write(path: Path, rows: list[dict]) -> None:
    rows = sorted(rows, key=lambda r: r["arrival_s"])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def sim(trace: Path, replicas: int, policy: str, profile: str, out: Path, extra: tuple[str, ...] = ()) -> dict:
    cmd = [sys.executable, "-m", "fleetserve.cluster.cli", "sim", "--trace", str(trace), "--profile", profile]
    cmd += ["--num-replicas", str(replicas), "--scheduling-policy", policy, *ENGINE_FLAGS, *extra]
    cmd += ["--no-progress", "-o", str(out)]
    print("$ fleetserve " + " ".join(cmd[3:]), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": ROOT})
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - t0
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, nargs="+", default=[16])
    ap.add_argument("--profile", default="h100-llama-3.1-8b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="fair_share_sim", help="folder for the traces and result JSONs")
    ap.add_argument("--seat", action="store_true", help="also fair with --fair-preemption-gap 0")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in args.replicas:
        heavy, light = traces(n, args.seed)
        both, alone = out / f"loaded-{n}.jsonl", out / f"alone-{n}.jsonl"
        write(both, heavy + light)
        write(alone, light)
        runs = {"alone": sim(alone, n, "fcfs", args.profile, out / f"alone-{n}.json")}
        for policy in ("fcfs", "fair"):
            runs[policy] = sim(both, n, policy, args.profile, out / f"{policy}-{n}.json")
        if args.seat:
            gap = ("--fair-preemption-gap", "0")
            runs["fair+seat"] = sim(both, n, "fair", args.profile, out / f"fair-seat-{n}.json", gap)
        for name, r in runs.items():
            light_t = r["tenants"]["light"]
            heavy_t = r["tenants"].get("heavy")
            rows.append(
                {
                    "replicas": n,
                    "run": name,
                    "light_reqs": light_t["completed"],
                    "light_ttft_p50": round(light_t["ttft_s"]["p50"], 3),
                    "light_ttft_p90": round(light_t["ttft_s"]["p90"], 3),
                    "heavy_ttft_p50": round(heavy_t["ttft_s"]["p50"], 2) if heavy_t else "-",
                    "tok_per_s": round(r["output_tokens_per_s"]),
                    "duration_s": round(r["duration_s"], 1),
                    "preemptions": r["preemptions"],
                    "wall_s": round(r["wall_s"], 1),
                }
            )
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in cols) + " |")
    (out / "rows.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
