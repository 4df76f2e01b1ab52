"""Served throughput and latency: `fleetserve serve` vs vLLM CPU's OpenAI server.

The two servers run one after the other on this machine, each as its users start it
(fleetserve: `fleetserve serve MODEL --num-replicas 1`, embedded local Ray; vLLM:
`python -m vllm.entrypoints.openai.api_server` from its own venv, see README.md), with
the same model and weights (the default GGUF; vLLM reads its HF export), dtype and
`--max-num-seqs`, each warmed up first. One load generator (aiohttp, as vLLM's serving
benchmark) sends the same requests to both: `/v1/completions`, streaming, greedy, EOS
ignored, ~120-token prompts x 128 output tokens (offline workload (a) served), Poisson
arrivals at each `--rates` value (`inf`: all at once, saturation). Output tokens are
the servers' own `usage` counts (`stream_options.include_usage`); TTFT is the time to
the first chunk with text, ITL the gaps between content chunks (as vLLM's benchmark).

Prints a table (per rate: output tok/s, TTFT p50/p99, ITL p50/p99, and fleetserve /
vLLM ratios) and writes benchmarks/results/serve_vs_vllm[-<dtype>].{json,png}.

    python benchmarks/serve_vs_vllm.py                          # bf16 where the CPU has it
    python benchmarks/serve_vs_vllm.py --dtype float32 --rates 1,4,inf
    python benchmarks/serve_vs_vllm.py --servers fleetserve     # without vLLM
    python benchmarks/serve_vs_vllm.py --rates inf --stream-interval 4   # both servers batch 4 tokens a chunk

The client shares the machine's cores with the server under test (for both servers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(Path(__file__).parent))

from serving import WORDS, Result, arrivals, cpu_name, free_port, pct  # noqa: E402  (benchmarks/ is not a package)

DEFAULT_VLLM_PYTHON = "/opt/vllm-venv/bin/python"


# -- workload -------------------------------------------------------------------


def prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"Request {seed}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(n)]


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    return [0.0] * n if math.isinf(rate) else arrivals(n, rate, seed)


async def send(session, url: str, model: str, prompt: str, max_tokens: int) -> Result:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res, t0, last = Result(), time.perf_counter(), None
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.read())[:200]!r}"
                return res
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = str(chunk["error"])[:200]
                    return res
                if chunk.get("usage"):
                    res.tokens = chunk["usage"].get("completion_tokens", 0)
                if any(c.get("text") for c in chunk.get("choices") or ()):
                    last = res.mark(t0, last)
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.ok = res.tokens > 0 and last is not None
    return res


async def run_rate(url: str, model: str, rate: float, n: int, words: int, max_tokens: int, seed: int) -> dict:
    import aiohttp

    texts = prompts(n, words, seed)
    times = arrival_times(n, rate, seed)
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=1800), connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        start = time.perf_counter()
        tasks = []
        for text, at in zip(texts, times):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(session, url, model, text, max_tokens)))
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok]
    itl = [x for r in ok for x in r.itl]
    errors = [r.error for r in results if not r.ok]
    return {
        "rate": rate,
        "requests": n,
        "ok": len(ok),
        "errors": errors[:3],
        "out_tok_s": sum(r.tokens for r in ok) / elapsed,
        "elapsed_s": elapsed,
        **{f"ttft_p{q}_ms": 1000 * pct(ttft, q) for q in (50, 90, 99)},
        **{f"itl_p{q}_ms": 1000 * pct(itl, q) for q in (50, 90, 99)},
    }


# -- servers --------------------------------------------------------------------


class Server:
    """A server process in its own process group, its output in a log file."""

    def __init__(self, name: str, cmd: list[str], env: dict, port: int, log: Path) -> None:
        self.name, self.port, self.log = name, port, log
        self.url = f"http://127.0.0.1:{port}"
        self._out = open(log, "w")
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True, cwd=str(ROOT)
        )

    def wait_ready(self, timeout_s: float) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited ({self.proc.returncode}); log {self.log}:\n" + self.log.read_text()[-3000:]
                )
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"{self.name} not ready in {timeout_s:.0f} s; log {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # Ctrl-C, as a user stops it
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._out.close()


def start_fleetserve(args, port: int, log: Path) -> Server:
    cmd = [
        sys.executable,
        "-m",
        "fleetserve.cluster.cli",
        "serve",
        args.model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--num-replicas",
        "1",
        "--dtype",
        args.dtype,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-model-len",
        str(args.max_model_len),
        "--served-model-name",
        args.model,
        "--stream-interval",
        str(args.stream_interval),
    ]
    return Server("fleetserve", cmd, dict(os.environ, RAY_AUTH_MODE="disabled"), port, log)


def start_vllm(args, hf_dir: str, port: int, log: Path) -> Server:
    cmd = [
        args.vllm_python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        hf_dir,
        "--served-model-name",
        args.model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-model-len",
        str(args.max_model_len),
        "--stream-interval",
        str(args.stream_interval),
    ]
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_gib),
        VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}",
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_LOGGING_LEVEL="WARNING",
    )
    return Server("vllm", cmd, env, port, log)


def measure(server: Server, args) -> list[dict]:
    rows = []
    asyncio.run(run_rate(server.url, args.model, math.inf, 16, args.prompt_words, 16, seed=999))
    for i, rate in enumerate(args.rates):
        row = asyncio.run(
            run_rate(server.url, args.model, rate, args.num_prompts, args.prompt_words, args.max_tokens, seed=1000 + i)
        )
        row["server"] = server.name
        rows.append(row)
        print(
            f"  {server.name:10s} rate {rate:>4}: {row['out_tok_s']:7.1f} tok/s  "
            f"TTFT p50 {row['ttft_p50_ms']:8.0f} ms  ITL p99 {row['itl_p99_ms']:7.1f} ms  "
            f"ok {row['ok']}/{row['requests']}",
            flush=True,
        )
        if row["errors"]:
            print("    errors:", row["errors"], flush=True)
    return rows


# -- report ---------------------------------------------------------------------


def report(rows: list[dict], args, cpu: str) -> None:
    by = {(r["server"], r["rate"]): r for r in rows}
    lines = [
        f"# served: fleetserve vs vLLM CPU ({args.model}, {args.dtype}, {cpu})",
        "",
        "| rate (req/s) | server | out tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | ok |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rate in args.rates:
        for name in args.servers:
            r = by.get((name, rate))
            if r is None:
                continue
            lines.append(
                f"| {rate} | {name} | {r['out_tok_s']:.1f} | {r['ttft_p50_ms']:.0f} ms | "
                f"{r['ttft_p99_ms']:.0f} ms | {r['itl_p50_ms']:.1f} ms | "
                f"{r['itl_p99_ms']:.1f} ms | {r['ok']}/{r['requests']} |"
            )
        f, v = by.get(("fleetserve", rate)), by.get(("vllm", rate))
        if f and v:
            lines.append(
                f"| {rate} | **fleetserve / vLLM** | **{f['out_tok_s'] / v['out_tok_s']:.2f}x** | "
                f"{f['ttft_p50_ms'] / v['ttft_p50_ms']:.2f}x | {f['ttft_p99_ms'] / v['ttft_p99_ms']:.2f}x | "
                f"{f['itl_p50_ms'] / v['itl_p50_ms']:.2f}x | {f['itl_p99_ms'] / v['itl_p99_ms']:.2f}x | |"
            )
    text = "\n".join(lines)
    print("\n" + text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / (
        f"serve_vs_vllm-{args.dtype}" + (f"-si{args.stream_interval}" if args.stream_interval > 1 else "")
    )
    stem.with_suffix(".json").write_text(
        json.dumps(
            {
                "cpu": cpu,
                "args": {k: v for k, v in vars(args).items() if k != "rates"},
                "rates": [str(r) for r in args.rates],
                "rows": rows,
            },
            indent=1,
            default=str,
        )
    )
    stem.with_suffix(".md").write_text(text + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    xs = [str(r) for r in args.rates]
    for name in args.servers:
        pts = [by.get((name, r)) for r in args.rates]
        for ax, key in zip(axes, ("out_tok_s", "ttft_p50_ms", "itl_p99_ms")):
            ax.plot(xs, [p[key] if p else float("nan") for p in pts], marker="o", label=name)
    for ax, title in zip(axes, ("output tok/s", "TTFT p50 (ms)", "ITL p99 (ms)")):
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"served {args.model} {args.dtype}: fleetserve vs vLLM CPU ({cpu})")
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)
    print(f"plot: {stem.with_suffix('.png')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 where the CPU has bf16, else float32")
    ap.add_argument("--rates", default="1,2,4,inf", help="Poisson request rates (req/s); inf = all at once")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=100, help="~1.2 tokens per word")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="both servers' --stream-interval (tokens per streamed chunk after the first; "
        "ITL is then the gap between chunks)",
    )
    ap.add_argument("--servers", default="vllm,fleetserve")
    ap.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    ap.add_argument("--vllm-kv-gib", type=int, default=4)
    ap.add_argument("--start-timeout-s", type=float, default=600)
    args = ap.parse_args()
    args.rates = [float(r) for r in args.rates.split(",")]
    args.rates = [int(r) if r.is_integer() else r for r in args.rates]
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    cpu = cpu_name()
    if args.dtype is None:
        args.dtype = "bfloat16" if "bf16" in cpu else "float32"
    if "vllm" in args.servers and not Path(args.vllm_python).exists():
        print(f"vLLM not installed at {args.vllm_python} (see benchmarks/README.md): fleetserve only")
        args.servers = [s for s in args.servers if s != "vllm"]
    hf_dir = None
    if "vllm" in args.servers:
        from fleetserve.replica.model_loader.hf_export import export_hf_folder

        hf_dir = str(export_hf_folder(args.model, Path.home() / ".cache" / "fleetserve" / "hf-export" / args.model))
    print(
        f"{cpu}; {args.model} {args.dtype}; {args.num_prompts} requests per rate, "
        f"~{args.prompt_words} words -> {args.max_tokens} tokens"
    )
    rows = []
    RESULTS.mkdir(parents=True, exist_ok=True)
    for name in args.servers:
        port, log = free_port(), RESULTS / f"serve_vs_vllm-{name}.log"
        server = start_vllm(args, hf_dir, port, log) if name == "vllm" else start_fleetserve(args, port, log)
        t0 = time.monotonic()
        try:
            server.wait_ready(args.start_timeout_s)
            print(f"{name} ready in {time.monotonic() - t0:.0f} s", flush=True)
            rows += measure(server, args)
        finally:
            server.stop()
    report(rows, args, cpu)


if __name__ == "__main__":
    main()
