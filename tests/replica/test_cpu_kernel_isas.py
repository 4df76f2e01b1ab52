"""Every vector path of the CPU kernels, on whatever machine runs the suite.

`-march=native` compiles only the best path the host has, so an AVX-512 machine never
compiles the AVX2+FMA or scalar code that AVX2-only CPUs (or others) run. Here each path
the host can execute is built for its own `-march` (FLEETSERVE_CPU_MARCH, a cache folder of
its own, ~15 s per build) and the kernel and model tests run against it in a subprocess
(one `torch.ops.fleetserve` library per process). The native build is what every other
test uses.
"""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from fleetserve.replica import kernels

ROOT = Path(__file__).resolve().parents[2]
# -march -> the paths that build must report (cpu_ops.cpp's isa()).
VARIANTS = [("x86-64-v3", "avx2"), ("skylake-avx512", "avx512"), ("x86-64-v2", "scalar")]


def _skip_reason(march: str, expected: str) -> str | None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"x86-64 -march values; this machine is {platform.machine()}"
    if kernels.cpu_ops() is None:
        return f"CPU kernels unavailable: {kernels.unavailable_reason()}"
    if kernels.isa() == expected:
        return f"the native build is the {expected} path (tests/replica/test_cpu_kernels.py runs it)"
    try:
        missing = kernels.missing_cpu_features(march)
    except RuntimeError as e:  # a compiler that does not know this -march (an old GCC, clang)
        return str(e)
    if missing:
        return f"-march={march} needs {', '.join(missing)}, which this CPU lacks"
    return None


@pytest.fixture(scope="module")
def variant_runs(tmp_path_factory):
    """Every runnable variant's build and tests, started together (each build is one compiler
    process: two cores take three of them in ~2/3 of the time one after the other)."""
    out = tmp_path_factory.mktemp("isas")
    runs = {}
    for march, expected in VARIANTS:
        reason = _skip_reason(march, expected)
        if reason is not None:
            runs[march] = reason
            continue
        env = {**os.environ, "FLEETSERVE_CPU_MARCH": march, "FLEETSERVE_EXPECT_CPU_ISA": expected}
        log = open(out / f"{march}.log", "w+")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-x",
                "tests/replica/test_cpu_kernels.py",
                "tests/replica/test_model_vs_hf.py",
                "tests/replica/test_sliding_window.py",
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        runs[march] = (proc, log)
    yield runs
    for run in runs.values():
        if isinstance(run, str):
            continue
        proc, log = run
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.parametrize("march,expected", VARIANTS)
def test_each_fallback_path_the_host_can_run(march, expected, variant_runs):
    run = variant_runs[march]
    if isinstance(run, str):
        pytest.skip(run)
    proc, log = run
    try:
        returncode = proc.wait(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    log.seek(0)
    tail = log.read()[-5000:].strip()
    assert returncode == 0, f"-march={march}:\n{tail}"
    # Nothing skipped: a build that failed would skip every kernel test and still exit 0.
    assert " passed" in tail and "skipped" not in tail, f"-march={march}:\n{tail}"


def test_a_march_the_cpu_cannot_run_is_refused(monkeypatch):
    """Code built for missing features would die with SIGILL: the build is refused instead and
    the model runs its PyTorch ops (kernels unavailable, the reason logged)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"x86-64 -march values; this machine is {platform.machine()}")
    flags = set(kernels._cpu_flags().split())
    if "amx_tile" in flags and "avx512_fp16" in flags:
        pytest.skip("this CPU runs everything -march=sapphirerapids uses")
    try:
        assert kernels.missing_cpu_features("sapphirerapids")
    except RuntimeError as e:  # a compiler that does not know this -march
        pytest.skip(str(e))
    monkeypatch.setenv("FLEETSERVE_CPU_MARCH", "sapphirerapids")
    with pytest.raises(RuntimeError, match="lacks"):
        kernels._build()
    monkeypatch.setenv("FLEETSERVE_CPU_MARCH", "no-such-cpu")
    with pytest.raises(RuntimeError, match="no-such-cpu"):
        kernels.missing_cpu_features(kernels.march())
    monkeypatch.setenv("FLEETSERVE_CPU_MARCH", "x86-64; rm -rf /")
    with pytest.raises(ValueError, match="not a -march value"):
        kernels.march()
