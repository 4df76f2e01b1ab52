"""Hand the C heap's free pages back to the OS every so often (glibc `malloc_trim`).

A step's activations are sized by its token count, which changes from step to step
while serving (a few decodes, then a decode batch plus a prefill chunk, ...). glibc
serves such tensors from its heaps and keeps what they free for reuse, in pieces that
later, differently sized tensors often cannot use. So the process's RSS climbs long
after its working set stopped growing. On SmolLM2-135M (bf16), running the four layer
matmuls once at every token count 1..2048 left a process 2.1 GB larger: 1.6 GB of it
free heap memory that one `malloc_trim(0)` returned (131 ms), 0.5 GB two caches of
compiled matmul primitives, one per token count and weight shape (PyTorch's ideep
cache and oneDNN's own, 1024 entries each by default; with both at 32 entries,
`LRU_CACHE_CAPACITY=32 ONEDNN_PRIMITIVE_CACHE_CAPACITY=32`: +150 MB, +22 MB after a
trim). Their capacity is left at the default: at 256 entries workload (b) of
benchmarks/offline_throughput.py ran 2-3% slower in two of three interleaved rounds
(within this machine's noise, not ruled out).

`HeapTrimmer.maybe_trim()` runs after each model step and trims at most once per
`interval_s` (the FLEETSERVE_MALLOC_TRIM_S environment variable, 10 s by default; 0
turns it off). A trim costs ~1.5 ms plus ~0.07 ms per MB it releases, and pages it
released are faulted in again if a later step needs them: noise at one trim per 10 s.
Where the C library has no `malloc_trim` (musl, macOS) it does nothing.

Between those trims the heap keeps what a step freed (`tune_malloc()`, called once per
engine process before the model loads). glibc's defaults give back the top of the heap
whenever more than twice the largest freed mmap chunk sits free there (its dynamic trim
threshold), and a 2048-token prefill step frees more than that: every such step
faulted its activations in again, page by page. A served engine core took 37-374k page
faults in 3 s of a 64-request burst (four runs), the kernel zeroing each page while the
step's other OpenMP thread spun at the next barrier. With the thresholds
fixed (mmap above 32 MB, the most glibc allows; trim only above 1 GiB of free top; 64 MiB
of headroom per heap growth): 4-11k faults in the same 3 s, and `benchmarks/
serve_vs_vllm.py`'s all-at-once burst (SmolLM2-135M bf16, 2-core Zen 5; medians of 9
bursts from 3 alternated server pairs) got TTFT p50 6% lower (1505 vs 1599 ms) and 4%
more output tok/s (913 vs 874); ITL unchanged. RSS is still bounded by the periodic trim above.
FLEETSERVE_MALLOC_TUNE=0 keeps glibc's defaults.

Measured (AMD EPYC, 2 cores, bf16; an engine-core process fed Poisson arrivals at 6/s
for 60 s, prompts of 20-900 tokens, 8-64 output tokens; one run each): its RSS grew
+675 MB without trimming, +548 MB with it (+300 and +275 MB at 100 s). Much of the rest is
the two caches (capped at 128 entries, two runs without trimming: +329 and +331 MB
instead of +456 and +461) and, we think, the KV cache's pages being written for the
first time (it is allocated untouched). Offline workload (b), two interleaved rounds: 253.6 / 246.0
tok/s with trimming, 248.2 / 255.9 without.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from typing import Callable, Optional

logger = logging.getLogger(__name__)

ENV = "FLEETSERVE_MALLOC_TRIM_S"
DEFAULT_INTERVAL_S = 10.0
TUNE_ENV = "FLEETSERVE_MALLOC_TUNE"

# mallopt(3) parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MALLOC_SETTINGS = {M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 1 << 30, M_TOP_PAD: 64 << 20}


def tune_malloc() -> bool:
    """Keep freed activation memory in the heap between steps (module docstring). Returns
    whether glibc took the settings; False where there is no `mallopt` (musl, macOS) or
    FLEETSERVE_MALLOC_TUNE=0. Process-wide; call it before the model loads."""
    if os.environ.get(TUNE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in MALLOC_SETTINGS.items())


def _libc_trim() -> Optional[Callable[[], int]]:
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return lambda: fn(0)


def interval_from_env() -> float:
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        logger.warning("%s=%r is not a number of seconds; using %s", ENV, raw, DEFAULT_INTERVAL_S)
        return DEFAULT_INTERVAL_S
    return max(0.0, value)


class HeapTrimmer:
    def __init__(self, interval_s: Optional[float] = None, *,
                 trim: Optional[Callable[[], int]] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_from_env() if interval_s is None else interval_s
        self._trim = trim if trim is not None else _libc_trim()
        self._clock = clock
        self._last = clock()
        self.num_trims = 0

    @property
    def enabled(self) -> bool:
        return self._trim is not None and self.interval_s > 0

    def maybe_trim(self) -> bool:
        """Trim if `interval_s` passed since the last trim (or since start); whether it did."""
        trim = self._trim
        if trim is None or self.interval_s <= 0:  # not enabled
            return False
        now = self._clock()
        if now - self._last < self.interval_s:
            return False
        self._last = now
        trim()
        self.num_trims += 1
        return True
