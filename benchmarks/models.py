"""Output tok/s of the model families at real shapes, random weights: fleetserve vs HF transformers
(and vLLM CPU where it is installed and supports the architecture), same machine, same weights.

No real checkpoint can be downloaded here, so each shape is written as an HF folder of random
weights (transformers' own class, `save_pretrained`) with a word-level tokenizer of the real
vocabulary size, so the embedding and LM head cost what they cost in the real model:

  qwen3-0.6b      Qwen3-0.6B's config (28 layers, hidden 1024, 16/8 heads of 128, vocab 151936)
  qwen3-30b-a3b   Qwen3-30B-A3B's config (hidden 2048, 32/4 heads of 128, 128 experts, top 8,
                  expert width 768, vocab 151936) with fewer layers (--moe-layers, default 2:
                  48 layers are 30B parameters, 120 GB in float32)

Workload: --num-prompts prompts of --prompt-len random tokens, --max-tokens output tokens each,
greedy, EOS ignored, all at t=0; HF runs them as one static batch (model.generate). Each engine
runs in its own process (memory is returned between them), interleaved over --repeats rounds;
the table shows medians and fleetserve's ratio to each baseline.

    python benchmarks/models.py                                   # both shapes, fleetserve + hf (+ vllm)
    python benchmarks/models.py --shapes qwen3-0.6b --repeats 3
    python benchmarks/models.py --shapes qwen3-30b-a3b --moe-layers 4 --engines fleetserve,hf
    python benchmarks/models.py --device cuda --dtype bfloat16 --engines fleetserve,hf --num-prompts 64

Writes benchmarks/results/models.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

RESULTS = ROOT / "benchmarks" / "results"

QWEN3_VOCAB = 151936
SHAPES: dict[str, tuple[str, dict]] = {
    "qwen3-0.6b": (
        "Qwen3Config",
        dict(
            vocab_size=QWEN3_VOCAB,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3-30b-a3b": (
        "Qwen3MoeConfig",
        dict(
            vocab_size=QWEN3_VOCAB,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    ),
}
# vLLM CPU architectures this benchmark asks it for (it reports its own refusal otherwise)
VLLM_ARCHS = {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"}


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer whose ids are exactly 0..vocab_size-1 (`<t17>` is id 17)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<t{i}>": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<t0>", bos_token="<t1>", eos_token="<t2>")


def write_shape(name: str, path: Path, moe_layers: int, seed: int = 0) -> Path:
    """The random-weight HF folder of one shape (reused when it is already there)."""
    import torch
    import transformers

    if (path / "config.json").is_file():
        return path
    cls_name, fields = SHAPES[name]
    fields = dict(fields)
    if cls_name == "Qwen3MoeConfig":
        fields["num_hidden_layers"] = moe_layers
    config = getattr(transformers, cls_name)(**fields, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    config.initializer_range = 0.02
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    word_tokenizer(config.vocab_size).save_pretrained(path)
    del model
    return path


def workload(num_prompts: int, prompt_len: int, max_tokens: int, vocab: int, seed: int = 0):
    import random

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(num_prompts)]
    return prompts, [max_tokens] * num_prompts


ONE_RUN = r"""
import json, sys
import torch
torch.set_num_threads(int(sys.argv[4]))
sys.path.insert(0, sys.argv[5])
import offline_throughput as ot
cfg = json.load(open(sys.argv[1]))
engine, model_dir = sys.argv[2], sys.argv[3]
if engine == "fleetserve":
    run = ot.run_fleetserve
else:
    run = ot.run_hf
