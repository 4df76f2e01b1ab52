"""`fleetserve profile`: time one engine replica's steps and write a calibrated profile.

    fleetserve profile [serve's flags] [--output profile.json] [--grid default|small] [--repeats 3]

It takes `fleetserve serve`'s flags and config (`--config app.yaml`, `--num-replicas`, every
engine flag) and measures ONE engine replica as that command would run it: the same model and
engine args, and the torch threads serve gives a replica (`num_threads`, else the CPUs Ray
reserves for it: with an embedded Ray the replicas split this machine's cores, so
`--num-replicas 2` on 2 cores is 1 thread each; `cluster/deploy.py`, `topology.split_cores`).
The replica's EngineCore is built in this process (no Ray) and stepped over a grid of step
shapes; each step's `StepShape` is taken right after `schedule()` (`sim.shape.step_shape`, the
rule the simulator prices steps by) and its seconds are the wall time of the whole
`EngineCore.step()`: schedule, model forward and sampling, `update_from_output`. That is the
time between one step's start and the next in the engine's busy loop, which the simulator's
replica steps back to back; the scheduler's own CPU time is in it, as the simulator assumes.

The grid (`GRIDS`), after an untimed warm-up (kernels are built on first use):

* prefill: one fresh prompt of each size (chunked when it exceeds max_num_batched_tokens);
* a long shared context built once (its chunks measured once), then prefix-cache hits on it:
  a prompt of `context + n` tokens whose first `context` are cached prefills only `n`;
* decode: batches of B requests whose prompts share a cached context of each length (so a
  long context costs one prefill), stepped `--repeats` times (their first step, a batched
  prefill of the B suffixes, is a sample too);
* mixed: B requests decoding while a fresh prompt of n tokens arrives.

Each point is repeated `--repeats` times (fresh tokens each time; decode and mixed points by
stepping on) and its median goes to `sim.profile.fit_linear`; the profile file records every
point (`fit.grid.points`: shape, median seconds, samples).

KV transfer figures are left empty unless `--kv-transfer storage,ray,p2p` asks for them: then
`benchmarks/kv_transfer.py`'s hand-off (both connector halves in this process, on this host)
is timed for a few sizes and a line through (bytes, seconds) gives each connector's bandwidth
and fixed latency (that needs a source checkout; ray and p2p start a local Ray). Without them
the simulator refuses a transfer by a connector the profile has no figures for.

Tensor parallelism (Ray workers) and P/D's connectors are not measured here: TP > 1 is refused,
and a P/D config profiles the pool named by `--pool` without its connector.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import random
import re
import shlex
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from fleetserve.cluster.cli_engine import add_engine_flags, add_schema_flags

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Grid:
    prefill: tuple[int, ...]  # fresh prompt sizes
    context: int  # the longest shared context (capped by max_model_len and the KV cache)
    hit_contexts: tuple[int, ...]  # cached contexts a prompt hits...
    hit_tokens: tuple[int, ...]  # ...and prefills this many new tokens after
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    suffix: int  # new tokens per decode request after its cached context
    mixed: tuple[tuple[int, int], ...]  # (decoding batch, arriving prompt tokens)
    mixed_context: int

    def describe(self) -> dict[str, Any]:
        return {
            "prefill_tokens": list(self.prefill),
            "context": self.context,
            "hit_contexts": list(self.hit_contexts),
            "hit_tokens": list(self.hit_tokens),
            "decode_batches": list(self.decode_batches),
            "decode_contexts": list(self.decode_contexts),
            "decode_suffix": self.suffix,
            "mixed": [list(m) for m in self.mixed],
            "mixed_context": self.mixed_context,
        }


# "default": about 2-4 minutes for SmolLM2-135M on one AVX2 thread; "small": seconds on a tiny model.
GRIDS: dict[str, Grid] = {
    "default": Grid(
        prefill=(16, 64, 256, 1024),
        context=4096,
        hit_contexts=(1024, 4096),
        hit_tokens=(16, 256),
        decode_batches=(1, 4, 16, 64),
        decode_contexts=(64, 1024, 4096),
        suffix=16,
        mixed=((4, 64), (16, 512)),
        mixed_context=1024,
    ),
    "small": Grid(
        prefill=(16, 48),
        context=128,
        hit_contexts=(64, 128),
        hit_tokens=(8,),
        decode_batches=(1, 4),
        decode_contexts=(16, 128),
        suffix=4,
        mixed=((2, 16),),
        mixed_context=32,
    ),
}

BASE_SALT = "fleetserve-profile-base"


@dataclass
class Point:
    """One grid point: its steps' shapes and seconds (the median goes to the fit)."""

    scenario: str
    kind: str  # prefill, decode or mixed (from the shape)
    shapes: list[Any] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)  # prompts of the step's prefill rows

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    def shape(self):
        """The field-wise median shape of the point's steps (decode contexts grow a little)."""
        from fleetserve.sim.shape import StepShape

        if len(self.shapes) == 1:
            return self.shapes[0]
        vals = {f: statistics.median_low([getattr(s, f) for s in self.shapes]) for f in StepShape.__dataclass_fields__}
        return StepShape(**vals)

    def to_json(self) -> dict[str, Any]:
        s = self.shape()
        return {
            "scenario": self.scenario,
            "kind": self.kind,
            "shape": {f: getattr(s, f) for f in type(s).__dataclass_fields__},
            "prompt_tokens": statistics.median_low(self.prompt_tokens) if self.prompt_tokens else 0,
            "seconds": self.median_s,
            "samples": len(self.seconds),
        }


