"""Host buffers reused between transfers (a fresh big buffer costs its page faults)."""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import torch


class StagingPool:
    """Reusable host buffers for gathered or received blocks, up to `max_bytes` kept.

    A fresh buffer of a few hundred MiB costs more in page faults than the copy into it
    (docs/benchmarks/results/2026-11-24-kv-transfer-epyc-avx512.md), so buffers go back here
    once their bytes are no longer needed (`BlockBatch.release`) and the next transfer reuses
    them."""

    def __init__(self, max_bytes: int = 1 << 30, pin_memory: bool = False) -> None:
        self.max_bytes = max_bytes
        self.pin_memory = pin_memory
        self._free: list[torch.Tensor] = []  # uint8 buffers
        self._lock = threading.Lock()

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> tuple[torch.Tensor, Callable[[], None]]:
        """(a tensor of `shape`, the callback that gives its buffer back)."""
        need = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        buf = None
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= need]
            if fits:  # the smallest that fits
                buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        if buf is None:
            buf = torch.empty(max(need, 1), dtype=torch.uint8, pin_memory=self.pin_memory)
        return buf[:need].view(dtype).view(tuple(shape)), lambda: self._give(buf)

    def _give(self, buf: torch.Tensor) -> None:
        with self._lock:
            if any(b is buf for b in self._free):
                return
            # Least recently given back goes first: the sizes recent transfers use stay (dropping
            # the biggest faulted a big prompt's buffer in afresh on every hand-off:
            # docs/benchmarks/results/2026-11-29-kv-transfer-zen5.md).
            if buf.numel() > self.max_bytes:
                return  # never kept: over the cap on its own
            self._free.append(buf)
            while sum(b.numel() for b in self._free) > self.max_bytes:
                self._free.pop(0)

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._free)
