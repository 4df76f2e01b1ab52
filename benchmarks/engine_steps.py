"""Engine step times: where an offline run's time goes, step by step (decode vs prefill steps).

Runs offline_throughput's workload (a) (N prompts of ~120 tokens x 128 output tokens,
greedy, EOS ignored) through one `LLM`, twice (the first round warms up), timing every
`EngineCore.step` of the second round: the decode-only steps (every request one token) and
the steps that carry prompt tokens are reported apart, as counts, medians, p90 and their
share of the round. On a GPU, `--engines graphs,eager` compares CUDA graphs with
`enforce_eager=True` in the same process run; on a CPU only the eager path exists. Prints
a table and writes `benchmarks/results/engine_steps.{png,json}`.

    python benchmarks/engine_steps.py                                   # CPU, SmolLM2, 64 prompts
    python benchmarks/engine_steps.py --model <dir> --device cuda --num-prompts 256 --engines graphs,eager

A py-spy of the same script (`py-spy record --format raw -o out.txt -- python
benchmarks/engine_steps.py ...`) shows which Python lines those steps spend their time on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(Path(__file__).parent))


def run(model: str, device: str, n: int, eager: bool, dtype: str) -> dict:
    from offline_throughput import workload

    from fleetserve.replica.engine.tokenizer import load_tokenizer
    from fleetserve.replica.llm import LLM
    from fleetserve.replica.model_loader.registry import resolve_model
    from fleetserve.scheduler import SamplingParams

    prompts, outputs = workload("a", load_tokenizer(resolve_model(model)), n)
    llm = LLM(
        model,
        dtype=dtype,
        max_num_seqs=n,
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=2 << 30,
        device=device,
        enforce_eager=eager,
    )
    core = llm.core
    inner_step, inner_schedule = core.step, core.scheduler.schedule
    steps: list[tuple[float, bool]] = []  # (seconds, decode-only)
    last: dict = {}

    def schedule(*args, **kwargs):
        last["out"] = inner_schedule(*args, **kwargs)
        return last["out"]

    def timed_step(*args, **kwargs):
        last.clear()
        t0 = time.perf_counter()
        out = inner_step(*args, **kwargs)
        so = last.get("out")
        if so is not None and so.total_num_scheduled_tokens:
            steps.append((time.perf_counter() - t0, so.total_num_scheduled_tokens == len(so.num_scheduled_tokens)))
        return out

    core.step, core.scheduler.schedule = timed_step, schedule
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in outputs]
    for _ in range(2):
        steps.clear()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    graphs = core.executor.worker.runner.decode_graphs
    core.shutdown()

    def summary(times: list[float]) -> dict:
        s = sorted(times)
        return {
            "count": len(s),
            "median_ms": 1e3 * statistics.median(s) if s else 0.0,
            "p90_ms": 1e3 * s[int(0.9 * (len(s) - 1))] if s else 0.0,
            "total_s": sum(s),
        }

    return {
        "engine": "eager" if eager or graphs is None else "graphs",
        "device": device,
        "prompts": n,
        "tok_s": ntok / elapsed,
        "elapsed_s": elapsed,
        "decode": summary([t for t, d in steps if d]),
        "prefill": summary([t for t, d in steps if not d]),
        "all_steps_ms": [round(1e3 * t, 3) for t, _ in steps],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--engines", default=None, help="graphs,eager on a GPU (default); eager on a CPU")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: 2 on CPU, 8 on GPU)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads or (8 if args.device == "cuda" else 2))
    engines = (args.engines or ("graphs,eager" if args.device == "cuda" else "eager")).split(",")
    rows = [run(args.model, args.device, args.num_prompts, e == "eager", args.dtype) for e in engines]
    print(f"workload (a), {args.num_prompts} prompts, {args.model} {args.dtype} on {args.device}; second round")
    head = (
        f"{'engine':<8}{'tok/s':>9}{'decode steps':>14}{'median ms':>11}{'p90 ms':>9}{'share':>7}"
        f"{'prefill steps':>15}{'median ms':>11}{'p90 ms':>9}{'share':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        d, p = r["decode"], r["prefill"]
        total = d["total_s"] + p["total_s"] or 1.0
        print(
            f"{r['engine']:<8}{r['tok_s']:>9.0f}{d['count']:>14}{d['median_ms']:>11.2f}{d['p90_ms']:>9.2f}"
            f"{d['total_s'] / total:>7.0%}{p['count']:>15}{p['median_ms']:>11.2f}{p['p90_ms']:>9.2f}"
            f"{p['total_s'] / total:>7.0%}"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "engine_steps.json").write_text(json.dumps(rows, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for r in rows:
        ax.plot(r["all_steps_ms"], marker=".", linewidth=0.8, label=f"{r['engine']} ({r['tok_s']:.0f} tok/s)")
    ax.set_xlabel("step of the second round")
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.set_title(f"Engine step times, workload (a), {args.num_prompts} prompts, {args.device}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "engine_steps.png", dpi=110)
    print(f"wrote {RESULTS / 'engine_steps.png'}")


if __name__ == "__main__":
    main()
