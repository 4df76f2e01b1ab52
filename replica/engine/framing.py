"""Length-prefixed frames over one end of a socketpair: a frame is written whole or the
channel is declared broken, and the reader reassembles frames from whatever arrives.

Why not `multiprocessing.connection.Connection`: its `send_bytes` assumes a blocking
descriptor and its `recv_bytes` assumes a frame arrives in one go. The parent's end of
the engine-core pipe is watched by the Serve replica's event loop (`loop.add_reader`),
and uvloop's `add_reader` (libuv's `uv_poll_init`) switches the descriptor to
non-blocking. A large message (one request with 100,000 stop strings, or n=1000) then
hit EAGAIN halfway through `send_bytes`: the parent raised, the child stayed blocked
reading the rest of a frame that never came, and every later request to that replica
hung (issue 15).

Here the descriptor is non-blocking on purpose, on both ends, so nothing depends on who
else touches it:

    frame = 8-byte big-endian payload length | payload

- `send` writes the whole frame, waiting (select) for room when the peer is slow, up to
  a deadline. A frame cut short by the deadline leaves the byte stream torn: the channel
  raises `ChannelBroken` and refuses any further sends; its owner must end the peer (the
  engine-core client kills the child, which fails the requests and the health check).
- `recv_ready` returns the complete frames that have arrived and keeps a partial one
  buffered for the next call; it never waits. `recv` waits for one frame (deadline).
"""

from __future__ import annotations

import collections
import os
import select
import struct
import threading
import time
from typing import Optional

HEADER = struct.Struct("!Q")
# A header claiming more than this is garbage (the stream is torn), not a real message.
MAX_FRAME_BYTES = 1 << 30
_READ_CHUNK = 1 << 20


class ChannelBroken(OSError):
    """The channel cannot carry frames any more: the peer closed it, a write timed out
    halfway through a frame, or a header made no sense."""


class FrameChannel:
    def __init__(self, fd: int) -> None:
        self._fd = fd
        os.set_blocking(fd, False)
        self._buffer = bytearray()
        self._pending: collections.deque = collections.deque()  # whole frames recv() has not returned
        self._send_lock = threading.Lock()
        self._broken: Optional[str] = None
        self._eof = False

    def fileno(self) -> int:
        return self._fd

    @property
    def broken(self) -> Optional[str]:
        return self._broken

    # -- writing ---------------------------------------------------------------

    def send(self, payload: bytes, timeout_s: Optional[float] = None) -> None:
        """Write one frame whole (thread-safe); `ChannelBroken` if it cannot be."""
        if len(payload) > MAX_FRAME_BYTES:
            raise ValueError(f"a frame of {len(payload)} bytes is over the {MAX_FRAME_BYTES} limit")
        data = memoryview(HEADER.pack(len(payload)) + payload)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._send_lock:
            if self._broken is not None:
                raise ChannelBroken(self._broken)
            total, sent = len(data), 0
            while sent < total:
                try:
                    sent += os.write(self._fd, data[sent:])
                    continue
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError as e:  # EPIPE, ECONNRESET, EBADF: the peer (or our end) is gone
                    self._broken = f"the peer closed the channel ({e.strerror or e})"
                    raise ChannelBroken(self._broken) from e
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    self._broken = (
                        f"a write timed out after {timeout_s:.0f} s with {sent} of "
                        f"{total} bytes of a frame written; the stream is torn"
                    )
                    raise ChannelBroken(self._broken)
                select.select([], [self._fd], [], 1.0 if wait is None else min(wait, 1.0))

    # -- reading ---------------------------------------------------------------

    def recv_ready(self) -> list[bytes]:
        """The complete frames that have arrived (maybe none), without waiting.
        EOFError once the peer has closed and every whole frame has been handed out."""
        while not self._eof:
            try:
                chunk = os.read(self._fd, _READ_CHUNK)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:  # ECONNRESET and the like: treat as the end
                self._eof = True
                self._broken = self._broken or f"read failed: {e}"
                break
            if not chunk:
                self._eof = True
                break
            self._buffer += chunk
            if len(chunk) < _READ_CHUNK:
                break
        frames = self._split()
        if not frames and self._eof:
            raise EOFError("the peer closed the channel")
        return frames

    def wait_readable(self, timeout_s: Optional[float]) -> bool:
        if self._eof or self._pending:
            return True
        readable, _, _ = select.select([self._fd], [], [], timeout_s)
        return bool(readable)

    def recv(self, timeout_s: Optional[float] = None) -> Optional[bytes]:
        """One frame, waiting up to `timeout_s` (None: forever); None on timeout. Frames that
        arrived after it stay buffered for the next call."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if self._pending:
                return self._pending.popleft()
            frames = self.recv_ready()
            if frames:
                self._pending.extend(frames[1:])
                return frames[0]
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                return None
            self.wait_readable(wait)

    def _split(self) -> list[bytes]:
        frames = list(self._pending)
        self._pending.clear()
        buf, pos = self._buffer, 0
        while len(buf) - pos >= HEADER.size:
            (size,) = HEADER.unpack_from(buf, pos)
            if size > MAX_FRAME_BYTES:
                self._broken = f"a frame header claims {size} bytes: the stream is torn"
                self._eof = True
                break
            if len(buf) - pos - HEADER.size < size:
                break
            start = pos + HEADER.size
            frames.append(bytes(buf[start : start + size]))
            pos = start + size
        if pos:
            del buf[:pos]
        return frames

    def close(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass
        self._broken = self._broken or "closed"
