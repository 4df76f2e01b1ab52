"""Helpers for engine-level KV transfer tests: two engines, one hand-off, a reference."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Optional

from fleetserve.replica.engine.async_engine import AsyncEngine
from fleetserve.scheduler import SamplingParams

BLOCK = 4
NUM_BLOCKS = 128


def engine(model_dir, kv: Optional[dict] = None, **kw) -> AsyncEngine:
    kw.setdefault("core_process", True)
    return AsyncEngine(
        model=str(model_dir),
        dtype="float32",
        block_size=BLOCK,
        num_gpu_blocks_override=NUM_BLOCKS,
        max_model_len=256,
        kv_transfer_config=kv,
        **kw,
    )


async def collect(eng: AsyncEngine, prompt, sp: SamplingParams, params: Optional[dict] = None):
    tokens, final = [], None
    async for out in eng.generate(prompt, sp, kv_transfer_params=params):
        tokens.extend(out.outputs[0].token_ids)
        final = out
    return tokens, final


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


async def hand_off(
    prod: AsyncEngine,
    cons: AsyncEngine,
    prompt: list[int],
    max_tokens: int,
    transfer_id: Optional[str] = None,
    mutate=None,
):
    """Prefill on `prod` (max_tokens=1), decode on `cons` with the producer's params."""
    tid = transfer_id or uuid.uuid4().hex
    _, pfinal = await collect(prod, prompt, greedy(1), {"do_remote_decode": True, "transfer_id": tid})
    params = pfinal.kv_transfer_params
    assert params is not None and params["transfer_id"] == tid
    if mutate is not None:
        params = mutate(dict(params))
    tokens, final = await collect(cons, prompt, greedy(max_tokens), params)
    return tokens, final, params


def wait_all_free(eng: AsyncEngine, timeout_s: float = 10.0) -> dict:
    """Every block back in the pool (a producer frees one step after its last output)."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = eng.get_load()
        if load["num_free_blocks"] == load["num_blocks"] and load["num_running"] == 0 and load["num_waiting"] == 0:
            return load
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still held: {load}")
        time.sleep(0.02)


def run(coro):
    return asyncio.run(coro)


def load_before_export(
    prod,
    cons,
    tid: str,
    keys: list[str],
    blocks: list[int],
    delay_s: float,
    source: Optional[dict] = None,
    timeout_s: float = 20.0,
) -> float:
    """Worker halves: the consumer asks for `tid` into `blocks` first, the producer exports its
    same blocks `delay_s` later (on a thread). Returns the seconds the load took; fails the
    test if it does not finish within `timeout_s`."""
    import threading

    from fleetserve.kv_transfer.base import ConnectorMetadata, LoadSpec, SaveSpec

    deadline = time.time() + timeout_s
    cons.bind_connector_metadata(ConnectorMetadata(loads=[LoadSpec("r0", tid, blocks, keys, deadline, source or {})]))
    cons.start_load_kv()
    cons.clear_connector_metadata()

    def export_later():
        time.sleep(delay_s)
        prod.bind_connector_metadata(ConnectorMetadata(saves=[SaveSpec("r0", tid, blocks, keys, 60)]))
        prod.start_load_kv()
        prod.clear_connector_metadata()

    threading.Thread(target=export_later).start()
    t0 = time.monotonic()
    while "r0" not in cons.get_finished(set())[1]:
        assert time.time() < deadline, "the load never finished"
        time.sleep(0.005)
    return time.monotonic() - t0
