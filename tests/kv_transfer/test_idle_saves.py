"""A finished request's KV save is queued for the step after it; an engine with nothing
left to run must still carry it out. The offline `LLM` (nothing steps it between calls),
two engine processes in a row (the second loads what the first wrote, and the first exits
right after `generate`), an `AsyncEngine` that goes idle, and the engines' own predicate:
idle means the connector has nothing pending. Saves that cannot finish in time are
reported (a warning naming how many, vllm:kv_transfer_dropped_saves) and hold no block."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fleetserve.kv_transfer.connectors.shared_storage import SharedStorageConnector, SharedStorageTransport
from fleetserve.kv_transfer.keys import chain_keys
from fleetserve.replica.engine.async_engine import AsyncEngine
from fleetserve.replica.llm import LLM
from fleetserve.scheduler import SamplingParams

BS, NUM_BLOCKS, MAX_LEN = 16, 128, 2048
PROMPT_LEN = 1301  # ~1.3k tokens: 81 full blocks and 5 tokens more
FULL = PROMPT_LEN // BS


def storage_cfg(path, connector="SharedStorageConnector", **kw) -> dict:
    return {"kv_connector": connector, "kv_role": "kv_both", "kv_connector_extra_config": {"path": str(path)}, **kw}


def engine_kwargs(path, **kw) -> dict:
    return dict(
        dtype="float32",
        block_size=BS,
        num_gpu_blocks_override=NUM_BLOCKS,
        max_model_len=MAX_LEN,
        kv_transfer_config=storage_cfg(path, **kw),
    )


def the_prompt(seed=0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(PROMPT_LEN)]


GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def stored_blocks(path) -> int:
    return len(list(Path(path).rglob("*.kvb")))


def leading_hits(core, prompt) -> int:
    """How many of the prompt's full blocks, from the first, the store holds (the
    connector's own lookup, by chain key)."""
    half = core.kv_connector.half
    return half.transport.lookup(chain_keys(half.ctx.fingerprint, prompt, BS, FULL))


def assert_idle_and_no_leak(core) -> None:
    """The engine's own idle predicate holds, nothing of the connector is pending on either
    half, and every block is back in the pool."""
    sched = core.scheduler
    assert not core.has_work() and not core.kv_pending()
    assert not core.kv_connector.has_pending_work() and core.num_pending_kv_saves() == 0
    assert core.executor.worker.kv_connector.num_saves_in_flight() == 0
    assert not sched.has_requests() and not sched.sending
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    sched.kv.check_invariants()


def assert_no_leak(core) -> None:
    sched = core.scheduler
    assert not sched.has_unfinished_requests() and not sched.sending
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    sched.kv.check_invariants()


# ---- the offline LLM ----------------------------------------------------------------------
def test_offline_llm_has_stored_every_full_block_when_generate_returns(tiny_model_dir, tmp_path):
    prompt = the_prompt()
    llm = LLM(str(tiny_model_dir), **engine_kwargs(tmp_path))
    try:
        (out,) = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
        assert out.num_cached_tokens == 0 and len(out.outputs[0].token_ids) == 4
        # Right after generate: nothing more will step this engine, and the KV is stored.
        assert stored_blocks(tmp_path) == FULL
        assert leading_hits(llm.core, prompt) == FULL
        assert_idle_and_no_leak(llm.core)
    finally:
        llm.shutdown()
    assert stored_blocks(tmp_path) == FULL


def test_an_idle_engine_core_has_nothing_of_its_connector_pending(tiny_model_dir, tmp_path):
    """The loops' own predicate (`while core.has_work(): core.step()`, as the core process and
    the engine thread run it): once it says idle, every save is written, none in flight."""
    prompt = the_prompt(seed=1)
    llm = LLM(str(tiny_model_dir), **engine_kwargs(tmp_path))
    core = llm.core
    try:
        _, requests = llm.input_processor.process({"prompt_token_ids": prompt}, GREEDY, "r0")
        for r in requests:
            core.add_request(r)
        finished = False
        for _ in range(10_000):
            if not core.has_work():
                break
            result = core.step()
            finished |= any(o.finished for o in result.outputs)
        assert finished
        assert stored_blocks(tmp_path) == FULL and leading_hits(core, prompt) == FULL
        assert_idle_and_no_leak(core)
    finally:
        llm.shutdown()


# ---- two engine processes -------------------------------------------------------------------
ENGINE_SCRIPT = """
import json, os, sys
import torch
torch.set_num_threads(1)
from fleetserve.replica.llm import LLM
from fleetserve.scheduler import SamplingParams

model, path, out = sys.argv[1], sys.argv[2], sys.argv[3]
prompt = json.loads(sys.argv[4])
llm = LLM(model, dtype="float32", block_size=%(bs)d, num_gpu_blocks_override=%(nb)d,
          max_model_len=%(ml)d, kv_transfer_config={"kv_connector": "SharedStorageConnector",
          "kv_role": "kv_both", "kv_connector_extra_config": {"path": path}})
(res,) = llm.generate({"prompt_token_ids": prompt},
                      SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
with open(out, "w") as f:
    json.dump({"tokens": list(res.outputs[0].token_ids), "cached": res.num_cached_tokens,
               "remote": res.num_remote_tokens}, f)
# Exit at once, as a script that is done: no shutdown, no interpreter clean-up, no atexit.
os._exit(0)
""" % {"bs": BS, "nb": NUM_BLOCKS, "ml": MAX_LEN}


