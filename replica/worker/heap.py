"""Hand the C heap's free pages back to the OS every so often (glibc `malloc_trim`).

A step's activations are sized by its token count, which changes from step to step
while serving (a few decodes, then a decode batch plus a prefill chunk, ...). glibc
serves such tensors from its heaps and keeps what they free for reuse, in pieces that
later, differently sized tensors often cannot use. So the process's RSS climbs long
after its working set stopped growing: most of the growth is free heap memory that one
`malloc_trim(0)` returns, the rest two caches of compiled matmul primitives, one entry
per token count and weight shape (PyTorch's ideep cache and oneDNN's own, 1024 entries
each by default). Their capacity is left at the default: smaller caches bound RSS lower
but may cost throughput.

`HeapTrimmer.maybe_trim()` runs after each model step and trims at most once per
`interval_s` (the FLEETSERVE_MALLOC_TRIM_S environment variable, 10 s by default; 0
turns it off). A trim costs milliseconds, and pages it released are faulted in again if
a later step needs them: noise at one trim per interval. Where the C library has no
`malloc_trim` (musl, macOS) it does nothing.

Between those trims the heap keeps what a step freed (`tune_malloc()`, called once per
engine process before the model loads). glibc's defaults give back the top of the heap
whenever more than twice the largest freed mmap chunk sits free there (its dynamic trim
threshold), and a long prefill step frees more than that: every such step faulted its
activations in again, page by page, the kernel zeroing each page while the step's other
OpenMP threads spun at the next barrier. So the thresholds are fixed (mmap above 32 MB,
the most glibc allows; trim only above 1 GiB of free top; 64 MiB of headroom per heap
growth); RSS is still bounded by the periodic trim above. FLEETSERVE_MALLOC_TUNE=0 keeps
glibc's defaults.

Figures (RSS growth with and without trimming, cache capacities, trim cost, page faults
and the served burst with the thresholds): docs/deployment/cpu.md, "Memory".
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
    def __init__(
        self,
        interval_s: Optional[float] = None,
        *,
        trim: Optional[Callable[[], int]] = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
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
