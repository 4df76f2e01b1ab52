"""Host buffers reused between transfers (a fresh big buffer costs its page faults), within a
cap on all the host memory they hold."""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import torch

from fleetserve.kv_transfer.errors import TransferError


class StagingFull(TransferError):
    """Staging this transfer would take the pool past its cap: the transfer is refused (a save
    is dropped, a load fails), and its KV is recomputed where it is needed."""


class StagingPool:
    """Host buffers for gathered or received blocks: at most `max_bytes` of them exist at any
    time, handed out and kept together.

    A fresh buffer of a few hundred MiB costs more in page faults than the copy into it
    (docs/benchmarks/results/2026-11-24-kv-transfer-epyc-avx512.md), so buffers go back here
    once their bytes are no longer needed (`BlockBatch.release`) and the next transfer reuses
    them. Exports held for a consumer keep their buffers until it reads them or their lease
    ends; `take` makes room by dropping kept buffers, and refuses (`StagingFull`, counted in
    `num_refused`) a buffer that would take what is handed out past `max_bytes`."""

    def __init__(self, max_bytes: int = 1 << 30, pin_memory: bool = False) -> None:
        self.max_bytes = max_bytes
        self.pin_memory = pin_memory
        self._free: list[torch.Tensor] = []  # uint8 buffers, least recently given back first
        self._in_use: dict[int, int] = {}  # id(buffer) -> its bytes, for buffers handed out
        self._lock = threading.Lock()
        self.num_refused = 0

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> tuple[torch.Tensor, Callable[[], None]]:
        """(a tensor of `shape`, the callback that gives its buffer back); `StagingFull` when
        the buffers handed out would exceed the cap."""
        need = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        size = max(need, 1)
        buf = None
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= need]
            if fits:  # the smallest that fits
                buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
            else:
                in_use = sum(self._in_use.values())
                if in_use + size > self.max_bytes:
                    self.num_refused += 1
                    raise StagingFull(
                        f"staging {need} bytes would exceed the staging pool's cap of {self.max_bytes} "
                        f"bytes ({in_use} in use): staging_max_bytes"
                    )
                # Room for the new buffer: drop kept ones, least recently given back first.
                while self._free and in_use + size + sum(b.numel() for b in self._free) > self.max_bytes:
                    self._free.pop(0)
                # (under the lock, so two takes never both pass the check: the pages are only
                # faulted in when the buffer is first written)
                buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)
            self._in_use[id(buf)] = buf.numel()
        return buf[:need].view(dtype).view(tuple(shape)), lambda: self._give(buf)

    def _give(self, buf: torch.Tensor) -> None:
        with self._lock:
            if self._in_use.pop(id(buf), None) is None:
                return  # given back already
            # Least recently given back goes first: the sizes recent transfers use stay (dropping
            # the biggest faulted a big prompt's buffer in afresh on every hand-off:
            # docs/benchmarks/results/2026-11-29-kv-transfer-zen5.md).
            self._free.append(buf)
            while sum(b.numel() for b in self._free) + sum(self._in_use.values()) > self.max_bytes:
                self._free.pop(0)

    @property
    def cached_bytes(self) -> int:
        """Bytes of the buffers kept for reuse."""
        with self._lock:
            return sum(b.numel() for b in self._free)

    @property
    def in_use_bytes(self) -> int:
        """Bytes of the buffers handed out and not given back yet."""
        with self._lock:
            return sum(self._in_use.values())
