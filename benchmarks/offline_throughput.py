"""Offline throughput: fleetserve's engine vs HF transformers static batching (and vLLM CPU).

Same machine, same weights (the default SmolLM2-135M GGUF, dequantized), one run:

  (a) fixed:  64 prompts of ~120 tokens x 128 output tokens, EOS ignored
  (b) varied: prompt and output lengths from a seeded long-tailed (log-normal)
              distribution, EOS ignored, so every engine produces the same tokens
  (pN) prefill only: prompts of N tokens, one output token each (64 prompts up to
              N = 256, fewer past it: 16 of 1000); compare "prompt tok/s"

for each dtype (bf16, fp32). Reports output tokens/s, mean TTFT (all requests
arrive at t=0), and model FLOP/s as a fraction of this machine's bf16 matmul
ceiling (F.linear at the model's own shapes, measured in the same script):
"% ceil (out)" counts output tokens only, "% ceil (all)" every token the model
processed (prompt + output), i.e. model FLOP utilization.
Prints a table and writes a PNG under benchmarks/results/.

    python benchmarks/offline_throughput.py                 # everything
    python benchmarks/offline_throughput.py --quick         # a smoke run (small)
    python benchmarks/offline_throughput.py --engines fleetserve,hf --dtypes bfloat16
    python benchmarks/offline_throughput.py --workloads a --dtypes bfloat16 --repeats 3   # medians
    python benchmarks/offline_throughput.py --workloads p120,p1000 --dtypes bfloat16 \
        --engines fleetserve,vllm --repeats 3

vLLM CPU runs when it is importable in a separate interpreter (--vllm-python,
default /opt/vllm-venv/bin/python; see benchmarks/README.md). On a GPU, the engine
`fleetserve-eager` is fleetserve with `enforce_eager=True` (no CUDA graphs):

    python benchmarks/offline_throughput.py --model <dir> --device cuda \
        --engines fleetserve,fleetserve-eager --dtypes bfloat16 --num-prompts 256 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"
TEXT = (
    "The history of computing is a story of abstractions stacked on abstractions. Early machines were "
    "programmed by rewiring panels; then came stored programs, assemblers, compilers and operating "
    "systems, each hiding the layer below. Networks joined machines into clusters, and clusters into "
    "clouds. Language models are the newest layer: they turn text into numbers, numbers into "
    "predictions, and predictions back into text. Serving them well means keeping expensive hardware "
    "busy while many users wait, which is a scheduling problem as much as a numerical one. A good "
    "scheduler batches requests that arrive at different times, shares memory for common prefixes, "
    "and never lets one long prompt starve everyone else. The rest is careful engineering of "
    "attention kernels, memory layouts and the data paths between processes. "
)


# ---- workloads ---------------------------------------------------------------------------
def make_prompts(tokenizer, lengths: list[int], seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    base = tokenizer.encode(TEXT * 40, add_special_tokens=False)
    out = []
    for n in lengths:
        start = rng.randrange(0, len(base) - n - 1)
        out.append(base[start : start + n])
    return out


def workload(name: str, tokenizer, num_prompts: int, seed: int = 0):
    import random

    rng = random.Random(seed)
    if name.startswith("p") and name[1:].isdigit():  # prefill only: pN, prompts of N tokens
        length = int(name[1:])
        n = max(8, min(num_prompts, num_prompts * 256 // length))
        return make_prompts(tokenizer, [length] * n, seed), [1] * n
    if name == "a":
        lengths = [rng.randint(112, 128) for _ in range(num_prompts)]
        outputs = [128] * num_prompts
    else:
        lengths = [int(min(1024, max(16, rng.lognormvariate(math.log(120), 0.9)))) for _ in range(num_prompts)]
        outputs = [int(min(512, max(4, rng.lognormvariate(math.log(64), 1.0)))) for _ in range(num_prompts)]
    return make_prompts(tokenizer, lengths, seed), outputs


# ---- engines -----------------------------------------------------------------------------
def run_fleetserve(
    model: str, dtype: str, prompts, outputs, max_num_seqs: int, device: str = "cpu", enforce_eager: bool = False
) -> dict:
    from fleetserve.replica.llm import LLM
    from fleetserve.scheduler import SamplingParams

    llm = LLM(
        model,
        dtype=dtype,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=2 << 30,
        device=device,
        enforce_eager=enforce_eager,
    )
    warm = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)] * len(prompts[:4])
    llm.generate(prompts[:4], warm, use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = statistics.mean(o.metrics.ttft for o in outs)
    graphs = llm.core.executor.worker.runner.decode_graphs
    extra = (
        {}
        if graphs is None
        else {"graphs": graphs.num_graphs, "replays": graphs.num_replays, "capture_s": round(graphs.capture_seconds, 2)}
    )
    llm.core.shutdown()
    return {"tok_s": ntok / elapsed, "ttft": ttft, "elapsed": elapsed, "tokens": ntok, **extra}


def run_hf(hf_dir: str, dtype: str, prompts, outputs, batch_size: int, device: str = "cpu") -> dict:
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch_dtype).eval().to(device)
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 2

    class FirstToken(LogitsProcessor):
        def __init__(self):
            self.t = None

        def __call__(self, input_ids, scores):
            if self.t is None:
                self.t = time.perf_counter()
            return scores

    def generate(batch_prompts, max_new):
        width = max(len(p) for p in batch_prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch_prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch_prompts], device=device)
        first = FirstToken()
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=pad,
                logits_processor=LogitsProcessorList([first]),
            )
        return first.t

    generate(prompts[:2], 2)  # warm-up
    t0 = time.perf_counter()
    ttfts = []
    for i in range(0, len(prompts), batch_size):
        bp, bo = prompts[i : i + batch_size], outputs[i : i + batch_size]
        # Static batching: the batch runs until its longest request is done.
        first = generate(bp, max(bo))
        ttfts += [first - t0] * len(bp)
    elapsed = time.perf_counter() - t0
    ntok = sum(outputs)  # only the tokens each request asked for count
    return {"tok_s": ntok / elapsed, "ttft": statistics.mean(ttfts), "elapsed": elapsed, "tokens": ntok}


VLLM_SCRIPT = r"""
import json, sys, time, statistics
def main():
    from vllm import LLM, SamplingParams
    cfg = json.load(open(sys.argv[1]))
    llm = LLM(model=cfg["hf_dir"], dtype=cfg["dtype"], max_num_seqs=cfg["max_num_seqs"],
              enable_prefix_caching=False, max_model_len=2048)
    llm.generate([{"prompt_token_ids": p} for p in cfg["prompts"][:4]],
                 SamplingParams(max_tokens=4, ignore_eos=True, temperature=0), use_tqdm=False)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in cfg["outputs"]]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in cfg["prompts"]], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs
             if getattr(o, "metrics", None) is not None and o.metrics.first_token_time]
    print("RESULT " + json.dumps({"tok_s": ntok / elapsed, "elapsed": elapsed, "tokens": ntok,
                                   "ttft": statistics.mean(ttfts) if ttfts else float("nan")}))
