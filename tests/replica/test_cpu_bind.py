"""cpu_bind: an engine process pinned to cores, and "auto" never giving two engines one core.

Each binding runs in a child process (`multiprocessing`, spawn), so the test process keeps
its own affinity; the lock files go to a temporary folder (FLEETSERVE_CPU_LOCK_DIR).
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from fleetserve.replica.engine.engine_args import EngineArgs
from fleetserve.replica.worker import device

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no sched_setaffinity on this OS")


def _bind_and_report(spec, threads, rank, lock_dir, hold, conn):
    os.environ["FLEETSERVE_CPU_LOCK_DIR"] = lock_dir
    try:
        cpus = device.bind_cpus(spec, threads, rank)
        conn.send(("ok", cpus, sorted(os.sched_getaffinity(0))))
    except Exception as e:  # noqa: BLE001 - sent to the test
        conn.send(("error", str(e), None))
    if hold:
        conn.recv()  # keep the claim until the test says so


def _child(spec, threads=None, rank=0, lock_dir="", hold=False):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_bind_and_report, args=(spec, threads, rank, lock_dir, hold, child))
    p.start()
    assert parent.poll(60), "the child did not report"
    return p, parent, parent.recv()


def _finish(p, conn):
    conn.send("done")
    p.join(30)
    assert p.exitcode == 0


def test_parse_and_validate():
    assert device.parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert device.parse_cpu_list("2") == [2]
    for bad in ("x", "3-1", "1-", "-1", ""):
        with pytest.raises(ValueError, match="cpu_bind"):
            device.parse_cpu_list(bad)
    assert EngineArgs(cpu_bind="0-1|2-3").cpu_bind == "0-1|2-3"
    assert EngineArgs(cpu_bind="auto").cpu_bind == "auto"
    with pytest.raises(ValueError, match="not a core number"):
        EngineArgs(cpu_bind="all")


def test_auto_claims_distinct_cores_and_releases_them_when_the_process_ends(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    lock_dir = str(tmp_path)
    p1, c1, (status, first, mask) = _child("auto", 1, lock_dir=lock_dir, hold=True)
    assert status == "ok" and first == [allowed[0]] and mask == first
    if len(allowed) >= 2:
        p2, c2, (status, second, mask2) = _child("auto", 1, lock_dir=lock_dir, hold=True)
        assert status == "ok" and second == [allowed[1]] and mask2 == second  # never the same core
        _finish(p2, c2)
    # Every core claimed (the first child holds one; ask for all of them): unbound, not doubled up.
    p3, c3, (status, cpus, mask3) = _child("auto", len(allowed), lock_dir=lock_dir, hold=False)
    assert status == "ok" and cpus is None and mask3 == allowed
    p3.join(30)
    _finish(p1, c1)
    # The first child has exited: its core is free again.
    p4, c4, (status, again, _) = _child("auto", 1, lock_dir=lock_dir, hold=False)
    assert status == "ok" and again == [allowed[0]]
    p4.join(30)


def test_explicit_lists_per_rank_and_cores_outside_the_mask(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    last = allowed[-1]
    p, _, (status, cpus, mask) = _child(f"{allowed[0]}|{last}", rank=1, lock_dir=str(tmp_path))
    assert status == "ok" and cpus == [last] and mask == [last]
    p.join(30)
    p, _, (status, msg, _) = _child(f"{last + 1000}", lock_dir=str(tmp_path))
    assert status == "error" and "not available to this process" in msg
    p.join(30)
    p, _, (status, msg, _) = _child("0|0", rank=2, lock_dir=str(tmp_path))
    assert status == "error" and "rank 2 has none" in msg
    p.join(30)


def test_nobind_and_unset_leave_the_mask(tmp_path):
    for spec in (None, "nobind"):
        p, _, (status, cpus, mask) = _child(spec, lock_dir=str(tmp_path))
        assert status == "ok" and cpus is None and mask == sorted(os.sched_getaffinity(0))
        p.join(30)


def _engine_child(model_dir, lock_dir, conn):
    os.environ["FLEETSERVE_CPU_LOCK_DIR"] = lock_dir
    import torch

    from fleetserve.replica.llm import LLM
    from fleetserve.scheduler import SamplingParams

    llm = LLM(model_dir, dtype="float32", cpu_bind="auto", num_threads=1, max_model_len=64)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    conn.send(
        (
            sorted(os.sched_getaffinity(0)),
            torch.get_num_threads(),
            len(out[0].outputs[0].token_ids),
            llm.core.executor.worker.cpus,
        )
    )
    llm.core.shutdown()


def test_an_engine_with_cpu_bind_auto_runs_on_its_claimed_core(tmp_path):
    from fleetserve.replica.testing import make_tiny_llama

    model_dir = str(make_tiny_llama(tmp_path / "m"))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_engine_child, args=(model_dir, str(tmp_path / "locks"), child))
    p.start()
    assert parent.poll(120), "the engine child did not report"
    mask, threads, ntok, cpus = parent.recv()
    p.join(60)
    assert mask == cpus == [sorted(os.sched_getaffinity(0))[0]] and threads == 1 and ntok == 4
