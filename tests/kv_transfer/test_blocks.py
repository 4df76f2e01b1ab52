"""Worker level: blocks round trip bit-identical through the cache, the wire format and
the shared-storage folder; corrupt, truncated, stale and foreign entries are refused."""

from __future__ import annotations

import os
import types

import pytest
import torch

from fleetserve.kv_transfer.blocks import (
    BlockBatch,
    batch_from_tensor,
    decode_from_bytes,
    encode_to_bytes,
    parse_header,
)
from fleetserve.kv_transfer.cache_copy import block_index, block_runs, gather_blocks, gather_layer, scatter_blocks
from fleetserve.kv_transfer.connectors.shared_storage import BlockStore
from fleetserve.kv_transfer.errors import KVFormatError
from fleetserve.kv_transfer.keys import chain_keys, kv_fingerprint
from fleetserve.kv_transfer.shards import local_head_range
from fleetserve.kv_transfer.staging import StagingPool

CFG = types.SimpleNamespace(
    num_attention_heads=4,
    num_key_value_heads=2,
    hidden_size=64,
    num_hidden_layers=3,
    vocab_size=384,
    model_type="llama",
    rope_theta=1e4,
)
LAYOUTS = [  # (layers, kv heads, block size, head dim)
    (3, 2, 4, 16),
    (2, 1, 16, 64),
    (1, 3, 8, 8),
]