def _kind(shape) -> str:
    if shape.prefill_tokens and shape.decode_seqs:
        return "mixed"
    return "decode" if shape.decode_seqs else "prefill"


class StepTimer:
    """Steps an EngineCore and records each step's shape and wall seconds under a scenario
    label (none: an untimed warm-up step)."""

    def __init__(self, core) -> None:
        from fleetserve.sim.shape import step_shape

        self.core = core
        self.points: dict[tuple, Point] = {}
        self.scenario: Optional[str] = None
        self._counts: dict[str, int] = {}
        self._shape: Any = None
        self._prompts = 0
        self._seconds = 0.0
        sched = core.scheduler
        schedule = sched.schedule

        def timed_schedule():
            out = schedule()
            self._shape = step_shape(out.num_scheduled_tokens, sched.requests)
            self._prompts = sum(
                sched.requests[rid].num_prompt_tokens
                for rid in out.num_scheduled_tokens
                if not sched.requests[rid].output_token_ids
            )
            return out

        sched.schedule = timed_schedule  # (this instance only: the engine's step is unchanged)

    def begin(self, scenario: Optional[str]) -> None:
        self.scenario = scenario
        self._counts = {}

    def step(self) -> None:
        self._shape = None
        t0 = time.monotonic()
        self.core.step()
        self._seconds = time.monotonic() - t0
        shape = self._shape
        if shape is None or shape.empty or self.scenario is None:
            return
        kind = _kind(shape)
        # Repeats of a scenario step the same way: prefill steps are told apart by their order
        # within the run (a chunked prompt's chunks); decode and mixed steps repeat one point.
        idx = self._counts.get(kind, 0)
        self._counts[kind] = idx + 1
        key = (self.scenario, kind, idx if kind == "prefill" else 0)
        point = self.points.setdefault(key, Point(self.scenario, kind))
        point.shapes.append(shape)
        point.seconds.append(self._seconds)
        point.prompt_tokens.append(self._prompts)

    def run_until_idle(self, limit: int = 100_000) -> None:
        for _ in range(limit):
            if not self.core.has_work():
                return
            self.step()
        raise RuntimeError("the engine did not finish the profile's requests")


