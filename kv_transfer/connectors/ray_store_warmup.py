"""Mapping the Ray object store's shared memory into this process ahead of its first puts.

A process pays a page fault for each page of the store it touches first; where the store's
memory is allocated already (preallocated), `map_store` faults all of this process's mapping
in with `madvise(MADV_POPULATE_WRITE)` (Linux >= 5.14: nothing is allocated), a chunk per
call so that a shutdown stops it between calls. A sparse store is left alone: mapping it
would allocate it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Callable, Optional

logger = logging.getLogger(__name__)

# madvise(addr, length, advice) -> 0 or -1 (errno set)
Madvise = Callable[[Optional[int], int, int], int]

MADV_POPULATE_WRITE = 23  # Linux >= 5.14
MAP_CHUNK = 64 << 20  # populated this much per call: a shutdown stops the warm-up between calls


def store_mappings() -> list[tuple[int, int, str]]:
    """(start, end, /proc/self/maps range) of this process's shared mappings of the Ray object
    store's memory (its file is named plasma*; in /dev/shm, or Ray's plasma directory)."""
    out: list[tuple[int, int, str]] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 6 or "s" not in parts[1]:
                    continue
                if not os.path.basename(parts[5]).startswith("plasma"):
                    continue
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi, parts[0]))
    except OSError:
        pass
    return out


def _madvise() -> Optional[Madvise]:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    madvise: Madvise = fn
    return madvise


def populate_supported() -> bool:
    """Whether this kernel knows MADV_POPULATE_WRITE (asked with an empty range)."""
    madvise = _madvise()
    return madvise is not None and madvise(None, 0, MADV_POPULATE_WRITE) == 0


def map_store(
    stop: threading.Event,
    ensure_mapped: Optional[Callable[[], None]] = None,
    mappings: Optional[list[tuple[int, int, str]]] = None,
) -> int:
    """Fault in this process's mapping of the object store (`mappings`, default
    `store_mappings()`), where the store's memory is allocated already (else this would
    allocate it all): returns the bytes mapped. `ensure_mapped` is called when the store is
    not mapped yet (a Ray client maps it at its first big object)."""
    madvise = _madvise()
    if madvise is None or not populate_supported():  # Linux < 5.14
        return 0
    maps = store_mappings() if mappings is None else mappings
    if not maps and ensure_mapped is not None:
        ensure_mapped()
        maps = store_mappings()
    done = 0
    for lo, hi, rng in maps:
        try:
            st = os.stat(f"/proc/self/map_files/{rng}")
        except OSError:  # not ours to look at: leave it
            continue
        if st.st_blocks * 512 < min(st.st_size, hi - lo):
            logger.debug("object store memory not preallocated: not mapped up front")
            continue
        for at in range(lo, hi, MAP_CHUNK):
            if stop.is_set():
                return done
            n = min(MAP_CHUNK, hi - at)
            if madvise(at, n, MADV_POPULATE_WRITE) != 0:  # e.g. the store went away
                return done
            done += n
    return done
