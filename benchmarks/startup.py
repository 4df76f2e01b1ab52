"""How long fleetserve takes to start, against another commit when asked.

    python benchmarks/startup.py                        # this checkout
    python benchmarks/startup.py --baseline da3a704     # and da3a704's, alternated
    python benchmarks/startup.py --cases engine,core    # without `fleetserve serve`

Cases, each in fresh processes:
- `engine`: `AsyncEngine` on a tiny random Llama (replica.testing), its EngineCore in a
  process of its own as in every Serve replica: import + construction until it can serve.
  What most of the test suite's app start-ups repeat.
- `core`: `EngineCore` of the default model (SmolLM2 GGUF) in this process, 1 thread, the
  default 1 GiB KV cache: what an engine replica's core process does before it serves.
- `serve`: `fleetserve serve` (default model, embedded Ray, 2 replicas) from launch until it
  logs "ready"; then SIGINT.

The baseline is a git worktree of `--baseline`, run with PYTHONPATH pointing at it (its
kernels build in their own hash-keyed cache folder on first use: a warm-up run of each
checkout comes first). Rounds alternate the checkouts; the table gives medians over rounds
and the ratio baseline / this. Writes `benchmarks/results/startup.{json,png}`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _vs_baseline import grouped_bars, print_table  # benchmarks/: this script's folder, first on sys.path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
CASES = ("engine", "core", "serve")

ENGINE = """
import sys, time
t0 = time.perf_counter()
from fleetserve.replica.engine.async_engine import AsyncEngine
engine = AsyncEngine(model=sys.argv[1], max_model_len=2048, num_gpu_blocks_override=160, max_num_seqs=8,
                     num_threads=1)
print("SECONDS", time.perf_counter() - t0, "torch" in sys.modules)
engine.shutdown()
"""

CORE = """
import time
t0 = time.perf_counter()
from fleetserve.replica.engine.engine_args import EngineArgs
from fleetserve.replica.engine.engine_core import EngineCore
core = EngineCore(EngineArgs(model="smollm2-135m", num_threads=1), 2)
print("SECONDS", time.perf_counter() - t0)
core.shutdown()
"""


def _env(checkout: str | None) -> dict:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if checkout:
        env["PYTHONPATH"] = checkout
    return env


def _seconds(code: str, checkout: str | None, *argv: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(checkout),
        cwd=tempfile.gettempdir(),
    )
    for line in out.stdout.splitlines():
        if line.startswith("SECONDS"):
            return float(line.split()[1])
    raise RuntimeError(f"no timing from {checkout or 'this checkout'}:\n{out.stderr[-3000:]}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_seconds(checkout: str | None, log_dir: Path) -> float:
    port, grpc = _free_port(), _free_port()
    log = log_dir / f"serve-{int(time.time() * 1000)}.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from fleetserve.cluster.cli import main; raise SystemExit(main())",
                "serve",
                "--port",
                str(port),
                "--grpc-port",
                str(grpc),
            ],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=_env(checkout),
            cwd=tempfile.gettempdir(),
        )
    try:
        deadline = t0 + 300
        while "ready; Ctrl-C" not in log.read_text():
            if proc.poll() is not None or time.perf_counter() > deadline:
                raise RuntimeError(f"fleetserve serve did not get ready; see {log}")
            time.sleep(0.1)
        return time.perf_counter() - t0
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--baseline", help="a git ref to time as well (from a git worktree of it)")
    args = p.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    if unknown := set(cases) - set(CASES):
        raise SystemExit(f"unknown cases {sorted(unknown)}; choose from {', '.join(CASES)}")

    tmp = Path(tempfile.mkdtemp(prefix="fleetserve-startup-"))
    checkouts: dict[str, str | None] = {"this": None}
    if args.baseline:
        tree = tmp / "baseline"
        out = subprocess.run(
            ["git", "worktree", "add", "--detach", str(tree), args.baseline], cwd=ROOT, capture_output=True, text=True
        )
        if out.returncode:
            raise SystemExit(f"--baseline {args.baseline}: {out.stderr.strip()}")
        checkouts[args.baseline] = str(tree)
    try:
        sys.path.insert(0, str(ROOT))
        from fleetserve.replica.testing import make_tiny_llama

        tiny = str(make_tiny_llama(tmp / "tiny-llama"))
        for checkout in checkouts.values():  # warm-up: kernel builds, tokenizer cache
            _seconds(ENGINE, checkout, tiny)
            if "core" in cases or "serve" in cases:
                _seconds(CORE, checkout)
        times: dict[str, dict[str, list[float]]] = {k: {c: [] for c in cases} for k in checkouts}
        for r in range(args.rounds):
            for name, checkout in checkouts.items() if r % 2 == 0 else reversed(checkouts.items()):
                for case in cases:
                    if case == "engine":
                        t = _seconds(ENGINE, checkout, tiny)
                    elif case == "core":
                        t = _seconds(CORE, checkout)
                    else:
                        t = _serve_seconds(checkout, tmp)
                    times[name][case].append(t)
                    print(f"round {r + 1} {name:>10s} {case:6s} {t:6.2f} s", flush=True)
    finally:
        if args.baseline:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(tmp / "baseline")], cwd=ROOT, capture_output=True
            )
    med = {k: {c: statistics.median(times[k][c]) for c in cases} for k in checkouts}
    cpu = (
        next(
            (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
            "unknown CPU",
        )
        if os.path.exists("/proc/cpuinfo")
        else "unknown CPU"
    )
    print(f"\nstart-up, seconds (median of {args.rounds} alternated rounds); {cpu}, {os.cpu_count()} CPUs")
    print_table(med, cases, args.baseline, case_width=8, digits=2)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "startup.json").write_text(
        json.dumps({"cpu": cpu, "baseline": args.baseline, "seconds": times}, indent=2)
    )
    grouped_bars(
        RESULTS / "startup.png", {k: med[k] for k in checkouts}, cases, "seconds to ready", "fleetserve start-up"
    )


if __name__ == "__main__":
    main()
