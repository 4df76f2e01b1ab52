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


@pytest.mark.parametrize("raw,expected", [("", 10.0), ("2.5", 2.5), ("0", 0.0), ("-3", 0.0),
                                          ("soon", 10.0)])
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
def step():  # a prefill step's activations: ~100 MB in pieces under 32 MB, all freed after
    xs = [torch.ones(5 << 20) for _ in range(5)]
    return sum(float(x[-1]) for x in xs)
step(); step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(tune: str) -> tuple[str, int]:
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, **{heap.TUNE_ENV: tune})).stdout.split()
    return out[0], int(out[1])


def test_tuned_malloc_keeps_freed_activations_in_the_heap():
    """glibc's defaults give the heap's top back after each step's frees and fault it in
    again on the next step (~25k 4 KiB pages for 100 MB); tuned, the pages stay."""
    if not hasattr(ctypes.CDLL(None), "mallopt"):
        pytest.skip("this C library has no mallopt (not glibc)")
    tuned, tuned_faults = _faults("1")
    plain, plain_faults = _faults("0")
    assert (tuned, plain) == ("True", "False")
    assert plain_faults > 100_000  # 10 steps x ~25k pages: the behaviour this fixes
    assert tuned_faults < plain_faults / 10
