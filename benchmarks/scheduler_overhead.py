"""Scheduler overhead: microseconds per step of schedule() + update_from_output().

Traces (benchmarks/_traces.py): 16/128/512/2048 running decode requests, and a
mixed prefill/decode trace with arrivals every step, each with prefix caching
on and off. The same traces run through vLLM's own v1 `Scheduler` when vLLM is
available (in-process if `import vllm` works here, else in a subprocess with
`--vllm-python`; see benchmarks/README.md), and our time is reported as a
ratio of vLLM's. Prints a table and writes a PNG and a JSON under
benchmarks/results/.

    python benchmarks/scheduler_overhead.py [--repeats 5] [--quick] [--no-vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _fleetserve_half import FleetserveAdapter  # noqa: E402
from _traces import run_trace, trace_specs  # noqa: E402

DEFAULT_VLLM_PYTHON = "/opt/vllm-venv/bin/python"


class VllmHalf:
    """vLLM's half: in-process if `import vllm` works, else a long-lived
    subprocess (one trace per request), so traces interleave with ours."""

    def __init__(self, vllm_python):
        self.version, self.reason, self._proc, self._adapter = None, None, None, None
        try:
            import vllm  # noqa: F401

            in_process = True
        except Exception:  # noqa: BLE001 - any import failure means "not here"
            in_process = False
        if in_process:
            import logging

            logging.disable(logging.WARNING)
            from _vllm_half import VllmAdapter, vllm_version

            self.version, self._adapter = vllm_version(), VllmAdapter
            return
        if not vllm_python or not os.path.exists(vllm_python):
            self.reason = "vLLM not installed (see benchmarks/README.md)"
            return
        self._proc = subprocess.Popen(
            [vllm_python, os.path.join(HERE, "_vllm_half.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONPATH": os.path.dirname(HERE), "VLLM_LOGGING_LEVEL": "ERROR"},
        )
        ready = self._read("@@READY@@")
        if ready is None:
            self.reason = f"vLLM not usable with {vllm_python} (import failed)"
            self.close()
        else:
            self.version = ready["version"]

    def _read(self, marker):
        for line in self._proc.stdout:
            if line.startswith(marker):
                return json.loads(line[len(marker) :])
        return None

    def run(self, spec, repeats):
        if self._adapter is not None:
            return run_trace(spec, self._adapter(), repeats)
        self._proc.stdin.write(json.dumps({"spec": spec, "repeats": repeats}) + "\n")
        self._proc.stdin.flush()
        result = self._read("@@RESULT@@")
        if result is None:
            raise RuntimeError(f"vLLM's half died on {spec['name']}")
        return result

    def close(self):
        if self._proc is not None:
            self._proc.stdin.close()
            self._proc.wait(timeout=60)
            self._proc = None


def print_table(rows, vllm_label):
    headers = ["trace", "prefix cache", "running", "fleetserve us/step", f"{vllm_label} us/step", "ratio"]
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="Scheduler overhead: schedule() + update_from_output(), median per step")
        for h in headers:
            table.add_column(h, justify="left" if h == "trace" else "right")
        for r in rows:
            table.add_row(*r)
        Console(width=120).print(table)
    except ImportError:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
        print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


def save_plot(specs, ours, theirs, path, vllm_label):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, caching in zip(axes, (True, False)):
        idx = [i for i, s in enumerate(specs) if s["prefix_caching"] == caching]
        labels = [specs[i]["name"] for i in idx]
        xs = range(len(idx))
        ax.bar([x - 0.2 for x in xs], [ours[i]["us_per_step"] for i in idx], 0.4, label="fleetserve")
        if theirs:
            ax.bar([x + 0.2 for x in xs], [theirs[i]["us_per_step"] for i in idx], 0.4, label=vllm_label)
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, rotation=20)
        ax.set_yscale("log")
        ax.set_title(f"prefix caching {'on' if caching else 'off'}")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("µs per step (median)")
    axes[0].legend()
    fig.suptitle("schedule() + update_from_output() per step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="timed windows per trace (median)")
    ap.add_argument("--quick", action="store_true", help="decode-16/128 and mixed only")
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM baseline")
    default_py = DEFAULT_VLLM_PYTHON if os.path.exists(DEFAULT_VLLM_PYTHON) else None
    ap.add_argument(
        "--vllm-python",
        default=default_py,
        help=f"interpreter with vllm installed (default: {DEFAULT_VLLM_PYTHON} if present)",
    )
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)

    specs = trace_specs()
    if args.quick:
        specs = [s for s in specs if s["name"] in ("decode-16", "decode-128", "mixed")]
    vllm_half = None if args.no_vllm else VllmHalf(args.vllm_python)
    have_vllm = vllm_half is not None and vllm_half.version is not None
    ours, theirs = [], []
    try:
        for spec in specs:  # interleaved, so both halves see the same machine load
            ours.append(run_trace(spec, FleetserveAdapter(), args.repeats))
            if have_vllm:
                theirs.append(vllm_half.run(spec, args.repeats))
    finally:
        if vllm_half is not None:
            vllm_half.close()
    if not have_vllm:
        theirs = "vLLM baseline skipped (--no-vllm)" if vllm_half is None else vllm_half.reason
    version = vllm_half.version if have_vllm else None
    vllm_label = f"vLLM {version}" if have_vllm else "vLLM"

    rows = []
    for i, (spec, o) in enumerate(zip(specs, ours)):
        v = theirs[i]["us_per_step"] if have_vllm else None
        running = str(o["running"])
        if have_vllm and theirs[i]["running"] != o["running"]:
            running += f" (vLLM {theirs[i]['running']})"
        rows.append(
            [
                spec["name"],
                "on" if spec["prefix_caching"] else "off",
                running,
                f"{o['us_per_step']:.0f}",
                f"{v:.0f}" if v else "-",
                f"{o['us_per_step'] / v:.2f}x" if v else "-",
            ]
        )
    if not have_vllm:
        rows.append([theirs, "", "", "", "", ""])
    print_table(rows, vllm_label)

    os.makedirs(args.out, exist_ok=True)
    png = os.path.join(args.out, "scheduler_overhead.png")
    save_plot(specs, ours, theirs if have_vllm else None, png, vllm_label)
    with open(os.path.join(args.out, "scheduler_overhead.json"), "w") as f:
        json.dump(
            {
                "machine": platform.processor() or platform.machine(),
                "repeats": args.repeats,
                "vllm": version,
                "specs": specs,
                "fleetserve": ours,
                "vllm_results": theirs if have_vllm else None,
            },
            f,
            indent=1,
        )
    print(f"plot: {os.path.relpath(png)}")
    if have_vllm:
        at512 = [r for r in rows if r[0] == "decode-512"]
        for r in at512:
            print(f"decode-512 (prefix cache {r[1]}): fleetserve/vLLM = {r[5]} (target <= 0.50x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
