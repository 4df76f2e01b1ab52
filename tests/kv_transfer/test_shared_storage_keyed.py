"""Keyed digests on the shared-storage folder (`"digest": "keyed"`): blocks written with the
cluster's KV secret load; a block planted by someone without it (a well-formed file, its
xxh3 digests right) is refused, counted, removed and recomputed; a valid block copied under
another block's name is refused too. Real BlockStores and real worker halves on a folder."""

from __future__ import annotations

import shutil
import time
import types

import pytest
import torch

from fleetserve.kv_transfer.base import ConnectorMetadata, KVConnectorRole, LoadSpec, SaveSpec
from fleetserve.kv_transfer.blocks import BlockBatch
from fleetserve.kv_transfer.cache_copy import gather_blocks
from fleetserve.kv_transfer.config import KVTransferConfig
from fleetserve.kv_transfer.connectors.shared_storage import BlockStore, SharedStorageConnector
from fleetserve.kv_transfer.digests import KeyedDigest
from fleetserve.kv_transfer.factory import build_context
from fleetserve.kv_transfer.keys import chain_keys, kv_fingerprint
from fleetserve.kv_transfer.secret import KV_SECRET_ENV, ClusterSecret

SECRET = "the-clusters-kv-secret-0123456789"
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


def caches(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((2, HEADS, NUM_BLOCKS, BS, HD), generator=g) for _ in range(LAYERS)]


def batch_of(fp: str, keys: list[str], seed: int) -> BlockBatch:
    return BlockBatch(fp, keys, gather_blocks(caches(seed), list(range(len(keys)))), (0, HEADS))


def test_a_keyed_folder_loads_its_own_blocks_and_refuses_forged_or_moved_ones(tmp_path):
    fp = kv_fingerprint("m", CFG, torch.float32, BS)
    keys = chain_keys(fp, list(range(1, 1 + 4 * BS)), BS, 4)
    keyed = BlockStore(tmp_path, fp, (0, HEADS), keyed=KeyedDigest(ClusterSecret(SECRET.encode())))
    real = batch_of(fp, keys, seed=0)
    keyed.put(real)
    for i, key in enumerate(keys):
        got = keyed.get(key)
        assert got is not None and torch.equal(got.data[0], real.data[i])
    # Someone who can write the folder but has no secret plants their own KV for key 0: a
    # well-formed file (unkeyed writer), then one keyed with another secret.
    planted = batch_of(fp, keys[:1], seed=7)
    keyed.path(keys[0]).unlink()
    BlockStore(tmp_path, fp, (0, HEADS)).put(planted)
    assert keyed.get(keys[0]) is None and keyed.refused == 1 and not keyed.path(keys[0]).exists()
    BlockStore(tmp_path, fp, (0, HEADS), keyed=KeyedDigest(ClusterSecret(b"not-the-clusters-secret!"))).put(planted)
    assert keyed.get(keys[0]) is None and keyed.refused == 2
    # A valid block copied under another block's name (another prefix) is refused too.
    keyed.path(keys[2]).unlink()
    shutil.copy(keyed.path(keys[1]), keyed.path(keys[2]))
    assert keyed.get(keys[2]) is None and keyed.refused == 3
    # Torn: the keyed digest cut off.
    p = keyed.path(keys[3])
    p.write_bytes(p.read_bytes()[:-5])
    assert keyed.get(keys[3]) is None and keyed.refused == 4
    # What is left untouched still loads; an unkeyed reader refuses keyed files (one mode a folder).
    assert keyed.get(keys[1]) is not None
    assert BlockStore(tmp_path, fp, (0, HEADS)).get(keys[1]) is None


def half(tmp_path, monkeypatch, secret, seed, digest="keyed"):
    if secret is None:
        monkeypatch.delenv(KV_SECRET_ENV, raising=False)
    else:
        monkeypatch.setenv(KV_SECRET_ENV, secret)
    cfg = KVTransferConfig(
        kv_connector="SharedStorageConnector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"path": str(tmp_path), "digest": digest},
    )
    w = SharedStorageConnector(cfg, KVConnectorRole.WORKER, build_context(cfg, "m", CFG, torch.float32, BS))
    w.register_kv_caches(caches(seed))
    return w


def save(w, blocks: list[int], keys: list[str]) -> None:
    w.bind_connector_metadata(ConnectorMetadata(saves=[SaveSpec("w", None, blocks, keys, 60)]))
    w.start_load_kv()
    w.half.wait_for_exports(30)
    w.clear_connector_metadata()


def load(w, blocks: list[int], keys: list[str]) -> set[int]:
    """A prefix-cache hit's load of `keys` into `blocks`; the failed block ids (recomputed)."""
    w.bind_connector_metadata(ConnectorMetadata(loads=[LoadSpec("c", None, blocks, keys, time.time() + 20)]))
    w.start_load_kv()
    w.clear_connector_metadata()
    deadline = time.monotonic() + 20
    while "c" not in w.get_finished(set())[1]:
        assert time.monotonic() < deadline, "load still running"
        time.sleep(0.002)
    return set(w.get_block_ids_with_load_errors())


def test_an_engine_recomputes_planted_blocks_and_loads_the_ones_written_with_the_key(tmp_path, monkeypatch):
    writer = half(tmp_path, monkeypatch, SECRET, seed=0)
    keys = chain_keys(writer.ctx.fingerprint, list(range(1, 1 + 3 * BS)), BS, 3)
    save(writer, [0, 1, 2], keys)
    # Block 1 is replaced by a folder writer without the secret (its own KV, well formed).
    attacker = half(tmp_path / "elsewhere", monkeypatch, None, seed=5, digest="unkeyed")
    save(attacker, [0, 1, 2], keys)
    store = writer.half.transport.store
    planted = attacker.half.transport.store.path(keys[1])
    shutil.copy(planted, store.path(keys[1]))
    reader = half(tmp_path, monkeypatch, SECRET, seed=9)
    for c in reader.half.kv_caches:
        c[:, :, 3:6] = -1.0
    assert reader.half.transport.lookup(keys) == 3  # the files are there ...
    assert load(reader, [3, 4, 5], keys) == {4, 5}  # ... block 0 loads, the rest is recomputed
    w, r = writer.half.kv_caches, reader.half.kv_caches
    assert all(torch.equal(a[:, :, 0], b[:, :, 3]) for a, b in zip(w, r))
    assert all(bool((b[:, :, 4:6] == -1.0).all()) for b in r)  # nothing planted landed
    assert reader.half.transport.store.refused == 1 and not store.path(keys[1]).exists()
    assert (reader.half.take_stats() or {}).get("failed_loads") == 1  # vllm:kv_transfer_failed_loads
    # Written again with the key (the recompute's save), every block loads.
    save(writer, [0, 1, 2], keys)
    assert load(reader, [3, 4, 5], keys) == set()
    assert all(torch.equal(a[:, :, :3], b[:, :, 3:6]) for a, b in zip(w, r))
    assert not reader.half.staging._in_use  # every staging buffer back, the refused load's too
    for x in (writer, attacker, reader):
        x.shutdown()


def test_keyed_digests_need_the_secret_and_a_known_mode(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="needs the cluster's KV secret"):
        half(tmp_path, monkeypatch, None, seed=0)
    with pytest.raises(ValueError, match='must be "unkeyed" or "keyed"'):
        KVTransferConfig(
            kv_connector="SharedStorageConnector", kv_connector_extra_config={"path": "/kv", "digest": "hmac"}
        )
    assert SECRET not in repr(KeyedDigest(ClusterSecret(SECRET.encode())))
