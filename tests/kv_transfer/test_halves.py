"""Both real connector halves around the real scheduler (tests.scheduler's fake model for
tokens, a real torch KV cache for the worker half, an in-memory transport): deadlines,
aborts while receiving, and late bytes that must never land."""

from __future__ import annotations

import threading
import time
import types

import torch

from fleetserve.kv_transfer.base import ConnectorContext, KVConnectorRole, run_connector_step
from fleetserve.kv_transfer.blocks import BlockBatch
from fleetserve.kv_transfer.config import KVTransferConfig
from fleetserve.kv_transfer.keys import chain_keys, kv_fingerprint
from fleetserve.kv_transfer.transfer import TransferConnector
from fleetserve.kv_transfer.transport import Transport
from fleetserve.scheduler import Request, RequestStatus, SamplingParams
from tests.scheduler.utils import (
    FakeModelRunner,
    assert_invariants,
    create_scheduler,
    reference_tokens,
    run_to_completion,
)

BS, LAYERS, HEADS, HD, NUM_BLOCKS = 4, 2, 2, 8, 32
CFG = types.SimpleNamespace(
    num_attention_heads=2,
    num_key_value_heads=HEADS,
    hidden_size=16,
    num_hidden_layers=LAYERS,
    vocab_size=97,
    model_type="llama",
)
FP = kv_fingerprint("m", CFG, torch.float32, BS)
CTX = ConnectorContext("e", FP, BS, LAYERS, HEADS, HD)


class GatedTransport(Transport):
    """Fetches wait for `gate`, then return `batch` (whatever was registered)."""

    gate = threading.Event()
    batch: BlockBatch = None

    def export(self, spec, batch):
        type(self).batch = batch

    def fetch(self, spec):
        type(self).gate.wait(30)
        return type(self).batch


class GatedConnector(TransferConnector):
    transport_cls = GatedTransport


def build(timeout_s=0.3, policy="recompute"):
    cfg = KVTransferConfig(
        kv_connector="tests.kv_transfer.test_halves:GatedConnector",
        kv_load_timeout_s=timeout_s,
        kv_load_failure_policy=policy,
    )
    sched_half = GatedConnector(cfg, KVConnectorRole.SCHEDULER, CTX)
    worker = GatedConnector(cfg, KVConnectorRole.WORKER, CTX)
    caches = [torch.zeros((2, HEADS, NUM_BLOCKS, BS, HD)) for _ in range(LAYERS)]
    worker.register_kv_caches(caches)
    sched = create_scheduler(connector=sched_half, block_size=BS, num_blocks=NUM_BLOCKS)
    fake = FakeModelRunner(NUM_BLOCKS, BS)
    runner = types.SimpleNamespace(execute=lambda so: run_connector_step(worker, so, fake.execute))
    GatedTransport.gate = threading.Event()
    prompt = [1 + i for i in range(18)]
    keys = chain_keys(FP, prompt, BS, 4)
    GatedTransport.batch = BlockBatch(FP, keys, torch.ones((4, LAYERS, 2, HEADS, BS, HD)), (0, HEADS))
    req = Request(
        "r0",
        prompt,
        SamplingParams(max_tokens=3, ignore_eos=True),
        kv_transfer_params={"do_remote_prefill": True, "transfer_id": "t1", "remote_num_tokens": 16},
    )
    return sched, runner, worker, caches, req


def step(sched, runner):
    so = sched.schedule()
    outs = sched.update_from_output(so, runner.execute(so))
    assert_invariants(sched)
    return {o.request_id: o for o in outs}


def load_in_time(sched, runner, req) -> None:
    """Step until the request's load (its bytes already there) is reported."""
    sched.add_request(req)
    for _ in range(200):
        step(sched, runner)
        if req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            break
        time.sleep(0.005)


def test_a_load_past_its_deadline_recomputes_and_its_late_bytes_never_land():
    sched, runner, worker, caches, req = build(timeout_s=0.3)
    sched.add_request(req)
    step(sched, runner)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    t0 = time.monotonic()
    while req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
        step(sched, runner)  # steps with no tokens still poll the load
        assert time.monotonic() - t0 < 5
    assert time.monotonic() - t0 >= 0.2
    assert req.num_computed_tokens == 0 and req.num_external_computed_tokens == 0
    GatedTransport.gate.set()  # the bytes arrive after all
    tokens, _ = run_to_completion(sched, runner)
    assert tokens["r0"] == reference_tokens(req, sched.config.max_model_len)
    assert all(not c.any() for c in caches)  # nothing was written into the cache
    assert sched.kv.num_free_blocks == NUM_BLOCKS


