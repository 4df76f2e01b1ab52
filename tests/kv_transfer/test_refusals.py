"""Per connector, worker level: what a consumer must refuse arrives through the real transport
(P2P: gloo, streamed; the Ray object store) and is refused there: bytes damaged after their
digests were taken, blocks exported under another prompt's chain keys (stale), blocks of
another model (foreign fingerprint). Every refused block is reported failed, none of its
bytes land in the consumer's cache, and the next good hand-off works. (Shared storage's
files: tests/kv_transfer/test_blocks.py.)"""

from __future__ import annotations

import time
import types

import pytest
import torch

from fleetserve.kv_transfer.base import ConnectorMetadata, KVConnectorRole, LoadSpec, SaveSpec
from fleetserve.kv_transfer.config import KVTransferConfig
from fleetserve.kv_transfer.connectors import ray_owner
from fleetserve.kv_transfer.factory import build_context, resolve_connector_class
from fleetserve.kv_transfer.keys import chain_keys

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
BLOCKS = [0, 1, 2]


def half(name: str, role: str, extra: dict, model: str = "m", faults: dict | None = None):
    if faults:
        name, extra = "FaultInjectionConnector", {"inner": name, "inner_extra": extra, "faults": faults}
    cfg = KVTransferConfig(
        kv_connector=name,
        kv_role=role,
        kv_load_timeout_s=10,
        kv_connector_extra_config=extra,
        engine_id=f"refuse-{role}-{time.monotonic_ns()}",
    )
    w = resolve_connector_class(name)(cfg, KVConnectorRole.WORKER, build_context(cfg, model, CFG, torch.float32, BS))
    seed = 0 if role == "kv_producer" else 1
    w.register_kv_caches(
        [
            torch.randn((2, HEADS, NUM_BLOCKS, BS, HD), generator=torch.Generator().manual_seed(seed))
            for _ in range(LAYERS)
        ]
    )
    return w


def hand_off(prod, cons, tid: str) -> set[int]:
    keys = chain_keys(
        prod.ctx.fingerprint, [(hash(tid) + j) % 90 + 1 for j in range(len(BLOCKS) * BS)], BS, len(BLOCKS)
    )
    prod.bind_connector_metadata(ConnectorMetadata(saves=[SaveSpec("p", tid, BLOCKS, keys, 60)]))
    prod.start_load_kv()
    prod.clear_connector_metadata()
    prod.half.wait_for_exports(10)
    # The consumer's own keys: its fingerprint (another model's differs) over the same tokens.
    ckeys = chain_keys(
        cons.ctx.fingerprint, [(hash(tid) + j) % 90 + 1 for j in range(len(BLOCKS) * BS)], BS, len(BLOCKS)
    )
    cons.bind_connector_metadata(
        ConnectorMetadata(
            loads=[
                LoadSpec(
                    "c",
                    tid,
                    BLOCKS,
                    ckeys,
                    time.time() + 10,
                    {"remote_tp_size": 1, "remote_engine_id": prod.ctx.engine_id, **prod.half.transport.location(tid)},
                )
            ]
        )
    )
    cons.start_load_kv()
    cons.clear_connector_metadata()
    deadline = time.monotonic() + 15
    while "c" not in cons.get_finished(set())[1]:
        assert time.monotonic() < deadline, "load never finished"
        time.sleep(0.005)
    prod.get_finished(set())
    return set(cons.get_block_ids_with_load_errors())


CONNECTORS = {"P2PConnector": {"host": "127.0.0.1"}, "RayObjectStoreConnector": {}}


@pytest.mark.parametrize("connector", list(CONNECTORS))
@pytest.mark.parametrize("bad", ["corrupt", "stale", "foreign"])
def test_bad_blocks_are_refused_and_none_of_their_bytes_land(local_ray, connector, bad):
    extra = dict(CONNECTORS[connector])
    if connector == "RayObjectStoreConnector":  # an owner of its own, up before the timing starts
        extra["owner_name"] = f"kv-owner-refuse-{time.monotonic_ns()}"
        local_ray.get(ray_owner.get_owner(local_ray, extra["owner_name"], "fleetserve").stats.remote(), timeout=60)
    faults = {bad: 1.0} if bad != "foreign" else None
    prod = half(connector, "kv_producer", extra, faults=faults)
    cons = half(connector, "kv_consumer", extra, model="another-model" if bad == "foreign" else "m")
    good_prod = half(connector, "kv_producer", extra, model="another-model" if bad == "foreign" else "m")
    try:
        before = [c.clone() for c in cons.half.kv_caches]
        assert hand_off(prod, cons, f"bad-{bad}") == set(BLOCKS)
        assert all(torch.equal(a, b) for a, b in zip(before, cons.half.kv_caches))  # nothing landed
        if "owner_name" in extra:  # refused, the export goes at once, not when its lease ends
            owner = local_ray.get_actor(extra["owner_name"], namespace="fleetserve")
            deadline = time.monotonic() + 5
            while local_ray.get(owner.stats.remote())["held"]:
                assert time.monotonic() < deadline, "the refused export is still held"
                time.sleep(0.02)
        assert hand_off(good_prod, cons, f"good-{bad}") == set()
        assert all(
            torch.equal(p[:, :, BLOCKS], c[:, :, BLOCKS]) for p, c in zip(good_prod.half.kv_caches, cons.half.kv_caches)
        )
    finally:
        for w in (prod, cons, good_prod):
            w.shutdown()
        if "owner_name" in extra:
            local_ray.kill(local_ray.get_actor(extra["owner_name"], namespace="fleetserve"))
