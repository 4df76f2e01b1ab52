"""The EngineCore in its own process (replica.engine.process_client / core_process): start-up
errors, a core that dies mid-stream, stop strings across the process boundary, and a core
that outlives its parent (it must not)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from fleetserve.replica.engine.async_engine import AsyncEngine, EngineDeadError
from fleetserve.scheduler import SamplingParams


def _wait_gone(pid: int, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_start_up_error_names_the_cause(tiny_model_dir):
    with pytest.raises(RuntimeError, match="engine core failed to start.*KV cache budget"):
        AsyncEngine(model=str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=16, core_process=True)


def test_core_started_before_a_failing_tokenizer_is_stopped(tiny_model_dir, monkeypatch):
    """The core process starts before the tokenizer loads (its imports overlap that load): when
    the engine fails in between, it must not outlive the error."""
    import fleetserve.replica.engine.async_engine as async_engine

    started = []

    class Recorded(async_engine.SpawnedCore):
        def __init__(self) -> None:
            super().__init__()
            started.append(self)

    def broken_tokenizer(source):
        raise OSError(f"no tokenizer files in {source}")

    monkeypatch.setattr(async_engine, "SpawnedCore", Recorded)
    monkeypatch.setattr(async_engine, "load_tokenizer", broken_tokenizer)
    with pytest.raises(OSError, match="no tokenizer files"):
        AsyncEngine(model=str(tiny_model_dir), dtype="float32", core_process=True)
    assert len(started) == 1
    assert started[0].proc.poll() is not None and _wait_gone(started[0].proc.pid)
    monkeypatch.undo()
    engine = AsyncEngine(
        model=str(tiny_model_dir), dtype="float32", core_process=True, kv_cache_memory_bytes=8 << 20
    )  # and a real start still works
    try:
        assert engine.core_pid is not None and engine.check_health() is None
    finally:
        engine.shutdown()


def test_stop_string_frees_blocks_and_serves_on(tiny_model_dir):
    """A stop string is found here (detokenizer) but the request lives in the core process:
    the finish crosses over, and its blocks go back to the pool."""
    engine = AsyncEngine(model=str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=64, core_process=True)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def text_of(sp):
        text, final = "", None
        async for out in engine.generate("The quick brown fox", sp):
            text += out.outputs[0].text
            final = out
        return text, final

    try:
        full, _ = asyncio.run(text_of(greedy))
        stop = full[len(full) // 2 : len(full) // 2 + 2]
        assert stop.strip(), f"no usable stop string in {full!r}"
        cut, final = asyncio.run(text_of(SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, stop=[stop])))
        assert final.outputs[0].finish_reason == "stop" and stop not in cut
        assert full.startswith(cut)
        for _ in range(100):
            load = engine.get_load()
            if load["num_running"] == 0 and load["num_free_blocks"] == load["num_blocks"]:
                break
            time.sleep(0.02)
        assert load["num_running"] == 0 and load["num_free_blocks"] == load["num_blocks"]
        again, _ = asyncio.run(text_of(greedy))
        assert again == full
    finally:
        engine.shutdown()


def test_core_killed_mid_stream_fails_requests_and_health(tiny_model_dir):
    engine = AsyncEngine(model=str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=64, core_process=True)
    pid = engine.core_pid

    async def main():
        got = 0
        with pytest.raises(EngineDeadError, match="engine core process exited.*signal 9"):
            async for out in engine.generate("hello", SamplingParams(max_tokens=10_000, ignore_eos=True)):
                got += len(out.outputs[0].token_ids)
                if got == 2:
                    os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("again", SamplingParams(max_tokens=4)):
                pass

    try:
        engine.check_health()
        asyncio.run(main())
        with pytest.raises(EngineDeadError):
            engine.check_health()
    finally:
        engine.shutdown()


def test_core_process_exits_with_its_parent(tiny_model_dir, tmp_path):
    """A parent killed with SIGKILL runs no cleanup; the core sees its pipe close and exits."""
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys, time
        from fleetserve.replica.engine.async_engine import AsyncEngine
        e = AsyncEngine(model={str(tiny_model_dir)!r}, dtype="float32", num_gpu_blocks_override=16,
                        core_process=True)
        print(e.core_pid, flush=True)
        time.sleep(600)
    """)
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        child_pid = int(parent.stdout.readline())
        assert psutil.pid_exists(child_pid)
        parent.kill()
        parent.wait(timeout=10)
        assert _wait_gone(child_pid), "the engine core outlived its parent"
    finally:
        parent.kill()


def test_outputs_reach_a_stream_in_delivery_order():
    """A core process's results are read on the caller's loop or, between loops, by a
    get_load/metrics_text caller on another thread. An output handed over from that
    thread must not be overtaken by the next one read on the loop (a streamed answer
    once came out with two pieces swapped)."""
    import threading
    import types

    async def main():
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        engine = types.SimpleNamespace(_streams={"r": (loop, queue)})
        other = threading.Thread(target=AsyncEngine._deliver, args=(engine, "r", "first"))
        other.start()
        other.join()
        AsyncEngine._deliver(engine, "r", "second")  # on the loop, before it ran the first
        return [await queue.get(), await queue.get()]

    assert asyncio.run(main()) == ["first", "second"]
