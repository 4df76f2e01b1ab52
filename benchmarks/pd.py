"""P/D, precise prefix routing and cluster prefix reuse, over HTTP with Poisson arrivals.

Three parts, one table and one PNG (benchmarks/results/pd.{md,json,png}). Every setup
has the same two engine replicas (one torch thread each) on the same machine: 2
colocated replicas, or 1 prefill + 1 decode replica.

1. interference -- steady short requests plus periodic long (~2k-token) prompts.
   Colocated (2 replicas, power_of_two) vs 1P+1D (`--connector`, default ray_object_store): ITL of the
   short requests (p50/p99/p99.9), TTFT of short and long ones, throughput; plus the P/D
   hand-off (router: prefill call, prefill-done -> decode's first item).
2. prefix -- two workloads with cache pressure (each replica's KV cache holds about
   half of the working set): several long system prompts, and multi-turn
   conversations (each turn resends the model's own answers): power_of_two vs
   prefix_aware_approx (guesses from routing history) vs prefix_aware (the engines'
   KV events): prefix-cache hit rate, share of requests routed to a prefix holder, TTFT.
3. reuse -- a 2k-token prefix that one replica caches while it is busy: TTFT of a
   request on the other replica that loads the prefix from its peer (cluster_reuse)
   vs recomputes it.

    python benchmarks/pd.py                      # a small random model (a few minutes)
    python benchmarks/pd.py --skip interference  # parts by name

On this project's 2-core machine, "equal cores" means both setups share the same two
cores with everything else (Ray, the ingress, the load generator): P/D cannot get
more hardware than colocated, and neither gets a core of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).parent))
import serving as sv  # noqa: E402  (the HTTP load generator and statistics)

RESULTS = sv.RESULTS


def app(
    args,
    port: int,
    *,
    policy: str = "power_of_two",
    blocks: int | None = None,
    pd: dict | None = None,
    reuse: dict | None = None,
    imbalance: int = 4,
):
    from fleetserve.cluster.config import AppConfig

    engine = {
        "model": args.model,
        "max_model_len": args.max_model_len,
        "num_threads": 1,
        "max_num_seqs": 32,
        "dtype": "float32",
        "cpu_bind": args.cpu_bind,
        # Chunked prefill, as colocated vLLM runs: a long prompt is computed in chunks
        # of this many tokens between decode steps (the same in every pool).
        "max_num_batched_tokens": args.max_batched_tokens,
    }
    if blocks:
        engine["num_gpu_blocks_override"] = blocks
    cfg = {
        "name": "bench",
        "engine": engine,
        "num_replicas": 2,
        "routing_policy": policy,
        "routing": {"imbalance_threshold": imbalance, "min_match_fraction": args.min_match_fraction},
        "http": {"port": port},
        "grpc": {"enabled": False},
        "num_cpus_per_replica": 0,
    }
    if pd is not None:  # {} is P/D with the defaults
        cfg["pd"] = {"enabled": True, "connector": args.connector, "min_prefill_tokens": args.min_prefill_tokens, **pd}
        if args.connector == "p2p":  # its servers listen on loopback here, not the node's IP
            cfg["pd"].setdefault("kv_connector_extra_config", {"host": "127.0.0.1"})
    if reuse is not None:
        cfg["cluster_reuse"] = {"enabled": True, **reuse}
    return AppConfig.model_validate(cfg)


# -- part 1: long-prefill interference ------------------------------------------------


def interference_workload(args) -> list[sv.Request]:
    rng = random.Random(3)
    work = []
    for i in range(args.num_requests):
        if i % args.long_every == args.long_every - 1:
            work.append(sv.Request("Long document: " + sv.text_of(rng, args.long_words), 8))
        else:
            work.append(sv.Request(sv.text_of(rng, 30), args.short_tokens))
    return work


def run_interference(args, port: int, url: str) -> list[dict]:
    work = interference_workload(args)
    setups = {
        "colocated 2x, power_of_two": app(args, port),
        f"1P+1D, {args.connector}": app(args, port, policy="prefix_aware", pd={}),
    }
    rows = []
    for label, config in setups.items():
        sv.redeploy(config)
        before = sv.scrape(url)
        src0 = labelled(url, "fleetserve:pd_decode_prompt_tokens", "source")
        results, elapsed = asyncio.run(_open_loop(url, config.served_model_name, work, args.rate))
        after = sv.scrape(url)
        src1 = labelled(url, "fleetserve:pd_decode_prompt_tokens", "source")
        short = [r for r, q in zip(results, work) if q.max_tokens == args.short_tokens]
        long_ = [r for r, q in zip(results, work) if q.max_tokens == 8]
        row = sv.summarize(f"interference, {label}", args.rate, short, elapsed)
        row["out_tok_s"] = sum(r.tokens for r in results if r.ok) / elapsed
        row["long_ttft_p50_ms"] = 1000 * sv.pct([r.ttft for r in long_ if r.ok], 50)
        row["long_ok"] = sum(r.ok for r in long_)
        row["itl_p999_ms"] = 1000 * sv.pct([x for r in short if r.ok for x in r.itl], 99.9)
        row.update(_handoff(before, after))
        for src, v in src1.items():
            row[f"decode_prompt_tokens_{src}"] = v - src0.get(src, 0)
        rows.append(row)
        print(row, flush=True)
    return rows


def _handoff(before: dict, after: dict) -> dict:
    out = {}
    for key, name in (
        ("fleetserve:pd_prefill_seconds", "prefill_call_mean_ms"),
        ("fleetserve:pd_handoff_seconds", "handoff_mean_ms"),
        ("vllm:kv_transfer_receive_seconds", "transfer_recv_mean_ms"),
        ("vllm:kv_transfer_send_seconds", "transfer_send_mean_ms"),
    ):
        n = after.get(key + "_count", 0) - before.get(key + "_count", 0)
        if n:
            out[name] = 1000 * (after.get(key + "_sum", 0) - before.get(key + "_sum", 0)) / n
    return out


def labelled(url: str, family: str, label: str) -> dict[str, float]:
    """Counter totals of one labelled family, by that label's value."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=60).text
    return {
        s.labels[label]: s.value
        for fam in text_string_to_metric_families(text)
        if fam.name == family
        for s in fam.samples
        if s.name.endswith("_total")
    }


