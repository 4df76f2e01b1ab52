"""What OpenTelemetry tracing costs a served model: `fleetserve serve` with and without
`--otlp-traces-endpoint`, the same load on each.

    python benchmarks/tracing_overhead.py                        # default model (SmolLM2), 1 replica
    python benchmarks/tracing_overhead.py --repeat 2             # off, on, off, on
    python benchmarks/tracing_overhead.py --concurrency 16 --max-tokens 128 --model smollm2-135m
    python benchmarks/tracing_overhead.py --on-args "--collect-detailed-traces"
    python benchmarks/tracing_overhead.py --modes off --rounds 1 --concurrency 2 --max-tokens 16   # smoke

Each block starts `fleetserve serve --num-replicas 1` as a user does (its own process
session; stopped with SIGTERM, anything left of it killed), waits for `/health` to say
`{"status": "ok"}`, warms up with one batch, then runs `--rounds` rounds, each `--concurrency`
streaming `/v1/completions` sent at once (`ignore_eos`, temperature 0, `--max-tokens` each).
Blocks run one after another, never two servers at once (they would share the cores):
off, on, and again `--repeat` times. The "on" server exports to a real OTLP/HTTP receiver in
this process (tests/otlp_receiver.py: what a collector sees); every request carries a W3C
`traceparent` in both modes (the same load), so the spans of each request's trace can be counted.

The prompts of round r are the same in every block and distinct across rounds and from the
warm-up, and every block starts a fresh server: the prefix cache is cold for each round in
both modes, so prefill is measured too.

Per request: TTFT (until the first SSE chunk with text) and end-to-end; per round: output
tokens/s (the streams' `usage`, over the round's wall time). The table gives per mode the
median over its rounds of the round's throughput, TTFT p50/p90 and E2E p50, and on / off.
Writes `benchmarks/results/tracing_overhead.{png,json}` (`--out` for the PNG; the JSON beside it).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import random
import secrets
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(ROOT))

from tests.otlp_receiver import OTLPReceiver  # noqa: E402 - after the checkout is on sys.path

MARKER = "FLEETSERVE_BENCH_MARKER"  # in every process a server starts: what is left after a stop
WORDS = (
    "time person year way day thing man world life hand part child eye woman place work "
    "week case point government company number group problem fact river stone light"
).split()


# -- the load ----------------------------------------------------------------------


def prompts(round_: int, n: int, words: int, seed: int) -> list[str]:
    """Round `round_`'s prompts (-1: the warm-up's): the same in every block."""
    rng = random.Random(f"{seed}-{round_}")
    return [f"Round {round_}, story {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(n)]


@dataclass
class Result:
    ttft_s: float = float("nan")
    e2e_s: float = float("nan")
    tokens: int = 0
    trace_id: str = ""
    error: str = ""


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, traceparent: bool):
    res = Result()
    headers = {}
    if traceparent:
        res.trace_id = secrets.token_hex(16)
        headers["traceparent"] = f"00-{res.trace_id}-{secrets.token_hex(8)}-01"
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0,
    }
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if math.isnan(res.ttft_s) and any(c.get("text") for c in chunk.get("choices") or ()):
                    res.ttft_s = time.perf_counter() - t0  # first chunk with content
                if chunk.get("usage"):
                    res.tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e_s = time.perf_counter() - t0
    if res.tokens == 0:
        res.error = "no usage chunk"
    return res


async def one_round(url: str, model: str, texts: list[str], max_tokens: int, traceparent: bool) -> dict:
    limits = httpx.Limits(max_connections=len(texts) + 4, max_keepalive_connections=len(texts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_request(client, model, t, max_tokens, traceparent) for t in texts))
        wall = time.perf_counter() - t0
    ok = [r for r in results if not r.error]
    return {
        "wall_s": wall,
        "out_tok_s": sum(r.tokens for r in ok) / wall,
        "ttft_p50_ms": 1e3 * pct([r.ttft_s for r in ok], 50),
        "ttft_p90_ms": 1e3 * pct([r.ttft_s for r in ok], 90),
        "e2e_p50_ms": 1e3 * pct([r.e2e_s for r in ok], 50),
        "ok": len(ok),
        "errors": [r.error for r in results if r.error][:3],
        "requests": [asdict(r) for r in results],
    }


def pct(values: list[float], q: float) -> float:
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


# -- the server --------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`fleetserve serve` in a process session of its own, its output in `log`."""

    def __init__(self, flags: list[str], log: Path) -> None:
        self.port, self.grpc_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.marker = uuid.uuid4().hex
        cmd = [sys.executable, "-m", "fleetserve.cluster.cli", "serve", "--port", str(self.port)]
        cmd += ["--grpc-port", str(self.grpc_port), "--num-replicas", "1", *flags]
        self.cmd = cmd
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", MARKER: self.marker}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        self._out = open(log, "w")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True, cwd=tempfile.gettempdir()
        )

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def wait_healthy(self, timeout_s: float) -> str:
        """Seconds until /health says ok; returns the served model's id (/v1/models)."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(base_url=self.url, timeout=5) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"fleetserve serve exited ({self.proc.returncode}); {self.log}:\n{self.tail()}")
                try:
                    r = client.get("/health")
                    if r.status_code == 200 and r.json().get("status") == "ok":
                        models = client.get("/v1/models")
                        if models.status_code == 200:
                            return models.json()["data"][0]["id"]
                except (httpx.HTTPError, ValueError):
                    pass
                time.sleep(0.5)
        raise TimeoutError(f"fleetserve serve not healthy within {timeout_s:.0f} s; {self.log}:\n{self.tail()}")

    def leftovers(self) -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter():
            try:
                if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(MARKER) == self.marker:
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return found

    def stop(self, timeout_s: float = 60) -> float:
        """SIGTERM, as a supervisor stops it; then whatever is left of it killed. Seconds to exit."""
        t0 = time.perf_counter()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                print(f"  fleetserve serve did not stop within {timeout_s:.0f} s of SIGTERM: killed", flush=True)
                self.kill()
        took = time.perf_counter() - t0
        deadline = time.monotonic() + 30  # an engine core notices its parent is gone at its next read
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.5)
        if left:
            print(f"  {len(left)} processes outlived the stop: killed ({[p.pid for p in left]})", flush=True)
            self.kill()
        self._out.close()
        return took

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(30)
        for p in self.leftovers():
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


# -- one block: a server started, warmed, loaded, stopped ---------------------------


def run_block(mode: str, args, rx: OTLPReceiver, log_dir: Path, block: int) -> dict:
    flags = shlex.split(args.serve_args)
    if args.model:
        flags += ["--model", args.model]
    if mode == "on":
        flags += ["--otlp-traces-endpoint", rx.endpoint, *shlex.split(args.on_args)]
    rx.clear()
    server = Server(flags, log_dir / f"serve-{block}-{mode}.log")
    print(f"[{mode}] {shlex.join(server.cmd[1:])}\n  log {server.log}", flush=True)
    try:
        model = server.wait_healthy(args.startup_timeout)
        startup_s = time.perf_counter() - server.t0
        print(f"  healthy after {startup_s:.1f} s; model {model}", flush=True)
        tp = not args.no_traceparent
        warm = asyncio.run(
            one_round(
                server.url, model, prompts(-1, args.concurrency, args.prompt_words, args.seed), args.max_tokens, tp
            )
        )
        if warm["errors"]:
            raise RuntimeError(f"warm-up failed: {warm['errors']}")
        rounds = []
        for r in range(args.rounds):
            texts = prompts(r, args.concurrency, args.prompt_words, args.seed)
            res = asyncio.run(one_round(server.url, model, texts, args.max_tokens, tp))
            rounds.append(res)
            print(
                f"  round {r + 1}: {res['out_tok_s']:7.1f} tok/s  TTFT p50 {res['ttft_p50_ms']:7.1f} ms "
                f"p90 {res['ttft_p90_ms']:7.1f} ms  E2E p50 {res['e2e_p50_ms']:7.1f} ms  "
                f"ok {res['ok']}/{args.concurrency}" + (f"  errors {res['errors']}" if res["errors"] else ""),
                flush=True,
            )
        measured = {r["trace_id"] for res in rounds for r in res["requests"] if r["trace_id"]}
        if mode == "on" and measured:  # let the batching exporter deliver before the stop (it flushes then too)
            try:
                rx.wait_for(lambda s: measured <= {x.trace_id for x in s}, timeout_s=args.span_wait)
            except AssertionError:
                pass
    except BaseException:
        server.kill()
        raise
    stop_s = server.stop()
    spans = rx.spans()
    traced = {s.trace_id for s in spans}
    out = {
        "mode": mode,
        "block": block,
        "startup_s": startup_s,
        "stop_s": stop_s,
        "rounds": rounds,
        "spans": len(spans),
        "export_requests": rx.requests,
        "span_names": dict(collections.Counter(s.name for s in spans)),
        "services": sorted({str(s.service_name) for s in spans}),
        "traces_sent": len(measured),
        "traces_with_spans": len(measured & traced),
    }
    print(
        f"  stopped in {stop_s:.1f} s; receiver: {out['spans']} spans in {out['export_requests']} requests", flush=True
    )
    if mode == "on":
        print(
            f"  {out['traces_with_spans']}/{out['traces_sent']} measured requests' traces arrived; "
            f"spans by name {out['span_names']}",
            flush=True,
        )
    return out


# -- report ------------------------------------------------------------------------

METRICS = (  # key, label, unit
    ("out_tok_s", "throughput", "tok/s"),
    ("ttft_p50_ms", "TTFT p50", "ms"),
    ("ttft_p90_ms", "TTFT p90", "ms"),
    ("e2e_p50_ms", "E2E p50", "ms"),
)


def medians(blocks: list[dict]) -> dict[str, dict[str, float]]:
    """Per mode, per metric: the median over all its rounds (of all its blocks)."""
    med: dict[str, dict[str, float]] = {}
    for mode in ("off", "on"):
        rounds = [r for b in blocks if b["mode"] == mode for r in b["rounds"]]
        if rounds:
            med[mode] = {k: statistics.median(r[k] for r in rounds) for k, _, _ in METRICS}
    return med


def print_table(med: dict[str, dict[str, float]], n_rounds: dict[str, int]) -> None:
    head = f"{'metric':18s}" + "".join(f" {m + f' ({n_rounds[m]})':>14s}" for m in med)
    head += f" {'on / off':>9s}" if len(med) == 2 else ""
    print(head)
    print("-" * len(head))
    for key, label, unit in METRICS:
        line = f"{label + ' (' + unit + ')':18s}" + "".join(f" {med[m][key]:14.1f}" for m in med)
        if len(med) == 2:
            line += f" {med['on'][key] / med['off'][key]:8.3f}x"
        print(line)


def plot(path: Path, blocks: list[dict], med: dict[str, dict[str, float]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(3.2 * len(METRICS), 3.6))
    colors = {"off": "tab:blue", "on": "tab:orange"}
    for ax, (key, label, unit) in zip(axes, METRICS):
        modes = list(med)
        ax.bar(modes, [med[m][key] for m in modes], color=[colors[m] for m in modes], alpha=0.8)
        for i, m in enumerate(modes):  # each round, as a dot over its mode's median bar
            values = [r[key] for b in blocks if b["mode"] == m for r in b["rounds"]]
            ax.plot([i] * len(values), values, "k.", alpha=0.6)
        ratio = f": on/off {med['on'][key] / med['off'][key]:.3f}x" if len(modes) == 2 else ""
        ax.set_title(f"{label}{ratio}", fontsize=9)
        ax.set_ylabel(unit)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} CPUs"
    except OSError:
        pass
    return f"unknown CPU, {os.cpu_count()} CPUs"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="passed to `fleetserve serve --model` (unset: its default, SmolLM2)")
    p.add_argument("--concurrency", type=int, default=8, help="requests sent at once per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds per block (server start)")
    p.add_argument("--repeat", type=int, default=1, help="how many times to run the off and on blocks")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="off,on", help="off, on or both (in this order in each repeat)")
    p.add_argument("--serve-args", default="", help="more `fleetserve serve` flags, for both servers (one string)")
    p.add_argument(
        "--on-args", default="", help="more flags for the tracing server only, e.g. --collect-detailed-traces"
    )
    p.add_argument("--no-traceparent", action="store_true", help="send no traceparent: each request starts a trace")
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument("--span-wait", type=float, default=10, help="seconds to wait for the traces after the load")
    p.add_argument("--out", type=Path, default=RESULTS / "tracing_overhead.png", help="the PNG; the JSON beside it")
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - {"off", "on"}:
        raise SystemExit(f"--modes: off and/or on, not {args.modes!r}")

    log_dir = Path(tempfile.mkdtemp(prefix="fleetserve-tracing-"))
    print(f"{cpu_name()}; logs in {log_dir}", flush=True)
    blocks: list[dict] = []
    failure = None
    with OTLPReceiver() as rx:
        print(f"OTLP receiver at {rx.endpoint}", flush=True)
        try:
            for _ in range(args.repeat):
                for mode in modes:
                    blocks.append(run_block(mode, args, rx, log_dir, len(blocks)))
        except (RuntimeError, TimeoutError) as e:
            failure = e
            print(f"\nblock failed: {e}", file=sys.stderr)

    if not blocks:
        return 1
    med = medians(blocks)
    n_rounds = {m: sum(len(b["rounds"]) for b in blocks if b["mode"] == m) for m in med}
    model = args.model or "the default model"
    what = f"{model}, 1 replica, {args.concurrency} concurrent x {args.max_tokens} tokens"
    print(f"\ntracing off vs on: medians over rounds ({what}); {cpu_name()}")
    print_table(med, n_rounds)
    on = [b for b in blocks if b["mode"] == "on"]
    if on:
        print(
            f"receiver: {sum(b['spans'] for b in on)} spans in {sum(b['export_requests'] for b in on)} export "
            f"requests; {sum(b['traces_with_spans'] for b in on)}/{sum(b['traces_sent'] for b in on)} "
            f"measured requests' traces arrived"
        )
    off_spans = sum(b["spans"] for b in blocks if b["mode"] == "off")
    if off_spans:
        print(f"warning: {off_spans} spans arrived while tracing was off")
    out_json = args.out.with_suffix(".json")
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(
        json.dumps({"cpu": cpu_name(), "args": vars(args), "medians": med, "blocks": blocks}, indent=1, default=str)
    )
    print(f"wrote {out_json}")
    plot(args.out, blocks, med, f"tracing overhead: {what}")
    return 1 if failure else 0


if __name__ == "__main__":
    sys.exit(main())
