"""Streamed P2P hand-offs: the producer exports a batch before it is gathered and sends each
chunk (its blocks' digests, then its bytes) as soon as it is copied out; the consumer checks
each chunk as it lands and writes it into its blocks while the next one arrives. Real worker
halves, real gloo between two threads of this process, a local Ray for the directory.

Each test ends with a hand-off that works, on whatever groups are left."""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch

from fleetserve.kv_transfer import loads, worker_half
from fleetserve.kv_transfer.base import ConnectorMetadata, KVConnectorRole, LoadSpec, SaveSpec
from fleetserve.kv_transfer.blocks import BlockBatch, batch_from_tensor, check_header, parse_header
from fleetserve.kv_transfer.config import KVTransferConfig
from fleetserve.kv_transfer.connectors import p2p, p2p_server
from fleetserve.kv_transfer.errors import KVFormatError
from fleetserve.kv_transfer.factory import build_context
from fleetserve.kv_transfer.keys import chain_keys
from fleetserve.kv_transfer.stream import MAX_CHUNKS, plan_chunks
from fleetserve.replica.worker.omp_bind import one_core_per_thread

BS, LAYERS, HEADS, HD, NUM_BLOCKS = 4, 2, 2, 8, 64
N = 9  # blocks per hand-off: chunks of 2 blocks (the last one 1)
CFG = types.SimpleNamespace(
    num_attention_heads=4,
    num_key_value_heads=HEADS,
    hidden_size=32,
    num_hidden_layers=LAYERS,
    vocab_size=97,
    model_type="llama",
    head_dim=HD,
)


def make_pair(dtype=torch.float32):
    halves = []
    block_bytes = LAYERS * 2 * HEADS * BS * HD * torch.empty((), dtype=dtype).element_size()
    for seed, role in ((0, "kv_producer"), (1, "kv_consumer")):
        cfg = KVTransferConfig(
            kv_connector="p2p",
            kv_role=role,
            kv_load_timeout_s=20,
            kv_connector_extra_config={"host": "127.0.0.1", "stream_chunk_bytes": 2 * block_bytes},
            engine_id=f"stream-{role}-{time.monotonic_ns()}",
        )
        w = p2p.P2PConnector(cfg, KVConnectorRole.WORKER, build_context(cfg, "m", CFG, dtype, BS))
        w.set_thread_initializer(one_core_per_thread)  # as the replica's worker does
        g = torch.Generator().manual_seed(seed)
        w.register_kv_caches(
            [torch.randn((2, HEADS, NUM_BLOCKS, BS, HD), generator=g).to(dtype) for _ in range(LAYERS)]
        )
        halves.append(w)
    return halves


@pytest.fixture
def pair(local_ray):
    halves = make_pair()
    yield halves
    for w in halves:
        w.shutdown()


def start(prod, cons, tid: str, blocks: list[int], timeout_s: float = 20.0) -> None:
    """Export `tid` from the producer's `blocks` and start loading it into the same block ids
    of the consumer at once, as P/D does (the consumer's pull may overtake the copy-out)."""
    tokens = [(hash(tid) + j) % 90 + 1 for j in range(len(blocks) * BS)]
    keys = chain_keys(prod.ctx.fingerprint, tokens, BS, len(blocks))
    prod.bind_connector_metadata(ConnectorMetadata(saves=[SaveSpec("p", tid, blocks, keys, 60)]))
    prod.start_load_kv()
    prod.clear_connector_metadata()
    spec = LoadSpec(
        "c", tid, blocks, keys, time.time() + timeout_s, {"remote_tp_size": 1, "remote_engine_id": prod.ctx.engine_id}
    )
    cons.bind_connector_metadata(ConnectorMetadata(loads=[spec]))
    cons.start_load_kv()
    cons.clear_connector_metadata()


def finish(prod, cons, timeout_s: float = 20.0) -> set[int]:
    """Wait for the load; returns the consumer's failed block ids. The producer's blocks are
    reported free (finished_sending) too."""
    deadline = time.monotonic() + timeout_s
    while "c" not in cons.get_finished(set())[1]:
        assert time.monotonic() < deadline, "load still running"
        time.sleep(0.002)
    prod.half.wait_for_exports(10)
    sent: set[str] = set()
    while "p" not in sent:
        assert time.monotonic() < deadline, "producer's blocks never reported free"
        sent |= prod.get_finished(set())[0]
        time.sleep(0.002)
    return set(cons.get_block_ids_with_load_errors())


def same(prod, cons, blocks) -> bool:
    return all(torch.equal(p[:, :, blocks], c[:, :, blocks]) for p, c in zip(prod.half.kv_caches, cons.half.kv_caches))


def scribble(cons, blocks) -> None:
    for c in cons.half.kv_caches:
        c[:, :, blocks] = -1.0


