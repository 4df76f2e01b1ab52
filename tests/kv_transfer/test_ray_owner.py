"""The Ray object store connector's owner actor: a consumer that asks for an export before it
has landed is answered the moment the producer's hold arrives (one waiting call, not a poll
every few ms on the actor the whole cluster shares), and a consumer still loads through an
owner started by an older fleetserve that lacks that call (detached actors outlive
upgrades). A load is checked and written chunk by chunk, up to the first damaged block.
Both real worker halves, a real local Ray. And the up-front mapping of the store's memory."""

from __future__ import annotations

import mmap
import time
import types

import pytest
import torch

from fleetserve.kv_transfer.base import KVConnectorRole
from fleetserve.kv_transfer.config import KVTransferConfig
from fleetserve.kv_transfer.connectors import ray_owner, ray_store, ray_store_warmup
from fleetserve.kv_transfer.factory import build_context
from fleetserve.kv_transfer.keys import chain_keys
from tests.kv_transfer.utils import load_before_export

BS, LAYERS, HEADS, HD, NUM_BLOCKS = 4, 2, 2, 8, 16
CFG = types.SimpleNamespace(
    num_attention_heads=4,
    num_key_value_heads=HEADS,
    hidden_size=32,
    num_hidden_layers=LAYERS,
    vocab_size=97,
    model_type="llama",
    head_dim=HD,
)


def make_pair(owner_name: str, **extra):
    halves = []
    for seed, role in ((0, "kv_producer"), (1, "kv_consumer")):
        cfg = KVTransferConfig(
            kv_connector="RayObjectStoreConnector",
            kv_role=role,
            kv_load_timeout_s=20,
            kv_connector_extra_config={"owner_name": owner_name, **extra},
            engine_id=f"owner-{role}-{time.monotonic_ns()}",
        )
        w = ray_store.RayObjectStoreConnector(
            cfg, KVConnectorRole.WORKER, build_context(cfg, "m", CFG, torch.float32, BS)
        )
        g = torch.Generator().manual_seed(seed)
        w.register_kv_caches([torch.randn((2, HEADS, NUM_BLOCKS, BS, HD), generator=g) for _ in range(LAYERS)])
        halves.append(w)
    return halves


def early_load(prod, cons, tid: str, delay_s: float) -> set[int]:
    """The consumer asks for `tid` first, the producer exports it `delay_s` later; the
    consumer's failed blocks."""
    keys = chain_keys(prod.ctx.fingerprint, list(range(1, 1 + 3 * BS)), BS, 3)
    assert load_before_export(prod, cons, tid, keys, [0, 1, 2], delay_s) >= delay_s * 0.8
    prod.half.wait_for_exports(10)
    prod.get_finished(set())
    return cons.get_block_ids_with_load_errors()


def same_blocks(prod, cons) -> bool:
    return all(torch.equal(p[:, :, :3], c[:, :, :3]) for p, c in zip(prod.half.kv_caches, cons.half.kv_caches))


@pytest.fixture
def owner_name(local_ray):
    name = f"kv-owner-test-{time.monotonic_ns()}"
    yield name
    try:
        local_ray.kill(local_ray.get_actor(name, namespace="fleetserve"))
    except ValueError:
        pass


def test_a_consumer_early_for_its_export_is_answered_when_it_lands(local_ray, owner_name):
    # The owner up first: calls made while its process starts are run in any order (seen in
    # CI: the hold before the consumer's ask, which then had nothing to wait for).
    local_ray.get(ray_owner.get_owner(local_ray, owner_name, "fleetserve").stats.remote(), timeout=60)
    prod, cons = make_pair(owner_name)
    try:
        assert early_load(prod, cons, "early-1", 1.0) == set()
        assert same_blocks(prod, cons)
        stats = local_ray.get(ray_owner.get_owner(local_ray, owner_name, "fleetserve").stats.remote())
        assert stats["waits"] == 1 and stats["woken"] == 1  # one call waited; the hold answered it
    finally:
        prod.shutdown()
        cons.shutdown()


def test_an_owner_without_wait_lookup_still_serves_by_polling(local_ray, owner_name):
    old = type("OldKVObjectOwner", (ray_owner.KVObjectOwner,), {"wait_lookup": None})
    handle = (
        local_ray.remote(old)
        .options(name=owner_name, namespace="fleetserve", lifetime="detached", num_cpus=0, max_concurrency=16)
        .remote()
    )
    local_ray.get(handle.stats.remote())
    prod, cons = make_pair(owner_name)
    try:
        assert early_load(prod, cons, "early-2", 0.3) == set()
        assert same_blocks(prod, cons)
        assert local_ray.get(handle.stats.remote())["waits"] == 0
    finally:
        prod.shutdown()
        cons.shutdown()


