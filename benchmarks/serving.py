"""Serving benchmark: open-loop Poisson arrivals over HTTP streaming.

Three parts, one table and one PNG (benchmarks/results/serving.{md,json,png}):

1. overhead -- the same workload on one in-process AsyncEngine (its EngineCore on a
   thread: the baseline; and in a child process) and on a 1-replica Serve app over
   HTTP (TTFT and ITL percentiles), with the replica's EngineCore in its own process
   (the default) and on a thread: what the router path adds.
2. rates -- the 2-replica app at several request rates: throughput, TTFT and
   ITL p50/p90/p99.
3. prefix -- a shared-prefix workload (several long system prompts, unique
   questions) on 2 replicas with `prefix_aware` vs `power_of_two`: prefix-cache
   hit rate (from /metrics) and TTFT. The KV cache per replica is sized to hold
   about half of the system prompts, as when many tenants share a fleet.

Also the PSS of the whole Ray process tree (GCS, raylet, Serve, replicas and their
engine core processes; the benchmark's own process not counted).

    python benchmarks/serving.py                       # tiny random model (fast)
    python benchmarks/serving.py --model smollm2-135m  # the real default model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
RESULTS = Path(__file__).parent / "results"


# -- workload ------------------------------------------------------------------

WORDS = (
    "time person year way day thing man world life hand part child eye woman place work "
    "week case point government company number group problem fact river stone light"
).split()


def text_of(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@dataclass
class Request:
    prompt: str
    max_tokens: int


@dataclass
class Result:
    ttft: float = float("nan")
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    ok: bool = False
    error: str = ""

    def mark(self, t0: float, last: float | None) -> float:
        """A chunk with output arrived now: TTFT for the first (from `t0`), ITL after."""
        now = time.perf_counter()
        if last is None:
            self.ttft = now - t0
        else:
            self.itl.append(now - last)
        return now


def plain_workload(n: int, prompt_words: int, out_tokens: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request(text_of(rng, prompt_words), out_tokens) for _ in range(n)]


def prefix_workload(
    n: int, n_prefixes: int, prefix_words: int, question_words: int, out_tokens: int, seed: int
) -> list[Request]:
    rng = random.Random(seed)
    systems = [f"System prompt {i}: " + text_of(rng, prefix_words) for i in range(n_prefixes)]
    return [Request(f"{rng.choice(systems)}\nQuestion: {text_of(rng, question_words)}", out_tokens) for _ in range(n)]


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


async def open_loop(requests: list[Request], rate: float, send) -> tuple[list[Result], float]:
    """Fire `send(request)` at Poisson times (open loop: arrivals never wait for replies)."""
    start = time.perf_counter()
    tasks = []
    for req, at in zip(requests, arrivals(len(requests), rate, seed=len(requests))):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(req)))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


# -- clients -------------------------------------------------------------------


def _observe_sse_line(res: Result, line: str, t0: float, last: float | None) -> float | None:
    """One SSE line: a chunk with choices is one token (TTFT for the first, ITL after)."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return last
    chunk = json.loads(line[6:])
    if not chunk.get("choices"):
        return last
    res.tokens += 1
    return res.mark(t0, last)


async def send_http(client, url: str, model: str, req: Request) -> Result:
    """httpx: what the openai client uses."""
    res, t0 = Result(), time.perf_counter()
    last = None
    async with client.stream("POST", url + "/v1/completions", json=_body(model, req)) as r:
        if r.status_code != 200:
            await r.aread()
            return res
        async for line in r.aiter_lines():
            last = _observe_sse_line(res, line, t0, last)
    res.ok = res.tokens > 0
    return res


async def send_aiohttp(session, url: str, model: str, req: Request) -> Result:
    """aiohttp: what vLLM's serving benchmark uses; lighter on the client's CPU than httpx,
    which shares these two cores with the server."""
    res, t0 = Result(), time.perf_counter()
    last = None
    async with session.post(url + "/v1/completions", json=_body(model, req)) as r:
        if r.status != 200:
            await r.read()
            return res
        async for raw in r.content:  # one line at a time
            last = _observe_sse_line(res, raw.decode().rstrip("\n"), t0, last)
    res.ok = res.tokens > 0
    return res


def _body(model: str, req: Request) -> dict:
    return {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }


