"""Speculative decoding (n-gram prompt lookup) vs plain decoding, same engine, same run.

    copy-b1   copy-heavy chats (quote, fix typos, summarise with quotes, add a
              title, document code), one request at a time
    copy-b16  16 of them at once
    (a)       offline_throughput's workload (a): 64 prompts of ~120 tokens x 128
              output tokens, EOS ignored, where little is proposed

Greedy, so both engines must produce the same tokens (checked). Reports output
tokens/s (median over --repeats rounds, the two engines interleaved within a
round), the speedup, and the acceptance counters. Prints a table and writes
benchmarks/results/spec_decode.png and .json.

    flock -x -w 1500 /tmp/fleetserve-heavy.lock python benchmarks/spec_decode.py
    python benchmarks/spec_decode.py --quick            # a smoke run
    python benchmarks/spec_decode.py --cases copy-b1,copy-b16 --k 6
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

RESULTS = ROOT / "benchmarks" / "results"


def build_cases(
    tokenizer, names: list[str], quick: bool, max_new: int, a_prompts: int = 64, a_tokens: int = 128
) -> dict:
    from _copy_prompts import copy_heavy_messages
    from offline_throughput import workload

    from fleetserve.replica.engine.tokenizer import apply_chat_template

    def chats(n):
        return [
            tokenizer.encode(apply_chat_template(tokenizer, m), add_special_tokens=False)
            for m in copy_heavy_messages(n)
        ]

    max_new = 64 if quick else max_new
    cases = {}
    if "copy-b1" in names:
        cases["copy-b1"] = dict(prompts=chats(2 if quick else 3), max_tokens=max_new, ignore_eos=False, batch=1)
    if "copy-b16" in names:
        cases["copy-b16"] = dict(prompts=chats(16), max_tokens=max_new, ignore_eos=False, batch=16)
    if "a" in names:
        prompts, _ = workload("a", tokenizer, 16 if quick else a_prompts)
        cases["a"] = dict(prompts=prompts, max_tokens=32 if quick else a_tokens, ignore_eos=True, batch=len(prompts))
    return cases


def run_case(llm, case: dict) -> tuple[float, list[list[int]]]:
    """(seconds, output tokens per prompt); batch 1 runs the prompts one after another."""
    from fleetserve.scheduler import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=case["max_tokens"], ignore_eos=case["ignore_eos"])
    prompts, batch = case["prompts"], case["batch"]
    tokens = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs = llm.generate(prompts[i : i + batch], sp, use_tqdm=False)
        tokens += [o.outputs[0].token_ids for o in outs]
    return time.perf_counter() - t0, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--cases", default="copy-b1,copy-b16,a")
    ap.add_argument("--k", type=int, default=6, help="num_speculative_tokens")
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=200, help="output cap of the copy cases")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--a-repeats", type=int, default=2, help="rounds of workload (a) (the long one)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--a-prompts", type=int, default=64, help="prompts of workload (a)")
    ap.add_argument("--a-tokens", type=int, default=128, help="output tokens per prompt of (a)")
    ap.add_argument(
        "--free-draft-tokens",
        type=int,
        default=None,
        help="speculative config's free_draft_tokens (default: the device's; 0: off)",
    )
    args = ap.parse_args()

    import torch

    from fleetserve.replica.llm import LLM

    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": args.lookup_min,
        "prompt_lookup_max": args.lookup_max,
        "free_draft_tokens": args.free_draft_tokens,
    }
    common = dict(
        dtype=args.dtype,
        max_num_seqs=64,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=1 << 30,
        num_threads=args.threads,
    )
    engines = {"plain": LLM(args.model, **common), "ngram": LLM(args.model, speculative_config=spec, **common)}
    cases = build_cases(
        engines["plain"].tokenizer, args.cases.split(","), args.quick, args.max_tokens, args.a_prompts, args.a_tokens
    )
    for llm in engines.values():  # warm-up: kernels, allocator, first-call paths
        run_case(llm, dict(prompts=next(iter(cases.values()))["prompts"][:2], max_tokens=8, ignore_eos=True, batch=2))

    rows = []
    for name, case in cases.items():
        times = {e: [] for e in engines}
        accept = None
        for _ in range(args.a_repeats if name == "a" else args.repeats):
            outputs = {}
            for e, llm in engines.items():
                before = llm.core.scheduler.spec_stats.snapshot()
                elapsed, outputs[e] = run_case(llm, case)
                times[e].append(elapsed)
                if e == "ngram":
                    after = llm.core.scheduler.spec_stats
                    accept = (
                        after.num_drafts - before.num_drafts,
                        after.num_draft_tokens - before.num_draft_tokens,
                        after.num_accepted_tokens - before.num_accepted_tokens,
                    )
            if outputs["plain"] != outputs["ngram"]:
                raise SystemExit(f"{name}: speculative output differs from plain greedy output")
        ntok = sum(len(t) for t in outputs["plain"])
        tok_s = {e: ntok / statistics.median(ts) for e, ts in times.items()}
        drafts, draft_tokens, accepted = accept
        rows.append(
            dict(
                case=name,
                batch=case["batch"],
                prompts=len(case["prompts"]),
                tokens=ntok,
                plain_tok_s=tok_s["plain"],
                ngram_tok_s=tok_s["ngram"],
                speedup=tok_s["ngram"] / tok_s["plain"],
                acceptance=accepted / draft_tokens if draft_tokens else 0.0,
                tokens_per_draft=(accepted / drafts if drafts else 0.0),
                draft_tokens=draft_tokens,
                times=times,
            )
        )
        r = rows[-1]
        print(
            f"{name}: plain {r['plain_tok_s']:.1f} tok/s, ngram {r['ngram_tok_s']:.1f} tok/s, "
            f"x{r['speedup']:.2f}, acceptance {r['acceptance']:.2f}",
            flush=True,
        )

    print()
    print(
        f"n-gram speculation (k={args.k}, lookup {args.lookup_min}-{args.lookup_max}), {args.model} "
        f"{args.dtype}, torch threads {torch.get_num_threads()}, median of {args.repeats} interleaved rounds "
        f"({args.a_repeats} for (a))"
    )
    print(
        f"{'case':<10}{'batch':>6}{'tokens':>8}{'plain tok/s':>13}{'ngram tok/s':>13}{'speedup':>9}"
        f"{'accept':>8}{'acc/draft':>10}"
    )
    for r in rows:
        print(
            f"{r['case']:<10}{r['batch']:>6}{r['tokens']:>8}{r['plain_tok_s']:>13.1f}{r['ngram_tok_s']:>13.1f}"
            f"{r['speedup']:>8.2f}x{r['acceptance']:>8.2f}{r['tokens_per_draft']:>10.2f}"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "spec_decode.json").write_text(json.dumps(dict(args=vars(args), rows=rows), indent=1))
    plot(rows, args)


def plot(rows, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["plain_tok_s"] for r in rows], 0.4, label="plain")
    ax.bar([x + 0.2 for x in xs], [r["ngram_tok_s"] for r in rows], 0.4, label=f"ngram k={args.k}")
    for x, r in zip(xs, rows):
        ax.text(x + 0.2, r["ngram_tok_s"], f"{r['speedup']:.2f}x", ha="center", va="bottom")
    ax.set_xticks(list(xs), [f"{r['case']} (batch {r['batch']})" for r in rows])
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"speculative decoding, {args.model} {args.dtype}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "spec_decode.png", dpi=120)
    print(f"wrote {RESULTS / 'spec_decode.png'}")


if __name__ == "__main__":
    main()
