"""Frames between the replica and its engine-core process: written whole or the channel is
broken, reassembled from any split, on non-blocking descriptors (issue 15: a frame torn by
EAGAIN under uvloop wedged a replica). Then the real engine under uvloop with a command far
larger than the socket buffer."""

from __future__ import annotations

import asyncio
import os
import socket
import threading

import pytest

from fleetserve.replica.engine.framing import HEADER, ChannelBroken, FrameChannel


def _pair():
    a, b = socket.socketpair()
    return FrameChannel(a.detach()), FrameChannel(b.detach())


def test_large_frames_cross_a_slow_reader_whole():
    left, right = _pair()
    payloads = [os.urandom(n) for n in (0, 1, 5 << 20, 17, 3 << 20)]
    got = []

    def read():
        while len(got) < len(payloads):
            got.append(right.recv(timeout_s=20))

    reader = threading.Thread(target=read)
    reader.start()
    for p in payloads:
        left.send(p, timeout_s=20)
    reader.join(timeout=30)
    assert got == payloads
    left.close(), right.close()


def test_reader_reassembles_frames_split_anywhere():
    a, b = socket.socketpair()
    right = FrameChannel(b.detach())
    stream = b"".join(HEADER.pack(len(p)) + p for p in (b"one", b"", b"three" * 1000))
    out = []
    for i in range(0, len(stream), 7):  # seven bytes at a time: headers split too
        a.sendall(stream[i : i + 7])
        out += right.recv_ready()
    assert out == [b"one", b"", b"three" * 1000]
    a.close()
    with pytest.raises(EOFError):
        right.wait_readable(5)
        right.recv_ready()


def test_a_write_past_its_deadline_breaks_the_channel_for_good():
    left, right = _pair()
    with pytest.raises(ChannelBroken, match="torn"):
        left.send(b"x" * (64 << 20), timeout_s=0.5)  # nobody reads: it cannot finish
    with pytest.raises(ChannelBroken):
        left.send(b"small", timeout_s=5)
    left.close(), right.close()


def test_garbage_header_is_not_a_frame():
    a, b = socket.socketpair()
    right = FrameChannel(b.detach())
    a.sendall(b"\xff" * 8 + b"junk")
    right.wait_readable(5)
    with pytest.raises(EOFError):
        right.recv_ready()
    assert "torn" in right.broken
    a.close()


def test_engine_core_under_uvloop_takes_a_huge_command(tiny_model_dir):
    """The original wedge: under uvloop the parent's end of the pipe is non-blocking, and one
    request whose pickled form is far larger than the socket buffer (100,000 stop strings)
    tore a frame. Now it is delivered whole, completes, and the engine serves on."""
    uvloop = pytest.importorskip("uvloop")
    from fleetserve.replica.engine.async_engine import AsyncEngine
    from fleetserve.scheduler import SamplingParams

    engine = AsyncEngine(model=str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=64, core_process=True)

    async def run(sp):
        """(final output, tokens of choice 0): outputs are deltas."""
        outs = [o async for o in engine.generate("hello there", sp)]
        return outs[-1], sum(len(c.token_ids) for o in outs for c in o.outputs if c.index == 0)

    async def main():
        # Keep the core stepping, so it is not sitting in a read when the big command comes.
        busy = asyncio.ensure_future(run(SamplingParams(max_tokens=150, ignore_eos=True)))
        await asyncio.sleep(0.3)
        huge = SamplingParams(
            temperature=0, max_tokens=3, ignore_eos=True, stop=[f"never-{i:06d}" for i in range(100_000)]
        )
        big, n = await asyncio.wait_for(run(huge), 120)
        assert big.finished and n == 3
        wide, n = await asyncio.wait_for(run(SamplingParams(n=64, max_tokens=2, ignore_eos=True)), 120)
        assert wide.finished and n == 2
        after, n = await asyncio.wait_for(run(SamplingParams(max_tokens=2, ignore_eos=True)), 60)
        assert after.finished and n == 2
        assert (await asyncio.wait_for(busy, 120))[1] == 150

    try:
        uvloop.run(main())
        engine.check_health()
        load = engine.get_load()
        assert load["num_running"] == 0 and load["num_free_blocks"] == load["num_blocks"]
    finally:
        engine.shutdown()