async def send_engine(engine, req: Request) -> Result:
    from fleetserve.scheduler import SamplingParams

    res, t0 = Result(), time.perf_counter()
    last = None
    params = SamplingParams(max_tokens=req.max_tokens, ignore_eos=True, temperature=0)
    async for out in engine.generate(req.prompt, params, f"bench-{id(req)}-{t0}"):
        if not out.outputs[0].token_ids:
            continue
        last = res.mark(t0, last)
        res.tokens += len(out.outputs[0].token_ids)
    res.ok = True
    return res


# -- statistics ----------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def summarize(label: str, rate: float, results: list[Result], elapsed: float) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok]
    itl = [x for r in ok for x in r.itl]
    return {
        "label": label,
        "rate": rate,
        "requests": len(results),
        "ok": len(ok),
        "out_tok_s": sum(r.tokens for r in ok) / elapsed,
        "ttft_mean_ms": 1000 * sum(ttft) / len(ttft) if ttft else float("nan"),
        **{f"ttft_p{q}_ms": 1000 * pct(ttft, q) for q in (50, 90, 99)},
        **{f"itl_p{q}_ms": 1000 * pct(itl, q) for q in (50, 90, 99)},
    }


def median_row(runs: list[dict]) -> dict:
    """One row per path: the median over rounds of every figure; the rounds' TTFT
    p50s kept to show the spread."""
    import statistics

    row = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, float):
            row[key] = statistics.median(r[key] for r in runs)
    row["ok"] = sum(r["ok"] for r in runs)
    row["requests"] = sum(r["requests"] for r in runs)
    row["rounds_ttft_p50_ms"] = [round(r["ttft_p50_ms"], 1) for r in runs]
    row["rounds_itl_p90_ms"] = [round(r["itl_p90_ms"], 2) for r in runs]
    return row


# -- serving -------------------------------------------------------------------


def cpu_name() -> str:
    """Which CPU a figure came from: '<model name>, <n> cores, <AVX2|AVX-512|AVX-512+bf16>'."""
    name, flags = "cpu", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name == "cpu":
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = line
    except OSError:
        pass
    isa = "AVX-512+bf16" if "avx512_bf16" in flags else "AVX-512" if "avx512f" in flags else "AVX2"
    return f"{name}, {os.cpu_count()} cores, {isa}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def app_config(args, port: int, replicas: int, policy: str, blocks: int | None):
    from fleetserve.cluster.config import AppConfig

    engine = {
        "model": args.model,
        "max_model_len": args.max_model_len,
        "num_threads": 1,
        "max_num_seqs": args.max_num_seqs,
    }
    if blocks:
        engine["num_gpu_blocks_override"] = blocks
    return AppConfig.model_validate(
        {
            "name": "bench",
            "engine": engine,
            "num_replicas": replicas,
            "routing_policy": policy,
            "http": {"port": port},
            "grpc": {"enabled": False},
            "num_cpus_per_replica": 0,
        }
    )


def redeploy(config) -> None:
    from ray import serve

    from fleetserve.cluster.deploy import deploy

    try:
        serve.delete(config.name)
    except Exception as e:  # nothing deployed yet
        print(f"(no previous app: {e})", file=sys.stderr)
    deploy(config)


def scrape(url: str) -> dict[str, float]:
    import httpx

    return metric_totals(httpx.get(url + "/metrics", timeout=60).text)


def metric_totals(text: str) -> dict[str, float]:
    """Counters and histogram sums/counts of a Prometheus text page, summed over labels."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith(("_total", "_sum", "_count")):
                totals[s.name] = totals.get(s.name, 0.0) + s.value
    return totals


def engine_ttft_ms(before: dict[str, float], after: dict[str, float]) -> float:
    """Mean TTFT the engine itself measured (arrival in the engine to first token)
    between two scrapes: what the request spent outside the router path."""
    key = "vllm:time_to_first_token_seconds"
    n = after.get(key + "_count", 0) - before.get(key + "_count", 0)
    return 1000 * (after.get(key + "_sum", 0) - before.get(key + "_sum", 0)) / n if n else float("nan")


def ray_tree_rss_mib() -> float:
    """PSS (shared pages split between sharers, so the sum is not inflated) of this
    process's descendants: with an embedded Ray that is GCS, raylet, Serve
    controller/proxy, ingress and engine replicas (and their engine core processes),
    not this benchmark's own process."""
    import psutil

    total = 0
    for p in psutil.Process().children(recursive=True):
        try:
            total += p.memory_full_info().pss
        except psutil.Error:
            pass
    return total / 2**20


