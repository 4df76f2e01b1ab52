"""fleetserve's CPU paged-attention kernel alone, at SmolLM2-135M's head shape (9 query heads,
3 KV heads, head_dim 64, 16-token blocks scattered through the cache), against another
commit's kernel when asked; the small-M linears too (`linear-NxK@M` cases).

    python benchmarks/attention_kernel.py                          # this checkout's kernel
    python benchmarks/attention_kernel.py --baseline HEAD~1        # and HEAD~1's, alternated
    python benchmarks/attention_kernel.py --baseline HEAD --rows-only   # both with row-major keys

Cases: `prefill-PxL` (P prompts of L tokens, each token attending causally to its prompt, as
a prefill step of one layer), `decode-B@C` (B sequences with C tokens of context),
`linear-NxK@M` (the small-M linear, `linear_bf16` or `linear_f32`, of an [N, K] weight at M
rows; the LM head's float32 logits when N is SmolLM2's vocabulary, 49152; the weight is read
from memory each call, as in a model's step: a call walks 8 copies of it in turn):

    python benchmarks/attention_kernel.py --baseline HEAD~1 \
        --cases linear-49152x576@64,linear-49152x576@16,linear-1536x576@64

Each round
runs every case `--reps` times in a fresh process per kernel (the baseline's source is built
in its own cache folder, the kernels' usual hash-keyed build); rounds alternate the kernels.
Per case it reports the median over rounds of each round's fastest run (this project's
machines are shared VMs: bursts of noise slow whole runs), and the ratio baseline / this.
Prints a table and writes `benchmarks/results/attention_kernel.{json,png}`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _vs_baseline import grouped_bars, print_table  # benchmarks/: this script's folder, first on sys.path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_CASES = "prefill-2x1000,prefill-16x120,decode-64@200,decode-64@600"
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def worker(args) -> None:
    import torch

    sys.path.insert(0, str(ROOT))
    from fleetserve.replica import kernels

    if args.source:  # another commit's kernel: built from that file, in its own cache folder
        kernels.SOURCE = Path(args.source)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    ops = kernels.ops_for(torch.empty(1, dtype=dtype))
    if ops is None:
        raise SystemExit(f"CPU kernels unavailable: {kernels.unavailable_reason()}")
    gen = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {}
    calls = {}
    linears = {}
    for case in args.cases.split(","):
        kind, shape = case.split("-", 1)
        if kind == "linear":
            nk, m = shape.split("@")
            n, k = (int(x) for x in nk.split("x"))
            copies = []
            for _ in range(8):  # more than the caches hold: each call reads its weight from memory
                w = (torch.randn(n, k, generator=gen) * 0.02).to(dtype)
                copies.append(ops.pack_linear_bf16(w) if dtype == torch.bfloat16 else ops.pack_linear_f32(w))
            x = torch.randn(int(m), k, generator=gen).to(dtype)
            if dtype == torch.bfloat16:
                run = lambda p, x=x, n=n: ops.linear_bf16(x, p, None, n, n == 49152)  # noqa: E731
            else:
                run = lambda p, x=x, n=n: ops.linear_f32(x, p, None, n)  # noqa: E731
            linears[case] = (run, copies)
            continue
        if kind == "prefill":
            prompts, length = (int(x) for x in shape.split("x"))
            context, tokens = length, prompts * length
            seq_lens = torch.cat([torch.arange(1, length + 1) for _ in range(prompts)])
            rows = torch.repeat_interleave(torch.arange(prompts), length)
        elif kind == "decode":
            prompts, context = (int(x) for x in shape.split("@"))
            tokens = prompts
            seq_lens = torch.full((prompts,), context)
            rows = torch.arange(prompts)
        else:
            raise SystemExit(f"unknown case {case!r}: prefill-PxL, decode-B@C or linear-NxK@M")
        per = (context + BLOCK - 1) // BLOCK
        num_blocks = prompts * per + 1
        k_cache = torch.randn(KV_HEADS, num_blocks, BLOCK, HEAD_DIM, generator=gen).to(dtype)
        v_cache = torch.randn(KV_HEADS, num_blocks, BLOCK, HEAD_DIM, generator=gen).to(dtype)
        table = (torch.randperm(num_blocks - 1, generator=gen) + 1)[: prompts * per].view(prompts, per)
        q = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen).to(dtype)
        calls[case] = (q, k_cache, v_cache, table.long(), seq_lens.long(), rows.long())
    # The key layout the engine would use with this kernel (replica.layers.attention.kv_cache_layout):
    # tiled keys where the kernel has them, unless --rows-only. The caches hold random numbers, so
    # the layout changes nothing but the memory order the kernel reads.
    tiled = not args.rows_only and hasattr(ops, "k_tiled_supported") and ops.k_tiled_supported(dtype, BLOCK, HEAD_DIM)
    extra = (True,) if tiled else ()
    for case, a in calls.items():
        ops.paged_attention(*a, HEAD_DIM**-0.5, *extra)  # warm-up
        times[case] = []
    for case, (run, copies) in linears.items():
        run(copies[0])
        times[case] = []
    for i in range(args.reps):
        for case, a in calls.items():
            t0 = time.perf_counter()
            ops.paged_attention(*a, HEAD_DIM**-0.5, *extra)
            times[case].append(time.perf_counter() - t0)
        for case, (run, copies) in linears.items():
            t0 = time.perf_counter()
            run(copies[(i + 1) % len(copies)])
            times[case].append(time.perf_counter() - t0)
    print(json.dumps({"isa": kernels.isa(), "layout": "k_tiled" if tiled else "rows", "times": times}))


def run_worker(args, source: str | None) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        "--cases",
        args.cases,
        "--dtype",
        args.dtype,
        "--threads",
        str(args.threads),
        "--reps",
        str(args.reps),
    ] + (["--rows-only"] if args.rows_only else [])
    if source:
        cmd += ["--source", source]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"worker failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=DEFAULT_CASES)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=15, help="runs of each case per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--baseline", help="a git ref whose replica/kernels/cpu_ops.cpp to time as well")
    p.add_argument(
        "--rows-only",
        action="store_true",
        help="row-major key blocks for every kernel (default: tiled keys where a kernel has them)",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--source", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)

    kernels = {"this": None}
    tmp = tempfile.TemporaryDirectory()
    if args.baseline:
        src = subprocess.run(
            ["git", "show", f"{args.baseline}:replica/kernels/cpu_ops.cpp"], cwd=ROOT, capture_output=True, text=True
        )
        if src.returncode:
            raise SystemExit(f"--baseline {args.baseline}: {src.stderr.strip()}")
        path = Path(tmp.name) / "cpu_ops.cpp"
        path.write_text(src.stdout)
        kernels[args.baseline] = str(path)
    best: dict[str, dict[str, list[float]]] = {k: {} for k in kernels}
    isa = ""
    layouts: dict[str, str] = {}
    for r in range(args.rounds):
        for name, source in kernels.items() if r % 2 == 0 else reversed(kernels.items()):
            out = run_worker(args, source)
            isa = out["isa"]
            layouts[name] = out.get("layout", "rows")
            for case, ts in out["times"].items():
                best[name].setdefault(case, []).append(min(ts))
    cases = args.cases.split(",")
    med = {k: {c: statistics.median(best[k][c]) * 1e3 for c in cases} for k in kernels}
    print(
        f"paged_attention and small-M linears, {args.dtype}, {args.threads} threads, {isa} build; ms per call "
        f"(median over {args.rounds} rounds of each round's fastest of {args.reps}); key layout: "
        + ", ".join(f"{k} {v}" for k, v in layouts.items())
    )
    print_table(
        med,
        cases,
        args.baseline,
        case_width=18,
        digits=3,
        extra=lambda c: "   rounds: " + " | ".join(", ".join(f"{x * 1e3:.2f}" for x in best[k][c]) for k in kernels),
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "attention_kernel.json").write_text(
        json.dumps(
            {
                "dtype": args.dtype,
                "threads": args.threads,
                "isa": isa,
                "layouts": layouts,
                "baseline": args.baseline,
                "best_per_round_s": best,
            },
            indent=2,
        )
    )
    grouped_bars(
        RESULTS / "attention_kernel.png",
        {k: med[k] for k in kernels},
        cases,
        "ms per call",
        f"paged_attention ({args.dtype}, {args.threads} threads, {isa})",
        figsize=(7, 3.5),
    )


if __name__ == "__main__":
    main()