def test_the_same_load_in_time_is_written_and_counted():
    sched, runner, worker, caches, req = build(timeout_s=10)
    GatedTransport.gate.set()
    load_in_time(sched, runner, req)
    assert req.status == RequestStatus.WAITING and req.num_external_computed_tokens == 16
    # A hand-off is read once: after a preemption the request recomputes.
    assert sched.connector.get_num_new_matched_tokens(req, 0) == (0, False)
    blocks = sched.kv.get_block_ids("r0")[:4]
    for c in caches:
        assert c[:, :, blocks].eq(1).all() and c.sum() == c[:, :, blocks].sum()
    sched.abort_requests(["r0"])
    run_to_completion(sched, runner)
    assert sched.kv.num_free_blocks == NUM_BLOCKS


def test_abort_while_receiving_frees_only_after_the_worker_dropped_the_load():
    sched, runner, worker, caches, req = build(timeout_s=10)
    sched.add_request(req)
    step(sched, runner)
    held = NUM_BLOCKS - sched.kv.num_free_blocks
    assert held == 4
    assert sched.abort_requests(["r0"]) == ["r0"]
    assert NUM_BLOCKS - sched.kv.num_free_blocks == held  # a write could still land
    step(sched, runner)  # the worker sees the cancel, drops the load, says so
    assert sched.kv.num_free_blocks == NUM_BLOCKS and not sched.has_requests()
    GatedTransport.gate.set()
    time.sleep(0.05)
    step(sched, runner)
    assert all(not c.any() for c in caches)


def test_a_lost_notice_is_failed_by_the_scheduler_after_deadline_and_grace(monkeypatch):
    from fleetserve.kv_transfer import scheduler_half

    monkeypatch.setattr(scheduler_half, "NOTICE_GRACE_S", 0.2)
    sched, runner, worker, caches, req = build(timeout_s=0.2, policy="fail")
    worker.half.get_finished = lambda ids: (set(), set())  # the worker never reports
    sched.add_request(req)
    t0 = time.monotonic()
    outs = {}
    while "r0" not in outs:
        outs.update(step(sched, runner))
        assert time.monotonic() - t0 < 5
        time.sleep(0.01)
    assert outs["r0"].finish_reason == "error"
    step(sched, runner)  # the workers hear of the finish
    assert sched.kv.num_free_blocks == NUM_BLOCKS and not sched.has_requests()


def test_a_cpu_cache_is_written_on_the_transfer_thread_not_the_engines(monkeypatch):
    """A load's copy into a CPU cache (7 ms for a 2k-token SmolLM2 prompt) runs on its transfer
    thread: the engine's steps never wait for it."""
    from fleetserve.kv_transfer import loads

    writers = []
    real = loads.scatter_blocks
    monkeypatch.setattr(loads, "scatter_blocks", lambda *a: writers.append(threading.current_thread()) or real(*a))
    sched, runner, worker, caches, req = build(timeout_s=10)
    GatedTransport.gate.set()
    load_in_time(sched, runner, req)
    assert req.num_external_computed_tokens == 16
    assert len(writers) == 1 and writers[0] is not threading.main_thread()
    blocks = sched.kv.get_block_ids("r0")[:4]
    assert all(c[:, :, blocks].eq(1).all() for c in caches)
    run_to_completion(sched, runner)
    assert sched.kv.num_free_blocks == NUM_BLOCKS