async def _open_loop(url: str, model: str, work, rate: float):
    sv.CLIENT = "httpx"
    async with sv._client() as client:
        await sv.send_http(client, url, model, sv.Request("warm up", 2))
        # A long one too: with P/D it takes the prefill pool, and each engine's first
        # transfer also connects its engine-core process to Ray (seconds, once).
        await sv.send_http(client, url, model, sv.Request("warm up " + sv.text_of(random.Random(0), 200), 2))
        if isinstance(work, Conversations):
            return await work.run(client, url, model, rate)
        return await sv.open_loop(work, rate, lambda r: _send(client, url, model, r))


async def _send(client, url: str, model: str, req) -> "sv.Result":
    """One request; a connection error counts as a failed request, not a crashed run."""
    try:
        return await sv.send_http(client, url, model, req)
    except Exception as e:  # noqa: BLE001 - counted (ok=False) and reported
        print(f"request failed: {e!r}", file=sys.stderr)
        return sv.Result()


# -- part 2: shared prefixes under cache pressure -------------------------------------


def multi_turn_workload(n_convs: int, turns: int, words: int, out_tokens: int, seed: int) -> list[sv.Request]:
    """`--multi-turn-answers synthetic`: conversations whose every turn resends the whole
    history plus a new question, with made-up assistant text (not what the model said, so
    only the previous prompt can hit), sent turn by turn across conversations (round
    robin), so a conversation's next turn comes after its previous one (at the rates used
    here) and its prefix keeps growing."""
    rng = random.Random(seed)
    convs = [f"Conversation {c}: " + sv.text_of(rng, words) for c in range(n_convs)]
    work = []
    for _ in range(turns):
        for c in range(n_convs):
            convs[c] += f"\nUser: {sv.text_of(rng, words // 2)}"
            work.append(sv.Request(convs[c] + "\nAssistant:", out_tokens))
            convs[c] += f"\nAssistant: {sv.text_of(rng, words // 2)}"
    return work


