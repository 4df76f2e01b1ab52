"""The engine's health check notices a wedged core, not only a dead one (issue 15): a core
process that is alive but stopped (SIGSTOP: the state a torn pipe once left it in) fails
the check within the stall timeout, recovers when it moves again, and a killed one is dead."""

from __future__ import annotations

import asyncio
import os
import signal
import time

from fleetserve.replica.engine.async_engine import AsyncEngine, EngineDeadError
from fleetserve.scheduler import SamplingParams


def _until_unhealthy(engine, timeout_s: float, limit_s: float = 20.0) -> str:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            engine.check_health(stall_timeout_s=timeout_s)
        except EngineDeadError as e:
            return str(e)
        time.sleep(0.2)
    raise AssertionError("the health check never failed")


def test_stopped_core_fails_health_then_recovers_then_dies(tiny_model_dir):
    engine = AsyncEngine(model=str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=64, core_process=True)
    pid = engine.core_pid
    try:
        for _ in range(3):  # pings answered while idle
            engine.check_health(stall_timeout_s=1.0)
            time.sleep(0.3)
        os.kill(pid, signal.SIGSTOP)
        try:
            assert "did not answer a ping" in _until_unhealthy(engine, 1.0)
        finally:
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 20
        while True:  # the pong arrives: healthy again
            try:
                engine.check_health(stall_timeout_s=1.0)
                break
            except EngineDeadError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

        async def stopped_mid_stream():
            got = 0
            async for out in engine.generate("hi", SamplingParams(max_tokens=2000, ignore_eos=True)):
                got += len(out.outputs[0].token_ids)
                if got >= 3:
                    os.kill(pid, signal.SIGSTOP)
                    break  # abort: the core has work it cannot drop while stopped

        asyncio.run(stopped_mid_stream())
        try:
            reason = _until_unhealthy(engine, 1.0)
            assert "wedged" in reason
        finally:
            os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while "dead" not in _until_unhealthy(engine, 1.0):  # wedged, until the exit is seen
            assert time.monotonic() < deadline, "a killed core never counted as dead"
            time.sleep(0.1)
    finally:
        engine.shutdown()


def test_a_step_longer_than_the_stall_timeout_is_progress_not_a_wedge(tmp_path):
    """A long prefill step (a full context on a slow CPU took 44 s, over the 30 s limit) moves
    the layer counter: the health check passes throughout, though the step is four times the
    stall timeout. The fused layers kernel (AVX2 float32 takes up to 4096 rows) runs layer by
    layer on such a step so that the counter moves inside it."""
    import threading

    from fleetserve.replica.testing import make_tiny_llama

    model = make_tiny_llama(
        tmp_path / "deep", hidden_size=256, num_layers=12, num_heads=4, num_kv_heads=2, max_position_embeddings=4096
    )
    core_process = True  # the layout served by default
    engine = AsyncEngine(
        model=str(model),
        dtype="float32",
        num_gpu_blocks_override=600,
        max_model_len=4096,
        max_num_batched_tokens=4096,
        num_threads=1,
        enable_prefix_caching=False,
        core_process=core_process,
    )
    try:

        async def prefill(first: int) -> float:
            start = time.monotonic()
            prompt = [(first + i) % 300 + 10 for i in range(2000)]  # one step: the whole prompt
            async for _ in engine.generate(prompt, SamplingParams(max_tokens=1)):
                pass
            return time.monotonic() - start

        async def warm_up():
            async for _ in engine.generate(list(range(10, 300)), SamplingParams(max_tokens=2)):
                pass

        asyncio.run(warm_up())  # first-call costs out of the measured step
        step_s = asyncio.run(prefill(0))
        timeout_s = step_s / 4  # a layer takes about step_s / 12
        failures: list[str] = []
        done = threading.Event()

        def watch():
            while not done.is_set():
                try:
                    engine.check_health(stall_timeout_s=timeout_s)
                except EngineDeadError as e:
                    failures.append(str(e))
                time.sleep(timeout_s / 4)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            again_s = asyncio.run(prefill(7))
        finally:
            done.set()
            watcher.join()
        assert again_s > 2 * timeout_s, (step_s, again_s)  # the step did outlast the timeout
        assert not failures, (core_process, step_s, failures[:3])
    finally:
        engine.shutdown()