def test_abort_during_a_write_waits_for_it_and_nothing_lands_after(monkeypatch):
    """The scheduler hears that a cancelled load is dropped only once no byte of it can land:
    a write under way on the transfer thread finishes first (the cancel waits for it), and the
    blocks, once freed, are never written again."""
    from fleetserve.kv_transfer import loads

    started, events = threading.Event(), []
    real = loads.scatter_blocks

    def slow(*a):
        started.set()
        time.sleep(0.3)
        real(*a)
        events.append("written")

    monkeypatch.setattr(loads, "scatter_blocks", slow)
    sched, runner, worker, caches, req = build(timeout_s=10)
    GatedTransport.gate.set()
    sched.add_request(req)
    step(sched, runner)
    assert started.wait(5)
    assert sched.abort_requests(["r0"]) == ["r0"]
    step(sched, runner)  # the worker's cancel waits for the write under way
    assert events == ["written"]
    step(sched, runner)
    assert sched.kv.num_free_blocks == NUM_BLOCKS and not sched.has_requests()
    for c in caches:
        c.zero_()
    time.sleep(0.1)
    assert all(not c.any() for c in caches) and events == ["written"]


def test_a_cpu_cache_is_copied_out_off_the_engines_thread_and_its_blocks_kept_until_done(monkeypatch):
    """A finished request's blocks are copied out on the worker's copy-out thread (a shared-
    storage connector exports every finished request: the engine's step must not wait for
    that copy); the request is reported in finished_sending, which lets the scheduler reuse
    its blocks, only once every layer is copied; the export then holds the cache's bytes."""
    from fleetserve.kv_transfer import worker_half
    from fleetserve.kv_transfer.base import ConnectorMetadata, SaveSpec

    started, copied = threading.Event(), []
    real = worker_half.gather_layer

    def slow(kv, idx, out, layer):
        if layer == 0:
            started.set()
            time.sleep(1.0)
        real(kv, idx, out, layer)
        copied.append(threading.current_thread())

    monkeypatch.setattr(worker_half, "gather_layer", slow)
    cfg = KVTransferConfig(kv_connector="tests.kv_transfer.test_halves:GatedConnector", kv_role="kv_both")
    worker = GatedConnector(cfg, KVConnectorRole.WORKER, CTX)
    caches = [torch.randn((2, HEADS, NUM_BLOCKS, BS, HD)) for _ in range(LAYERS)]
    worker.register_kv_caches(caches)
    GatedTransport.batch = None
    blocks = [5, 6, 7, 8]
    keys = chain_keys(FP, list(range(1, 1 + 4 * BS)), BS, 4)
    worker.bind_connector_metadata(ConnectorMetadata(saves=[SaveSpec("r0", "t-out", blocks, keys, 60)]))
    t0 = time.monotonic()
    worker.start_load_kv()  # returns at once: the copy (1 s here) is on the copy-out thread
    worker.clear_connector_metadata()
    assert started.wait(5)
    assert "r0" not in worker.get_finished(set())[0]  # still copying: its blocks stay taken
    sending: set[str] = set()
    while "r0" not in sending:
        assert time.monotonic() - t0 < 5
        sending |= worker.get_finished(set())[0]
        time.sleep(0.01)
    assert len(copied) == LAYERS and all(t is not threading.main_thread() for t in copied)
    worker.half.wait_for_exports(10)
    exported = GatedTransport.batch
    assert exported is not None and exported.keys == keys
    for layer, c in enumerate(caches):
        assert torch.equal(exported.data[:, layer], c[:, :, blocks].permute(2, 0, 1, 3, 4))
    worker.shutdown()


def test_a_load_ending_wakes_an_idle_engine_and_the_next_step_sees_it():
    """An engine idling on transfers alone waits on its own wake-up, which it gives the
    worker half (`set_wakeup`; no module-global event); the load's transfer thread calls it
    only once the load's future is done, so the step right after the wake reports the load."""
    sched, runner, worker, caches, req = build(timeout_s=10)
    ours, seen = threading.Event(), []
    sched.add_request(req)
    step(sched, runner)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    load = worker.half._loads["r0"]

    def wake():
        if threading.current_thread() in worker.half._pool._threads:
            seen.append(load.future.done())
            ours.set()

    worker.set_wakeup(wake)
    GatedTransport.gate.set()
    assert ours.wait(5)
    assert seen == [True]  # woken once, after the future was done
    step(sched, runner)
    assert req.status == RequestStatus.WAITING and req.num_external_computed_tokens == 16
    run_to_completion(sched, runner)
    assert sched.kv.num_free_blocks == NUM_BLOCKS
