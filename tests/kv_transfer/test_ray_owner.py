"""The Ray object store connector's owner actor: a consumer that asks for an export before it
has landed is answered the moment the producer's hold arrives (one waiting call, not a poll
every few ms on the actor the whole cluster shares), and a consumer still loads through an
owner started by an older fleetserve that lacks that call (detached actors outlive
upgrades). Both real worker halves, a real local Ray."""

from __future__ import annotations

import time
import types

import pytest
import torch

from fleetserve.kv_transfer import ray_store
from fleetserve.kv_transfer.base import KVConnectorRole
from fleetserve.kv_transfer.blocks import chain_keys
from fleetserve.kv_transfer.config import KVTransferConfig
from fleetserve.kv_transfer.factory import build_context
from tests.kv_transfer.utils import load_before_export

BS, LAYERS, HEADS, HD, NUM_BLOCKS = 4, 2, 2, 8, 16
CFG = types.SimpleNamespace(num_attention_heads=4, num_key_value_heads=HEADS, hidden_size=32,
                            num_hidden_layers=LAYERS, vocab_size=97, model_type="llama", head_dim=HD)


def make_pair(owner_name: str):
    halves = []
    for seed, role in ((0, "kv_producer"), (1, "kv_consumer")):
        cfg = KVTransferConfig(kv_connector="RayObjectStoreConnector", kv_role=role, kv_load_timeout_s=20,
                               kv_connector_extra_config={"owner_name": owner_name},
                               engine_id=f"owner-{role}-{time.monotonic_ns()}")
        w = ray_store.RayObjectStoreConnector(cfg, KVConnectorRole.WORKER,
                                              build_context(cfg, "m", CFG, torch.float32, BS))
        g = torch.Generator().manual_seed(seed)
        w.register_kv_caches([torch.randn((2, HEADS, NUM_BLOCKS, BS, HD), generator=g)
                              for _ in range(LAYERS)])
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
    local_ray.get(ray_store.get_owner(local_ray, owner_name, "fleetserve").stats.remote(), timeout=60)
    prod, cons = make_pair(owner_name)
    try:
        assert early_load(prod, cons, "early-1", 1.0) == set()
        assert same_blocks(prod, cons)
        stats = local_ray.get(ray_store.get_owner(local_ray, owner_name, "fleetserve").stats.remote())
        assert stats["waits"] == 1 and stats["woken"] == 1  # one call waited; the hold answered it
    finally:
        prod.shutdown()
        cons.shutdown()


def test_an_owner_without_wait_lookup_still_serves_by_polling(local_ray, owner_name):
    old = type("OldKVObjectOwner", (ray_store.KVObjectOwner,), {"wait_lookup": None})
    handle = local_ray.remote(old).options(name=owner_name, namespace="fleetserve", lifetime="detached",
                                           num_cpus=0, max_concurrency=16).remote()
    local_ray.get(handle.stats.remote())
    prod, cons = make_pair(owner_name)
    try:
        assert early_load(prod, cons, "early-2", 0.3) == set()
        assert same_blocks(prod, cons)
        assert local_ray.get(handle.stats.remote())["waits"] == 0
    finally:
        prod.shutdown()
        cons.shutdown()