class Workload:
    """The grid's scenarios against one engine, scaled to its limits."""

    def __init__(self, core, grid: Grid, repeats: int, seed: int = 0) -> None:
        self.core = core
        self.timer = StepTimer(core)
        self.repeats = repeats
        self.rng = random.Random(seed)
        vocab = int(core.hf_config.vocab_size)
        self.low, self.high = max(3, vocab // 8), vocab - 1  # clear of special tokens
        args = core.args
        bs = args.block_size
        self.block_size = bs
        self.max_seqs = args.max_num_seqs
        capacity = core.scheduler.kv.num_blocks * bs
        self.max_len = core.max_model_len
        self.prefix_caching = args.enable_prefix_caching
        headroom = max(grid.suffix, max(grid.hit_tokens), max(grid.prefill)) + repeats + 2

        def fit(c: int) -> int:  # a cached context: whole blocks, within the model and the cache
            c = min(c, self.max_len - headroom, capacity // 4)
            return max(bs, c // bs * bs)

        context = fit(grid.context)
        if not self.prefix_caching:  # every request computes its context: keep them short
            context = fit(min(grid.context, 4 * grid.suffix, 256))
        self.grid = grid
        self.context = context
        self.hit_contexts = sorted({fit(c) for c in grid.hit_contexts if c <= context} | {context})
        self.decode_contexts = sorted({min(fit(c), context) for c in grid.decode_contexts})
        self.mixed_context = min(fit(grid.mixed_context), context)
        self.batches = sorted({min(b, self.max_seqs) for b in grid.decode_batches})
        self.prefill = sorted({min(n, self.max_len - 2) for n in grid.prefill})
        self.base: list[int] = []

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randint(self.low, self.high) for _ in range(n)]

    def request(self, tokens: list[int], max_tokens: int, salt: Optional[str]):
        from fleetserve.scheduler import Request, SamplingParams

        rid = uuid.uuid4().hex
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.core.add_request(Request(rid, tokens, params, eos_token_id=None, cache_salt=salt))
        return rid

    def scenarios(self) -> list[tuple[str, Callable[[], None]]]:
        """(label, run) in order; the base context is built before the scenarios that hit it."""
        out: list[tuple[str, Callable[[], None]]] = [("warm-up", self.warm_up)]
        for n in self.prefill:
            out.append((f"prefill {n}", functools.partial(self.fresh_prefill, n)))
        out.append((f"context {self.context}", self.build_context))
        if self.prefix_caching:
            for c in self.hit_contexts:
                for n in self.grid.hit_tokens:
                    out.append((f"hit {n} on {c}", functools.partial(self.hit, c, n)))
        for c in self.decode_contexts:
            for b in self.batches:
                out.append((f"decode {b} x {c}", functools.partial(self.decode, b, c)))
        for b, n in self.grid.mixed:
            b = min(b, max(1, self.max_seqs - 1))
            out.append((f"mixed {b} x {self.mixed_context} + {n}", functools.partial(self.mixed, b, n)))
        return out

    # ---- scenarios --------------------------------------------------------------------------
    def warm_up(self) -> None:
        t = self.timer
        t.begin(None)
        n = min(256, self.max_len // 2)
        first = self.tokens(n)
        self.request(first, 2, "warm-up")
        t.run_until_idle()
        self.request(first + self.tokens(8), 2, "warm-up")  # a hit: attention over a context
        for _ in range(min(4, self.max_seqs)):
            self.request(self.tokens(8), 3, "warm-up")
        t.run_until_idle()

    def fresh_prefill(self, n: int) -> None:
        for _ in range(self.repeats):
            self.timer.begin(f"prefill {n}")
            self.request(self.tokens(n), 1, f"prefill-{uuid.uuid4().hex}")
            self.timer.run_until_idle()

    def build_context(self) -> None:
        self.timer.begin(f"context {self.context}")
        self.base = self.tokens(self.context)
        self.request(self.base, 1, BASE_SALT)
        self.timer.run_until_idle()

    def _on_base(self, c: int, n: int) -> list[int]:
        return self.base[:c] + self.tokens(n)

    def _salt(self) -> Optional[str]:
        return BASE_SALT if self.prefix_caching else None

    def hit(self, c: int, n: int) -> None:
        for _ in range(self.repeats):
            self.timer.begin(f"hit {n} on {c}")
            self.request(self._on_base(c, n), 1, BASE_SALT)
            self.timer.run_until_idle()

    def decode(self, b: int, c: int) -> None:
        self.timer.begin(f"decode {b} x {c}")
        for _ in range(b):
            self.request(self._on_base(c, self.grid.suffix), self.repeats + 1, self._salt())
        self.timer.run_until_idle()

    def mixed(self, b: int, n: int) -> None:
        t = self.timer
        t.begin(f"mixed {b} x {self.mixed_context} + {n}")
        running = [
            self.request(self._on_base(self.mixed_context, self.grid.suffix), 10 * (self.repeats + 2), self._salt())
            for _ in range(b)
        ]
        sched = self.core.scheduler

        def decoding() -> bool:
            return all(rid in sched.requests and sched.requests[rid].output_token_ids for rid in running)

        for _ in range(100):  # their prefill (chunked or not) and first token
            if decoding():
                break
            t.step()
        for _ in range(self.repeats):
            arriving = self.request(self.tokens(n), 1, f"mixed-{uuid.uuid4().hex}")
            for _ in range(100):  # the mixed step(s), until the arrival is done
                if arriving not in sched.requests:
                    break
                t.step()
            t.step()  # a decode step in between
        self.core.abort_requests(running)
        t.run_until_idle()


def measure(core, grid: Grid, repeats: int, progress: bool = True) -> tuple[list[Point], Workload]:
    """Run `grid` on `core` (an EngineCore); the measured points in grid order."""
    from tqdm.auto import tqdm

    work = Workload(core, grid, repeats)
    scenarios = work.scenarios()
    bar = tqdm(scenarios, desc="profiling", unit="point", disable=not progress, file=sys.stderr)
    for label, run in bar:
        bar.set_postfix_str(label)
        run()
    bar.close()
    return list(work.timer.points.values()), work


# ---- KV transfer ------------------------------------------------------------------------------
# --kv-transfer's names (benchmarks/kv_transfer.py's) -> the profile's connector names.
KV_CONNECTORS = {"storage": "shared_storage", "ray": "ray_object_store", "p2p": "p2p"}
KV_SIZES = {"default": (256, 1024, 4096), "small": (64, 512)}  # tokens per hand-off


def _kv_benchmark():
    """benchmarks/kv_transfer.py, which a source checkout has (an installed package does not)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "kv_transfer.py"
    if not path.is_file():
        raise ValueError(f"--kv-transfer runs {path}, which only a source checkout of fleetserve has")
    spec = importlib.util.spec_from_file_location("fleetserve_profile_kv_transfer", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def measure_kv_transfer(connectors: Sequence[str], sizes: Sequence[int], repeats: int) -> dict[str, dict[str, Any]]:
    """Bandwidth and fixed latency of each connector (`KV_CONNECTORS`' keys) on this machine:
    benchmarks/kv_transfer.py's hand-off (the producer half exports a paged cache's blocks, the
    consumer half loads and checks them into its own; both halves in this process) of `sizes`
    tokens, the median of `repeats` each, and a least-squares line through (bytes, seconds)."""
    import tempfile

    import numpy as np

    bench = _kv_benchmark()
    per_token = bench.LAYERS * 2 * bench.HEADS * bench.HEAD_DIM * 4  # the benchmark's float32 caches
    ray = bench.start_ray() if {"ray", "p2p"} & set(connectors) else None
    out: dict[str, dict[str, Any]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="fleetserve-profile-kv-") as tmp:
            for short in connectors:
                kind = bench.KINDS[short][0]
                ctx, prod, cons = bench.make_pair(kind, max(sizes) // bench.BS, os.path.join(tmp, short))
                try:
                    bench.hand_off(ctx, prod, cons, min(sizes), f"warm-up-{short}")  # not timed
                    xs, ys = [], []
                    for n in sizes:
                        runs = [
                            sum(bench.hand_off(ctx, prod, cons, n, f"profile-{short}-{n}-{r}")[:2])
                            for r in range(repeats)
                        ]
                        xs.append(float(n * per_token))
                        ys.append(statistics.median(runs))
                finally:
                    prod.shutdown()
                    cons.shutdown()
                slope, intercept = (float(v) for v in np.polyfit(xs, ys, 1))
                if slope <= 0:
                    raise ValueError(f"--kv-transfer {short}: hand-off times {ys} s do not grow with size {xs} B")
                out[KV_CONNECTORS[short]] = {
                    "bandwidth_bytes_s": 1.0 / slope,
                    "latency_s": max(0.0, intercept),
                    "source": (
                        f"measured by fleetserve profile --kv-transfer: benchmarks/kv_transfer.py hand-offs "
                        f"(export + load, both connector halves in one process on this host, SmolLM2-135M's KV "
                        f"layout in float32) of {', '.join(str(n) for n in sizes)} tokens "
                        f"({', '.join(f'{x / 2**20:.1f}' for x in xs)} MiB), median of {repeats}: "
                        f"{', '.join(f'{y * 1e3:.2f}' for y in ys)} ms; least-squares line"
                    ),
                }
    finally:
        if ray is not None:
            ray.shutdown()
    return out


# ---- the command -----------------------------------------------------------------------------
def add_profile_parser(sub) -> None:
    from fleetserve.cluster import cli
    from fleetserve.cluster.config import AppConfig

    p = sub.add_parser(
        "profile",
        help="time one engine replica's steps on this machine and write a calibrated profile for `fleetserve sim`",
        description="Run one engine replica in this process, as `fleetserve serve` with the same "
        "flags would run it (model, engine args, torch threads per replica), over a grid of "
        "prefill, decode, mixed and prefix-hit steps; fit the simulator's linear step cost to "
        "the medians and write the profile JSON.",
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("model_tag", nargs="?", help="the model (same as --model)")
    p.add_argument("--config", help="application YAML, as `fleetserve serve --config` [default: unset]")
    g = p.add_argument_group("profile")
    g.add_argument("--output", "-o", default="profile.json", help="where to write the profile [default: profile.json]")
    g.add_argument(
        "--grid",
        choices=sorted(GRIDS),
        default="default",
        help="the step grid: default (minutes on a 135M model, one thread) or small (seconds, "
        "for tests) [default: default]",
    )
    g.add_argument("--quick", action="store_const", dest="grid", const="small", help="same as --grid small")
    g.add_argument("--repeats", type=_positive, default=3, help="samples per grid point (their median) [default: 3]")
    g.add_argument("--profile-name", default=None, help="the profile's name [default: <hardware>-<model>-<threads>t]")
    g.add_argument(
        "--pool",
        choices=("prefill", "decode"),
        default="decode",
        help="with --pd: which pool's replica to profile [default: decode]",
    )
    g.add_argument(
        "--kv-transfer",
        default="",
        metavar="CONNECTORS",
        help="also measure KV transfer by these connectors, a comma list of storage, ray, p2p "
        "(benchmarks/kv_transfer.py's hand-off on this host; needs a source checkout) "
        "[default: none: the profile has no kv_transfer figures]",
    )
    g.add_argument("--no-progress", action="store_true", default=False, help="no progress bar")
    add_engine_flags(p)
    add_schema_flags(p.add_argument_group("application"), AppConfig, skip=cli.APP_SKIP)
    p.set_defaults(func=cmd_profile)


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def replica_engine(config) -> tuple[Any, int]:
    """The EngineArgs one replica of `config` runs with (its torch threads set as serve sets
    them) and that thread count."""
    from fleetserve.cluster.topology import split_cores

    config = split_cores(config)  # an embedded Ray's replicas split this machine's cores
    return _with_threads(config.engine, config.cpus_per_replica)


def _with_threads(engine, cpus: float):
    threads = engine.num_threads or max(1, int(cpus))
    # (serve's replicas also get the router's KV events and cluster reuse's connector: neither
    # is in the model's step.)
    return engine.model_copy(update={"num_threads": threads, "kv_transfer_config": None}), threads


def pool_engine(config, pool: str):
    from fleetserve.cluster.topology import split_cores

    config = split_cores(config)
    p = getattr(config.pd, pool)
    cpus = config.cpus_per_replica if p.num_cpus_per_replica is None else p.num_cpus_per_replica
    return _with_threads(config.pool_engine(pool), cpus)


def cpu_hardware() -> tuple[str, str, str]:
    """(CPU model name, ISA class, short name): the name from /proc/cpuinfo, the ISA the
    engine's CPU kernels were built for (`replica.kernels.isa()`, what sets the step times)."""
    import platform

    from fleetserve.replica.kernels import isa as kernel_isa

    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    name = name or platform.processor() or platform.machine() or "cpu"
    isa = {"avx512_bf16": "AVX-512+bf16", "avx512": "AVX-512", "avx2": "AVX2"}.get(kernel_isa() or "", "")
    words = [
        w for w in re.sub(r"\((R|TM|tm|r)\)", "", name).split() if w.isalpha() and w.lower() not in ("cpu", "processor")
    ]
    short = "-".join(["cpu", *(w.lower() for w in words[:2]), *([isa.lower().replace("+", "-")] if isa else [])])
    return name, isa, short


def _worker(core):
    """The replica's one worker (TP=1: in this process)."""
    from fleetserve.replica.executor.uniproc import UniProcExecutor

    assert isinstance(core.executor, UniProcExecutor)
    return core.executor.worker


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower().rsplit("/", 1)[-1]).strip("-") or "model"


def model_shape(core) -> dict[str, Any]:
    cfg = core.hf_config
    heads = int(cfg.num_attention_heads)
    hidden = int(cfg.hidden_size)
    model = _worker(core).runner.model
    seen: set[int] = set()
    params = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            params += p.numel()
    return {
        "num_layers": int(cfg.num_hidden_layers),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_kv_heads": int(getattr(cfg, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(cfg, "head_dim", None) or hidden // heads),
        "intermediate_size": int(cfg.intermediate_size),
        "vocab_size": int(cfg.vocab_size),
        "num_params": float(params),
        "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
    }


def _command_line(args: argparse.Namespace) -> str:
    argv = sys.argv
    if "profile" in argv:
        return "fleetserve " + shlex.join(argv[argv.index("profile") :])
    given = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    parts = ["fleetserve", "profile"]
    for k, v in given.items():
        parts.append(f"--{k.replace('_', '-')}={v}")
    return shlex.join(parts)


def format_table(points: Sequence[Point], predict: Callable[[Any], float]) -> str:
    head = (
        f"{'point':<24} {'kind':<7} {'n':>2} {'prefill':>7} {'seqs':>4} {'attn':>10} "
        f"{'decode':>6} {'ctx':>7} {'ms':>9} {'fit ms':>9} {'err':>6}"
    )
    lines = [head, "-" * len(head)]
    for p in points:
        s = p.shape()
        t = p.median_s
        f = predict(s)
        lines.append(
            f"{p.scenario:<24} {p.kind:<7} {len(p.seconds):>2} {s.prefill_tokens:>7} {s.prefill_seqs:>4} "
            f"{s.prefill_attn_tokens:>10.0f} {s.decode_seqs:>6} {s.decode_context_tokens:>7} "
            f"{t * 1e3:>9.2f} {f * 1e3:>9.2f} {abs(f - t) / t:>6.1%}"
        )
    return "\n".join(lines)


def cmd_profile(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from fleetserve.cluster.cli import config_from_args
    from fleetserve.replica.model_loader.registry import ModelNotFoundError

    def fail(msg: str) -> int:
        print(f"fleetserve profile: {msg}", file=sys.stderr)
        return 2

    try:
        config = config_from_args(args)
    except (ValidationError, ValueError, OSError) as e:
        return fail(f"invalid configuration:\n{e}")
    grid_name = getattr(args, "grid", "default")
    repeats = getattr(args, "repeats", 3)
    try:
        if config.pd.enabled:
            engine, threads = pool_engine(config, getattr(args, "pool", "decode"))
        else:
            engine, threads = replica_engine(config)
    except (ValidationError, ValueError) as e:
        return fail(f"invalid configuration:\n{e}")
    if engine.tensor_parallel_size > 1:
        return fail(
            f"tensor_parallel_size={engine.tensor_parallel_size}: profile measures a replica in this "
            "process, which needs tensor_parallel_size 1 (TP ranks run as Ray workers)"
        )
    from fleetserve.cluster.topology import check_model

    try:
        check_model(config)  # metadata only
    except (ModelNotFoundError, ValueError) as e:
        return fail(str(e))
    output = getattr(args, "output", "profile.json")
    out_dir = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(out_dir):
        return fail(f"--output {output}: folder {out_dir} does not exist")
    command_line = _command_line(args)
    kv_connectors = [c.strip() for c in getattr(args, "kv_transfer", "").split(",") if c.strip()]
    unknown = [c for c in kv_connectors if c not in KV_CONNECTORS]
    if unknown:
        return fail(f"--kv-transfer {','.join(unknown)}: choose from {', '.join(KV_CONNECTORS)}")

    from fleetserve.replica.engine.engine_core import EngineCore

    started = time.monotonic()
    try:
        core = EngineCore(engine, None)
    except (ModelNotFoundError, ValueError, OSError) as e:
        return fail(f"cannot start the engine: {e}")
    loaded = time.monotonic()
    try:
        points, work = measure(core, GRIDS[grid_name], repeats, progress=not getattr(args, "no_progress", False))
        worker = _worker(core)
        dtype = str(worker.dtype).removeprefix("torch.")
        device = worker.device
        shape = model_shape(core)
        kv_blocks = core.scheduler.kv.num_blocks
        itemsize = worker.dtype.itemsize
    finally:
        core.shutdown()
    measured = time.monotonic()
    kv_transfer: dict[str, dict[str, Any]] = {}
    if kv_connectors:
        try:
            kv_transfer = measure_kv_transfer(kv_connectors, KV_SIZES[grid_name], repeats)
        except ValueError as e:
            return fail(str(e))

    from fleetserve.sim.profile import ProfileError, calibrated_profile

    if device.type == "cuda":
        import torch

        hardware, short = torch.cuda.get_device_name(device), "gpu-" + _slug(torch.cuda.get_device_name(device))
    else:
        cpu, isa, short = cpu_hardware()
        hardware = f"{cpu}, {isa or 'unknown ISA'}, {threads} thread{'s' if threads != 1 else ''}"
    name = getattr(args, "profile_name", None) or f"{short}-{_slug(engine.model)}-{threads}t"
    samples = [(p.shape(), p.median_s) for p in points]
    grid_info = {
        "name": grid_name,
        "repeats": repeats,
        **work.grid.describe(),
        "used": {
            "context": work.context,
            "hit_contexts": work.hit_contexts,
            "decode_contexts": work.decode_contexts,
            "decode_batches": work.batches,
            "prefill_tokens": work.prefill,
        },
        "points": [p.to_json() for p in points],
    }
    try:
        kv_bytes = 2 * shape["num_layers"] * shape["num_kv_heads"] * shape["head_dim"] * itemsize
        profile = calibrated_profile(
            samples,
            name=name,
            hardware=hardware,
            model=engine.model,
            model_shape=shape,
            dtype=dtype,
            tensor_parallel_size=engine.tensor_parallel_size,
            threads=threads if device.type == "cpu" else None,
            source=command_line,
            kv_transfer=kv_transfer,
            grid=grid_info,
            kv_cache_memory_bytes=kv_blocks * engine.block_size * kv_bytes,
        )
    except ProfileError as e:
        return fail(f"the fit failed: {e}")
    profile.save(output)
    cost = profile.cost_model()
    fit = profile.fit
    assert fit is not None
    print(format_table(points, cost.step_seconds))
    print(
        f"\n{name}: {hardware}; {engine.model} {dtype}, TP {engine.tensor_parallel_size}\n"
        f"fit over {fit.samples} points: median error {fit.median_rel_error:.1%}, "
        f"p90 {fit.p90_rel_error:.1%}, max {fit.max_rel_error:.1%}\n"
        f"step = {_formula(profile.step)}\n"
        f"kv_transfer: {_links(kv_transfer)}\n"
        f"load {loaded - started:.1f} s, measuring steps {measured - loaded:.1f} s"
        f"{f', KV transfer {time.monotonic() - measured:.1f} s' if kv_transfer else ''}; wrote {output}"
    )
    return 0


def _links(kv_transfer: dict[str, dict[str, Any]]) -> str:
    if not kv_transfer:
        return "none measured (--kv-transfer storage,ray,p2p measures them)"
    return ", ".join(
        f"{k} {v['bandwidth_bytes_s'] / 1e9:.2f} GB/s + {v['latency_s'] * 1e3:.2f} ms" for k, v in kv_transfer.items()
    )


def _formula(step) -> str:
    return (
        f"{step.overhead_s * 1e3:.3g} ms + {step.per_prefill_token_s * 1e3:.3g} ms/prefill token"
        f" + {step.per_prefill_attn_token_s * 1e9:.3g} ns/attn token"
        f" + {step.per_prefill_seq_s * 1e3:.3g} ms/prefill seq"
        f" + {step.per_decode_seq_s * 1e3:.3g} ms/decode seq + {step.per_decode_context_token_s * 1e6:.3g} us/ctx token"
    )


__all__ = ["GRIDS", "Grid", "add_profile_parser", "cmd_profile", "measure"]
