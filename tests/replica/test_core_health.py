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
    engine = AsyncEngine(model=str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=64,
                         core_process=True)
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
