"""Tensor parallelism on this machine: TP=1 vs TP=2 vs TP=3, and what the fan-out costs.

On 2 CPU cores TP cannot speed anything up (the ranks share the same cores and
every layer adds two gloo all-reduces); the point of this benchmark is the
overhead of the step fan-out: the driver puts the SchedulerOutput diff into the
object store once, every rank reads it, and rank 0's ModelRunnerOutput comes
back. Fan-out overhead per step = driver wall time - the slowest rank's own
step time. Prints a table and writes benchmarks/results/tp_overhead.png.

    python benchmarks/tp_overhead.py            # a random 12-head model, TP 1/2/3
    python benchmarks/tp_overhead.py --quick

Not run on a GPU: with NCCL the all-reduces are what TP pays for, and the
fan-out cost measured here is the part that stays the same.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"


def run(model_dir: str, tp: int, prompts, max_tokens: int, threads: int) -> dict:
    from fleetserve.replica.llm import LLM
    from fleetserve.scheduler import SamplingParams

    llm = LLM(
        model_dir,
        dtype="float32",
        tensor_parallel_size=tp,
        num_gpu_blocks_override=512,
        num_threads=max(1, threads // tp),
        enable_prefix_caching=False,
    )
    try:
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
        executor = llm.core.executor
        timings = getattr(executor, "step_timings", None)
        if timings is not None:
            timings.clear()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        ntok = sum(len(o.outputs[0].token_ids) for o in outs)
        row = {"tp": tp, "tok_s": ntok / elapsed, "tokens": [o.outputs[0].token_ids for o in outs]}
        if timings:
            walls = [w for w, _ in timings]
            over = [w - r for w, r in timings]
            row.update(
                step_ms=1e3 * statistics.median(walls),
                fanout_us=1e6 * statistics.median(over),
                fanout_frac=statistics.median(o / w for (w, _), o in zip(timings, over)),
            )
        else:
            row.update(step_ms=1e3 * elapsed / max(1, max_tokens), fanout_us=0.0, fanout_frac=0.0)
        return row
    finally:
        llm.core.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", default="1,2,3")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    import torch

    torch.set_num_threads(args.threads)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    from fleetserve.replica.testing import make_tiny_llama

    # 12 heads / 6 kv heads, hidden 768, intermediate 1536: all divide by 1, 2 and 3.
    model_dir = str(
        make_tiny_llama(
            Path(tempfile.mkdtemp()) / "tp-model",
            hidden_size=768,
            intermediate_size=1536,
            num_layers=4 if args.quick else 8,
            num_heads=12,
            num_kv_heads=6,
            init_std=0.02,
        )
    )
    import random

    rng = random.Random(0)
    n = 4 if args.quick else args.num_prompts
    prompts = [[rng.randrange(3, 380) for _ in range(64)] for _ in range(n)]
    max_tokens = 8 if args.quick else args.max_tokens
    rows = [run(model_dir, int(tp), prompts, max_tokens, args.threads) for tp in args.tp.split(",")]
    same = all(r["tokens"] == rows[0]["tokens"] for r in rows)
    print(f"\ngreedy tokens identical across TP sizes: {same}")
    header = f"{'TP':>3}{'out tok/s':>11}{'median step ms':>16}{'fan-out us/step':>17}{'fan-out % step':>16}"
    print(header + "\n" + "-" * len(header))
    for r in rows:
        print(
            f"{r['tp']:>3}{r['tok_s']:>11.1f}{r['step_ms']:>16.1f}{r['fanout_us']:>17.0f}"
            f"{100 * r['fanout_frac']:>15.1f}%"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    for r in rows:
        r.pop("tokens")
    (RESULTS / "tp_overhead.json").write_text(json.dumps(rows, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].bar([str(r["tp"]) for r in rows], [r["tok_s"] for r in rows])
    axes[0].set_xlabel("tensor_parallel_size")
    axes[0].set_ylabel("output tokens/s (2 CPU cores)")
    axes[1].bar([str(r["tp"]) for r in rows], [r["step_ms"] - r["fanout_us"] / 1e3 for r in rows], label="ranks' step")
    axes[1].bar(
        [str(r["tp"]) for r in rows],
        [r["fanout_us"] / 1e3 for r in rows],
        bottom=[r["step_ms"] - r["fanout_us"] / 1e3 for r in rows],
        label="fan-out overhead",
    )
    axes[1].set_ylabel("median step (ms)")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "tp_overhead.png", dpi=110)
    print(f"wrote {RESULTS / 'tp_overhead.png'}")
    ray.shutdown()


if __name__ == "__main__":
    main()