async def run_http(url: str, model: str, requests: list[Request], rate: float, label: str) -> dict:
    async with _client() as client:
        send = send_aiohttp if CLIENT == "aiohttp" else send_http
        await send(client, url, model, Request("warm up", 2))
        before = await asyncio.to_thread(scrape, url)
        results, elapsed = await open_loop(requests, rate, lambda r: send(client, url, model, r))
        after = await asyncio.to_thread(scrape, url)
    row = summarize(label, rate, results, elapsed)
    row["engine_ttft_mean_ms"] = engine_ttft_ms(before, after)
    return row


def _client():
    if CLIENT == "aiohttp":
        import aiohttp

        return aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=600), connector=aiohttp.TCPConnector(limit=1000)
        )
    import httpx

    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    return httpx.AsyncClient(timeout=600, limits=limits)


def make_engine(args, core_process: bool):
    import torch

    from fleetserve.replica.engine.async_engine import AsyncEngine
    from fleetserve.replica.engine.engine_args import EngineArgs

    torch.set_num_threads(1)
    return AsyncEngine(
        EngineArgs(model=args.model, max_model_len=args.max_model_len, num_threads=1, max_num_seqs=args.max_num_seqs),
        core_process=core_process,
    )


def run_in_process(engine, label: str, requests: list[Request], rate: float) -> dict:
    async def go():
        await send_engine(engine, Request("warm up", 2))
        before = metric_totals(engine.metrics_text())
        out = await open_loop(requests, rate, lambda r: send_engine(engine, r))
        return out, before, metric_totals(engine.metrics_text())

    (results, elapsed), before, after = asyncio.run(go())
    row = summarize(label, rate, results, elapsed)
    row["engine_ttft_mean_ms"] = engine_ttft_ms(before, after)
    return row


# The in-process baselines: the AsyncEngine in the benchmark's own process, its EngineCore
# on a thread (the strict baseline the router overhead is measured against) or in a child
# process (what a replica runs by default; the difference is the IPC's cost).
IN_PROCESS = {False: "in-process engine", True: "in-process engine, core process"}
HTTP_LABEL = {"process": "HTTP, 1 replica", "thread": "HTTP, 1 replica, core thread"}


