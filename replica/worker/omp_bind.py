"""OpenMP's thread count per thread, through ctypes: a KV transfer thread's torch copies run
on one core while the engine's forward keeps its threads."""

from __future__ import annotations

import ctypes
from typing import Callable, Optional


def _omp_set_num_threads() -> Optional[Callable[[int], None]]:
    """OpenMP's omp_set_num_threads as torch loaded it (libgomp, or Intel's/LLVM's), or None."""
    try:
        setter: Callable[[int], None] = ctypes.CDLL(None).omp_set_num_threads
        return setter
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if any(n in line for n in ("libgomp", "libiomp", "libomp"))}
    except OSError:
        return None
    for lib in sorted(libs):
        try:
            setter = ctypes.CDLL(lib).omp_set_num_threads
            return setter
        except (OSError, AttributeError):
            continue
    return None


def one_core_per_thread() -> None:
    """A thread initializer (the KV connector's transfer pools: `set_thread_initializer`): this
    thread's torch ops (gathers, scatters) run on one core, so copies beside a forward or a
    gloo transfer do not oversubscribe the cores the engine's intra-op threads use
    (docs/benchmarks/results/2026-11-29-kv-transfer-zen5.md, "transfer copies on one core").
    OpenMP keeps the thread count per thread; torch.set_num_threads would change the
    process-wide default too."""
    import torch

    torch.get_num_threads()  # torch's own per-thread set-up first: it would undo what follows
    setter = _omp_set_num_threads()
    if setter is not None:
        setter(1)