def random_caches(layers, heads, num_blocks, bs, hd, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((2, heads, num_blocks, bs, hd), generator=g).to(dtype) for _ in range(layers)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_blocks_round_trip_bit_identical(dtype, layout, tmp_path):
    layers, heads, bs, hd = layout
    src = random_caches(layers, heads, 10, bs, hd, dtype)
    dst = [torch.zeros_like(c) for c in src]
    fp = kv_fingerprint("m", CFG, dtype, bs)
    keys = chain_keys(fp, list(range(3 * bs)), bs, 3)
    batch = BlockBatch(fp, keys, gather_blocks(src, [7, 2, 5]), (0, heads))
    back = decode_from_bytes(encode_to_bytes(batch), fp)
    assert back.keys == keys and back.heads == (0, heads)
    scatter_blocks(dst, [1, 3, 4], back.data)
    for s, d in zip(src, dst):
        for a, b in ((7, 1), (2, 3), (5, 4)):
            assert torch.equal(s[:, :, a].view(torch.uint8), d[:, :, b].view(torch.uint8))
        assert not d[:, :, 0].any() and not d[:, :, 9].any()  # nothing else written
    # The same through the folder.
    store = BlockStore(tmp_path, fp, (0, heads))
    store.put(batch)
    for i, key in enumerate(keys):
        got = store.get(key)
        assert got is not None and got.keys == [key]
        assert torch.equal(got.data[0].view(torch.uint8), batch.data[i].view(torch.uint8))


def test_chain_keys_depend_on_every_earlier_token_salt_and_fingerprint():
    fp = kv_fingerprint("m", CFG, torch.float32, 4)
    base = chain_keys(fp, list(range(12)), 4, 3)
    changed = chain_keys(fp, [99] + list(range(1, 12)), 4, 3)
    assert all(a != b for a, b in zip(base, changed))  # a change in block 0 moves every key
    assert chain_keys(fp, list(range(12)), 4, 3, cache_salt="tenant") != base
    other = kv_fingerprint("m", CFG, torch.bfloat16, 4)
    assert chain_keys(other, list(range(12)), 4, 3) != base
    # Engines whose key blocks are laid out differently (the CPU kernel's tiled keys) share nothing.
    assert kv_fingerprint("m", CFG, torch.bfloat16, 16, "k_tiled") != kv_fingerprint("m", CFG, torch.bfloat16, 16)
    assert kv_fingerprint("m", CFG, torch.bfloat16, 16, "rows") == kv_fingerprint("m", CFG, torch.bfloat16, 16)
    assert chain_keys(fp, list(range(10)), 4, 3) == base[:2]  # full blocks only


def test_fingerprints_differ_with_the_rope():
    """Keys are cached after rope: engines whose rope theta, type or scaling differ must not
    share blocks, in transformers 5's `rope_parameters` form (what ModelConfig and AutoConfig
    give) and in the older `rope_theta` / `rope_scaling` form."""
    from fleetserve.replica.model_loader.model_config import ModelConfig

    def v5(**rope):
        params = {"rope_type": "default", "rope_theta": 1e4, **rope}
        return types.SimpleNamespace(**{**vars(CFG), "rope_parameters": params})

    base = kv_fingerprint("m", v5(), torch.float32, 4)
    assert kv_fingerprint("m", v5(), torch.float32, 4) == base
    assert kv_fingerprint("m", v5(rope_theta=5e5), torch.float32, 4) != base
    assert kv_fingerprint("m", v5(rope_type="linear", factor=2.0), torch.float32, 4) != base
    old = kv_fingerprint("m", CFG, torch.float32, 4)
    assert kv_fingerprint("m", types.SimpleNamespace(**{**vars(CFG), "rope_theta": 5e5}), torch.float32, 4) != old
    scaled = types.SimpleNamespace(**{**vars(CFG), "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert kv_fingerprint("m", scaled, torch.float32, 4) != old
    # What an engine fingerprints with: its ModelConfig from config.json.
    fields = dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=384,
    )
    a = ModelConfig.from_dict({**fields, "rope_theta": 1e4})
    b = ModelConfig.from_dict({**fields, "rope_theta": 5e5})
    assert kv_fingerprint("m", a, torch.float32, 4) != kv_fingerprint("m", b, torch.float32, 4)


def test_corrupt_truncated_and_foreign_payloads_are_refused():
    fp = kv_fingerprint("m", CFG, torch.float32, 4)
    batch = BlockBatch(
        fp,
        chain_keys(fp, list(range(8)), 4, 2),
        gather_blocks(random_caches(3, 2, 4, 4, 16, torch.float32), [0, 1]),
        (0, 2),
    )
    raw = bytearray(encode_to_bytes(batch))
    flipped = bytearray(raw)
    flipped[-5] ^= 0x40
    with pytest.raises(KVFormatError, match="block 1 fails its xxh3_64 digest"):
        decode_from_bytes(bytes(flipped), fp)
    with pytest.raises(KVFormatError, match="truncated"):
        decode_from_bytes(bytes(raw[:-100]), fp)
    with pytest.raises(KVFormatError, match="fingerprint"):
        decode_from_bytes(bytes(raw), kv_fingerprint("other-model", CFG, torch.float32, 4))
    with pytest.raises(KVFormatError, match="magic"):
        decode_from_bytes(b"garbage" * 10, fp)


def test_store_refuses_and_removes_bad_files_and_never_sees_half_writes(tmp_path):
    fp = kv_fingerprint("m", CFG, torch.float32, 4)
    keys = chain_keys(fp, list(range(12)), 4, 3)
    batch = BlockBatch(fp, keys, gather_blocks(random_caches(3, 2, 4, 4, 16, torch.float32), [0, 1, 2]), (0, 2))
    store = BlockStore(tmp_path, fp, (0, 2))
    store.put(batch)
    # Corrupt block 0, truncate block 1, rename block 2 under another key (stale).
    p0, p1, p2 = (store.path(k) for k in keys)
    data = bytearray(p0.read_bytes())
    data[-1] ^= 1
    p0.write_bytes(bytes(data))
    p1.write_bytes(p1.read_bytes()[:-64])
    stale_key = chain_keys(fp, list(range(100, 112)), 4, 3)[2]
    os.makedirs(store.path(stale_key).parent, exist_ok=True)
    os.replace(p2, store.path(stale_key))
    assert store.get(keys[0]) is None and not p0.exists()
    assert store.get(keys[1]) is None and not p1.exists()
    assert store.get(stale_key) is None  # the file holds another key's block
    # A writer that died mid-write leaves only a temporary file: never a hit.
    (store.tmp / f"{keys[0]}.123.ab.tmp").write_bytes(b"FSKV" + b"\0" * 10)
    assert store.get(keys[0]) is None
    # Another model's folder is another folder: same keys, no hit.
    foreign = BlockStore(tmp_path, kv_fingerprint("x", CFG, torch.float32, 4), (0, 2))
    foreign.put(batch)  # written under the wrong fingerprint name...
    store.put(batch)
    assert store.get(keys[0]) is not None  # ...and refused there; ours is whole again


def test_store_evicts_least_recently_used_under_its_cap(tmp_path):
    fp = kv_fingerprint("m", CFG, torch.float32, 4)
    caches = random_caches(3, 2, 8, 4, 16, torch.float32)
    keys = chain_keys(fp, list(range(32)), 4, 8)
    one = BlockBatch(fp, keys[:1], gather_blocks(caches, [0]), (0, 2))
    size = len(one.header()) + one.nbytes
    store = BlockStore(tmp_path, fp, (0, 2), max_bytes=int(size * 4.5))
    for i in range(4):
        store.put(BlockBatch(fp, [keys[i]], gather_blocks(caches, [i]), (0, 2)))
        os.utime(store.path(keys[i]), (1000 + i, 1000 + i))
    assert store.get(keys[0]) is not None  # block 0 is now the most recently used
    store.put(BlockBatch(fp, [keys[4]], gather_blocks(caches, [4]), (0, 2)))
    present = [store.contains(k) for k in keys[:5]]
    assert present[0] and present[4] and not present[1], present
    assert sum(p.stat().st_size for p in store.dir.glob("*/*.kvb")) <= store.max_bytes


def test_head_ranges_cover_the_model_once_or_replicate():
    assert [local_head_range(4, 2, r) for r in range(2)] == [(0, 2), (2, 4)]
    assert [local_head_range(3, 3, r) for r in range(3)] == [(0, 1), (1, 2), (2, 3)]
    assert [local_head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]


def test_device_digest_path_refuses_a_changed_or_moved_word():
    """wsum64 is what the NCCL path checks on the GPU; the same code runs on CPU tensors here."""
    fp = kv_fingerprint("m", CFG, torch.float32, 4)
    data = gather_blocks(random_caches(3, 2, 4, 4, 16, torch.float32), [0, 1, 2])
    batch = BlockBatch(fp, chain_keys(fp, list(range(12)), 4, 3), data, (0, 2), digest="wsum64")
    meta, _ = parse_header(batch.header())
    assert meta["digest"] == "wsum64"
    raw = data.clone().view(torch.uint8).view(-1)
    assert batch_from_tensor(meta, raw.clone(), fp).keys == batch.keys
    flipped = raw.clone()
    flipped[-3] ^= 0x01
    with pytest.raises(KVFormatError, match="block 2 fails its wsum64 digest"):
        batch_from_tensor(meta, flipped, fp)
    words = raw.clone().view(torch.int32)
    words[[5, 6]] = words[[6, 5]]  # two words swapped inside block 0
    if not torch.equal(words[5], words[6]):
        with pytest.raises(KVFormatError, match="block 0 fails"):
            batch_from_tensor(meta, words.view(torch.uint8), fp)


def test_gather_and_scatter_take_head_slices_and_given_buffers():
    """A TP consumer writes only its heads of a wider batch; gather fills a caller's buffer."""
    src = random_caches(2, 4, 6, 4, 8, torch.float32)
    out = torch.full((2, 2, 2, 4, 4, 8), float("nan"))
    assert gather_blocks(src, [5, 1], out) is out
    dst = random_caches(2, 2, 6, 4, 8, torch.float32, seed=1)
    before = [d.clone() for d in dst]
    scatter_blocks(dst, [0, 3], out[:, :, :, 2:4])  # heads 2..3 of the batch
    for s_, d, b in zip(src, dst, before):
        assert torch.equal(d[:, :, 0], s_[:, 2:4, 5]) and torch.equal(d[:, :, 3], s_[:, 2:4, 1])
        assert torch.equal(d[:, :, [1, 2, 4, 5]], b[:, :, [1, 2, 4, 5]])


ID_ORDERS = {  # block ids as a cache hands them out: fresh (ascending), reused (descending
    # runs: a finished request's blocks go back reversed), mixed, and scattered
    "ascending": list(range(3, 43)),
    "descending": list(range(44, 4, -1)),
    "runs both ways": list(range(0, 12)) + list(range(30, 18, -1)) + [40] + list(range(45, 60)),
    "runs at both ends of the cache": list(range(2, -1, -1)) + list(range(61, 64)),
    "scattered": [17, 3, 40, 8, 9, 2, 33, 60, 61, 5, 12, 50],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("order", list(ID_ORDERS))
def test_gather_and_scatter_equal_index_ops_for_every_id_order(order, dtype):
    """The CPU copies go run by run (numpy byte views) or by index ops: both must move
    exactly the blocks index_select / index_copy_ move, in batch order, and nothing else."""
    ids = ID_ORDERS[order]
    src = random_caches(3, 2, 64, 4, 8, dtype)
    want = torch.stack([torch.stack([kv[:, :, b] for kv in src]) for b in ids])  # [n, L, 2, h, bs, hd]
    got = gather_blocks(src, ids)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    # Streamed exports gather a chunk at a time from a slice of the index.
    idx, chunked = block_index(ids, "cpu"), torch.full_like(want, float("nan"))
    for s, e in ((0, 5), (5, 6), (6, len(ids))):
        for layer, kv in enumerate(src):
            gather_layer(kv, idx[s:e], chunked[s:e], layer)
    assert torch.equal(chunked.view(torch.uint8), want.view(torch.uint8))
    dst = random_caches(3, 2, 64, 4, 8, dtype, seed=1)
    before = [d.clone() for d in dst]
    scatter_blocks(dst, ids, want)
    others = [b for b in range(64) if b not in ids]
    for layer, (d, b) in enumerate(zip(dst, before)):
        assert torch.equal(d[:, :, ids].view(torch.uint8), want[:, layer].permute(1, 2, 0, 3, 4).view(torch.uint8))
        assert torch.equal(d[:, :, others].view(torch.uint8), b[:, :, others].view(torch.uint8))


def test_block_runs_and_their_slices():
    assert block_runs([5, 6, 7, 3, 2, 9]) == [(0, 3, 5, 1), (3, 5, 3, -1), (5, 6, 9, 1)]
    assert block_runs([]) == [] and block_runs([4]) == [(0, 1, 4, 1)]
    idx = block_index([5, 6, 7, 3, 2, 9], "cpu")
    part = idx[1:5]
    assert part.ids == [6, 7, 3, 2] and part.tensor.tolist() == [6, 7, 3, 2]
    assert part.runs == [(0, 2, 6, 1), (2, 4, 3, -1)]
    assert idx[4:4].runs == [] and len(idx[4:4]) == 0


def test_scatter_refuses_blocks_that_do_not_fit_the_cache():
    dst = random_caches(2, 2, 8, 4, 8, torch.float32)
    before = [d.clone() for d in dst]
    for data in (
        torch.zeros(2, 2, 2, 1, 4, 8),  # one head where the cache has two
        torch.zeros(3, 2, 2, 2, 4, 8),  # three blocks for two ids
        torch.zeros(2, 1, 2, 2, 4, 8),
    ):  # one layer for two
        with pytest.raises(ValueError, match="do not fit"):
            scatter_blocks(dst, [1, 2], data)
    assert all(torch.equal(a, b) for a, b in zip(dst, before))


def test_staging_pool_reuses_buffers_and_keeps_under_its_cap():
    pool = StagingPool(max_bytes=1000)
    a, give_a = pool.take((10, 10), torch.float32)  # 400 bytes
    ptr = a.data_ptr()
    give_a()
    give_a()  # twice is once
    b, give_b = pool.take((5, 10), torch.float32)  # fits the cached buffer: reused
    assert b.data_ptr() == ptr and pool.cached_bytes == 0
    c, give_c = pool.take((150,), torch.float32)  # 600 bytes: 1000 handed out in all
    give_b()
    give_c()
    assert pool.cached_bytes == 1000 and pool.in_use_bytes == 0


def test_staging_pool_refuses_what_would_pass_its_cap_and_serves_once_room_comes_back():
    """Buffers handed out count against the cap (an export held for its consumer keeps its
    buffer): a take past it is refused, counted, and kept buffers are dropped to make room."""
    from fleetserve.kv_transfer.staging import StagingFull

    pool = StagingPool(max_bytes=1000)
    held, give_held = pool.take((600,), torch.uint8)
    with pytest.raises(StagingFull, match="staging_max_bytes"):
        pool.take((600,), torch.uint8)
    with pytest.raises(StagingFull):
        pool.take((1001,), torch.uint8)  # over the cap on its own
    assert pool.num_refused == 2 and pool.in_use_bytes == 600
    small, give_small = pool.take((300,), torch.uint8)  # fits beside it
    give_small()
    give_held()
    assert pool.cached_bytes == 900 and pool.in_use_bytes == 0
    big, give_big = pool.take((700,), torch.uint8)  # none fits: the kept ones make room
    assert pool.in_use_bytes + pool.cached_bytes <= 1000
    give_big()
    assert pool.in_use_bytes == 0 and pool.cached_bytes <= 1000


def test_staging_pool_drops_the_least_recently_given_back_first():
    pool = StagingPool(max_bytes=1200)
    (_, give_a), (b, give_b) = pool.take((400,), torch.uint8), pool.take((500,), torch.uint8)
    give_a()
    give_b()
    assert pool.cached_bytes == 900
    c, give_c = pool.take((600,), torch.uint8)  # none fits; 600 + 900 is over the cap: the 400 goes
    assert pool.cached_bytes == 500 and pool.in_use_bytes == 600
    again, _ = pool.take((450,), torch.uint8)  # the smallest that fits: the 500 kept
    assert again.data_ptr() == b.data_ptr()


def test_store_reads_blocks_straight_into_a_given_buffer(tmp_path):
    fp = kv_fingerprint("m", CFG, torch.bfloat16, 4)
    keys = chain_keys(fp, list(range(8)), 4, 2)
    batch = BlockBatch(fp, keys, gather_blocks(random_caches(3, 2, 4, 4, 16, torch.bfloat16), [3, 0]), (0, 2))
    store = BlockStore(tmp_path, fp, (0, 2))
    store.put(batch)
    out = torch.zeros_like(batch.data)
    got = store.get(keys[1], out=out[1:2])
    assert got.data.data_ptr() == out[1].data_ptr()
    assert torch.equal(out[1].view(torch.uint8), batch.data[1].view(torch.uint8)) and not out[0].any()
    # A buffer of another shape: the file cannot be what the fingerprint says; refused.
    assert store.get(keys[0], out=torch.zeros(1, 3, 2, 2, 4, 8, dtype=torch.bfloat16)) is None


def test_digests_behind_a_gather_and_ahead_of_a_write_equal_the_whole_batchs():
    from fleetserve.kv_transfer.digests import DigestsBehind, digests_ahead, host_digests
    from fleetserve.kv_transfer.stream import plan_chunks

    data = torch.randn(13, 2, 2, 2, 4, 8)
    whole = host_digests(data.view(torch.uint8).numpy(), 13)
    chunks = plan_chunks(13, data[0].numel() * 4, 3 * data[0].numel() * 4)
    assert len(chunks) == 5  # 3+3+3+3+1 blocks
    behind = DigestsBehind(data)
    for s, e in chunks:
        behind.add(s, e)
    assert behind.result() == whole
    seen = [(s, e, got) for s, e, got in digests_ahead(data, chunks)]
    assert [(s, e) for s, e, _ in seen] == chunks
    assert [d for _, _, got in seen for d in got] == whole


class RecordingSink:
    """stream.ChunkSink's interface (loads.Sink): what a verified delivery hands over, in order."""

    def __init__(self, want=None):
        self.begun, self.writes, self.want = None, [], want

    def begin(self, fingerprint, keys, heads, shape, dtype):
        self.begun = (fingerprint, list(keys), heads, list(shape), dtype)

    def wanted(self):
        return self.begun[3][0] if self.want is None else self.want

    def write(self, start, data, n_ok):
        self.writes.append((start, data.clone(), n_ok))


@pytest.mark.parametrize("bad_block", [None, 0, 4, 6])
def test_a_verified_delivery_hands_over_chunks_in_order_up_to_the_first_damaged_block(bad_block):
    from fleetserve.kv_transfer.blocks import deliver_verified

    src = random_caches(2, 2, 10, 4, 8, torch.float32)
    fp = kv_fingerprint("m", CFG, torch.float32, 4)
    keys = chain_keys(fp, list(range(7 * 4)), 4, 7)
    ids = [9, 8, 7, 1, 2, 3, 5]
    batch = BlockBatch(fp, keys, gather_blocks(src, ids), (0, 2))
    meta, off = parse_header(batch.header())
    payload = bytearray(batch.payload().tobytes())
    per = len(payload) // 7
    if bad_block is not None:  # one byte of one block changed after its digest was taken
        payload[bad_block * per + per // 2] ^= 0x10
    sink = RecordingSink()
    back = deliver_verified(meta, payload, fp, sink, chunk_bytes=2 * per)  # 2 blocks a chunk
    assert sink.begun == (fp, keys, (0, 2), list(batch.data.shape), torch.float32)
    chunks = [(0, 2), (2, 4), (4, 6), (6, 7)]
    if bad_block is not None:  # up to the chunk holding the damaged block, then nothing
        chunks = [(s, e) for s, e in chunks if s <= bad_block]
    assert [s for s, _, _ in sink.writes] == [s for s, _ in chunks]
    for (s, data, n_ok), (_, e) in zip(sink.writes, chunks):
        assert n_ok == (bad_block - s if bad_block is not None and s <= bad_block < e else e - s)
        assert torch.equal(data[:n_ok], batch.data[s : s + n_ok])
    assert sum(n for _, _, n in sink.writes) == (7 if bad_block is None else bad_block)
    assert back.keys == keys and back.digests == batch.checksums()


def test_a_verified_delivery_refuses_a_truncated_or_streamed_payload_before_writing():
    from fleetserve.kv_transfer.blocks import deliver_verified

    src = random_caches(2, 2, 4, 4, 8, torch.float32)
    fp = kv_fingerprint("m", CFG, torch.float32, 4)
    batch = BlockBatch(fp, chain_keys(fp, list(range(8)), 4, 2), gather_blocks(src, [0, 1]), (0, 2))
    meta, _ = parse_header(batch.header())
    sink = RecordingSink()
    with pytest.raises(KVFormatError, match="truncated"):
        deliver_verified(meta, batch.payload().tobytes()[:-4], fp, sink)
    streamed, _ = parse_header(batch.header(chunks=[1, 1]))
    with pytest.raises(KVFormatError):
        deliver_verified(streamed, batch.payload().tobytes(), fp, sink)
    with pytest.raises(KVFormatError, match="fingerprint"):
        deliver_verified(meta, batch.payload().tobytes(), "another", sink)
    assert sink.begun is None and sink.writes == []


def test_a_verified_delivery_checks_only_the_blocks_its_load_can_use():
    from fleetserve.kv_transfer.blocks import deliver_verified

    src = random_caches(2, 2, 8, 4, 8, torch.float32)
    fp = kv_fingerprint("m", CFG, torch.float32, 4)
    batch = BlockBatch(fp, chain_keys(fp, list(range(24)), 4, 6), gather_blocks(src, list(range(6))), (0, 2))
    meta, _ = parse_header(batch.header())
    per = batch.nbytes // 6
    payload = bytearray(batch.payload().tobytes())
    payload[4 * per] ^= 1  # block 4 damaged: beyond what the load uses, so never looked at
    sink = RecordingSink(want=3)
    deliver_verified(meta, payload, fp, sink, chunk_bytes=2 * per)
    assert [(s, n) for s, _, n in sink.writes] == [(0, 2), (2, 2)]  # chunks 0-1 and 2-3 only
    refused = RecordingSink(want=0)  # e.g. the first chain key differs: nothing is checked
    deliver_verified(meta, payload, fp, refused, chunk_bytes=2 * per)
    assert refused.writes == []