# -- main ----------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: a tiny random Llama written to a temp dir")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--rates", type=float, nargs="+", default=[2.0, 4.0, 8.0])
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--out-tokens", type=int, default=32)
    p.add_argument("--overhead-rate", type=float, default=2.0)
    p.add_argument(
        "--overhead-repeats",
        type=int,
        default=3,
        help="rounds of the overhead part (each on fresh prompts); medians are reported",
    )
    p.add_argument(
        "--overhead-warmup",
        type=int,
        default=24,
        help="requests of a discarded first round on each path (a fresh process pays "
        "one-time costs, e.g. oneDNN building kernels for each new batch shape)",
    )
    p.add_argument(
        "--engine-modes",
        nargs="+",
        default=["process", "thread"],
        choices=["process", "thread"],
        help="where the replica's EngineCore runs in the overhead part: its own process "
        "(the default) and/or a thread of the replica (as before issue 5's last step)",
    )
    p.add_argument(
        "--client",
        default="aiohttp",
        choices=["aiohttp", "httpx"],
        help="HTTP client of the load generator (aiohttp, as vLLM's serving benchmark)",
    )
    p.add_argument("--prefix-rate", type=float, default=4.0)
    p.add_argument("--prefix-count", type=int, default=8)
    p.add_argument("--prefix-words", type=int, default=200)
    p.add_argument(
        "--prefix-blocks",
        type=int,
        default=None,
        help="KV blocks per replica in the prefix part (default: about half the prefixes)",
    )
    p.add_argument("--skip", nargs="*", default=[], choices=["overhead", "rates", "prefix"])
    args = p.parse_args()
    global CLIENT
    CLIENT = args.client
    if args.model is None:
        from fleetserve.replica.testing import make_tiny_llama

        args.model = str(make_tiny_llama(Path(tempfile.mkdtemp()) / "tiny"))
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    plain = plain_workload(args.num_requests, args.prompt_words, args.out_tokens, seed=0)

    # Overhead rounds: each round draws its prompts with its own seed, the same on
    # both paths, so neither path gets prefix-cache hits from an earlier round.
    rounds = [
        plain_workload(args.num_requests, args.prompt_words, args.out_tokens, seed=100 + r)
        for r in range(max(1, args.overhead_repeats))
    ]
    warmup = plain_workload(args.overhead_warmup, args.prompt_words, args.out_tokens, seed=99)

    def interleaved(paths: dict) -> list[dict]:
        """label -> (prepare or None, run_one). Round by round, every path in turn (a noisy
        machine then slows all paths alike); `prepare` (a redeploy) runs before each of its
        rounds and is followed by a discarded warm-up round (a fresh process pays one-time
        costs, e.g. oneDNN building kernels for each new batch shape); a path without one
        is warmed up once. One row of medians per path."""
        runs: dict[str, list[dict]] = {label: [] for label in paths}
        for i, work in enumerate(rounds):
            for label, (prepare, run_one) in paths.items():
                if prepare is not None:
                    prepare()
                if warmup and (prepare is not None or i == 0):
                    print("warm-up (discarded):", run_one(warmup), flush=True)
                runs[label].append(run_one(work))
                print(runs[label][-1], flush=True)
        return [median_row(r) for r in runs.values()]

    if "overhead" not in args.skip:  # before Ray starts: nothing else on the cores
        engines = {cp: make_engine(args, cp) for cp in IN_PROCESS}
        try:
            rows.extend(
                interleaved(
                    {
                        IN_PROCESS[cp]: (
                            None,
                            lambda work, cp=cp: run_in_process(engines[cp], IN_PROCESS[cp], work, args.overhead_rate),
                        )
                        for cp in IN_PROCESS
                    }
                )
            )
        finally:
            for engine in engines.values():
                engine.shutdown()

    import ray
    from ray import serve

    from fleetserve.cluster.deploy import connect_ray, start_serve

    port = free_port()
    config = app_config(args, port, 1, "power_of_two", None)
    connect_ray(config, log_to_driver=False)
    start_serve(config)
    url = f"http://127.0.0.1:{port}"
    memory = {}
    try:
        if "overhead" not in args.skip:

            def deploy_mode(mode: str) -> None:
                # The replicas read this when their engine starts (deploy passes FLEETSERVE_*
                # through the runtime_env); a new value means new replica processes.
                os.environ["FLEETSERVE_ENGINE_CORE_PROCESS"] = "1" if mode == "process" else "0"
                redeploy(config)
                memory[f"1 replica, core {mode}"] = ray_tree_rss_mib()

            rows.extend(
                interleaved(
                    {
                        HTTP_LABEL[mode]: (
                            lambda mode=mode: deploy_mode(mode),
                            lambda work, mode=mode: asyncio.run(
                                run_http(url, config.served_model_name, work, args.overhead_rate, HTTP_LABEL[mode])
                            ),
                        )
                        for mode in args.engine_modes
                    }
                )
            )
            os.environ.pop("FLEETSERVE_ENGINE_CORE_PROCESS", None)
        if "rates" not in args.skip:
            config = app_config(args, port, 2, "power_of_two", None)
            redeploy(config)
            memory["2 replicas"] = ray_tree_rss_mib()
            for rate in args.rates:
                rows.append(asyncio.run(run_http(url, config.served_model_name, plain, rate, "HTTP, 2 replicas")))
                print(rows[-1], flush=True)
        if "prefix" not in args.skip:
            rows.extend(run_prefix(args, port, url))
        memory["after runs"] = ray_tree_rss_mib()
    finally:
        serve.shutdown()
        ray.shutdown()
    report(rows, memory, args)