if __name__ == "__main__":
    main()
"""


def run_vllm(python: str, hf_dir: str, dtype: str, prompts, outputs, max_num_seqs: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cfg = Path(d) / "cfg.json"
        cfg.write_text(
            json.dumps(
                {"hf_dir": hf_dir, "dtype": dtype, "prompts": prompts, "outputs": outputs, "max_num_seqs": max_num_seqs}
            )
        )
        script = Path(d) / "run_vllm.py"
        script.write_text(VLLM_SCRIPT)
        env = dict(
            os.environ,
            VLLM_CPU_KVCACHE_SPACE="4",
            VLLM_CPU_OMP_THREADS_BIND="0-1",
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            VLLM_LOGGING_LEVEL="WARNING",
        )
        proc = subprocess.run([python, str(script), str(cfg)], capture_output=True, text=True, env=env, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"vLLM run failed:\n{proc.stderr[-3000:]}")


# ---- roofline --------------------------------------------------------------------------------
def matmul_ceiling(
    hidden: int, inter: int, tokens: int = 512, reps: int = 20, rounds: int = 3, device: str = "cpu"
) -> float:
    """bf16 GFLOP/s of the model's own projection shapes (F.linear, weights [out, in] as the model
    holds them) at a saturating batch: the best of `rounds` medians, since it is a ceiling and a
    shared machine only ever makes a round slower."""
    import torch
    import torch.nn.functional as F

    shapes = [(tokens, hidden, inter), (tokens, inter, hidden), (tokens, hidden, hidden)]
    best = 0.0
    for m, k, n in shapes:
        a = torch.randn(m, k, dtype=torch.bfloat16, device=device)
        w = torch.randn(n, k, dtype=torch.bfloat16, device=device)
        for _ in range(3):
            F.linear(a, w)
        for _ in range(rounds):
            times = []
            for _ in range(reps):
                _sync(device)
                t = time.perf_counter()
                F.linear(a, w)
                _sync(device)
                times.append(time.perf_counter() - t)
            best = max(best, 2 * m * k * n / statistics.median(times) / 1e9)
    return best


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def model_flops_per_token(hf_config) -> float:
    h, i, L = hf_config.hidden_size, hf_config.intermediate_size, hf_config.num_hidden_layers
    heads, kv = hf_config.num_attention_heads, hf_config.num_key_value_heads
    d = getattr(hf_config, "head_dim", None) or h // heads
    per_layer = h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * i
    return 2.0 * (L * per_layer + h * hf_config.vocab_size)


# ---- main ---------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workloads", default="a,b")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--engines", default="fleetserve,hf,vllm")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where fleetserve and HF run (vLLM CPU always runs on the CPU)",
    )
    ap.add_argument("--vllm-python", default="/opt/vllm-venv/bin/python")
    ap.add_argument("--quick", action="store_true", help="8 prompts, short outputs: a smoke run")
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of all engines, interleaved; the median round per engine is reported",
    )
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from fleetserve.replica.engine.tokenizer import load_tokenizer
    from fleetserve.replica.model_loader.registry import resolve_model

    tokenizer = load_tokenizer(resolve_model(args.model))
    from fleetserve.replica.model_loader.hf_export import export_hf_folder

    hf_dir = str(export_hf_folder(args.model, Path.home() / ".cache" / "fleetserve" / "hf-export" / args.model))
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(hf_dir)
    flops_tok = model_flops_per_token(hf_config)
    ceiling = matmul_ceiling(hf_config.hidden_size, hf_config.intermediate_size, device=args.device)
    print(
        f"bf16 matmul ceiling at the model's shapes: {ceiling:.0f} GFLOP/s; "
        f"model: {flops_tok / 1e9:.3f} GFLOP per token"
    )

    engines = args.engines.split(",")
    have_vllm = "vllm" in engines and Path(args.vllm_python).exists() and args.device == "cpu"
    rows = []
    for wl in args.workloads.split(","):
        n = 8 if args.quick else args.num_prompts
        prompts, outputs = workload(wl, tokenizer, n)
        if args.quick:
            outputs = [min(o, 16) for o in outputs]
        for dtype in args.dtypes.split(","):
            # Engines interleaved, `--repeats` rounds: a noisy machine slows whichever engine runs
            # during a bad moment, so each engine's median over rounds is reported.
            runs: dict[str, list[dict]] = {}
            for _ in range(args.repeats):
                if "fleetserve" in engines:
                    runs.setdefault("fleetserve", []).append(
                        run_fleetserve(args.model, dtype, prompts, outputs, max_num_seqs=max(64, n), device=args.device)
                    )
                if "fleetserve-eager" in engines:  # on a GPU: no CUDA graphs (--enforce-eager)
                    runs.setdefault("fleetserve-eager", []).append(
                        run_fleetserve(
                            args.model,
                            dtype,
                            prompts,
                            outputs,
                            max_num_seqs=max(64, n),
                            device=args.device,
                            enforce_eager=True,
                        )
                    )
                if "hf" in engines:
                    runs.setdefault("hf-static", []).append(
                        run_hf(hf_dir, dtype, prompts, outputs, args.hf_batch_size, args.device)
                    )
                if "vllm" in engines:
                    if have_vllm:
                        try:
                            runs.setdefault("vllm-cpu", []).append(
                                run_vllm(args.vllm_python, hf_dir, dtype, prompts, outputs, max(64, n))
                            )
                        except (RuntimeError, subprocess.TimeoutExpired) as e:
                            print(f"vLLM failed: {e}", file=sys.stderr)
                    else:
                        print(f"vLLM not installed at {args.vllm_python}: skipped", file=sys.stderr)
            res = {}
            prompt_tokens = sum(map(len, prompts))
            for engine, rs in runs.items():
                med = sorted(rs, key=lambda r: r["tok_s"])[len(rs) // 2]
                # Rounds as the table's main figure: prompt tokens/s for a prefill-only workload.
                rounds = [prompt_tokens / r["elapsed"] if wl.startswith("p") else r["tok_s"] for r in rs]
                res[engine] = dict(med, all_tok_s=[round(x, 1) for x in rounds])
            for engine, r in res.items():
                r.update(workload=wl, dtype=dtype, engine=engine, device=args.device, model=Path(args.model).name)
                # Output tokens only (the target's definition), and model FLOP utilization over
                # every token the model processed (prompt + output: prefill is real work).
                r["prompt_tok_s"] = prompt_tokens / r["elapsed"]
                r["roofline_frac"] = r["tok_s"] * flops_tok / 1e9 / ceiling if dtype == "bfloat16" else None
                r["mfu_all_tokens"] = (
                    (r["tok_s"] * (prompt_tokens + sum(outputs)) / sum(outputs) * flops_tok / 1e9 / ceiling)
                    if dtype == "bfloat16"
                    else None
                )
                if "fleetserve" in res:
                    r["fs_over_this"] = res["fleetserve"]["tok_s"] / r["tok_s"]
                rows.append(r)
            print_table([r for r in rows if r["workload"] == wl and r["dtype"] == dtype])
    print("\n== all runs ==")
    print_table(rows)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "offline_throughput.json").write_text(json.dumps(rows, indent=2))
    plot(rows, RESULTS / "offline_throughput.png")
    print(f"wrote {RESULTS / 'offline_throughput.png'}")


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'workload':<9}{'dtype':<10}{'engine':<18}{'out tok/s':>10}{'prompt tok/s':>13}"
        f"{'mean TTFT s':>12}{'fleetserve/x':>13}{'% ceil (out)':>14}{'% ceil (all)':>14}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        frac = "" if r.get("roofline_frac") is None else f"{100 * r['roofline_frac']:.1f}%"
        mfu = "" if r.get("mfu_all_tokens") is None else f"{100 * r['mfu_all_tokens']:.1f}%"
        ratio = "" if r.get("fs_over_this") is None else f"{r['fs_over_this']:.2f}x"
        rounds = "" if len(r.get("all_tok_s", [])) < 2 else "  rounds: " + ", ".join(map(str, r["all_tok_s"]))
        print(
            f"{r['workload']:<9}{r['dtype']:<10}{r['engine']:<18}{r['tok_s']:>10.1f}"
            f"{r.get('prompt_tok_s', float('nan')):>13.1f}{r['ttft']:>12.2f}{ratio:>13}{frac:>14}{mfu:>14}{rounds}"
        )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["workload"], r["dtype"]) for r in rows})
    engines = sorted({r["engine"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(engines))

    def value(r: dict, metric: str) -> float:
        if metric == "tok_s" and r["workload"].startswith("p"):  # prefill only: prompt tokens
            return r["prompt_tok_s"]
        return r[metric]

    for metric, ax, label in (
        ("tok_s", axes[0], "output tokens/s (prompt tokens/s for pN)"),
        ("ttft", axes[1], "mean TTFT (s)"),
    ):
        for j, engine in enumerate(engines):
            vals = [
                next((value(r, metric) for r in rows if (r["workload"], r["dtype"]) == g and r["engine"] == engine), 0)
                for g in groups
            ]
            ax.bar([i + j * width for i in range(len(groups))], vals, width, label=engine)
        ax.set_xticks([i + width * (len(engines) - 1) / 2 for i in range(len(groups))])
        ax.set_xticklabels([f"({w}) {d}" for w, d in groups])
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(
        f"Offline throughput, {rows[0].get('model', 'SmolLM2-135M')} on {rows[0].get('device', 'cpu')}, same machine"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
