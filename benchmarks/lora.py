"""What serving LoRA adapters costs: generation throughput with adapters against the same
weights merged into the model (no adapter work at all), on SmolLM2-135M.

Adapters: `--num-adapters` random PEFT adapters (written by `peft`, rank `--rank` on all seven
projections) of SmolLM2's HF export. Workload: `--num-prompts` prompts of 112-128 tokens
(offline_throughput.py's), `--max-tokens` greedy output tokens each, one `LLM.generate` call.
Setups, interleaved over `--repeats` rounds (each one's median round is reported), all with
`--threads` torch threads:

- `merged`: adapter 1 merged into the weights (`merge_and_unload`): the ceiling, no LoRA;
- `base`: the base model on an engine without LoRA;
- `base, lora engine`: the base model on an engine with `--enable-lora` and adapters loaded
  (steps without an adapter cost what they cost without LoRA);
- `1 adapter`: every request with adapter 1 (the same output as `merged`: checked);
- `N adapters`: requests spread over all adapters (`--max-loras N`).

On a GPU (`--device cuda`) decode steps replay CUDA graphs, adapters included (replica/lora/stack.py);
`--eager-too` adds the two adapter setups on an `--enforce-eager` engine (graphs vs eager).
`--random-model` replaces SmolLM2's weights by random ones of its shape (no model package needed:
how it runs on a GPU machine that cannot hold the package).

    python benchmarks/lora.py                       # 3 rounds, float32, 4 adapters of rank 16
    python benchmarks/lora.py --device cuda --dtype bfloat16 --random-model --eager-too --num-prompts 64
Prints a table and writes benchmarks/results/lora_<dtype>.png and .json.
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

from offline_throughput import RESULTS, workload  # noqa: E402
from structured_outputs import cpu_name  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    ap.add_argument("--random-model", action="store_true", help="random weights of SmolLM2-135M's shape")
    ap.add_argument("--eager-too", action="store_true", help="also the adapter setups with --enforce-eager")
    args = ap.parse_args()

    import torch

    from fleetserve.replica.engine.tokenizer import load_tokenizer
    from fleetserve.replica.llm import LLM
    from fleetserve.replica.lora import LoRARequest
    from fleetserve.replica.model_loader.hf_export import export_hf_folder
    from fleetserve.replica.model_loader.registry import resolve_model
    from fleetserve.replica.testing import make_tiny_lora
    from fleetserve.scheduler import SamplingParams

    torch.set_num_threads(args.threads)
    cache = Path.home() / ".cache" / "fleetserve" / "lora-bench"
    if args.random_model:
        from fleetserve.replica.testing import make_tiny_llama

        cache = cache / "random-smollm2"  # its adapters too: they fit this model only
        hf_dir = cache / "model"
        if not (hf_dir / "config.json").exists():
            make_tiny_llama(
                hf_dir,
                hidden_size=576,
                intermediate_size=1536,
                num_layers=30,
                num_heads=9,
                num_kv_heads=3,
                tie_word_embeddings=True,
                init_std=0.02,
                seed=0,
            )
        args.model = str(hf_dir)
    else:
        cache = cache / args.model.replace("/", "_")
        hf_dir = export_hf_folder(args.model, Path.home() / ".cache" / "fleetserve" / "hf-export" / args.model)
    adapters = []
    for i in range(args.num_adapters):
        path = cache / f"r{args.rank}-{i}"
        if not (path / "adapter_config.json").exists():
            make_tiny_lora(hf_dir, path, r=args.rank, lora_alpha=2 * args.rank, init_std=0.02, seed=i)
        adapters.append(path)
    merged_dir = cache / f"merged-r{args.rank}"
    if not (merged_dir / "config.json").exists():
        from peft import PeftModel
        from transformers import AutoTokenizer, LlamaForCausalLM

        base = LlamaForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
        PeftModel.from_pretrained(base, str(adapters[0])).merge_and_unload().save_pretrained(merged_dir)
        AutoTokenizer.from_pretrained(str(hf_dir)).save_pretrained(merged_dir)

    tokenizer = load_tokenizer(resolve_model(args.model))
    prompts, _ = workload("a", tokenizer, args.num_prompts)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    common = dict(
        dtype=args.dtype,
        num_threads=args.threads,
        max_num_seqs=max(64, len(prompts)),
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=1 << 30,
        device=args.device,
    )
    modules = [f"lora{i}={p}" for i, p in enumerate(adapters)]
    engines = {
        "merged": LLM(str(merged_dir), **common),
        "base": LLM(str(hf_dir), **common),
        "lora": LLM(str(hf_dir), lora_modules=modules, max_loras=len(adapters), max_lora_rank=args.rank, **common),
    }
    if args.eager_too:
        engines["lora eager"] = LLM(
            str(hf_dir),
            lora_modules=modules,
            max_loras=len(adapters),
            max_lora_rank=args.rank,
            enforce_eager=True,
            **common,
        )
    reqs = [LoRARequest(f"lora{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    setups = {
        "merged": ("merged", None),
        "base": ("base", None),
        "base, lora engine": ("lora", None),
        "1 adapter": ("lora", [reqs[0]] * len(prompts)),
        f"{len(reqs)} adapters": ("lora", [reqs[i % len(reqs)] for i in range(len(prompts))]),
    }
    if args.eager_too:
        setups["1 adapter, eager"] = ("lora eager", setups["1 adapter"][1])
        setups[f"{len(reqs)} adapters, eager"] = ("lora eager", setups[f"{len(reqs)} adapters"][1])
    for engine, loras in setups.values():  # warm-up (kernels, allocator)
        engines[engine].generate(
            prompts[:4], SamplingParams(max_tokens=4), use_tqdm=False, lora_request=None if loras is None else loras[:4]
        )
    times: dict[str, list[float]] = {name: [] for name in setups}
    tokens: dict[str, list] = {}
    for _ in range(args.repeats):  # interleaved: a bad moment slows one round of each, not one setup
        for name, (engine, loras) in setups.items():
            t0 = time.perf_counter()
            outs = engines[engine].generate(prompts, params, use_tqdm=False, lora_request=loras)
            times[name].append(time.perf_counter() - t0)
            tokens[name] = [o.outputs[0].token_ids for o in outs]
    # The adapter's tokens equal the merged model's (float32: the same sums in another order,
    # so a near tie may still flip late in a long output; counted, not asserted).
    same = sum(a == b for a, b in zip(tokens["1 adapter"], tokens["merged"]))
    ceiling = statistics.median(times["merged"])
    num_out = len(prompts) * args.max_tokens
    rows = []
    for name in setups:
        t = statistics.median(times[name])
        rows.append(
            {
                "setup": name,
                "seconds": round(t, 3),
                "output_tokens_s": round(num_out / t, 1),
                "vs_merged": round(ceiling / t, 3),
                "rounds_s": [round(x, 3) for x in times[name]],
            }
        )
    cpu = cpu_name()
    device = next(iter(engines.values())).core.executor.worker.device
    if device.type == "cuda":
        cpu = f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    print(
        f"{len(prompts)} prompts x {args.max_tokens} tokens, {len(reqs)} adapters of rank {args.rank}, "
        f"{args.dtype}, {args.threads} threads, {cpu}; 1 adapter's outputs equal merged's: {same}/{len(prompts)}"
    )
    header = f"{'setup':<20}{'s (median)':>11}{'out tok/s':>11}{'x merged':>10}  rounds (s)"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['setup']:<20}{r['seconds']:>11.3f}{r['output_tokens_s']:>11.1f}{r['vs_merged']:>10.3f}  "
            f"{r['rounds_s']}"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / (f"lora_{args.dtype}" + ("" if device.type == "cpu" else f"_{device.type}"))
    out.with_suffix(".json").write_text(
        json.dumps(
            {
                "cpu": cpu,
                "dtype": args.dtype,
                "threads": args.threads,
                "num_prompts": len(prompts),
                "max_tokens": args.max_tokens,
                "rank": args.rank,
                "num_adapters": len(reqs),
                "same_as_merged": same,
                "rows": rows,
            },
            indent=1,
        )
    )
    plot(rows, out.with_suffix(".png"), f"{len(reqs)} adapters of rank {args.rank}, {args.dtype}, {cpu}")
    print(f"wrote {out.with_suffix('.png')} and .json")


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    bars = ax.bar(
        [r["setup"].replace(", ", ",\n") for r in rows],
        [r["output_tokens_s"] for r in rows],
        color=(["#888", "#8ac", "#8ac", "#48c", "#48c"] + ["#c84"] * 2)[: len(rows)],
    )
    for bar, r in zip(bars, rows):
        ax.annotate(
            f"{r['output_tokens_s']:.0f}\n({r['vs_merged']:.2f}x)",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylabel("output tokens / s")
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title(f"LoRA serving, SmolLM2-135M: {title}", fontsize=8)
    ax.margins(y=0.2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