def run_prefix(args, port: int, url: str) -> list[dict]:
    from fleetserve.replica.engine.tokenizer import load_tokenizer
    from fleetserve.replica.model_loader.registry import resolve_model

    work = prefix_workload(args.num_requests, args.prefix_count, args.prefix_words, 16, args.out_tokens, seed=1)
    blocks = args.prefix_blocks
    if blocks is None:  # size each replica's cache to hold about half the system prompts
        tok = load_tokenizer(resolve_model(args.model))
        n_tok = len(tok(work[0].prompt).input_ids) + args.out_tokens
        blocks = max(32, (n_tok // 16 + 1) * (args.prefix_count // 2 + 2))
    rows = []
    for policy in ("power_of_two", "prefix_aware"):
        config = app_config(args, port, 2, policy, blocks)
        redeploy(config)
        before = scrape(url)
        row = asyncio.run(run_http(url, config.served_model_name, work, args.prefix_rate, f"shared prefix, {policy}"))
        after = scrape(url)
        q = after.get("vllm:prefix_cache_queries_total", 0) - before.get("vllm:prefix_cache_queries_total", 0)
        h = after.get("vllm:prefix_cache_hits_total", 0) - before.get("vllm:prefix_cache_hits_total", 0)
        row["prefix_hit_rate"] = h / q if q else float("nan")
        row["kv_blocks_per_replica"] = blocks
        rows.append(row)
        print(row, flush=True)
    return rows


def report(rows: list[dict], memory: dict, args) -> None:
    cols = [
        "label",
        "rate",
        "ok",
        "out_tok_s",
        "ttft_p50_ms",
        "ttft_p90_ms",
        "ttft_p99_ms",
        "itl_p50_ms",
        "itl_p90_ms",
        "itl_p99_ms",
        "prefix_hit_rate",
    ]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    by_label = {r["label"]: r for r in rows}
    extra = []
    base = by_label.get(IN_PROCESS[False])
    for other in (IN_PROCESS[True], *HTTP_LABEL.values()):
        b = by_label.get(other)
        if base is None or b is None:
            continue
        extra.append(
            f"{other} - in-process engine (medians of {len(b['rounds_ttft_p50_ms'])} "
            f"rounds): TTFT p50 {b['ttft_p50_ms'] - base['ttft_p50_ms']:+.1f} ms, ITL p50 "
            f"{b['itl_p50_ms'] - base['itl_p50_ms']:+.2f} ms, ITL p90 "
            f"{b['itl_p90_ms'] - base['itl_p90_ms']:+.2f} ms"
        )
    overhead = [by_label[k] for k in (*IN_PROCESS.values(), *HTTP_LABEL.values()) if k in by_label]
    if overhead:
        for r in overhead:
            extra.append(
                f"  {r['label']}: TTFT p50 per round {r['rounds_ttft_p50_ms']} ms, "
                f"ITL p90 per round {r['rounds_itl_p90_ms']} ms; mean TTFT "
                f"{r['ttft_mean_ms']:.1f} ms, of which in the engine "
                f"{r['engine_ttft_mean_ms']:.1f} ms (arrival to first token)"
            )
    pre = {r["label"]: r for r in rows if r["label"].startswith("shared prefix")}
    if len(pre) == 2:
        a, b = pre["shared prefix, power_of_two"], pre["shared prefix, prefix_aware"]
        extra.append(
            f"prefix_aware / power_of_two TTFT p50: {b['ttft_p50_ms'] / a['ttft_p50_ms']:.2f}x; "
            f"hit rate {b['prefix_hit_rate']:.2f} vs {a['prefix_hit_rate']:.2f}"
        )
    extra.append(
        "Ray process tree PSS (MiB, the benchmark's own process not counted): "
        + ", ".join(f"{k} {v:.0f}" for k, v in memory.items())
    )
    text = "\n".join(
        [
            f"model: {args.model}; requests per run: {args.num_requests}; "
            f"out tokens: {args.out_tokens}; HTTP client: {args.client}",
            "",
            *lines,
            "",
            *extra,
        ]
    )
    print(text)
    (RESULTS / "serving.md").write_text(text + "\n")
    (RESULTS / "serving.json").write_text(json.dumps({"rows": rows, "memory_mib": memory}, indent=1))
    plot(rows)


def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    rated = [r for r in rows if r["label"] == "HTTP, 2 replicas"]
    if rated:
        x = [r["rate"] for r in rated]
        for q in (50, 90, 99):
            axes[0].plot(x, [r[f"ttft_p{q}_ms"] for r in rated], marker="o", label=f"TTFT p{q}")
            axes[1].plot(x, [r[f"itl_p{q}_ms"] for r in rated], marker="o", label=f"ITL p{q}")
        axes[0].set_xlabel("request rate (req/s)")
        axes[1].set_xlabel("request rate (req/s)")
        axes[0].set_ylabel("ms")
        axes[0].set_title("TTFT, 2 replicas over HTTP")
        axes[1].set_title("inter-token latency")
        axes[0].legend()
        axes[1].legend()
    bars = [
        r
        for r in rows
        if r["label"] in (*IN_PROCESS.values(), *HTTP_LABEL.values()) or r["label"].startswith("shared prefix")
    ]
    if bars:
        names = [r["label"].replace("shared prefix, ", "prefix: ") for r in bars]
        axes[2].barh(names[::-1], [r["ttft_p50_ms"] for r in bars][::-1])
        axes[2].set_xlabel("TTFT p50 (ms)")
        axes[2].set_title("router overhead and prefix-aware routing")
    fig.tight_layout()
    fig.savefig(RESULTS / "serving.png", dpi=110)


if __name__ == "__main__":
    main()
