"""KV transfer throughput per connector vs its raw transport, and load vs recompute.

SmolLM2-135M's KV shape (30 layers, 3 KV heads, head_dim 64, block size 16, float32:
45 KiB per token), prompts of 512 to 16k tokens. For each size and connector, one
hand-off end to end through the real connector halves (`TransferWorker`): the
producer copies the blocks out of its paged cache and exports them, the consumer
fetches, checks every block (chain key, checksum) and writes them into its own
paged cache. Against, in the same run and on the same bytes:

* its raw transport: one file write + read (shared storage), one `ray.put` +
  `ray.get` (Ray object store), one gloo send + recv between two ranks (P2P; the
  connector's two ranks live in this one process too, on the server's thread; the
  group formed once, as the connector keeps its groups);
* a plain memcpy (`torch` copy of the same bytes).

Each size starts with one untimed round of every path (the steady state of a serving
engine: staging buffers of that size pooled, pages touched, groups formed).

A connector's hand-off also copies the blocks out of one paged cache and into
another (two copies the raw transports do not make) and checks every block's
digest on both sides, so its ceiling against a one-copy raw transport is well
under 1: the table shows the ratio, and the JSON the export and load times.

Then load vs recompute for a 2k-token prompt: the real model's prefill time on this
CPU (an engine, `max_tokens=1`) against the consumer-side load time (fetch, verify,
write into the cache) of each connector.

Medians of `--repeats` interleaved rounds. Prints a table and writes
`benchmarks/results/kv_transfer.{png,json}`.

    python benchmarks/kv_transfer.py                # 512..16k tokens, 3 rounds
    python benchmarks/kv_transfer.py --quick        # 512 and 2k tokens, 2 rounds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(Path(__file__).parent))

from serving import cpu_name  # noqa: E402  (benchmarks/ is not a package)

LAYERS, HEADS, HEAD_DIM, BS = 30, 3, 64, 16
CFG = type("Cfg", (), dict(num_attention_heads=9, num_key_value_heads=HEADS, hidden_size=576,
                           num_hidden_layers=LAYERS, vocab_size=49152, model_type="llama",
                           rope_theta=100000.0, head_dim=HEAD_DIM))


def make_pair(kind: str, num_blocks: int, tmp: str):
    """A producer and a consumer worker half of one connector, each with its own cache."""
    from fleetserve.kv_transfer.base import KVConnectorRole
    from fleetserve.kv_transfer.config import KVTransferConfig
    from fleetserve.kv_transfer.factory import build_context, resolve_connector_class

    extra = ({"path": tmp, "max_bytes": 64 << 30} if kind == "SharedStorageConnector"
             else {"host": "127.0.0.1"} if kind.endswith("P2PConnector") else {})
    cls = resolve_connector_class(kind)
    halves = []
    for seed, role in ((0, "kv_producer"), (1, "kv_consumer")):
        cfg = KVTransferConfig(kv_connector=kind, kv_role=role, kv_connector_extra_config=extra,
                               kv_load_timeout_s=600, engine_id=f"bench-{role}")
        ctx = build_context(cfg, "smollm2-135m", CFG, torch.float32, BS)
        w = cls(cfg, KVConnectorRole.WORKER, ctx)
        g = torch.Generator().manual_seed(seed)
        w.register_kv_caches([torch.randn((2, HEADS, num_blocks, BS, HEAD_DIM), generator=g)
                              for _ in range(LAYERS)])
        halves.append(w)
    return halves[0].ctx, halves[0], halves[1]


def hand_off(ctx, prod, cons, num_tokens: int, tid: str) -> tuple[float, float]:
    """(export seconds, load seconds) of one transfer of `num_tokens` tokens."""
    from fleetserve.kv_transfer.base import ConnectorMetadata, LoadSpec, SaveSpec
    from fleetserve.kv_transfer.blocks import chain_keys

    n = num_tokens // BS
    tokens = [(hash(tid) + i) % 49000 for i in range(num_tokens)]
    keys = chain_keys(ctx.fingerprint, tokens, BS, n)
    blocks = list(range(n))
    t0 = time.perf_counter()
    prod.bind_connector_metadata(ConnectorMetadata(saves=[SaveSpec("r", tid, blocks, keys, 600)]))
    prod.start_load_kv()
    prod.half.wait_for_exports(600)
    t1 = time.perf_counter()
    spec = LoadSpec("r", tid, blocks, keys, time.time() + 600,
                    {"remote_tp_size": 1, "remote_engine_id": ctx.engine_id})
    cons.bind_connector_metadata(ConnectorMetadata(loads=[spec]))
    cons.start_load_kv()
    while "r" not in cons.get_finished(set())[1]:
        time.sleep(0.0005)
    t2 = time.perf_counter()
    assert not cons.get_block_ids_with_load_errors(), "a benchmark load failed"
    prod.get_finished(set())
    return t1 - t0, t2 - t1


def raw_file(buf: np.ndarray, tmp: str) -> float:
    path = os.path.join(tmp, "raw.bin")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(memoryview(buf))
    back = np.fromfile(path, dtype=np.uint8)
    dt = time.perf_counter() - t0
    assert back.nbytes == buf.nbytes
    os.unlink(path)
    return dt


class RawGloo:
    """Two gloo ranks (threads of this process) over loopback, the group formed once and kept,
    as the P2P connector keeps its groups between pulls."""

    def __init__(self) -> None:
        import datetime
        import threading

        import torch.distributed as dist

        master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        # One store client per rank, as between two processes (one shared client deadlocks).
        self.stores = [master, dist.TCPStore("127.0.0.1", master.port, is_master=False)]
        self.groups = [None, None]

        def make(rank):
            self.groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("raw", self.stores[rank]), rank, 2,
                                                      datetime.timedelta(seconds=60))

        ts = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        self.tag = 0

    def __call__(self, buf: torch.Tensor, out: torch.Tensor) -> float:
        """One send + recv of `buf`, receive buffer already touched."""
        import threading

        self.tag += 1
        t0 = time.perf_counter()
        sender = threading.Thread(target=lambda: self.groups[0].send([buf], 1, self.tag).wait())
        sender.start()
        self.groups[1].recv([out], 0, self.tag).wait()
        sender.join()
        return time.perf_counter() - t0


def raw_ray(buf: np.ndarray) -> float:
    import ray

    t0 = time.perf_counter()
    back = ray.get(ray.put(buf))
    dt = time.perf_counter() - t0
    assert back.nbytes == buf.nbytes
    return dt


def memcpy(t: torch.Tensor) -> float:
    out = torch.empty_like(t).zero_()  # pages touched first: the caches are warm too
    t0 = time.perf_counter()
    out.copy_(t)
    return time.perf_counter() - t0


def recompute_seconds(num_tokens: int, repeats: int) -> list[float]:
    """The real SmolLM2's prefill of `num_tokens` tokens (TTFT with max_tokens=1)."""
    from fleetserve.replica.llm import LLM
    from fleetserve.scheduler import SamplingParams

    llm = LLM("smollm2-135m", dtype="float32", max_model_len=num_tokens + 16,
              enable_prefix_caching=False, max_num_batched_tokens=num_tokens + 16)
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([list(range(10, 74))], sp, use_tqdm=False)  # warm-up
    times = []
    for r in range(repeats):
        prompt = [(r * 7919 + i) % 49000 + 10 for i in range(num_tokens)]
        t0 = time.perf_counter()
        llm.generate([prompt], sp, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    llm.core.shutdown()
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args()
    sizes = [512, 2048] if args.quick else [512, 2048, 8192, 16384]
    repeats = args.repeats or (2 if args.quick else 3)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    for attempt in range(3):  # a loaded machine may miss Ray's 30 s raylet start-up window
        try:
            # Shared memory touched up front (RAY_preallocate_plasma_memory=1 for `ray start`):
            # else every put into store memory not yet (or no longer) mapped pays its page
            # faults, 40 ms of a 94 MB put on this VM, against 8 ms once the pages are warm.
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                     object_store_memory=3 << 30, _node_ip_address="127.0.0.1",
                     _system_config={"preallocate_plasma_memory": True})
            break
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception here
            print(f"ray.init failed ({e}); retrying", file=sys.stderr)
            ray.shutdown()
            if attempt == 2:
                raise
    kinds = ["SharedStorageConnector", "RayObjectStoreConnector", "P2PConnector"]
    shorts = ("storage", "ray", "p2p")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvbench-") as tmp:
        pairs = {k: make_pair(k, max(sizes) // BS, os.path.join(tmp, k)) for k in kinds}
        for k in kinds:  # warm-up (actor start, first file in each folder), not timed
            hand_off(*pairs[k], 512, f"warmup-{k[:4]}")
        raw_ray(np.zeros(1 << 20, dtype=np.uint8))
        raw_gloo = RawGloo()
        for n in sizes:
            nbytes = n * LAYERS * 2 * HEADS * HEAD_DIM * 4
            data = torch.randn(nbytes // 4)
            buf = data.view(torch.uint8).numpy()
            t = {k: [] for k in ("memcpy", "raw_file", "raw_ray", "raw_gloo",
                                 *[f"{k}_{p}" for k in kinds for p in ("export", "load")])}
            recv = torch.zeros_like(data.view(torch.uint8))
            for r in range(-1, repeats):  # interleaved: every path once per round; round -1 untimed
                if r < 0:  # warm-up at this size: buffers of this size pooled, pages touched
                    memcpy(data), raw_file(buf, tmp), raw_ray(buf), raw_gloo(data.view(torch.uint8), recv)
                    for k in kinds:
                        hand_off(*pairs[k], n, f"warmup-{n}-{k[:4]}")
                    continue
                t["memcpy"].append(memcpy(data))
                t["raw_file"].append(raw_file(buf, tmp))
                t["raw_ray"].append(raw_ray(buf))
                t["raw_gloo"].append(raw_gloo(data.view(torch.uint8), recv))
                for k in kinds:
                    ctx, prod, cons = pairs[k]
                    e, l = hand_off(ctx, prod, cons, n, f"bench-{n}-{r}-{k[:4]}")
                    t[f"{k}_export"].append(e)
                    t[f"{k}_load"].append(l)
            med = {k: statistics.median(v) for k, v in t.items()}
            gbs = lambda s: nbytes / s / 1e9  # noqa: E731
            row = {"tokens": n, "bytes": nbytes, "memcpy_gbs": gbs(med["memcpy"]),
                   "file_raw_gbs": gbs(med["raw_file"]), "ray_raw_gbs": gbs(med["raw_ray"]),
                   "gloo_raw_gbs": gbs(med["raw_gloo"])}
            for k, short in zip(kinds, shorts):
                total = med[f"{k}_export"] + med[f"{k}_load"]
                row[f"{short}_gbs"] = gbs(total)
                row[f"{short}_export_s"] = med[f"{k}_export"]
                row[f"{short}_load_s"] = med[f"{k}_load"]
            row["storage_vs_raw"] = row["storage_gbs"] / row["file_raw_gbs"]
            row["ray_vs_raw"] = row["ray_gbs"] / row["ray_raw_gbs"]
            row["ray_vs_memcpy"] = row["ray_gbs"] / row["memcpy_gbs"]
            row["p2p_vs_raw"] = row["p2p_gbs"] / row["gloo_raw_gbs"]
            rows.append(row)
            print(json.dumps(row), flush=True)
        for _, prod, cons in pairs.values():
            prod.shutdown()
            cons.shutdown()
    ray.shutdown()
    recompute = statistics.median(recompute_seconds(2048, repeats))
    two_k = next(r for r in rows if r["tokens"] == 2048)
    report(rows, recompute, two_k)
    return 0


def report(rows, recompute, two_k) -> None:
    print(f"CPU: {cpu_name()}")
    print("\nGB/s end to end (producer cache -> consumer cache), medians; raw = the transport alone")
    print(f"{'tokens':>7} {'MiB':>6} {'memcpy':>7} {'file':>6} {'storage':>8} {'st/raw':>7} "
          f"{'ray raw':>8} {'ray':>6} {'ray/raw':>8} {'ray/mcpy':>9} {'gloo':>6} {'p2p':>6} {'p2p/raw':>8}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['bytes'] / 2**20:>6.0f} {r['memcpy_gbs']:>7.2f} "
              f"{r['file_raw_gbs']:>6.2f} {r['storage_gbs']:>8.2f} {r['storage_vs_raw']:>7.2f} "
              f"{r['ray_raw_gbs']:>8.2f} {r['ray_gbs']:>6.2f} {r['ray_vs_raw']:>8.2f} "
              f"{r['ray_vs_memcpy']:>9.2f} {r['gloo_raw_gbs']:>6.2f} {r['p2p_gbs']:>6.2f} "
              f"{r['p2p_vs_raw']:>8.2f}")
    print(f"\nload vs recompute, 2048 tokens: prefill {recompute * 1e3:.0f} ms; "
          f"storage load {two_k['storage_load_s'] * 1e3:.1f} ms "
          f"({recompute / two_k['storage_load_s']:.0f}x); ray load {two_k['ray_load_s'] * 1e3:.1f} ms "
          f"({recompute / two_k['ray_load_s']:.0f}x); p2p load {two_k['p2p_load_s'] * 1e3:.1f} ms "
          f"({recompute / two_k['p2p_load_s']:.0f}x)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "kv_transfer.json").write_text(json.dumps(
        {"rows": rows, "recompute_2k_s": recompute}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = [r["tokens"] for r in rows]
    for key, label in (("memcpy_gbs", "memcpy"), ("file_raw_gbs", "file write+read (raw)"),
                       ("storage_gbs", "shared storage connector"), ("ray_raw_gbs", "ray put+get (raw)"),
                       ("ray_gbs", "Ray object store connector"), ("gloo_raw_gbs", "gloo send+recv (raw)"),
                       ("p2p_gbs", "P2P connector (gloo)")):
        a.plot(x, [r[key] for r in rows], marker="o", label=label)
    a.set_xscale("log", base=2)
    a.set_xlabel("prompt tokens (SmolLM2 KV, fp32)")
    a.set_ylabel("GB/s")
    a.set_title(f"KV hand-off throughput ({cpu_name()})", fontsize=9)
    a.legend(fontsize=8)
    names = ["recompute\n(prefill)", "storage\nload", "ray\nload", "p2p\nload"]
    vals = [recompute, two_k["storage_load_s"], two_k["ray_load_s"], two_k["p2p_load_s"]]
    b.barh(names, [v * 1e3 for v in vals])
    b.set_xscale("log")
    b.set_xlabel("ms to make a 2048-token prompt's KV ready")
    b.set_title("load vs recompute")
    fig.tight_layout()
    fig.savefig(RESULTS / "kv_transfer.png", dpi=110)
    print(f"wrote {RESULTS / 'kv_transfer.png'}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
