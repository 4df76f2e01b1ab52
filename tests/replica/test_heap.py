"""Engine processes hand the C heap's free pages back to the OS now and then."""

from __future__ import annotations

import ctypes

import pytest

from fleetserve.replica.worker import heap
from fleetserve.replica.worker.heap import HeapTrimmer


def test_trims_at_most_once_per_interval():
    now, calls = [100.0], []
    t = HeapTrimmer(10.0, trim=lambda: calls.append(now[0]) or 1, clock=lambda: now[0])
    assert not t.maybe_trim()  # the interval counts from the start
    now[0] = 109.9
    assert not t.maybe_trim()
    now[0] = 110.0
    assert t.maybe_trim() and calls == [110.0]
    now[0] = 115.0
    assert not t.maybe_trim()
    now[0] = 125.0
    assert t.maybe_trim() and calls == [110.0, 125.0] and t.num_trims == 2


@pytest.mark.parametrize("raw,expected", [("", 10.0), ("2.5", 2.5), ("0", 0.0), ("-3", 0.0), ("soon", 10.0)])
def test_interval_from_the_environment(monkeypatch, raw, expected):
    monkeypatch.setenv(heap.ENV, raw)
    assert heap.interval_from_env() == expected
    t = HeapTrimmer(trim=lambda: 1, clock=lambda: 1e9)
    assert t.enabled == (expected > 0)
    if not t.enabled:
        assert not t.maybe_trim()


def test_the_libc_trim_is_found_on_glibc():
    if not hasattr(ctypes.CDLL(None), "malloc_trim"):
        pytest.skip("this C library has no malloc_trim (not glibc)")
    t = HeapTrimmer(1.0, clock=iter([0.0, 2.0]).__next__)
    assert t.enabled and t.maybe_trim()


def test_the_worker_trims_between_steps(tiny_model_dir, monkeypatch):
    """Wired into every model step (engine core, TP ranks, in-thread engines alike)."""
    from fleetserve.replica.llm import LLM
    from fleetserve.scheduler import SamplingParams

    monkeypatch.setenv(heap.ENV, "0.000001")
    llm = LLM(str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=64)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate([[5, 6, 7, 8]], sp)[0].outputs[0].token_ids
    worker = llm.core.executor.worker
    assert worker.heap.enabled and worker.heap.num_trims >= 5  # about once per step
    assert worker.malloc_tuned == hasattr(ctypes.CDLL(None), "mallopt")
    assert llm.generate([[5, 6, 7, 8]], sp)[0].outputs[0].token_ids == first


_FAULTS_SCRIPT = """
import resource, torch
from fleetserve.replica.worker.heap import tune_malloc
tuned = tune_malloc()
SIZES = [1 << 20, 5 << 20, 3 << 20, 6 << 20]  # floats: steps of 20-120 MB, as token counts vary
def step(i):  # a step's activations in pieces under 32 MB, all freed after
    xs = [torch.ones(SIZES[i % len(SIZES)]) for _ in range(5)]  # written: every page touched
    del xs
for i in range(8):  # warm-up: the heap grows to the largest step once
    step(i)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(12):
    step(i)
print(tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(tune: str) -> tuple[str, int]:
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _FAULTS_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, **{heap.TUNE_ENV: tune}),
    ).stdout.split()
    return out[0], int(out[1])


def test_tuned_malloc_keeps_freed_activations_in_the_heap():
    """Tuned, a step's freed activations stay in the heap: after warm-up, steps of 20-120 MB
    fault no pages in again (0 in every run here). With glibc's defaults the same script
    faulted 104-156k pages in 3 of 5 runs and none in the others (it depends on where the heap's
    top lands), so a tuning that stopped working fails this most of the time, not always."""
    if not hasattr(ctypes.CDLL(None), "mallopt"):
        pytest.skip("this C library has no mallopt (not glibc)")
    tuned, tuned_faults = _faults("1")
    assert tuned == "True"
    assert tuned_faults < 2_000, tuned_faults  # 12 steps: well under one step's 5-30k pages
    plain, _ = _faults("0")
    assert plain == "False"  # FLEETSERVE_MALLOC_TUNE=0 leaves glibc's defaults
