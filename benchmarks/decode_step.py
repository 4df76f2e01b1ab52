"""Per-step cost of the model forward (+ LM head + greedy sampling) on the real model.

    python benchmarks/decode_step.py                      # bf16, 2 threads
    python benchmarks/decode_step.py --threads 1 --reps 7  # when the machine is busy

Cases: one prefill step of 2048 tokens (16 prompts of 128, no cached context;
`prefill1000-2000` is one of two prompts of 1000) and decode steps at batch 16
and 64 with 200 tokens of context each. The KV blocks of the requests are scattered
through the cache (a shuffled free list, as after a while of serving). Per case it reports the median step time and a
breakdown by kind of op from `torch.profiler` (one profiled step, scaled to the
median): weight matmuls (linear / addmm / mm, fleetserve's small-M `linear_bf16` / `linear_f32`),
attention (bmm, sdpa, softmax, masking), KV cache (index_copy_ / index_select), LM head + sampling, and the
rest (norms, rotary, activations, Python). With fleetserve's CPU kernels the
attention and KV cache parts are their fused ops. Prints a table and writes
`benchmarks/results/decode_step.{png,json}`.

`--compare-small-m` adds a row per case with bfloat16 linears through oneDNN
instead of fleetserve's small-M kernel (replica/layers/linear.py; set aside
while that row runs), the two timed in alternation, rep by rep:

    python benchmarks/decode_step.py --cases decode-1,decode-16,decode-64 --compare-small-m

`--compare-kernel-layers` adds a row per case with the decoder layers run through their
modules (FLEETSERVE_KERNEL_LAYERS=0) instead of LlamaModel's loop of kernel calls
(replica/models/llama.py, `_kernel_plan`), timed the same way:

    python benchmarks/decode_step.py --cases decode-1,decode-16,decode-64 --compare-kernel-layers
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleetserve.replica.kernels import isa as kernels_isa  # noqa: E402
from fleetserve.replica.layers.attention import AttentionMetadata  # noqa: E402
from fleetserve.replica.layers.linear import small_m_rows  # noqa: E402
from fleetserve.replica.layers.sampler import greedy  # noqa: E402
from fleetserve.replica.model_loader.registry import resolve_model  # noqa: E402
from fleetserve.replica.model_loader.weights import allocate_kv_caches, load_model  # noqa: E402

# Decode cases advance one token per step (as in serving) for up to GROWTH steps, then start over.
GROWTH = 64
RESULTS = Path(__file__).resolve().parent / "results"

CATEGORIES = {
    "weight matmul": (
        "aten::linear",
        "aten::addmm",
        "aten::mm",
        "aten::matmul",
        "mkldnn::_linear_pointwise",
        "fleetserve::linear_bf16",
        "fleetserve::linear_f32",
        "fleetserve::linear_bf16_silu_mul",
    ),  # gate|up with SiLU-and-multiply fused
    "attention": (
        "aten::bmm",
        "aten::scaled_dot_product_attention",
        "aten::_softmax",
        "aten::softmax",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::baddbmm",
        "fleetserve::paged_attention",
    ),
    "kv cache": (
        "aten::index_copy_",
        "aten::index_select",
        "aten::index_put_",
        "aten::gather",
        "fleetserve::reshape_and_cache_",
    ),
}


def build_case(kind: str, batch: int, context: int, block_size: int, num_blocks: int, gen: torch.Generator):
    free = torch.randperm(num_blocks - 1, generator=gen) + 1  # block 0 stays padding
    tables, q_lens, ctx_lens, ids = [], [], [], []
    pos = 0
    for _ in range(batch):
        q = 1 if kind == "decode" else context
        c = context if kind == "decode" else 0
        n = -(-(c + q + GROWTH) // block_size)
        tables.append(free[pos : pos + n].tolist())
        pos += n
        q_lens.append(q)
        ctx_lens.append(c)
        ids.extend(torch.randint(100, 40000, (q,), generator=gen).tolist())
    return q_lens, ctx_lens, tables, ids


def make_step(model, kv_caches, case, block_size):
    q_lens, ctx_lens0, tables0, ids = case
    decode = all(q == 1 for q in q_lens)
    counter = [0]
    rids = list(range(len(q_lens)))

    @torch.inference_mode()
    def step():
        grow = counter[0] % GROWTH if decode else 0
        counter[0] += 1
        ctx_lens = [c + grow for c in ctx_lens0]
        tables = [t[: -(-(c + q) // block_size)] for t, c, q in zip(tables0, ctx_lens, q_lens)]
        positions = [c + i for c, q in zip(ctx_lens, q_lens) for i in range(q)]
        md = AttentionMetadata.build(q_lens, ctx_lens, tables, block_size, request_ids=rids)
        hidden = model(torch.tensor(ids), torch.tensor(positions), kv_caches, md)
        logits = model.compute_logits(hidden[md.last_token_indices])
        return greedy(logits)  # the engine's greedy sampling: the argmax kernel where it runs

    return step


def breakdown(step) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        step()
        total = time.perf_counter() - t0
    parts = {k: 0.0 for k in CATEGORIES}
    parts["lm head + sample"] = 0.0

    # Top-level ops only (events with no parent among the timed ops); the kernels that the
    # one-call decoder layers (fleetserve::llama_layers) record count as top-level.
    def top(ev) -> bool:
        return ev.cpu_parent is None or ev.cpu_parent.name == "fleetserve::llama_layers"

    for ev in prof.events():
        if not top(ev):
            continue
        name = ev.name
        dur = ev.cpu_time_total / 1e6
        for cat, names in CATEGORIES.items():
            if name in names:
                parts[cat] += dur
                break
    # The LM head matmul is a weight matmul too; separate it by shape: the largest single linear.
    lm = [ev.cpu_time_total / 1e6 for ev in prof.events() if top(ev) and ev.name in CATEGORIES["weight matmul"]]
    if lm:
        head = lm[-1]
        parts["weight matmul"] -= head
        parts["lm head + sample"] += head
    argmax = [
        ev.cpu_time_total / 1e6
        for ev in prof.events()
        if ev.cpu_parent is None and ev.name in ("aten::argmax", "fleetserve::argmax_rows")
    ]
    parts["lm head + sample"] += sum(argmax)
    parts["other"] = max(0.0, total - sum(parts.values()))
    return {k: v / total for k, v in parts.items()}


@contextlib.contextmanager
def small_m_kernel(model, on: bool):
    """Inside: the model's linears without fleetserve's small-M kernel when `on` is False
    (their packed copies for it set aside, so every linear goes to oneDNN)."""
    from fleetserve.replica.layers.linear import PackedWeightMixin

    # The fused gate|up + SiLU kernel's packed copy (`_gated`) is set aside too.
    kept = [(m, m._small_m, m.__dict__.get("_gated")) for m in model.modules() if isinstance(m, PackedWeightMixin)]
    if not on:
        for m, _, gated in kept:
            m._small_m = None
            if gated is not None:
                m._gated = None
    try:
        yield
    finally:
        for m, small, gated in kept:
            m._small_m = small
            if gated is not None:
                m._gated = gated


@contextlib.contextmanager
def kernel_layers(on: bool):
    """Inside: LlamaModel's loop of kernel calls on or off (FLEETSERVE_KERNEL_LAYERS)."""
    prev = os.environ.get("FLEETSERVE_KERNEL_LAYERS")
    os.environ["FLEETSERVE_KERNEL_LAYERS"] = "1" if on else "0"
    try:
        yield
    finally:
        if prev is None:
            os.environ.pop("FLEETSERVE_KERNEL_LAYERS")
        else:
            os.environ["FLEETSERVE_KERNEL_LAYERS"] = prev


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--cases", default="prefill-2048,decode-16,decode-64")
    ap.add_argument("--out", default="decode_step")
    ap.add_argument(
        "--no-decode-buffer",
        action="store_true",
        help="gather the decode rows' KV blocks in every layer (the pre-buffer path)",
    )
    ap.add_argument("--no-fused-norm", action="store_true", help="RMSNorm through float32 copies (HF formula)")
    ap.add_argument(
        "--compare-small-m",
        action="store_true",
        help="also time every case with bf16 linears through oneDNN (small-M kernel off)",
    )
    ap.add_argument(
        "--compare-kernel-layers",
        action="store_true",
        help="also time every case with the decoder layers through their modules",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from fleetserve.replica.layers import RMSNorm
    from fleetserve.replica.layers.attention import PagedAttention

    PagedAttention.use_decode_buffer = not args.no_decode_buffer
    RMSNorm.fused = not args.no_fused_norm
    dtype = getattr(torch, args.dtype)
    model, cfg = load_model(resolve_model(args.model), dtype)
    block_size = 16
    # Enough blocks for the largest case (decode-N: N requests of context + GROWTH tokens).
    need = max(
        (
            int(c.split("-")[1]) * -(-(args.context + 1 + GROWTH) // block_size)
            for c in args.cases.split(",")
            if c.startswith("decode-")
        ),
        default=0,
    )
    num_blocks = max(2048, need + 1)
    kv_caches = allocate_kv_caches(cfg, num_blocks, block_size, dtype)
    gen = torch.Generator().manual_seed(0)
    # Weight FLOPs per token (2 * params touched by matmuls, LM head included).
    h, inter, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    hd = h // cfg.num_attention_heads
    qkv = h * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd
    per_layer = qkv + cfg.num_attention_heads * hd * h + 3 * h * inter
    rows = []
    for name in args.cases.split(","):
        kind, n = name.split("-")
        n = int(n)
        if kind.startswith("prefill"):  # prefill-N: prompts of 128; prefillL-N: prompts of L
            length = int(kind[len("prefill") :] or 128)
            case = build_case("prefill", n // length, length, block_size, num_blocks, gen)
            tokens, sampled = n // length * length, n // length
        else:
            case = build_case("decode", n, args.context, block_size, num_blocks, gen)
            tokens, sampled = n, n
        step = make_step(model, kv_caches, case, block_size)
        variants = [("", lambda: small_m_kernel(model, True))]
        # Alternating with " oneDNN" rebuilds LlamaModel's kernel plan in the first timed step
        # after each switch back (~0.1 ms; replica/models/llama.py, _kernel_plan).
        if args.compare_small_m:
            variants.append((" oneDNN", lambda: small_m_kernel(model, False)))
        if args.compare_kernel_layers:
            variants.append((" modules", lambda: kernel_layers(False)))
        times: dict[str, list] = {label: [] for label, _ in variants}
        for _, setting in variants:
            with setting():
                step()
                step()
        for _ in range(args.reps):
            for label, setting in variants:
                with setting():
                    t0 = time.perf_counter()
                    step()
                    times[label].append(time.perf_counter() - t0)
        flops = 2 * (tokens * L * per_layer + sampled * cfg.vocab_size * h)
        for label, setting in variants:
            med = statistics.median(times[label])
            with setting():
                parts = breakdown(step)
            rows.append(
                {
                    "case": name + label,
                    "ms": med * 1e3,
                    "min_ms": min(times[label]) * 1e3,
                    "gflops_weights": flops / med / 1e9,
                    "parts_ms": {k: v * med * 1e3 for k, v in parts.items()},
                }
            )
    cats = list(rows[0]["parts_ms"])
    print(f"model {args.model} {args.dtype}, {args.threads} threads, context {args.context}, median of {args.reps}")
    print(f"{'case':<14}{'ms/step':>9}{'min':>8}{'GFLOP/s':>9}" + "".join(f"{c:>18}" for c in cats))
    for r in rows:
        print(
            f"{r['case']:<14}{r['ms']:>9.1f}{r['min_ms']:>8.1f}{r['gflops_weights']:>9.0f}"
            + "".join(f"{r['parts_ms'][c]:>18.1f}" for c in cats)
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {
        "model": args.model,
        "dtype": args.dtype,
        "threads": args.threads,
        "context": args.context,
        "cpu_kernels_isa": kernels_isa(),
        "small_m_rows": small_m_rows(dtype),
        "decode_buffer": not args.no_decode_buffer,
        "fused_norm": not args.no_fused_norm,
        "kernel_layers": os.environ.get("FLEETSERVE_KERNEL_LAYERS", "1") != "0",
        "reps": args.reps,
        "rows": rows,
    }
    (RESULTS / f"{args.out}.json").write_text(json.dumps(meta, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(rows)
    for c in cats:
        vals = [r["parts_ms"][c] for r in rows]
        ax.bar([r["case"] for r in rows], vals, bottom=bottom, label=c)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("ms per step")
    ax.set_title(f"fleetserve step time, {args.model} {args.dtype}, {args.threads} threads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"{args.out}.png", dpi=110)


if __name__ == "__main__":
    main()