def test_a_load_is_written_chunk_by_chunk_up_to_its_first_damaged_block(local_ray, owner_name, monkeypatch):
    from fleetserve.kv_transfer.blocks import BlockBatch

    local_ray.get(ray_owner.get_owner(local_ray, owner_name, "fleetserve").stats.remote(), timeout=60)
    per_block = LAYERS * 2 * HEADS * BS * HD * 4
    prod, cons = make_pair(owner_name, stream_chunk_bytes=per_block)  # one block a chunk
    deliveries = []
    real_deliver = ray_store.deliver_verified
    monkeypatch.setattr(
        ray_store, "deliver_verified", lambda *a, **k: deliveries.append(a[-1]) or real_deliver(*a, **k)
    )
    transport = prod.half.transport
    real_export = transport.export

    def damaged_export(spec, batch):  # block 2 of 4 changes after its digest was taken
        sums = batch.checksums()
        data = batch.data.clone()
        data[2].view(-1)[5] += 1.0
        batch.release()
        real_export(spec, BlockBatch(batch.fingerprint, batch.keys, data, batch.heads, sums, batch.digest))

    monkeypatch.setattr(transport, "export", damaged_export)
    try:
        before = [c.clone() for c in cons.half.kv_caches]
        ids, tid = [3, 2, 1, 0], "chunks-1"
        keys = chain_keys(prod.ctx.fingerprint, list(range(1, 1 + 4 * BS)), BS, 4)
        load_before_export(prod, cons, tid, keys, ids, 0.0, {"remote_tp_size": 1, **transport.location(tid)})
        prod.half.wait_for_exports(10)
        assert cons.get_block_ids_with_load_errors() == {1, 0}  # the damaged block and after it
        assert len(deliveries) == 1  # checked and written through the chunked path
        for p, c, b in zip(prod.half.kv_caches, cons.half.kv_caches, before):
            assert torch.equal(c[:, :, 3], p[:, :, 3]) and torch.equal(c[:, :, 2], p[:, :, 2])
            assert torch.equal(c[:, :, :2], b[:, :, :2])  # nothing of the bad block or after it
        stats = cons.half.take_stats()
        assert stats["failed_loads"] == 1
        assert stats["bytes_recv"] == [2 * per_block]
    finally:
        prod.shutdown()
        cons.shutdown()


def test_the_store_mapping_warm_up_maps_allocated_memory_and_leaves_sparse_memory_alone(tmp_path):
    """The warm-up (ray_store_warmup.map_store) on two shared file mappings named as Ray names its
    store's file: a fully allocated one is mapped in whole (this process's resident pages),
    a sparse one gets no page (mapping it would allocate the store's memory)."""
    import os
    import tempfile
    import threading

    if not ray_store_warmup.populate_supported():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14): the warm-up is a no-op")

    def rss_kib(lo):  # this process's resident KiB of the mapping that starts at `lo`
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                first = line.split()[0]
                if "-" in first and ":" not in first:
                    inside = int(first.split("-")[0], 16) == lo
                elif inside and line.startswith("Rss:"):
                    return int(line.split()[1])
        raise AssertionError("mapping not found")

    size = 8 << 20
    where = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)  # (where Ray puts it)
    with tempfile.TemporaryDirectory(dir=where) as folder:
        mms, maps = [], {}
        for kind in ("allocated", "sparse"):
            path = os.path.join(folder, f"plasma-{kind}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if kind == "allocated":
                    os.posix_fallocate(fd, 0, size)
                else:
                    os.ftruncate(fd, size)
                mms.append(mmap.mmap(fd, size, mmap.MAP_SHARED))
            finally:
                os.close(fd)
            maps[kind] = next(
                m for m in ray_store_warmup.store_mappings() if os.readlink(f"/proc/self/map_files/{m[2]}") == path
            )
        try:
            for lo, hi, _ in maps.values():
                assert hi - lo == size and rss_kib(lo) == 0
            assert ray_store_warmup.map_store(threading.Event(), mappings=list(maps.values())) == size
            assert rss_kib(maps["allocated"][0]) == size >> 10  # all of it, now
            assert rss_kib(maps["sparse"][0]) == 0
            assert os.stat(os.path.join(folder, "plasma-sparse")).st_blocks == 0  # nothing allocated
            stop = threading.Event()
            stop.set()  # a shutdown stops a warm-up between its calls
            assert ray_store_warmup.map_store(stop, mappings=list(maps.values())) == 0
        finally:
            for mm in mms:
                mm.close()
