"""Streamed batches: an export handed to its transport while its blocks are still being
gathered, and a load whose chunks are checked and written as they arrive, so the copies out
of and into the caches overlap the transfer."""

from __future__ import annotations

import threading
from typing import Callable, Optional, Protocol, Sequence

import torch

STREAM_CHUNK_BYTES = 8 << 20  # a streamed batch moves in chunks of about this many bytes
MAX_CHUNKS = 256  # (P2P tags a stream's messages 0..2*MAX_CHUNKS-1 within a pull's tag range)


def plan_chunks(num_blocks: int, block_bytes: int, chunk_bytes: int = STREAM_CHUNK_BYTES) -> list[tuple[int, int]]:
    """[start, end) block ranges of about `chunk_bytes` each (at least one block; at most
    MAX_CHUNKS ranges)."""
    per = max(1, chunk_bytes // max(1, block_bytes), -(-num_blocks // MAX_CHUNKS))
    return [(s, min(s + per, num_blocks)) for s in range(0, num_blocks, per)]


class StreamAborted(RuntimeError):
    """A streamed batch's gathering failed: the rest of its chunks never come."""


class ExportProgress:
    """A batch that is exported while its blocks are still being copied out of the cache,
    chunk by chunk (each chunk's digests computed as it lands), so a transport can send the
    first chunks while the later ones are gathered (P2P). The gatherer calls `advance` per
    chunk (or `fail`); senders wait for the chunk they need. The batch's buffer goes back
    to its pool only once the gatherer is done with it (`when_done`)."""

    def __init__(self, chunks: list[tuple[int, int]]) -> None:
        self.chunks = chunks
        self._cond = threading.Condition()
        self._ready = 0
        self._error: Optional[BaseException] = None
        self._on_done: list[Callable[[], None]] = []

    def _over(self) -> bool:
        """Every chunk gathered, or gathering failed (under self._cond)."""
        return self._ready == len(self.chunks) or self._error is not None

    def advance(self) -> None:
        """The next chunk is gathered and its digests are set."""
        with self._cond:
            self._ready += 1
            self._cond.notify_all()
            last = self._ready == len(self.chunks)
        if last:
            self._finish()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()
        self._finish()

    def _finish(self) -> None:
        with self._cond:
            callbacks, self._on_done = self._on_done, []
        for cb in callbacks:
            cb()

    def wait_chunk(self, c: int, timeout: float) -> None:
        """Until chunk `c` is ready; raises StreamAborted if gathering failed or took longer
        than `timeout` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready > c or self._error is not None, timeout):
                raise StreamAborted(f"chunk {c} not gathered within {timeout:.1f} s")
            if self._ready <= c:
                raise StreamAborted(f"gathering the blocks failed: {self._error}")

    def wait_all(self, timeout: float) -> None:
        self.wait_chunk(len(self.chunks) - 1, timeout)

    def when_done(self, cb: Callable[[], None]) -> None:
        """`cb` once the gatherer no longer writes the buffer (now, if it is done)."""
        with self._cond:
            if not self._over():
                self._on_done.append(cb)
                return
        cb()


class ChunkSink(Protocol):
    """Where a streaming transport hands a load's blocks as they arrive (kv_transfer.loads.Sink
    on the worker): `begin` with what the batch's header says (raises KVFormatError if the
    batch cannot be the load's), then `write` chunk by chunk, in order, each with how many of
    its blocks, from the first, passed their digests; `wanted` is how many of the batch's
    blocks, from the first, the load can still use."""

    def begin(
        self, fingerprint: str, keys: list[str], heads: tuple[int, int], shape: Sequence[int], dtype: torch.dtype
    ) -> None: ...

    def wanted(self) -> int: ...

    def write(self, start: int, data: torch.Tensor, n_ok: int) -> None: ...
