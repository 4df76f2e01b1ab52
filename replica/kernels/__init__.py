"""Fused CPU kernels (`cpu_ops.cpp`), built on first use and cached per machine.

    ops = cpu_ops()          # torch.ops.fleetserve, or None when they cannot be used
    if ops is not None and x.is_cpu: y = ops.rms_norm(x, w, eps)

The source is compiled with the machine's C++ compiler (`-O3 -march=native`,
through `torch.utils.cpp_extension`, which needs `ninja`) into
`~/.cache/fleetserve/kernels/<hash>/`, the hash covering the source, torch's
version and the CPU's flags, so a build is reused by every later process on
the same machine (Ray workers included) and never by another kind of CPU.
The first build takes a while (docs/deployment/cpu.md); concurrent first uses wait on one build.

`FLEETSERVE_CPU_MARCH` compiles for another `-march` than `native` (e.g.
`x86-64-v3`: AVX2+FMA, no AVX-512; `x86-64-v2`: the scalar loops): a build to
copy to other machines, or the tests of each fallback on a machine that has
more (tests/replica/test_cpu_kernel_isas.py). `isa()` says which paths the
loaded build has.

When no compiler is there, the build fails, or `FLEETSERVE_CPU_KERNELS=0` is
set, `cpu_ops()` returns None (logging why, once) and the model runs its
plain PyTorch ops instead: same results within rounding, slower. GPU tensors
always take the PyTorch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
_lock = threading.Lock()
_state: dict[str, Any] = {"tried": False, "ops": None, "error": None}


def enabled_by_env() -> bool:
    return os.environ.get("FLEETSERVE_CPU_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def march() -> str:
    """The -march the kernels are built for: FLEETSERVE_CPU_MARCH, else native."""
    value = os.environ.get("FLEETSERVE_CPU_MARCH", "").strip() or "native"
    if not all(c.isalnum() or c in "-_." for c in value):
        raise ValueError(f"FLEETSERVE_CPU_MARCH={value!r} is not a -march value (e.g. native, x86-64-v3)")
    return value


# Compiler macros a -march turns on -> the /proc/cpuinfo flag the CPU needs for them.
_MACRO_FLAGS = {
    "__SSE4_2__": "sse4_2",
    "__AVX__": "avx",
    "__AVX2__": "avx2",
    "__FMA__": "fma",
    "__F16C__": "f16c",
    "__BMI2__": "bmi2",
    "__AVX512F__": "avx512f",
    "__AVX512BW__": "avx512bw",
    "__AVX512CD__": "avx512cd",
    "__AVX512DQ__": "avx512dq",
    "__AVX512VL__": "avx512vl",
    "__AVX512BF16__": "avx512_bf16",
    "__AVX512VNNI__": "avx512_vnni",
    "__AVX512FP16__": "avx512_fp16",
    "__AVX512VBMI__": "avx512vbmi",
    "__AVX512VBMI2__": "avx512_vbmi2",
    "__AVX512IFMA__": "avx512ifma",
    "__AVX512BITALG__": "avx512_bitalg",
    "__AVX512VPOPCNTDQ__": "avx512_vpopcntdq",
    "__AVXVNNI__": "avx_vnni",
    "__AMX_TILE__": "amx_tile",
}


def missing_cpu_features(march_value: str) -> list[str]:
    """The CPU features code built with -march=`march_value` would use and this CPU lacks
    (empty: it runs here). Asks the compiler which ISA macros that -march defines."""
    import shutil
    import subprocess

    if march_value == "native":
        return []
    cxx = os.environ.get("CXX") or shutil.which("c++") or "c++"
    done = subprocess.run(
        [cxx, f"-march={march_value}", "-dM", "-E", "-x", "c++", os.devnull], capture_output=True, text=True, timeout=60
    )
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        errors = [line for line in lines if "error" in line] or lines
        raise RuntimeError(f"FLEETSERVE_CPU_MARCH={march_value}: {errors[0]}")
    have = set(_cpu_flags().split())
    macros = {line.split()[1] for line in done.stdout.splitlines() if line.startswith("#define ")}
    return sorted(flag for macro, flag in _MACRO_FLAGS.items() if macro in macros and flag not in have)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def build_dir() -> Path:
    digest = hashlib.sha256()
    digest.update(SOURCE.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(_cpu_flags().encode())
    digest.update(march().encode())
    root = Path(os.environ.get("FLEETSERVE_CACHE_DIR", Path.home() / ".cache" / "fleetserve"))
    return root / "kernels" / digest.hexdigest()[:16]


def _build() -> Any:
    from torch.utils.cpp_extension import load

    out = build_dir()
    missing = missing_cpu_features(march())
    if missing:  # its code would stop the process with SIGILL on the first such instruction
        raise RuntimeError(
            f"FLEETSERVE_CPU_MARCH={march()} needs CPU features this machine lacks: {', '.join(missing)}"
        )
    out.mkdir(parents=True, exist_ok=True)
    name = "fleetserve_cpu_ops"
    if not (out / f"{name}.so").exists():
        logger.info("building fleetserve CPU kernels in %s (once per machine, ~20-40 s)", out)
    # Build from a copy inside the cache folder: ninja's build file names its sources, and a
    # checkout's own path there made every other checkout of the same source rebuild it.
    source = out / SOURCE.name
    if not source.exists() or source.read_bytes() != SOURCE.read_bytes():
        tmp = out / f".{SOURCE.name}.{os.getpid()}"
        tmp.write_bytes(SOURCE.read_bytes())
        os.replace(tmp, source)
    # Always through load(): it holds a lock file in the build directory, so processes starting
    # together (Ray replicas, TP workers) wait for one build instead of loading a half-written
    # library; when the library is up to date it only loads it.
    load(
        name=name,
        sources=[str(source)],
        build_directory=str(out),
        is_python_module=False,
        extra_cflags=["-O3", f"-march={march()}", "-fopenmp", "-ffp-contract=off"],
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )
    return torch.ops.fleetserve


def cpu_ops() -> Optional[Any]:
    """torch.ops.fleetserve with the kernels loaded, or None (disabled, or the build failed)."""
    if _state["tried"]:
        return _state["ops"]
    with _lock:
        if _state["tried"]:
            return _state["ops"]
        ops = None
        if not enabled_by_env():
            _state["error"] = "disabled by FLEETSERVE_CPU_KERNELS"
        else:
            try:
                ops = _build()
                logger.info("fleetserve CPU kernels: %s paths (-march=%s)", ops.isa(), march())
            except Exception as e:  # no compiler, no ninja, a build error: fall back, say why once
                _state["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e}"
                logger.warning("fleetserve CPU kernels unavailable (%s); using plain PyTorch ops", _state["error"])
        _state["ops"] = ops
        _state["tried"] = True
        return ops


def isa() -> Optional[str]:
    """The vector paths of the loaded kernels ("avx512_bf16", "avx512", "avx2", "scalar"), or None."""
    ops = cpu_ops()
    return None if ops is None else str(ops.isa())


def unavailable_reason() -> Optional[str]:
    cpu_ops()
    return _state["error"]


_SUPPORTED = (torch.float32, torch.bfloat16)
_override: dict[str, bool] = {}


def ops_for(t: torch.Tensor) -> Optional[Any]:
    """The kernels when they apply to tensor `t` (CPU, float32/bfloat16), else None."""
    if _override.get("off") or t.device.type != "cpu" or t.dtype not in _SUPPORTED:
        return None
    return cpu_ops()


class disabled:
    """`with disabled():` runs the plain PyTorch ops in this process (tests compare both paths)."""

    def __enter__(self):
        self._prev = _override.get("off", False)
        _override["off"] = True
        return self

    def __exit__(self, *exc):
        _override["off"] = self._prev
        return False
