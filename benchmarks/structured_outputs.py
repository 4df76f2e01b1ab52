"""Throughput cost of structured outputs: offline workload (a) with 0%, 25% and 100% of the
requests constrained to a JSON schema.

Workload (a) of offline_throughput.py (64 prompts of ~120 tokens -> 128 output tokens,
greedy, EOS ignored) on the default model. The constrained requests use a JSON schema
whose first field is a long string (minLength 2000), so every request still produces
exactly 128 tokens: the rows differ only in how many of them pay for the grammar (the
bitmask filled per step on the engine core, applied in the sampler), not in how long
they run. The schema is compiled once, in the warm-up (the cache serves it after).
Rounds interleave the fractions; the median round of each is reported, with the ratio
to the unconstrained round of the same repeat.

    python benchmarks/structured_outputs.py                    # 3 rounds
    python benchmarks/structured_outputs.py --repeats 5 --dtype float32
Prints a table and writes benchmarks/results/structured_outputs_<dtype>.png and .json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from offline_throughput import RESULTS, workload  # noqa: E402  (workload (a), reused)

SCHEMA = {
    "type": "object",
    "properties": {
        "summary": {"type": "string", "minLength": 2000},
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
        "reviewed": {"type": "boolean"},
    },
    "required": ["summary", "title", "year", "tags", "reviewed"],
}


def params_for(outputs: list[int], fraction: float):
    from fleetserve.scheduler import SamplingParams, StructuredOutputsParams

    n = len(outputs)
    k = round(n * fraction)
    # Spread the constrained requests through the batch (every 4th at 25%).
    step = n / k if k else 0
    constrained = {int(i * step) for i in range(k)}
    so = StructuredOutputsParams(json=SCHEMA)
    return [
        SamplingParams(
            temperature=0, max_tokens=m, ignore_eos=True, structured_outputs=so if i in constrained else None
        )
        for i, m in enumerate(outputs)
    ]


def run_once(llm, prompts, outputs, fraction: float, timers: "Timers | None" = None) -> dict:
    params = params_for(outputs, fraction)
    if timers is not None:
        timers.reset()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"tok_s": ntok / elapsed, "tokens": ntok, "elapsed": elapsed}
    if timers is not None:
        result["ms_per_step"] = timers.per_step()
    return result


class Timers:
    """--breakdown: wall time of the grammar work on the step's critical path, per step
    (engine core: bitmask fill, matcher accepts; model runner: bitmask rows, masking)."""

    def __init__(self) -> None:
        from fleetserve.replica.engine.engine_core import EngineCore
        from fleetserve.replica.layers import sampler
        from fleetserve.replica.structured_output.manager import GrammarBitmask, StructuredOutputManager

        self.total: dict[str, float] = {}
        for owner, name, label in (
            (EngineCore, "step", "step"),
            (StructuredOutputManager, "bitmask", "fill"),
            (StructuredOutputManager, "accept", "accept"),
            (GrammarBitmask, "for_rows", "rows"),
            (sampler, "apply_token_bitmask", "apply"),
        ):
            setattr(owner, name, self._wrap(getattr(owner, name), label))
        self.reset()

    def _wrap(self, fn, label):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[label] += time.perf_counter() - t0
                if label == "step":
                    self.steps += 1

        return timed

    def reset(self) -> None:
        self.total = dict.fromkeys(("step", "fill", "accept", "rows", "apply"), 0.0)
        self.steps = 0

    def per_step(self) -> dict:
        return {k: 1000 * v / max(self.steps, 1) for k, v in self.total.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--fractions", default="0,0.25,1")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="also time the grammar work per step (fill, accept, bitmask rows, masking)",
    )
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from fleetserve.replica.llm import LLM

    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=args.num_prompts,
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=2 << 30,
        device=args.device,
        num_threads=args.threads,
    )
    prompts, outputs = workload("a", llm.tokenizer, args.num_prompts)
    timers = Timers() if args.breakdown else None
    fractions = [float(f) for f in args.fractions.split(",")]
    # Warm-up: kernels, and the schema's compilation (then cached, as in serving).
    t0 = time.perf_counter()
    llm.generate(prompts[:4], params_for([4] * 4, 1.0), use_tqdm=False)
    print(f"warm-up incl. tokenizer info + schema compile: {time.perf_counter() - t0:.1f} s")
    rounds: dict[float, list[dict]] = {f: [] for f in fractions}
    for rep in range(args.repeats):
        for f in fractions if rep % 2 == 0 else fractions[::-1]:  # interleaved, both orders
            r = run_once(llm, prompts, outputs, f, timers)
            rounds[f].append(r)
            print(f"round {rep}: {f:>4.0%} constrained  {r['tok_s']:7.1f} tok/s  ({r['tokens']} tokens)")
    base = [r["tok_s"] for r in rounds[fractions[0]]]
    rows = []
    for f in fractions:
        tok_s = [r["tok_s"] for r in rounds[f]]
        ratios = [t / b for t, b in zip(tok_s, base)]
        rows.append(
            {
                "fraction": f,
                "tok_s": statistics.median(tok_s),
                "ratio": statistics.median(ratios),
                "min": min(tok_s),
                "max": max(tok_s),
                "ratios": ratios,
            }
        )
    print(
        f"\nworkload (a): {args.num_prompts} prompts ~120 in -> 128 out, greedy, dtype {args.dtype}, "
        f"{args.threads} threads, {args.device}; median of {args.repeats} interleaved rounds"
    )
    print(f"{'constrained':>12}{'out tok/s':>11}{'vs 0%':>8}{'min':>9}{'max':>9}   ratios per repeat")
    for r in rows:
        print(
            f"{r['fraction']:>12.0%}{r['tok_s']:>11.1f}{r['ratio']:>8.3f}{r['min']:>9.1f}{r['max']:>9.1f}   "
            + " ".join(f"{x:.3f}" for x in r["ratios"])
        )
    if timers is not None:
        print("\ngrammar work per step, ms (median over rounds): step = the whole engine step")
        print(f"{'constrained':>12}" + "".join(f"{k:>9}" for k in ("step", "fill", "accept", "rows", "apply")))
        for f in fractions:
            med = {
                k: statistics.median(r["ms_per_step"][k] for r in rounds[f])
                for k in ("step", "fill", "accept", "rows", "apply")
            }
            print(f"{f:>12.0%}" + "".join(f"{v:>9.3f}" for v in med.values()))
    name = f"structured_outputs_{args.dtype}" + ("_breakdown" if timers is not None else "")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(
        json.dumps(
            {
                "cpu": cpu_name(),
                "dtype": args.dtype,
                "threads": args.threads,
                "repeats": args.repeats,
                "num_prompts": args.num_prompts,
                "rows": rows,
                "rounds": {str(f): rounds[f] for f in fractions},
            },
            indent=1,
        )
    )
    plot(rows, RESULTS / f"{name}.png", args.dtype)


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def plot(rows: list[dict], path: Path, dtype: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = [f"{r['fraction']:.0%}" for r in rows]
    bars = ax.bar(labels, [r["tok_s"] for r in rows], color=["#888", "#4a8", "#48c"][: len(rows)])
    for bar, r in zip(bars, rows):
        ax.annotate(
            f"{r['tok_s']:.0f}\n({r['ratio']:.3f}x)",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xlabel("requests constrained to a JSON schema")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Structured outputs: throughput cost (workload a, {dtype})")
    ax.margins(y=0.2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
