"""Progress inside a step, for the health check's wedge detection.

A replica counts as wedged when its engine core holds work but makes no step for
`engine_stall_timeout_s` (30 s). One step can take longer than that and still be working:
a full-context prefill on a slow CPU (SmolLM2 at 8k tokens, one core: 44 s) got a healthy
replica killed mid-request. So the model bumps a counter as each decoder layer starts,
and progress is "a step finished, or the counter moved": a layer takes a fraction of a
step, while a core that is stopped, deadlocked or stuck in one collective does not move it.

The counter is 8 bytes of a shared file mapping (under /dev/shm when there is one) that
the core process writes and the replica process reads: no message, no thread, nothing
between steps. A bump costs well under a microsecond; a step of `PROGRESS_SPLIT_ROWS` tokens
or more runs the fused layers kernel one layer per call so that it can bump between them.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
from typing import Callable, Optional

_SIZE = 8


class ProgressCounter:
    """`ProgressCounter()` creates the mapping (the replica's side; `path` for the core);
    `ProgressCounter(path)` maps an existing one. `bump()` and `read()`."""

    def __init__(self, path: Optional[str] = None) -> None:
        if path is None:
            folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
            fd, path = tempfile.mkstemp(prefix="fleetserve-progress-", dir=folder)
            os.write(fd, b"\0" * _SIZE)
        else:
            fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)
        self.path = path
        self._value = ctypes.c_uint64.from_buffer(self._mm)

    def bump(self) -> None:
        self._value.value += 1

    def read(self) -> int:
        return self._value.value

    def unlink(self) -> None:
        """Remove the file (both sides keep their mappings)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def hook_layers(model, bump: Callable[[], None]) -> bool:
    """Call `bump` as each decoder layer of `model` starts: the model's decoder (a module with
    `layers` and a `progress` attribute, e.g. LlamaModel) calls it, in its per-layer loop and
    between the calls of its layers kernel on long steps. False when the model has none."""
    for module in model.modules():
        if hasattr(module, "layers") and hasattr(type(module), "progress"):
            module.progress = bump
            return True
    return False
