"""Embedding throughput: fleetserve's `LLM.embed` against transformers on the same weights.

Workload: `--num-prompts` prompts (default 64) of 112-128 tokens (offline_throughput.py's
text), embedded as `/v1/embeddings` does (the final-norm hidden state of each prompt's last
token, L2-normalized). Engines, interleaved over `--repeats` rounds (each one's median round
is reported), all with `--threads` torch threads:

- `fleetserve`: one `LLM.embed` call with every prompt: the scheduler packs the prompts
  into prefill steps of up to 2048 tokens (prefix caching off, so rounds do not hit it);
- `fleetserve-one-by-one`: one `LLM.embed` call per prompt (what a client sending one
  input per request costs without the server batching them);
- `hf-batched`: transformers' forward over right-padded batches of `--hf-batch-size` with
  an attention mask, the last real token's `hidden_states[-1]`, normalized.

The `max |diff|` column compares each engine's vectors with transformers' (correctness,
not speed).

    python benchmarks/embeddings.py                       # 3 rounds, float32
    python benchmarks/embeddings.py --repeats 5 --dtype bfloat16
Prints a table and writes benchmarks/results/embeddings_<dtype>.png and .json.
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

from offline_throughput import RESULTS, workload  # noqa: E402  (workload (a)'s prompts)
from structured_outputs import cpu_name  # noqa: E402


def run_fleetserve(llm, prompts, one_by_one: bool) -> tuple[float, list]:
    forms = [{"prompt_token_ids": p} for p in prompts]
    t0 = time.perf_counter()
    if one_by_one:
        outs = [llm.embed(f, use_tqdm=False)[0] for f in forms]
    else:
        outs = llm.embed(forms, use_tqdm=False)
    return time.perf_counter() - t0, [o.outputs.embedding for o in outs]


def run_hf(model, prompts, batch_size: int) -> tuple[float, list]:
    import torch

    vectors = []
    t0 = time.perf_counter()
    with torch.no_grad():
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            width = max(map(len, batch))
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for i, p in enumerate(batch):
                ids[i, : len(p)] = torch.tensor(p)
                mask[i, : len(p)] = 1
            hidden = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
            last = hidden[torch.arange(len(batch)), torch.tensor([len(p) - 1 for p in batch])]
            vectors += torch.nn.functional.normalize(last.float(), dim=-1).tolist()
    return time.perf_counter() - t0, vectors


def max_diff(a: list, b: list) -> float:
    return max(max(abs(x - y) for x, y in zip(u, v)) for u, v in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from fleetserve.replica.engine.tokenizer import load_tokenizer
    from fleetserve.replica.llm import LLM
    from fleetserve.replica.model_loader.hf_export import export_hf_folder
    from fleetserve.replica.model_loader.registry import resolve_model

    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(resolve_model(args.model))
    prompts, _ = workload("a", tokenizer, args.num_prompts)
    num_tokens = sum(map(len, prompts))
    hf_dir = export_hf_folder(args.model, Path.home() / ".cache" / "fleetserve" / "hf-export" / args.model)
    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype).eval()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        num_threads=args.threads,
        max_num_seqs=max(64, len(prompts)),
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
    )
    llm.embed(prompts[:4], use_tqdm=False)  # warm-up (kernels, allocator)
    run_hf(hf, prompts[:4], args.hf_batch_size)

    engines = {
        "fleetserve": lambda: run_fleetserve(llm, prompts, False),
        "fleetserve-one-by-one": lambda: run_fleetserve(llm, prompts, True),
        "hf-batched": lambda: run_hf(hf, prompts, args.hf_batch_size),
    }
    times: dict[str, list[float]] = {name: [] for name in engines}
    vectors: dict[str, list] = {}
    for _ in range(args.repeats):  # interleaved: a bad moment slows one round of each, not one engine
        for name, run in engines.items():
            elapsed, vecs = run()
            times[name].append(elapsed)
            vectors[name] = vecs
    base = statistics.median(times["hf-batched"])
    rows = []
    for name in engines:
        t = statistics.median(times[name])
        rows.append(
            {
                "engine": name,
                "seconds": round(t, 3),
                "prompts_s": round(len(prompts) / t, 1),
                "tokens_s": round(num_tokens / t, 1),
                "vs_hf": round(base / t, 2),
                "max_diff_vs_hf": max_diff(vectors[name], vectors["hf-batched"]),
                "rounds_s": [round(x, 3) for x in times[name]],
            }
        )
    cpu = cpu_name()
    print(f"{len(prompts)} prompts, {num_tokens} tokens, {args.dtype}, {args.threads} threads, {cpu}")
    header = (
        f"{'engine':<24}{'s (median)':>11}{'prompts/s':>11}{'tokens/s':>10}{'x hf':>7}{'max |diff|':>12}  rounds (s)"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['engine']:<24}{r['seconds']:>11.3f}{r['prompts_s']:>11.1f}{r['tokens_s']:>10.1f}"
            f"{r['vs_hf']:>7.2f}{r['max_diff_vs_hf']:>12.2e}  {r['rounds_s']}"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"embeddings_{args.dtype}"
    out.with_suffix(".json").write_text(
        json.dumps(
            {"cpu": cpu, "dtype": args.dtype, "threads": args.threads, "num_prompts": len(prompts), "rows": rows},
            indent=1,
        )
    )
    plot(rows, out.with_suffix(".png"), args.dtype, cpu)
    print(f"wrote {out.with_suffix('.png')} and .json")


def plot(rows: list[dict], path: Path, dtype: str, cpu: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    bars = ax.bar([r["engine"] for r in rows], [r["tokens_s"] for r in rows], color=["#48c", "#8ac", "#888"])
    for bar, r in zip(bars, rows):
        ax.annotate(
            f"{r['tokens_s']:.0f}\n({r['vs_hf']:.2f}x hf)",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylabel("prompt tokens embedded / s")
    ax.set_title(f"Embeddings, SmolLM2-135M {dtype}, {cpu}", fontsize=9)
    ax.margins(y=0.25)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