r = run(model_dir, cfg["dtype"], cfg["prompts"], cfg["outputs"], len(cfg["prompts"]), device=cfg["device"])
print("RESULT " + json.dumps(r))
"""


def run_one(
    engine: str, model_dir: Path, prompts, outputs, dtype: str, threads: int, vllm_python: str, device: str = "cpu"
) -> dict:
    import offline_throughput as ot

    if engine == "vllm":
        return ot.run_vllm(vllm_python, str(model_dir), dtype, prompts, outputs, len(prompts))
    with tempfile.TemporaryDirectory() as d:
        cfg = Path(d) / "cfg.json"
        cfg.write_text(json.dumps({"dtype": dtype, "device": device, "prompts": prompts, "outputs": outputs}))
        script = Path(d) / "one.py"
        script.write_text(ONE_RUN)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        proc = subprocess.run(
            [sys.executable, str(script), str(cfg), engine, str(model_dir), str(threads), str(ROOT / "benchmarks")],
            capture_output=True,
            text=True,
            env=env,
            timeout=3600,
        )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{engine} run failed:\n{proc.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--engines", default="fleetserve,hf,vllm")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (fleetserve and HF on the GPU; vLLM CPU is skipped)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--moe-layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "fleetserve-bench-models"))
    ap.add_argument("--vllm-python", default="/opt/vllm-venv/bin/python")
    args = ap.parse_args()

    engines = [e for e in args.engines.split(",") if e]
    if args.device != "cpu" and "vllm" in engines:
        print(f"vLLM: the installed vLLM is its CPU build; skipped on --device {args.device}")
        engines.remove("vllm")
    if "vllm" in engines and not Path(args.vllm_python).exists():
        print(f"vLLM: {args.vllm_python} not found (docs/benchmarks/index.md installs it); skipped")
        engines.remove("vllm")
    rows: list[dict] = []
    for shape in args.shapes.split(","):
        folder = f"{shape}-L{args.moe_layers}" if SHAPES[shape][0] == "Qwen3MoeConfig" else shape
        model_dir = write_shape(shape, Path(args.cache) / folder, args.moe_layers)
        cfg = json.loads((model_dir / "config.json").read_text())
        prompts, outputs = workload(args.num_prompts, args.prompt_len, args.max_tokens, cfg["vocab_size"])
        runs: dict[str, list[dict]] = {e: [] for e in engines}
        errors: dict[str, str] = {}
        for _ in range(args.repeats):  # interleaved rounds: the machine's drift hits every engine alike
            for e in engines:
                if e in errors or (e == "vllm" and cfg["architectures"][0] not in VLLM_ARCHS):
                    continue
                try:
                    runs[e].append(
                        run_one(e, model_dir, prompts, outputs, args.dtype, args.threads, args.vllm_python, args.device)
                    )
                except RuntimeError as err:
                    errors[e] = str(err).strip().splitlines()[-1][:200]
        fs = statistics.median(r["tok_s"] for r in runs["fleetserve"]) if runs.get("fleetserve") else None
        for e in engines:
            if not runs[e]:
                rows.append({"shape": shape, "engine": e, "error": errors.get(e, "not run")})
                continue
            tok_s = statistics.median(r["tok_s"] for r in runs[e])
            rows.append(
                {
                    "shape": shape,
                    "layers": cfg["num_hidden_layers"],
                    "engine": e,
                    "tok_s": tok_s,
                    "ttft": statistics.median(r["ttft"] for r in runs[e]),
                    "all_tok_s": [round(r["tok_s"], 1) for r in runs[e]],
                    "fs_over_this": None if fs is None else fs / tok_s,
                }
            )
    print_table(rows, args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "models.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    plot(rows, RESULTS / "models.png")
    print(f"wrote {RESULTS / 'models.png'}")


def print_table(rows: list[dict], args) -> None:
    print(
        f"{args.num_prompts} prompts x {args.prompt_len} tokens -> {args.max_tokens} tokens, {args.dtype} on "
        f"{args.device}, {args.threads} threads, medians of {args.repeats}"
    )
    header = f"{'shape':<15}{'layers':>7}  {'engine':<12}{'out tok/s':>10}{'TTFT s':>8}{'fleetserve/x':>13}  rounds"
    print(header)
    print("-" * len(header))
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:<15}{'':>7}  {r['engine']:<12}{'-':>10}   ({r['error']})")
            continue
        ratio = "" if r["fs_over_this"] is None else f"{r['fs_over_this']:.2f}x"
        print(
            f"{r['shape']:<15}{r['layers']:>7}  {r['engine']:<12}{r['tok_s']:>10.1f}{r['ttft']:>8.2f}{ratio:>13}"
            f"  {', '.join(map(str, r['all_tok_s']))}"
        )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if "error" not in r]
    shapes = sorted({r["shape"] for r in done})
    engines = sorted({r["engine"] for r in done})
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(engines))
    for j, e in enumerate(engines):
        vals = [next((r["tok_s"] for r in done if r["shape"] == s and r["engine"] == e), 0) for s in shapes]
        ax.bar([i + j * width for i in range(len(shapes))], vals, width, label=e)
    ax.set_xticks([i + width * (len(engines) - 1) / 2 for i in range(len(shapes))])
    ax.set_xticklabels([f"{s} ({next(r['layers'] for r in done if r['shape'] == s)} layers)" for s in shapes])
    ax.set_ylabel("output tokens/s")
    ax.set_title("Random weights at real shapes, same machine")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
