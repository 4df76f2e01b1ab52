"""The fleet questions two CPU cores could not answer, answered in virtual time.

Every figure here is SIMULATED: the real scheduler and routing policies run in
`fleetserve.sim`, with the model forward priced by an analytic profile (by default an
H100 SXM running a Llama-3.1-8B-shaped model in bf16, `sim/profiles/h100-llama-3.1-8b.json`:
a roofline from published FLOP/s and bandwidth, not a measurement).

    python benchmarks/fleet_questions.py pd        # (1) P/D vs colocated at 16 GPUs
    python benchmarks/fleet_questions.py prefix    # (2) precise vs guessing vs power-of-two
    python benchmarks/fleet_questions.py plan      # (3) GPUs and P:D ratio for an SLO at a load
    python benchmarks/fleet_questions.py all --requests 2000   # all three, shorter

(1) goodput at a TTFT/TPOT SLO for colocated replicas and P:D ratios of the same GPU
    count over request rates, and the decode ITL p99 under long-prefill interference
    (P/D's over colocated's; the target two cores could not show is 0.5x);
(2) many tenants sharing long system prompts (llm-d's setup: 150 tenants x 6K tokens on
    16 GPUs): TTFT p50/p90 and prefix hit rate per routing policy;
(3) at a given load and SLO, the fewest GPUs (colocated or P:D) meeting the SLO for 90%
    of requests.

Each part prints a table and writes benchmarks/results/fleet_<part>.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from fleetserve.sim.cluster import run_simulation
from fleetserve.sim.generators import Lengths, generate
from fleetserve.sim.profile import load_profile

RESULTS = Path(__file__).parent / "results"

# (1) and (3): long prompts, moderate outputs (a RAG / summarization mix).
LONG_PROMPT = Lengths(median=3000, sigma=0.6, lo=256, hi=16000)
OUTPUT = Lengths(median=256, sigma=0.6, lo=16, hi=1024)
SLO_TTFT_S = 2.0
SLO_TPOT_S = 0.030  # the mean inter-token time a chat user tolerates here
ENGINE = {"max_num_seqs": 256, "max_num_batched_tokens": 2048, "max_model_len": 32768}


def simulate(trace, cost, replicas: int, policy: str, pd: Optional[tuple[int, int]], **kw: Any) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if pd is not None:
        extra.update(pd=pd, pd_min_prefill_tokens=64, kv_connector="p2p")
    t0 = time.perf_counter()
    r = run_simulation(
        trace,
        cost,
        sum(pd) if pd else replicas,
        policy,
        dict(ENGINE, **kw.pop("engine", {})),
        slo_ttft_s=kw.pop("slo_ttft_s", SLO_TTFT_S),
        slo_itl_s=kw.pop("slo_itl_s", SLO_TPOT_S),
        **extra,
        **kw,
    ).to_dict()
    r["wall_s"] = time.perf_counter() - t0
    return r


def row(label: str, r: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "config": label,
        **extra,
        "completed": r["completed"],
        "refused": r["refused"],
        "goodput": r["slo"]["goodput"],
        "attainment": r["slo"]["attainment"],
        "ttft_p50_s": r["ttft_s"]["p50"],
        "ttft_p90_s": r["ttft_s"]["p90"],
        "itl_p50_s": r["itl_s"]["p50"],
        "itl_p99_s": r["itl_s"]["p99"],
        "tpot_p90_s": r["tpot_s"]["p90"],
        "prefix_hit_rate": r["prefix_hit_rate"],
        "kv_gb_moved": r["kv_bytes_moved"] / 1e9,
        "util_mean": sum(r["utilization"]) / len(r["utilization"]),
        "wall_s": round(r["wall_s"], 1),
    }


def table(rows: list[dict[str, Any]], title: str) -> None:
    print(f"\n{title}")
    cols = list(rows[0])
    print("  ".join(f"{c:>12}" for c in cols))
    for r in rows:
        print("  ".join(f"{_fmt(r[c]):>12}" for c in cols))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def save(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"fleet_{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ---- (1) P/D vs colocated ------------------------------------------------------------------
def question_pd(cost, profile_name: str, n: int, gpus: int, rates: list[float], seed: int) -> dict[str, Any]:
    ratios: list[Optional[tuple[int, int]]] = [None] + [
        (p, gpus - p) for p in (gpus // 8, gpus // 4, 3 * gpus // 8, gpus // 2)
    ]
    rows = []
    for rate in rates:
        trace = generate("poisson", num_requests=n, rate=rate, seed=seed, prompt=LONG_PROMPT, output=OUTPUT)
        for pd in ratios:
            label = "colocated" if pd is None else f"P/D {pd[0]}:{pd[1]}"
            r = simulate(trace, cost, gpus, "least_loaded", pd, seed=seed)
            rows.append(row(label, r, rate=rate))
            print(rows[-1], flush=True)
    table(rows, f"(1) P/D vs colocated, {gpus} GPUs, {profile_name} (simulated)")
    interference = []
    for rate in rates:
        at = [r for r in rows if r["rate"] == rate]
        colo = next(r for r in at if r["config"] == "colocated")
        best = max((r for r in at if r["config"] != "colocated"), key=lambda r: r["goodput"])
        interference.append(
            {
                "rate": rate,
                "best_pd": best["config"],
                "itl_p99_colocated_s": colo["itl_p99_s"],
                "itl_p99_pd_s": best["itl_p99_s"],
                "itl_p99_ratio": best["itl_p99_s"] / colo["itl_p99_s"] if colo["itl_p99_s"] else float("nan"),
                "goodput_colocated": colo["goodput"],
                "goodput_pd": best["goodput"],
            }
        )
    table(interference, "decode ITL p99 under long-prefill interference: the best P:D over colocated")
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for label in dict.fromkeys(r["config"] for r in rows):
        rs = [r for r in rows if r["config"] == label]
        a.plot([r["rate"] for r in rs], [r["goodput"] for r in rs], marker="o", label=label)
        b.plot([r["rate"] for r in rs], [1e3 * r["itl_p99_s"] for r in rs], marker="o", label=label)
    a.set(xlabel="request rate (req/s)", ylabel="goodput (req/s meeting TTFT and TPOT SLO)")
    b.set(xlabel="request rate (req/s)", ylabel="ITL p99 (ms)")
    a.set_title(f"{gpus} GPUs, SLO TTFT {SLO_TTFT_S}s TPOT {SLO_TPOT_S * 1e3:.0f}ms (simulated)", fontsize=9)
    a.legend(fontsize=7)
    b.set_yscale("log")
    fig.tight_layout()
    fig.savefig(RESULTS / "fleet_pd.png", dpi=110)
    plt.close(fig)
    return {"rows": rows, "interference": interference}


# ---- (2) prefix routing ---------------------------------------------------------------------
def question_prefix(
    cost,
    profile_name: str,
    n: int,
    gpus: int,
    rate: float,
    tenants: int,
    prefix: int,
    seed: int,
    kv_blocks: list[Optional[int]],
) -> dict[str, Any]:
    trace = generate(
        "shared_prefix",
        num_requests=n,
        rate=rate,
        seed=seed,
        num_tenants=tenants,
        system_prompt_tokens=prefix,
        user=Lengths(median=256, sigma=0.6, lo=16, hi=2048),
        output=Lengths(median=128, sigma=0.6, lo=8, hi=512),
    )
    rows = []
    # The profile's KV cache (an H100's memory), then smaller ones: where caches evict, a router
    # that guesses from where it sent prompts goes stale and one fed by KV events does not.
    for blocks in kv_blocks:
        engine = {} if blocks is None else {"num_gpu_blocks_override": blocks}
        kv = "profile" if blocks is None else f"{blocks * 16 // 1000}k tok"
        at = []
        for policy in ("power_of_two", "prefix_aware_approx", "prefix_aware"):
            r = simulate(
                trace, cost, gpus, policy, None, seed=seed, slo_ttft_s=1.0, slo_itl_s=SLO_TPOT_S, engine=engine
            )
            at.append(row(policy, r, kv_cache=kv, rate=rate))
            print(at[-1], flush=True)
        for r in at:
            r["ttft_p90_vs_power_of_two"] = at[0]["ttft_p90_s"] / r["ttft_p90_s"] if r["ttft_p90_s"] else float("nan")
        rows.extend(at)
    table(rows, f"(2) {tenants} tenants x {prefix}-token system prompts, {gpus} GPUs, {rate} req/s, {profile_name}")
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    fig.set_size_inches(max(6, 2 * len(rows)), 4)
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["ttft_p50_s"] for r in rows], 0.4, label="TTFT p50")
    ax.bar([x + 0.2 for x in xs], [r["ttft_p90_s"] for r in rows], 0.4, label="TTFT p90")
    labels = [f"{r['config']}\nKV {r['kv_cache']}, hit {r['prefix_hit_rate']:.2f}" for r in rows]
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("seconds (simulated)")
    ax.set_title(f"{tenants} tenants x {prefix} tokens, {gpus} GPUs, {rate} req/s", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "fleet_prefix.png", dpi=110)
    plt.close(fig)
    return {"rows": rows}


# ---- (3) capacity planning ------------------------------------------------------------------
def question_plan(cost, profile_name: str, n: int, rate: float, totals: list[int], seed: int) -> dict[str, Any]:
    trace = generate("poisson", num_requests=n, rate=rate, seed=seed, prompt=LONG_PROMPT, output=OUTPUT)
    rows = []
    for total in totals:
        options: list[Optional[tuple[int, int]]] = [None]
        fractions = (total // 8, total // 4, 3 * total // 8, total // 2)
        options += sorted({(p, total - p) for p in fractions if p >= 1})
        for pd in options:
            label = "colocated" if pd is None else f"P/D {pd[0]}:{pd[1]}"
            r = simulate(trace, cost, total, "least_loaded", pd, seed=seed)
            rows.append(row(label, r, gpus=total))
            print(rows[-1], flush=True)
    table(rows, f"(3) {rate} req/s, SLO TTFT {SLO_TTFT_S}s TPOT {SLO_TPOT_S * 1e3:.0f}ms for 90%, {profile_name}")
    meeting = [r for r in rows if r["attainment"] >= 0.9]
    best = {}
    for kind in ("colocated", "P/D"):
        ok = [r for r in meeting if r["config"].startswith(kind)]
        if ok:
            pick = min(ok, key=lambda r: (r["gpus"], -r["attainment"]))
            best[kind] = {"config": pick["config"], "gpus": pick["gpus"], "attainment": pick["attainment"]}
        else:
            best[kind] = None
    print("\nfewest GPUs meeting the SLO:", json.dumps(best))
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for label in ("colocated", "P/D"):
        rs = [r for r in rows if r["config"].startswith(label)]
        per_total: dict[int, float] = {}
        for r in rs:
            per_total[r["gpus"]] = max(per_total.get(r["gpus"], 0.0), r["attainment"])
        ax.plot(list(per_total), list(per_total.values()), marker="o", label=f"{label} (best ratio)")
    ax.axhline(0.9, color="grey", linestyle="--", linewidth=1)
    ax.set(xlabel="GPUs", ylabel="SLO attainment")
    ax.set_title(f"{rate} req/s, TTFT {SLO_TTFT_S}s, TPOT {SLO_TPOT_S * 1e3:.0f}ms (simulated)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "fleet_plan.png", dpi=110)
    plt.close(fig)
    return {"rows": rows, "fewest_gpus": best}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=["pd", "prefix", "plan", "all"])
    p.add_argument("--profile", default="h100-llama-3.1-8b")
    p.add_argument("--requests", type=int, default=3000, help="requests per simulated point")
    p.add_argument("--gpus", type=int, default=16)
    p.add_argument("--rates", type=float, nargs="+", default=[16.0, 32.0, 64.0, 96.0], help="(1): request rates")
    p.add_argument("--prefix-rate", type=float, default=80.0, help="(2): request rate")
    p.add_argument("--tenants", type=int, default=150)
    p.add_argument("--prefix-tokens", type=int, default=6000)
    p.add_argument(
        "--prefix-kv-blocks",
        default="profile,5000",
        help="(2): KV blocks per replica to try, comma-separated ('profile': the GPU's memory)",
    )
    p.add_argument("--plan-rate", type=float, default=48.0, help="(3): the load to plan for")
    p.add_argument("--plan-gpus", type=int, nargs="+", default=[8, 12, 16, 20, 24])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    profile = load_profile(args.profile)
    cost = profile.cost_model()
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = f"{profile.name} ({profile.kind})"
    print(f"profile: {name}: {profile.hardware}; host: {os.cpu_count()} cores", file=sys.stderr)
    out: dict[str, Any] = {"profile": profile.name, "kind": profile.kind, "args": vars(args)}
    t0 = time.perf_counter()
    if args.part in ("pd", "all"):
        out["pd"] = question_pd(cost, name, args.requests, args.gpus, args.rates, args.seed)
        save("pd", {**out, **out["pd"]})
    if args.part in ("prefix", "all"):
        out["prefix"] = question_prefix(
            cost,
            name,
            args.requests,
            args.gpus,
            args.prefix_rate,
            args.tenants,
            args.prefix_tokens,
            args.seed,
            [None if b.strip() == "profile" else int(b) for b in args.prefix_kv_blocks.split(",")],
        )
        save("prefix", {**out, **out["prefix"]})
    if args.part in ("plan", "all"):
        out["plan"] = question_plan(cost, name, args.requests, args.plan_rate, args.plan_gpus, args.seed)
        save("plan", {**out, **out["plan"]})
    print(f"\nwall {time.perf_counter() - t0:.0f} s; results in {RESULTS}/fleet_*.json and .png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
