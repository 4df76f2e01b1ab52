"""KV transfer throughput per connector vs its raw transport, and load vs recompute.

SmolLM2-135M's KV shape (30 layers, 3 KV heads, head_dim 64, block size 16, float32:
45 KiB per token), prompts of 512 to 16k tokens. For each size and connector, one
hand-off end to end through the real connector halves (`TransferWorker`): the
producer copies the blocks out of its paged cache and exports them, the consumer
fetches, checks every block (chain key, checksum) and writes them into its own
paged cache. The consumer starts as soon as the producer's engine thread has handed the
export over (as in P/D, where the prefill's reply reaches the decode engine while its
blocks are still being copied out; a streaming transport moves the first chunks then),
so the time is the whole hand-off; `--serial` exports completely first. Against, in the
same run and on the same bytes:

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
write into the cache) of each connector, its export done before it starts (a prompt
whose KV is already stored somewhere).

Medians of `--repeats` interleaved rounds. Prints a table and writes
`benchmarks/results/kv_transfer.{png,json}`.

    python benchmarks/kv_transfer.py                # 512..16k tokens, 3 rounds
    python benchmarks/kv_transfer.py --quick        # 512 and 2k tokens, 2 rounds

`--device cuda` puts both paged caches on the GPU: a hand-off then also copies the blocks
to pinned host memory and back, and the table gains that copy alone (`d2h+h2d`: the same
bytes from device to pinned host and back) as a second baseline. `--connectors storage`
runs one connector (no Ray needed), `--no-recompute` skips the real model's prefill.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(Path(__file__).parent))

from serving import cpu_name  # noqa: E402  (benchmarks/ is not a package)

LAYERS, HEADS, HEAD_DIM, BS = 30, 3, 64, 16
CFG = type(
    "Cfg",
    (),
    dict(
        num_attention_heads=9,
        num_key_value_heads=HEADS,
        hidden_size=576,
        num_hidden_layers=LAYERS,
        vocab_size=49152,
        model_type="llama",
        rope_theta=100000.0,
        head_dim=HEAD_DIM,
    ),
)


def make_pair(kind: str, num_blocks: int, tmp: str, device: str = "cpu", dtype=torch.float32):
    """A producer and a consumer worker half of one connector, each with its own cache."""
    from fleetserve.kv_transfer.base import KVConnectorRole
    from fleetserve.kv_transfer.config import KVTransferConfig
    from fleetserve.kv_transfer.factory import build_context, resolve_connector_class

    extra = (
        {"path": tmp, "max_bytes": 64 << 30}
        if kind == "SharedStorageConnector"
        else {"host": "127.0.0.1"}
        if kind.endswith("P2PConnector")
        else {}
    )
    cls = resolve_connector_class(kind)
    halves = []
    for seed, role in ((0, "kv_producer"), (1, "kv_consumer")):
        cfg = KVTransferConfig(
            kv_connector=kind,
            kv_role=role,
            kv_connector_extra_config=extra,
            kv_load_timeout_s=600,
            engine_id=f"bench-{role}",
        )
        ctx = build_context(cfg, "smollm2-135m", CFG, dtype, BS)
        w = cls(cfg, KVConnectorRole.WORKER, ctx)
        g = torch.Generator().manual_seed(seed)
        w.register_kv_caches(
            [torch.randn((2, HEADS, num_blocks, BS, HEAD_DIM), generator=g).to(device, dtype) for _ in range(LAYERS)]
        )
        # The Ray connector maps the (preallocated) object store at engine start: an engine's
        # steady state, where its puts no longer page-fault. Waited for, so it is not timed.
        wait_mapped = getattr(w.half.transport, "wait_store_mapped", None)
        if wait_mapped is not None:
            print(f"{role}: mapped {(wait_mapped(120) or 0) >> 20} MiB of the object store", file=sys.stderr)
        halves.append(w)
    return halves[0].ctx, halves[0], halves[1]


def block_ids(order: str, n: int, num_blocks: int) -> list[int]:
    """Which cache blocks a hand-off of `n` blocks uses: a fresh cache hands them out in
    ascending order; a warm one in descending runs (a finished request's blocks go back to
    the free queue reversed); "scattered" is a random choice, the worst case."""
    if order == "ascending":
        return list(range(n))
    if order == "descending":
        return list(range(n - 1, -1, -1))
    return random.Random(n).sample(range(num_blocks), n)


def hand_off(
    ctx, prod, cons, num_tokens: int, tid: str, overlap: bool = True, order: str = "descending"
) -> tuple[float, float, float, float]:
    """(export seconds, load seconds, and the seconds the producer's and the consumer's engine
    threads spent in the transfer's `start_load_kv` and `get_finished` calls) of one transfer
    of `num_tokens` tokens. With `overlap` the consumer starts as soon as the producer's
    engine thread handed the export over (as in P/D: the prefill's reply reaches the decode
    engine while its blocks are still being copied out), so "export" is that hand-over and
    "load" the rest; without, the export completes first."""
    from fleetserve.kv_transfer.base import ConnectorMetadata, LoadSpec, SaveSpec
    from fleetserve.kv_transfer.keys import chain_keys

    n = num_tokens // BS
    tokens = [(hash(tid) + i) % 49000 for i in range(num_tokens)]
    keys = chain_keys(ctx.fingerprint, tokens, BS, n)
    blocks = block_ids(order, n, prod.half.kv_caches[0].shape[2])
    t0 = time.perf_counter()
    prod.bind_connector_metadata(ConnectorMetadata(saves=[SaveSpec("r", tid, blocks, keys, 600)]))
    prod.start_load_kv()
    prod_engine = time.perf_counter() - t0
    if not overlap:
        prod.half.wait_for_exports(600)
    t1 = time.perf_counter()
    spec = LoadSpec("r", tid, blocks, keys, time.time() + 600, {"remote_tp_size": 1, "remote_engine_id": ctx.engine_id})
    cons.bind_connector_metadata(ConnectorMetadata(loads=[spec]))
    cons.start_load_kv()
    engine = time.perf_counter() - t1
    while True:
        c0 = time.perf_counter()
        done = "r" in cons.get_finished(set())[1]
        engine += time.perf_counter() - c0
        if done:
            break
        time.sleep(0.0005)
    t2 = time.perf_counter()
    assert not cons.get_block_ids_with_load_errors(), "a benchmark load failed"
    c0 = time.perf_counter()
    prod.get_finished(set())
    if overlap:
        prod_engine += time.perf_counter() - c0
        prod.half.wait_for_exports(600)  # (done by now; not timed)
        c0 = time.perf_counter()
        prod.get_finished(set())
    return t1 - t0, t2 - t1, prod_engine + time.perf_counter() - c0, engine


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
            self.groups[rank] = dist.ProcessGroupGloo(
                dist.PrefixStore("raw", self.stores[rank]), rank, 2, datetime.timedelta(seconds=60)
            )

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


def d2h_h2d(dev: torch.Tensor, host: torch.Tensor) -> float:
    """The bytes of a GPU tensor to pinned host memory and back, synchronised."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    host.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def memcpy(t: torch.Tensor) -> float:
    out = torch.empty_like(t).zero_()  # pages touched first: the caches are warm too
    t0 = time.perf_counter()
    out.copy_(t)
    return time.perf_counter() - t0


def _gbs(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def recompute_seconds(num_tokens: int, repeats: int) -> list[float]:
    """The real SmolLM2's prefill of `num_tokens` tokens (TTFT with max_tokens=1)."""
    from fleetserve.replica.llm import LLM
    from fleetserve.scheduler import SamplingParams

    llm = LLM(
        "smollm2-135m",
        dtype="float32",
        max_model_len=num_tokens + 16,
        enable_prefix_caching=False,
        max_num_batched_tokens=num_tokens + 16,
    )
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


KINDS = {
    "storage": ("SharedStorageConnector", "raw_file", "file write+read (raw)", "shared storage connector"),
    "ray": ("RayObjectStoreConnector", "raw_ray", "ray put+get (raw)", "Ray object store connector"),
    "p2p": ("P2PConnector", "raw_gloo", "gloo send+recv (raw)", "P2P connector (gloo)"),
}


def start_ray():
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    for attempt in range(3):  # a loaded machine may miss Ray's 30 s raylet start-up window
        try:
            # Shared memory touched up front (RAY_preallocate_plasma_memory=1 for `ray start`):
            # else every put into store memory not yet (or no longer) mapped pays its page
            # faults, 40 ms of a 94 MB put on this VM, against 8 ms once the pages are warm.
            ray.init(
                address="local",
                num_cpus=2,
                include_dashboard=False,
                log_to_driver=False,
                object_store_memory=3 << 30,
                _node_ip_address="127.0.0.1",
                _system_config={"preallocate_plasma_memory": True},
            )
            return ray
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception here
            print(f"ray.init failed ({e}); retrying", file=sys.stderr)
            ray.shutdown()
            if attempt == 2:
                raise


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both paged caches live")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--connectors", default="storage,ray,p2p", help="comma list of storage, ray, p2p")
    ap.add_argument("--no-recompute", action="store_true", help="skip the real model's 2k-token prefill")
    ap.add_argument(
        "--block-order",
        default="descending",
        choices=["descending", "ascending", "scattered"],
        help="the cache blocks a hand-off uses: descending runs as a warm engine hands "
        "them out (default), ascending as a fresh one does, or scattered",
    )
    ap.add_argument(
        "--serial",
        action="store_true",
        help="export completely before the consumer starts (the default overlaps them, as P/D does)",
    )
    args = ap.parse_args()
    shorts = [c for c in args.connectors.split(",") if c]
    if not shorts or any(c not in KINDS for c in shorts):
        ap.error(f"--connectors: choose from {', '.join(KINDS)}")
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device visible")
    dtype = getattr(torch, args.dtype)
    sizes = [512, 2048] if args.quick else [512, 2048, 8192, 16384]
    repeats = args.repeats or (2 if args.quick else 3)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    ray = start_ray() if {"ray", "p2p"} & set(shorts) else None
    kinds = [KINDS[c][0] for c in shorts]
    raws = {KINDS[c][1] for c in shorts} | ({"d2h_h2d"} if cuda else set())
    per_token = LAYERS * 2 * HEADS * HEAD_DIM * torch.empty((), dtype=dtype).element_size()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvbench-") as tmp:
        pairs = {k: make_pair(k, max(sizes) // BS, os.path.join(tmp, k), args.device, dtype) for k in kinds}
        for k in kinds:  # warm-up (actor start, first file in each folder), not timed
            hand_off(*pairs[k], 512, f"warmup-{k[:4]}")
        if "raw_ray" in raws:
            raw_ray(np.zeros(1 << 20, dtype=np.uint8))
        raw_gloo = RawGloo() if "raw_gloo" in raws else None
        for n in sizes:
            nbytes = n * per_token
            data = torch.randn(nbytes // 4)
            buf = data.view(torch.uint8).numpy()
            recv = torch.zeros_like(data.view(torch.uint8))
            dev = data.to("cuda") if cuda else None
            pinned = torch.empty(data.shape, dtype=data.dtype, pin_memory=True) if cuda else None
            paths = {
                "memcpy": partial(memcpy, data),
                "raw_file": partial(raw_file, buf, tmp),
                "raw_ray": partial(raw_ray, buf),
                "raw_gloo": None if raw_gloo is None else partial(raw_gloo, data.view(torch.uint8), recv),
                "d2h_h2d": partial(d2h_h2d, dev, pinned),
            }
            paths = {k: f for k, f in paths.items() if f is not None and (k == "memcpy" or k in raws)}
            t: dict[str, list[float]] = {k: [] for k in paths}
            t.update({f"{k}_{p}": [] for k in kinds for p in ("export", "load", "prod_engine", "engine")})
            # Load vs recompute (2048 tokens): the consumer's load alone, its export done first
            # (a prompt whose KV is already stored: no producer copying beside it).
            alone = n == 2048 and not args.serial
            for r in range(-1, repeats):  # interleaved: every path once per round; round -1 untimed
                for name, fn in paths.items():
                    dt = fn()
                    if r >= 0:  # round -1 warms up: buffers of this size pooled, pages touched
                        t[name].append(dt)
                for k in kinds:
                    ctx, prod, cons = pairs[k]
                    e, load_s, pg, g = hand_off(
                        ctx, prod, cons, n, f"bench-{n}-{r}-{k[:4]}", not args.serial, args.block_order
                    )
                    if r >= 0:
                        t[f"{k}_export"].append(e)
                        t[f"{k}_load"].append(load_s)
                        t[f"{k}_prod_engine"].append(pg)
                        t[f"{k}_engine"].append(g)
                    if alone:
                        _, load_s, _, _ = hand_off(
                            ctx, prod, cons, n, f"alone-{n}-{r}-{k[:4]}", False, args.block_order
                        )
                        if r >= 0:
                            t.setdefault(f"{k}_load_alone", []).append(load_s)
            med = {k: statistics.median(v) for k, v in t.items()}
            row = {
                "tokens": n,
                "bytes": nbytes,
                "device": args.device,
                "dtype": args.dtype,
                "block_order": args.block_order,
            }
            for k in paths:
                row[f"{k}_gbs"] = _gbs(nbytes, med[k])
            for c in shorts:
                k, raw = KINDS[c][0], KINDS[c][1]
                total = med[f"{k}_export"] + med[f"{k}_load"]
                row[f"{c}_gbs"] = _gbs(nbytes, total)
                row[f"{c}_export_s"] = med[f"{k}_export"]
                row[f"{c}_load_s"] = med[f"{k}_load"]
                row[f"{c}_load_alone_s"] = med.get(f"{k}_load_alone", med[f"{k}_load"])
                row[f"{c}_engine_thread_s"] = med[f"{k}_engine"]
                row[f"{c}_producer_engine_thread_s"] = med[f"{k}_prod_engine"]
                row[f"{c}_vs_raw"] = row[f"{c}_gbs"] / row[f"{raw}_gbs"]
                if cuda:
                    row[f"{c}_vs_d2h_h2d"] = row[f"{c}_gbs"] / row["d2h_h2d_gbs"]
            if "ray" in shorts:
                row["ray_vs_memcpy"] = row["ray_gbs"] / row["memcpy_gbs"]
            rows.append(row)
            print(json.dumps(row), flush=True)
        for _, prod, cons in pairs.values():
            prod.shutdown()
            cons.shutdown()
    if ray is not None:
        ray.shutdown()
    recompute = None if args.no_recompute else statistics.median(recompute_seconds(2048, repeats))
    two_k = next(r for r in rows if r["tokens"] == 2048)
    report(rows, recompute, two_k, shorts, cuda)
    return 0


def report(rows, recompute, two_k, shorts, cuda) -> None:
    where = f"GPU: {torch.cuda.get_device_name()}, host " if cuda else ""
    print(
        f"{where}CPU: {cpu_name()}; caches {rows[0]['dtype']} on {rows[0]['device']}, "
        f"blocks in {rows[0]['block_order']} order"
    )
    print("\nGB/s end to end (producer cache -> consumer cache), medians; raw = the transport alone")
    cols = [("memcpy", "memcpy_gbs")] + ([("d2h+h2d", "d2h_h2d_gbs")] if cuda else [])
    for c in shorts:
        cols += [(f"{c} raw", f"{KINDS[c][1]}_gbs"), (c, f"{c}_gbs"), (f"{c}/raw", f"{c}_vs_raw")]
        if cuda:
            cols.append((f"{c}/d2h", f"{c}_vs_d2h_h2d"))
    if "ray" in shorts:
        cols.append(("ray/mcpy", "ray_vs_memcpy"))
    print(f"{'tokens':>7} {'MiB':>6} " + " ".join(f"{h:>{max(8, len(h))}}" for h, _ in cols))
    for r in rows:
        print(
            f"{r['tokens']:>7} {r['bytes'] / 2**20:>6.0f} " + " ".join(f"{r[k]:>{max(8, len(h))}.2f}" for h, k in cols)
        )
    loads = ", ".join(
        f"{c} load {two_k[f'{c}_load_alone_s'] * 1e3:.1f} ms"
        + (f" ({recompute / two_k[f'{c}_load_alone_s']:.0f}x)" if recompute else "")
        for c in shorts
    )
    for side, key in (("producer", "producer_engine_thread_s"), ("consumer", "engine_thread_s")):
        print(
            f"{side} engine thread per hand-off (start_load_kv + get_finished calls), ms: "
            + "; ".join(
                f"{r['tokens']} tokens " + ", ".join(f"{c} {r[f'{c}_{key}'] * 1e3:.2f}" for c in shorts) for r in rows
            )
        )
    print(
        "\nload vs recompute, 2048 tokens (the load alone, its export done first): "
        + (f"prefill {recompute * 1e3:.0f} ms; " if recompute else "prefill not run; ")
        + loads
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "kv_transfer.json").write_text(json.dumps({"rows": rows, "recompute_2k_s": recompute}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = [r["tokens"] for r in rows]
    lines = [("memcpy_gbs", "memcpy")] + ([("d2h_h2d_gbs", "GPU -> pinned host -> GPU (raw)")] if cuda else [])
    for c in shorts:
        lines += [(f"{KINDS[c][1]}_gbs", KINDS[c][2]), (f"{c}_gbs", KINDS[c][3])]
    for key, label in lines:
        a.plot(x, [r[key] for r in rows], marker="o", label=label)
    a.set_xscale("log", base=2)
    a.set_xlabel(f"prompt tokens (SmolLM2 KV, {rows[0]['dtype']}, caches on {rows[0]['device']})")
    a.set_ylabel("GB/s")
    a.set_title(f"KV hand-off throughput ({where}{cpu_name()})", fontsize=9)
    a.legend(fontsize=8)
    names = ([] if recompute is None else ["recompute\n(prefill)"]) + [f"{c}\nload" for c in shorts]
    vals = ([] if recompute is None else [recompute]) + [two_k[f"{c}_load_alone_s"] for c in shorts]
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