def unchanged(cons, blocks) -> bool:
    return all(bool((c[:, :, blocks] == -1.0).all()) for c in cons.half.kv_caches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_streamed_hand_off_arrives_bit_identical_in_chunks(local_ray, monkeypatch, dtype):
    prod, cons = make_pair(dtype)
    writes = []
    real = loads.Sink.write
    monkeypatch.setattr(
        loads.Sink, "write", lambda self, s, d, n: (writes.append((s, d.shape[0], n)), real(self, s, d, n))
    )
    try:
        blocks = [3, 17, 4, 40, 41, 42, 9, 60, 1]  # scattered, as a busy engine's are
        start(prod, cons, "bits", blocks)
        assert finish(prod, cons) == set()
        assert same(prod, cons, blocks)
        assert writes == [(0, 2, 2), (2, 2, 2), (4, 2, 2), (6, 2, 2), (8, 1, 1)]
        assert prod.half.transport.held() == 0 and prod.half.transport.kept_groups() == (1, 0)
    finally:
        prod.shutdown()
        cons.shutdown()


def test_the_first_chunks_move_while_later_ones_are_still_being_copied_out(pair, monkeypatch):
    """The copy-out is slowed down: the consumer writes chunk 0 before the producer has
    gathered the last chunk, and every block still arrives intact."""
    prod, cons = pair
    events = []
    real_gather = worker_half.gather_layer

    def slow_gather(kv, idx, out, layer):
        time.sleep(0.1)  # 1 s of copy-out in all: the first write comes well before its end
        real_gather(kv, idx, out, layer)
        if layer == LAYERS - 1:
            events.append(("gathered", time.monotonic()))

    real_write = loads.Sink.write

    def write(self, s, d, n):
        real_write(self, s, d, n)
        events.append(("written", time.monotonic()))

    monkeypatch.setattr(worker_half, "gather_layer", slow_gather)
    monkeypatch.setattr(loads.Sink, "write", write)
    blocks = list(range(N))
    start(prod, cons, "overlap", blocks)
    assert finish(prod, cons) == set()
    assert same(prod, cons, blocks)
    first_written = next(t for e, t in events if e == "written")
    last_gathered = max(t for e, t in events if e == "gathered")
    assert first_written < last_gathered, events


def test_a_corrupt_chunk_keeps_the_blocks_before_it_and_writes_nothing_after(pair, monkeypatch):
    """Bytes damaged after their digests were taken (block 5, in chunk 2): blocks 0-4 are
    written and good, 5-8 fail and are never written; the group stays and serves next."""
    prod, cons = pair
    real = p2p_server.P2PServer._send_chunks

    def damaging(self, pg, pid, batch, chunks, flat):
        per = flat.numel() // batch.data.shape[0]
        batch.progress.wait_all(10)  # (digests taken) then damage block 5
        flat[5 * per + 7] ^= 0x40
        return real(self, pg, pid, batch, chunks, flat)

    monkeypatch.setattr(p2p_server.P2PServer, "_send_chunks", damaging)
    blocks = list(range(N))
    scribble(cons, blocks)
    start(prod, cons, "corrupt", blocks)
    assert finish(prod, cons) == set(range(5, N))
    assert same(prod, cons, list(range(5)))
    assert unchanged(cons, list(range(5, N)))
    monkeypatch.setattr(p2p_server.P2PServer, "_send_chunks", real)
    start(prod, cons, "after", blocks)
    assert finish(prod, cons) == set() and same(prod, cons, blocks)
    assert cons.half.transport.kept_groups() == (0, 1)


def test_a_copy_out_that_fails_midway_fails_the_load_at_once(pair, monkeypatch):
    """The producer's gather of chunk 2 raises: the stream says so after chunk 1, the
    consumer's load fails well before its deadline with every block reported, the producer's
    blocks are still reported free, both sides drop the group, and the next hand-off forms a
    new one."""
    prod, cons = pair
    real_gather = worker_half.gather_layer
    calls = []

    def failing(kv, idx, out, layer):
        calls.append(1)
        if len(calls) == 2 * LAYERS + 1:
            raise RuntimeError("gather failed (injected)")
        real_gather(kv, idx, out, layer)

    monkeypatch.setattr(worker_half, "gather_layer", failing)
    blocks = list(range(N))
    t0 = time.monotonic()
    start(prod, cons, "broken", blocks, timeout_s=15)
    assert finish(prod, cons) == set(blocks)
    assert time.monotonic() - t0 < 5
    assert prod.half.transport.held() == 0
    deadline = time.monotonic() + 5
    while prod.half.transport.kept_groups() != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert prod.half.transport.kept_groups() == (0, 0) and cons.half.transport.kept_groups() == (0, 0)
    monkeypatch.setattr(worker_half, "gather_layer", real_gather)
    start(prod, cons, "after", blocks)
    assert finish(prod, cons) == set() and same(prod, cons, blocks)


def test_a_load_given_up_midstream_writes_nothing_more(pair, monkeypatch):
    """The scheduler cancels the load after its first chunk was written: the cancel waits for
    a write under way, nothing lands afterwards, and the blocks are reported free."""
    prod, cons = pair
    first = threading.Event()
    cancelled = threading.Event()
    real = loads.Sink.write

    def write(self, s, d, n):
        real(self, s, d, n)
        if s == 0:
            first.set()
            assert cancelled.wait(10)

    monkeypatch.setattr(loads.Sink, "write", write)
    blocks = list(range(N))
    scribble(cons, blocks)
    start(prod, cons, "cancel", blocks)
    assert first.wait(10)
    cons.bind_connector_metadata(ConnectorMetadata(cancels=["c"]))
    cons.start_load_kv()
    cons.clear_connector_metadata()
    cancelled.set()
    assert "c" in cons.get_finished(set())[0]  # its blocks may be reused now
    time.sleep(0.3)  # the stream goes on arriving: none of it lands
    assert same(prod, cons, [0, 1]) and unchanged(cons, blocks[2:])
    monkeypatch.setattr(loads.Sink, "write", real)
    prod.half.wait_for_exports(10)
    prod.get_finished(set())
    start(prod, cons, "after", blocks)
    assert finish(prod, cons) == set() and same(prod, cons, blocks)


def test_a_consumer_that_does_not_stream_gets_the_whole_batch(pair):
    """A pull without a sink (a consumer joining head shards of several producer ranks, or an
    older fleetserve) is answered with the whole batch once it is gathered, digests in its
    header, and the next streamed hand-off still works on the same group."""
    prod, cons = pair
    blocks = [5, 0, 7, 2, 8, 1, 3, 6, 4]
    keys = chain_keys(prod.ctx.fingerprint, [(j * 7) % 90 + 1 for j in range(N * BS)], BS, N)
    prod.bind_connector_metadata(ConnectorMetadata(saves=[SaveSpec("p", "whole", blocks, keys, 60)]))
    prod.start_load_kv()
    prod.clear_connector_metadata()
    batch = cons.half.transport.fetch(
        LoadSpec(
            "x", "whole", blocks, keys, time.time() + 20, {"remote_tp_size": 1, "remote_engine_id": prod.ctx.engine_id}
        )
    )
    try:
        assert batch.keys == keys and len(batch.digests) == N
        for layer, kv in enumerate(prod.half.kv_caches):
            assert torch.equal(batch.data[:, layer], kv.permute(2, 0, 1, 3, 4)[blocks])
    finally:
        batch.release()
    prod.half.wait_for_exports(10)
    prod.get_finished(set())
    start(prod, cons, "after", list(range(N)))
    assert finish(prod, cons) == set() and same(prod, cons, list(range(N)))


def test_transfer_threads_copy_on_one_core(pair):
    """With the engine's 2 intra-op threads, a transfer thread's copies still run on one core
    (the initializer the replica gives the worker half runs on every pool thread) and nobody
    else's setting changes."""
    prod, _ = pair
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert prod.half._pool.submit(torch.get_num_threads).result() == 1
        assert prod.half._copy_pool.submit(torch.get_num_threads).result() == 1
        assert torch.get_num_threads() == 2
        got = []
        t = threading.Thread(target=lambda: got.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert got == [2]  # other threads keep the process's setting
    finally:
        torch.set_num_threads(before)


def test_streamed_headers_are_checked():
    fp = "f" * 32
    data = torch.randn(3, 2, 2, 1, 4, 8)
    batch = BlockBatch(fp, ["a", "b", "c"], data, (0, 1))
    meta, _ = parse_header(batch.header([2, 1]))
    assert meta["digests"] is None and meta["chunks"] == [2, 1]
    check_header(meta, fp)
    for bad in (
        {"chunks": [2, 2]},
        {"chunks": [3, 0]},
        {"chunks": []},
        {"chunks": "3"},
        {"digests": [1, 2, 3]},
        {"chunks": [1] * (MAX_CHUNKS + 1)},
        {"shape": [MAX_CHUNKS + 1, 2, 2, 1, 4, 8], "keys": ["k"] * (MAX_CHUNKS + 1), "chunks": [1] * (MAX_CHUNKS + 1)},
    ):
        with pytest.raises(KVFormatError):
            check_header({**meta, **bad}, fp)
    with pytest.raises(KVFormatError, match="streamed"):  # its digests are not in the header
        batch_from_tensor(meta, data.view(torch.uint8).reshape(-1), fp)
    assert plan_chunks(9, 100, 250) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 9)]
    assert plan_chunks(1, 1 << 30) == [(0, 1)]
    assert len(plan_chunks(10_000, 1)) <= MAX_CHUNKS
