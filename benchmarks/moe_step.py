"""One MoE layer's step, split into its phases: routing, dispatch and the expert matmuls.

The layer is Qwen3-30B-A3B's (hidden 2048, 128 experts, top-8, each expert's intermediate
size 768, softmax then top-k without renormalisation) with random weights, one rank
(replica.layers.moe.SparseMoeBlock). For decode batches of 1, 8 and 32 tokens and a
256-token prefill it times, per call, the median of --repeats after a warm-up:

    routing   gate linear [T, 2048] x [128, 2048] + softmax + top-k   (SparseMoeBlock.gate, select_experts)
    dispatch  sort the T*8 (token, expert) pairs by expert, count them on the host, gather
              the tokens' rows, then scale by the routing weights and index_add_ them back
              (FusedMoE.dispatch, x[tokens], FusedMoE.combine)
    experts   gate|up matmul, silu * up, down matmul over every expert's tokens: as two grouped
              GEMMs (torch's grouped_mm, FusedMoE._run_grouped: what run_experts takes where it
              runs) and, for comparison, one pair of matmuls per expert with tokens
              (FusedMoE._run_each, with its host read of the counts)

and the whole forward (SparseMoeBlock(x)) as a check that the phases add up. Random router
weights spread tokens over experts about evenly, which a trained router does not; a
decode token reads 8 experts' weights (8 x 9.4M parameters), a 256-token prefill most of
the 128. Prints a table and writes benchmarks/results/moe_step.{json,png}.

    python benchmarks/moe_step.py                      # CPU, float32, 1 thread
    python benchmarks/moe_step.py --device cuda --dtype bfloat16
    python benchmarks/moe_step.py --quick              # fewer repeats
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"

HIDDEN, EXPERTS, TOP_K, EXPERT_INTERMEDIATE = 2048, 128, 8, 768
BATCHES = [("decode", 1), ("decode", 8), ("decode", 32), ("prefill", 256)]
PHASES = ("routing", "dispatch", "experts", "experts_each")


def build(device: torch.device, dtype: torch.dtype):
    from fleetserve.replica.layers.moe import SparseMoeBlock

    with torch.device(device):
        block = SparseMoeBlock(EXPERTS, TOP_K, HIDDEN, EXPERT_INTERMEDIATE, renormalize=False).to(dtype)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=torch.float32).to(dtype) * 0.02)
    return block.eval()


def timed(sync: Callable[[], None], fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    sync()
    t0 = time.perf_counter()
    out = fn(*args)
    sync()
    return time.perf_counter() - t0, out


def measure(block, T: int, device: torch.device, dtype: torch.dtype, repeats: int, warmup: int) -> dict:
    from fleetserve.replica.layers.moe import select_experts

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    moe = block.experts
    x = torch.randn(T, HIDDEN, generator=torch.Generator(device=device).manual_seed(T), device=device).to(dtype)
    samples: dict[str, list[float]] = {p: [] for p in (*PHASES, "total")}

    def route(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts(block.gate(x), TOP_K, block.renormalize)

    def combine(ys: torch.Tensor, tokens: torch.Tensor, pair_w: torch.Tensor) -> torch.Tensor:
        return moe.combine(ys, tokens, pair_w, T).to(dtype)

    with torch.no_grad():
        for i in range(warmup + repeats):
            t_route, (weights, ids) = timed(sync, route, x)
            t_disp, (tokens, pair_w, counts) = timed(sync, moe.dispatch, weights, ids)
            t_gather, xs = timed(sync, x.__getitem__, tokens)
            t_exp, ys = timed(sync, moe.run_experts, xs, counts)
            t_each, _ = timed(sync, lambda xs, c: moe._run_each(xs, c.tolist()), xs, counts)
            t_comb, _ = timed(sync, combine, ys, tokens, pair_w)
            t_total, _ = timed(sync, block, x)
            if i >= warmup:
                samples["routing"].append(t_route)
                samples["dispatch"].append(t_disp + t_gather + t_comb)
                samples["experts"].append(t_exp)
                samples["experts_each"].append(t_each)
                samples["total"].append(t_total)
        active = int((counts > 0).sum())
    return {"tokens": T, "active_experts": active, **{k: statistics.median(v) * 1e3 for k, v in samples.items()}}


def plot(rows: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['kind']}\n{r['tokens']} tok" for r in rows]
    width = 0.2
    names = ("routing", "dispatch", "experts (grouped_mm)", "experts (per expert)")
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:olive")
    for j, (phase, name, color) in enumerate(zip(PHASES, names, colors)):
        xs = [i + (j - 1.5) * width for i in range(len(rows))]
        ax.bar(xs, [r[phase] for r in rows], width, label=name, color=color)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_yscale("log")
    ax.set_ylabel("ms per layer call (median, log scale)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="3 repeats, 1 warm-up")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.warmup = 3, 1
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    from fleetserve.replica.layers.moe import _grouped_mm_runs

    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    block = build(device, dtype)
    rows = []
    for kind, T in BATCHES:
        row = {"kind": kind, **measure(block, T, device, dtype, args.repeats, args.warmup)}
        rows.append(row)
    grouped = (
        "grouped_mm"
        if block.experts.grouped_mm and _grouped_mm_runs(torch.empty(0, device=device, dtype=dtype))
        else "per expert"
    )
    where = f"{device.type}, {str(dtype).removeprefix('torch.')}, experts {grouped}" + (
        f", {args.threads} thread(s)" if device.type == "cpu" else ""
    )
    print(f"MoE layer {HIDDEN}h x {EXPERTS} experts top-{TOP_K}, expert intermediate {EXPERT_INTERMEDIATE} ({where})")
    print(
        f"{'batch':>14} {'active':>7} {'routing ms':>11} {'dispatch ms':>12} {'experts ms':>11} "
        f"{'(per expert)':>13} {'total ms':>9}"
    )
    for r in rows:
        print(
            f"{r['kind'] + ' ' + str(r['tokens']):>14} {r['active_experts']:>7} {r['routing']:>11.3f} "
            f"{r['dispatch']:>12.3f} {r['experts']:>11.3f} {r['experts_each']:>13.3f} {r['total']:>9.3f}"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "moe_step.json").write_text(json.dumps({"setup": where, "rows": rows}, indent=1))
    plot(rows, f"Qwen3-30B-A3B-shaped MoE layer ({where})", RESULTS / "moe_step.png")
    print(f"wrote {RESULTS / 'moe_step.json'} and {RESULTS / 'moe_step.png'}")


if __name__ == "__main__":
    main()
