"""KV hand-off between two engines, as served: load vs recompute on the real model, per connector.

Two `AsyncEngine`s (each EngineCore in a process of its own, as a Serve replica runs it), the
real SmolLM2 (float32 by default, one torch thread each, no local prefix cache). Per round and
connector: engine A prefills a fresh prompt (`max_tokens=1`, `do_remote_decode`), then engine
B runs the same prompt with A's `kv_transfer_params` for one token; the time of B's call is the
hand-off as a decode replica sees it (its load, started as soon as A has replied, so A's
copy-out may still be under way, then one step). Against: B computing the same prompt itself
(no params: the prefill a hand-off saves). Medians of `--repeats` rounds after one untimed.

    python benchmarks/engine_hand_off.py                       # 2048 tokens, every connector
    python benchmarks/engine_hand_off.py --connectors p2p --tokens 512,2048

Prints a table and writes `benchmarks/results/engine_hand_off.{json,png}`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(Path(__file__).parent))

from serving import cpu_name  # noqa: E402  (benchmarks/ is not a package)

CONNECTORS = {"storage": "SharedStorageConnector", "ray": "RayObjectStoreConnector", "p2p": "P2PConnector"}


def engines(kind: str, tmp: str, dtype: str, max_len: int):
    from fleetserve.replica.engine.async_engine import AsyncEngine

    extra = {"SharedStorageConnector": {"path": os.path.join(tmp, "kv")}, "P2PConnector": {"host": "127.0.0.1"}}.get(
        CONNECTORS[kind], {}
    )
    kv = {
        "kv_connector": CONNECTORS[kind],
        "kv_role": "kv_both",
        "kv_load_failure_policy": "fail",
        "kv_load_timeout_s": 120.0,
        "kv_connector_extra_config": extra,
    }
    common = dict(
        model="smollm2-135m",
        dtype=dtype,
        max_model_len=max_len,
        max_num_batched_tokens=max_len,
        enable_prefix_caching=False,
        kv_transfer_config=kv,
        num_threads=1,
        core_process=True,
    )
    return AsyncEngine(**common), AsyncEngine(**common)


async def call(eng, prompt, params=None):
    from fleetserve.scheduler import SamplingParams

    out = None
    async for o in eng.generate(
        prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), kv_transfer_params=params
    ):
        out = o
    return out


async def rounds(a, b, n_tokens: int, repeats: int, salt: int) -> tuple[list[float], list[float]]:
    """(B's hand-off call seconds, B's own prefill seconds), `repeats` each after one untimed."""
    hand, own = [], []
    for r in range(repeats + 1):
        prompt = [(salt * 104729 + r * 7919 + i) % 40000 + 100 for i in range(n_tokens)]
        p = await call(a, prompt, {"do_remote_decode": True, "transfer_id": uuid.uuid4().hex})
        t0 = time.perf_counter()
        o = await call(b, prompt, p.kv_transfer_params)
        dt = time.perf_counter() - t0
        if o.outputs[0].finish_reason == "error" or o.num_remote_tokens < n_tokens // 16 * 16 - 16:
            raise SystemExit(f"a hand-off failed: {o.outputs[0].finish_reason}, {o.num_remote_tokens} remote tokens")
        other = [(salt * 31 + r * 13 + i) % 40000 + 100 for i in range(n_tokens)]
        t0 = time.perf_counter()
        await call(b, other)
        own_dt = time.perf_counter() - t0
        if r:
            hand.append(dt)
            own.append(own_dt)
    return hand, own


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--connectors", default="storage,ray,p2p")
    ap.add_argument("--tokens", default="2048", help="comma list of prompt lengths")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    kinds = [k for k in args.connectors.split(",") if k]
    if not kinds or any(k not in CONNECTORS for k in kinds):
        ap.error(f"--connectors: choose from {', '.join(CONNECTORS)}")
    sizes = [int(t) for t in args.tokens.split(",")]
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    rows = []
    with tempfile.TemporaryDirectory(prefix="handoff-") as tmp:
        for kind in kinds:
            a, b = engines(kind, tmp, args.dtype, max(sizes) + 64)
            try:
                for n in sizes:
                    hand, own = asyncio.run(rounds(a, b, n, args.repeats, len(rows)))
                    row = {
                        "connector": kind,
                        "tokens": n,
                        "hand_off_s": statistics.median(hand),
                        "recompute_s": statistics.median(own),
                        "hand_off_all_s": hand,
                        "recompute_all_s": own,
                    }
                    row["speedup"] = row["recompute_s"] / row["hand_off_s"]
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if not k.endswith("_all_s")}), flush=True)
            finally:
                a.shutdown()
                b.shutdown()
    ray.shutdown()
    report(rows, args.dtype)
    return 0


def report(rows, dtype: str) -> None:
    print(f"CPU: {cpu_name()}; SmolLM2 {dtype}, one torch thread per engine, engines in their own processes")
    print(f"\n{'connector':>9} {'tokens':>7} {'hand-off ms':>12} {'recompute ms':>13} {'speed-up':>9}")
    for r in rows:
        print(
            f"{r['connector']:>9} {r['tokens']:>7} {r['hand_off_s'] * 1e3:>12.1f} "
            f"{r['recompute_s'] * 1e3:>13.1f} {r['speedup']:>8.0f}x"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "engine_hand_off.json").write_text(
        json.dumps({"dtype": dtype, "cpu": cpu_name(), "rows": rows}, indent=1)
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['connector']}\n{r['tokens']} tok" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["recompute_s"] * 1e3 for r in rows], 0.4, label="recompute (prefill)")
    ax.bar([i + 0.2 for i in x], [r["hand_off_s"] * 1e3 for r in rows], 0.4, label="hand-off (load + 1 step)")
    ax.set_xticks(list(x), labels)
    ax.set_yscale("log")
    ax.set_ylabel("ms, decode engine's call")
    ax.set_title(f"KV hand-off between engine processes, SmolLM2 {dtype} ({cpu_name()})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "engine_hand_off.png", dpi=110)
    print(f"wrote {RESULTS / 'engine_hand_off.png'}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