def run_engine_process(script, model_dir, store, out, prompt) -> dict:
    proc = subprocess.run(
        [sys.executable, str(script), str(model_dir), str(store), str(out), json.dumps(prompt)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(Path(out).read_text())


def test_a_second_engine_process_loads_every_full_block_the_first_one_computed(tiny_model_dir, tmp_path):
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_SCRIPT)
    store = tmp_path / "kv"
    prompt = the_prompt(seed=2)
    first = run_engine_process(script, tiny_model_dir, store, tmp_path / "a.json", prompt)
    assert first["cached"] == 0 and first["remote"] == 0
    assert stored_blocks(store) == FULL  # written before the first process's generate returned
    second = run_engine_process(script, tiny_model_dir, store, tmp_path / "b.json", prompt)
    assert second["remote"] == FULL * BS, second  # every full block loaded, none recomputed
    assert second["cached"] == FULL * BS
    assert second["tokens"] == first["tokens"]


# ---- an AsyncEngine that goes idle ------------------------------------------------------------
@pytest.mark.parametrize("core_process", [True, False], ids=["core-process", "core-thread"])
def test_an_async_engine_idle_after_its_last_request_writes_its_blocks(tiny_model_dir, tmp_path, core_process):
    prompt = the_prompt(seed=3)
    eng = AsyncEngine(model=str(tiny_model_dir), core_process=core_process, **engine_kwargs(tmp_path))

    async def one():
        final = None
        async for out in eng.generate({"prompt_token_ids": prompt}, GREEDY):
            final = out
        return final

    try:
        final = asyncio.run(one())
        assert final.finished and final.num_cached_tokens == 0
        deadline = time.monotonic() + 5.0  # no further request: the engine must do it alone
        while stored_blocks(tmp_path) < FULL and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stored_blocks(tmp_path) == FULL
        while time.monotonic() < deadline:
            load = eng.get_load()
            if load["num_free_blocks"] == load["num_blocks"]:
                break
            time.sleep(0.01)
        load = eng.get_load()
        assert load["num_free_blocks"] == load["num_blocks"] and load["num_running"] == 0, load
    finally:
        eng.shutdown()


# ---- saves that cannot finish in time -----------------------------------------------------------
class GatedStorageTransport(SharedStorageTransport):
    """Exports wait for `gate` (a store that hangs); with `fail` set they raise instead."""

    gate = threading.Event()
    fail = False

    def export(self, spec, batch):
        if type(self).fail:
            raise OSError("the store is gone (injected)")
        if not type(self).gate.wait(30):
            raise OSError("gate never opened")
        super().export(spec, batch)


class GatedStorageConnector(SharedStorageConnector):
    transport_cls = GatedStorageTransport


GATED = "tests.kv_transfer.test_idle_saves:GatedStorageConnector"


def dropped_saves_metric(llm) -> float:
    for line in llm.metrics.text().splitlines():
        if line.startswith("vllm:kv_transfer_dropped_saves_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:kv_transfer_dropped_saves metric")


def test_a_save_past_its_deadline_is_reported_and_dropped_at_shutdown(tiny_model_dir, tmp_path, caplog):
    GatedStorageTransport.gate = threading.Event()
    GatedStorageTransport.fail = False
    llm = LLM(str(tiny_model_dir), **engine_kwargs(tmp_path, connector=GATED, kv_save_timeout_s=0.5))
    core = llm.core
    try:
        with caplog.at_level(logging.WARNING):
            t0 = time.monotonic()
            llm.generate({"prompt_token_ids": the_prompt(seed=4)}, GREEDY, use_tqdm=False)
            assert 0.4 < time.monotonic() - t0 < 10
        assert "1 saves not finished within kv_save_timeout_s=0.5 s" in caplog.text
        assert stored_blocks(tmp_path) == 0
        # Not idle while the save is in flight (it is not stranded: the engine keeps at it)...
        assert core.has_work() and core.kv_pending() and core.num_pending_kv_saves() == 1
        # ...yet no block is held for it: they were copied out, the store is what hangs.
        assert_no_leak(core)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            llm.shutdown()
        assert "1 saves dropped at shutdown" in caplog.text
        assert core.kv_saves_dropped == 1 and dropped_saves_metric(llm) == 1
        assert_no_leak(core)
    finally:
        GatedStorageTransport.gate.set()
        llm.shutdown()


def test_a_save_whose_export_fails_is_counted_and_holds_no_block(tiny_model_dir, tmp_path, caplog):
    GatedStorageTransport.gate = threading.Event()
    GatedStorageTransport.fail = True
    llm = LLM(str(tiny_model_dir), **engine_kwargs(tmp_path, connector=GATED))
    try:
        with caplog.at_level(logging.WARNING):
            t0 = time.monotonic()
            llm.generate({"prompt_token_ids": the_prompt(seed=5)}, GREEDY, use_tqdm=False)
            assert time.monotonic() - t0 < 5  # a failed export is over: nothing to wait for
        assert "dropped: its export failed" in caplog.text
        assert dropped_saves_metric(llm) == 1 and stored_blocks(tmp_path) == 0
        assert_idle_and_no_leak(llm.core)
    finally:
        GatedStorageTransport.fail = False
        GatedStorageTransport.gate.set()
        llm.shutdown()