class Conversations:
    """`--multi-turn-answers model` (the default): multi-turn chat as clients run it. Each
    turn sends the whole history -- earlier questions *and the model's own answers* -- plus
    a new question, so a replica that served the previous turn holds all but the new
    question (the engines cache the answer's full blocks too). Prompts travel as token ids
    (the history is the exact ids the model produced: a random model's output does not
    survive a round trip through text), the answers come back as ids through vLLM's
    `logprobs` + `return_tokens_as_token_ids`. Turns arrive round robin across
    conversations at Poisson times, and a turn waits for its conversation's previous
    answer (a user reads before replying); its TTFT counts from when it is sent."""

    def __init__(self, tok, n_convs: int, turns: int, words: int, out_tokens: int, seed: int) -> None:
        rng = random.Random(seed)
        ids = lambda text, special=False: list(tok(text, add_special_tokens=special).input_ids)  # noqa: E731
        self.openings = [ids(f"Conversation {c}: " + sv.text_of(rng, words), True) for c in range(n_convs)]
        self.questions = [
            [ids(f"\nUser: {sv.text_of(rng, words // 2)}\nAssistant:") for _ in range(turns)] for _ in range(n_convs)
        ]
        self.turns, self.out_tokens = turns, out_tokens

    def longest(self) -> list[int]:
        """Each conversation's last prompt length, in tokens (its answers counted at full length)."""
        return [
            len(o) + sum(map(len, q)) + (self.turns - 1) * self.out_tokens
            for o, q in zip(self.openings, self.questions)
        ]

    async def run(self, client, url: str, model: str, rate: float) -> tuple[list[sv.Result], float]:
        n = len(self.openings)
        history = [list(o) for o in self.openings]
        last: list[Optional[asyncio.Task]] = [None] * n

        async def turn(c: int, t: int, before: Optional[asyncio.Task]) -> sv.Result:
            if before is not None:
                await before
            prompt = history[c] + self.questions[c][t]
            res, answer = await _send_ids(client, url, model, prompt, self.out_tokens)
            history[c] = prompt + answer
            return res

        start = time.perf_counter()
        tasks = []
        for i, at in enumerate(sv.arrivals(n * self.turns, rate, seed=n * self.turns)):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            c = i % n
            last[c] = asyncio.create_task(turn(c, i // n, last[c]))
            tasks.append(last[c])
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


async def _send_ids(client, url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[sv.Result, list[int]]:
    """A streamed completion of a token-id prompt: (its result, the answer's token ids)."""
    res, t0, last, answer = sv.Result(), time.perf_counter(), None, []
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                print(f"request failed: HTTP {r.status_code} {r.text[:200]}", file=sys.stderr)
                return res, answer
            async for line in r.aiter_lines():
                last = sv._observe_sse_line(res, line, t0, last)
                if line.startswith("data: {"):
                    for ch in json.loads(line[6:]).get("choices") or []:
                        answer += [int(x.split(":", 1)[1]) for x in (ch.get("logprobs") or {}).get("tokens") or []]
    except Exception as e:  # noqa: BLE001 - counted (ok=False) and reported
        print(f"request failed: {e!r}", file=sys.stderr)
        return sv.Result(), answer
    res.ok = res.tokens > 0 and len(answer) == max_tokens
    return res, answer


def run_prefix(args, port: int, url: str) -> list[dict]:
    from fleetserve.replica.engine.tokenizer import load_tokenizer
    from fleetserve.replica.model_loader.registry import resolve_model

    tok = load_tokenizer(resolve_model(args.model))
    system = sv.prefix_workload(args.num_requests, args.prefix_count, args.prefix_words, 16, 16, seed=1)
    # Cache pressure: each replica's KV cache holds about half of the working set (the
    # system prompts; the conversations' longest histories).
    sys_blocks = (len(tok(system[0].prompt).input_ids) + 16) // 16 + 1
    if args.multi_turn_answers == "model":
        multi = Conversations(tok, args.convs, args.turns, args.turn_words, args.turn_tokens, seed=2)
        longest = multi.longest()
    else:
        multi = multi_turn_workload(args.convs, args.turns, args.turn_words, args.turn_tokens, seed=2)
        longest = [len(tok(r.prompt).input_ids) for r in multi[-args.convs :]]
    conv_blocks = sum(n + args.turn_tokens for n in longest) // 16 + args.convs
    workloads = {
        "system prompts": (system, max(32, sys_blocks * (args.prefix_count // 2 + 1)), args.prefix_rate),
        "multi-turn": (multi, max(32, conv_blocks // 2), args.turn_rate),
    }
    workloads = {k: v for k, v in workloads.items() if k.split()[0] in args.prefix_workloads.split(",")}
    rows = []
    policies = ("power_of_two", "prefix_aware_approx", "prefix_aware")
    for wname, (work, blocks, rate) in workloads.items():
        # Rounds interleave the policies; a row pools every round's requests (one round of
        # the multi-turn workload is only 32 requests, too few for a stable p90).
        acc = {
            p: {"results": [], "elapsed": 0.0, "h": 0.0, "q": 0.0, "holder": 0.0, "routed": 0.0, "p90s": []}
            for p in policies
        }
        for _ in range(args.prefix_rounds):
            for policy in policies:
                config = app(args, port, policy=policy, blocks=blocks)
                sv.redeploy(config)
                before = sv.scrape(url)
                routed0 = labelled(url, "fleetserve:router_prefix_routed_requests", "prefix_match")
                results, elapsed = asyncio.run(_open_loop(url, config.served_model_name, work, rate))
                after = sv.scrape(url)
                routed1 = labelled(url, "fleetserve:router_prefix_routed_requests", "prefix_match")
                a = acc[policy]
                a["results"] += results
                a["elapsed"] += elapsed
                for key, metric in (("q", "vllm:prefix_cache_queries_total"), ("h", "vllm:prefix_cache_hits_total")):
                    a[key] += after.get(metric, 0) - before.get(metric, 0)
                a["routed"] += sum(routed1.values()) - sum(routed0.values())
                a["holder"] += routed1.get("true", 0) - routed0.get("true", 0)
                a["p90s"].append(round(1000 * sv.pct([r.ttft for r in results if r.ok], 90), 1))
                print(f"{wname}, {policy}: round TTFT p90 {a['p90s'][-1]} ms", flush=True)
        for policy in policies:
            a = acc[policy]
            row = sv.summarize(f"shared prefix ({wname}), {policy}", rate, a["results"], a["elapsed"])
            row["prefix_hit_rate"] = a["h"] / a["q"] if a["q"] else float("nan")
            if a["routed"]:
                row["routed_to_holder"] = a["holder"] / a["routed"]
            row["kv_blocks_per_replica"] = blocks
            row["rounds"] = args.prefix_rounds
            row["rounds_ttft_p90_ms"] = a["p90s"]
            if wname == "multi-turn":
                row["multi_turn_answers"] = args.multi_turn_answers
                row["turn_tokens"] = args.turn_tokens
            rows.append(row)
            print(row, flush=True)
    return rows


# -- part 3: cluster reuse -----------------------------------------------------------


def run_reuse(args, port: int, url: str) -> list[dict]:
    rows = []
    for label, reuse in (("recomputed", None), ("loaded from peer", {"min_tokens": 256})):
        config = app(args, port, policy="prefix_aware", reuse=reuse, imbalance=1)
        sv.redeploy(config)
        src0 = labelled(url, "fleetserve:prefix_reuse_prompt_tokens", "source")
        ttfts = asyncio.run(_reuse_rounds(url, config.served_model_name, args))
        src1 = labelled(url, "fleetserve:prefix_reuse_prompt_tokens", "source")
        row = {
            "label": f"reuse 2k prefix, {label}",
            "rate": 0.0,
            "ok": len(ttfts),
            "ttft_p50_ms": 1000 * statistics.median(ttfts) if ttfts else float("nan"),
            "rounds_ttft_ms": [round(1000 * t, 1) for t in ttfts],
            "loaded_tokens": src1.get("loaded", 0) - src0.get("loaded", 0),
        }
        rows.append(row)
        print(row, flush=True)
    return rows


async def _reuse_rounds(url: str, model: str, args) -> list[float]:
    """Each round: a fresh long prefix warmed on one replica, that replica kept busy by a
    stream with the same prefix, then the measured request (it goes to the other one)."""
    sv.CLIENT = "httpx"
    rng = random.Random(9)
    out = []
    async with sv._client() as client:
        await sv.send_http(client, url, model, sv.Request("warm up", 2))
        for i in range(args.reuse_rounds):
            prefix = f"Round {i}: " + sv.text_of(rng, args.long_words)
            await sv.send_http(client, url, model, sv.Request(prefix + " warm", 1))
            busy = asyncio.create_task(sv.send_http(client, url, model, sv.Request(prefix + " busy", 64)))
            await asyncio.sleep(0.5)
            res = await sv.send_http(client, url, model, sv.Request(prefix + " question", 4))
            await busy
            if res.ok:
                out.append(res.ttft)
    return out


# -- report --------------------------------------------------------------------------

COLS = [
    "label",
    "rate",
    "ok",
    "out_tok_s",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "itl_p999_ms",
    "long_ttft_p50_ms",
    "prefix_hit_rate",
    "routed_to_holder",
    "prefill_call_mean_ms",
    "handoff_mean_ms",
    "transfer_recv_mean_ms",
]


def report(rows: list[dict], args) -> None:
    lines = ["| " + " | ".join(COLS) + " |", "|" + "---|" * len(COLS)]
    for r in rows:
        cells = []
        for c in COLS:
            v = r.get(c, "")
            cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "pd.md").write_text(text + "\n")
    (RESULTS / "pd.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    plot(rows)


def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [
        ("interference", "itl_p99_ms", "short requests' ITL p99 (ms)"),
        ("shared prefix (system prompts)", "ttft_p90_ms", "TTFT p90 (ms)"),
        ("shared prefix (multi-turn)", "ttft_p90_ms", "TTFT p90 (ms)"),
        ("reuse", "ttft_p50_ms", "TTFT p50 (ms)"),
    ]
    parts = [p for p in parts if any(r["label"].startswith(p[0]) for r in rows)]
    fig, axes = plt.subplots(1, len(parts), figsize=(5 * len(parts), 4), squeeze=False)
    for ax, (prefix, key, title) in zip(axes[0], parts):
        sel = [r for r in rows if r["label"].startswith(prefix)]
        ax.bar([r["label"].split(", ", 1)[-1] for r in sel], [r.get(key, 0) for r in sel])
        ax.set_title(f"{prefix}: {title}", fontsize=9)
        ax.tick_params(axis="x", rotation=15)
    fig.tight_layout()
    fig.savefig(RESULTS / "pd.png", dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: a random Llama of 4 layers, hidden 256")
    p.add_argument("--max-model-len", type=int, default=2560)
    p.add_argument("--num-requests", type=int, default=90)
    p.add_argument("--rate", type=float, default=5.0)
    p.add_argument("--long-every", type=int, default=6)
    p.add_argument(
        "--min-prefill-tokens",
        type=int,
        default=256,
        help="P/D: prompts with fewer uncached tokens skip the prefill pool",
    )
    p.add_argument("--short-tokens", type=int, default=96, help="output tokens of a short request")
    p.add_argument(
        "--max-batched-tokens", type=int, default=512, help="engines' max_num_batched_tokens (the prefill chunk)"
    )
    p.add_argument("--long-words", type=int, default=500, help="~2k tokens (4 per word here)")
    p.add_argument("--prefix-count", type=int, default=6)
    p.add_argument("--prefix-words", type=int, default=300)
    p.add_argument("--prefix-rate", type=float, default=4.0)
    p.add_argument("--convs", type=int, default=8, help="multi-turn: conversations")
    p.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    p.add_argument("--turn-words", type=int, default=60, help="multi-turn: words per turn")
    p.add_argument("--turn-rate", type=float, default=3.0)
    p.add_argument("--turn-tokens", type=int, default=32, help="multi-turn: tokens per answer")
    p.add_argument(
        "--multi-turn-answers",
        default="model",
        choices=["model", "synthetic"],
        help="multi-turn: each turn resends the model's own answers (as chat clients do), "
        "or made-up assistant text (the earlier workload: only the previous prompt can hit)",
    )
    p.add_argument(
        "--prefix-workloads",
        default="system,multi-turn",
        help="shared-prefix part: which workloads (system, multi-turn)",
    )
    p.add_argument(
        "--prefix-rounds",
        type=int,
        default=3,
        help="shared-prefix part: interleaved rounds per policy (rows pool their requests)",
    )
    p.add_argument(
        "--min-match-fraction", type=float, default=0.5, help="routing.min_match_fraction of the prefix-aware policies"
    )
    p.add_argument("--reuse-rounds", type=int, default=5)
    p.add_argument("--skip", nargs="*", default=[], choices=["interference", "prefix", "reuse"])
    p.add_argument(
        "--cpu-bind",
        default=None,
        choices=[None, "auto"],
        help="auto: each engine replica pinned to a core of its own (default: unbound)",
    )
    p.add_argument(
        "--connector",
        default="ray_object_store",
        choices=["ray_object_store", "p2p"],
        help="interference: the P/D setup's KV connector",
    )
    args = p.parse_args()
    if args.model is None:
        from fleetserve.replica.testing import make_tiny_llama

        args.model = str(
            make_tiny_llama(
                Path(tempfile.mkdtemp()) / "bench-llama",
                num_layers=4,
                hidden_size=256,
                num_heads=8,
                num_kv_heads=4,
                max_position_embeddings=4096,
            )
        )
    from fleetserve.cluster.deploy import connect_ray, start_serve

    port = sv.free_port()
    url = f"http://127.0.0.1:{port}"
    base = app(args, port)
    for attempt in range(3):  # a loaded machine can miss Ray's fixed 30 s node start-up wait
        try:
            connect_ray(base, log_to_driver=False)
            break
        except Exception as e:  # noqa: BLE001 - retried, then raised
            if "timed out during startup" not in str(e) or attempt == 2:
                raise
            import ray

            ray.shutdown()
    start_serve(base)
    rows = []
    t0 = time.time()
    for name, fn in (("interference", run_interference), ("prefix", run_prefix), ("reuse", run_reuse)):
        if name not in args.skip:
            rows += fn(args, port, url)
    print(f"total {time.time() - t0:.0f} s")
    report(rows, args)


if __name__ == "__main__":
    main()
