"""The KV-transfer data path with the paged cache on a GPU. Skipped where no GPU is visible
(CI, the development machines); run on a GPU machine with
`python -m pytest -q tests/kv_transfer/test_cuda.py`.

The CPU suite runs the same connectors with CPU caches. What only a GPU exercises: blocks
gathered from a CUDA cache into pinned host memory (copies that do not wait, synchronised
before the bytes are read) or into device memory (what the NCCL path sends), `wsum64`
digests computed on the GPU, scattering host or device bytes into a CUDA cache, and an
engine on a GPU handing KV to an engine on a CPU and back (one fingerprint: fp32 with
row-major keys on both). The rest of this folder's engine tests also run on the GPU there:
their engines take `--device auto`.

Not covered (needs two GPUs): the P2P connector's NCCL pull (NCCL refuses two ranks on
one GPU).
"""

from __future__ import annotations

import random

import pytest
import torch

from fleetserve.kv_transfer.blocks import BlockBatch, batch_from_tensor, parse_header
from fleetserve.kv_transfer.cache_copy import gather_blocks, scatter_blocks
from fleetserve.kv_transfer.digests import device_digests
from fleetserve.kv_transfer.errors import KVFormatError
from tests.kv_transfer.utils import BLOCK, collect, engine, greedy, hand_off, run, wait_all_free

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

LAYERS, HEADS, NB, BS, HD = 3, 2, 16, 4, 8


def caches(dtype, seed, fill=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (2, HEADS, NB, BS, HD)
    if not fill:
        return [torch.zeros(shape, dtype=dtype, device="cuda") for _ in range(LAYERS)]
    return [torch.randn(shape, generator=g, device="cuda").to(dtype) for _ in range(LAYERS)]


def blocks_of(kv_caches, ids):
    """[n, layers, 2, heads, bs, hd] of blocks `ids`, by plain indexing (the reference)."""
    return torch.stack([kv[:, :, ids] for kv in kv_caches], dim=0).permute(3, 0, 1, 2, 4, 5).cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_and_scatter_between_gpu_caches_via_host_and_device(dtype):
    src = caches(dtype, 1)
    ids = [5, 2, 9, 0]
    host = gather_blocks(src, ids)  # default: pinned host memory, copies not waited for
    assert host.device.type == "cpu" and host.is_pinned()
    dev = gather_blocks(src, ids, out=torch.empty_like(host, device="cuda"))
    want = blocks_of(src, ids)
    assert torch.equal(host, want) and torch.equal(dev.cpu(), want)

    dst = caches(dtype, 2, fill=False)
    scatter_blocks(dst, [1, 7, 3, 12], host)  # host bytes into a GPU cache, a layer at a time
    scatter_blocks(dst, [10, 11, 13, 14], dev)  # device bytes, no host copy
    assert torch.equal(blocks_of(dst, [1, 7, 3, 12]), want)
    assert torch.equal(blocks_of(dst, [10, 11, 13, 14]), want)
    untouched = [b for b in range(NB) if b not in (1, 7, 3, 12, 10, 11, 13, 14)]
    assert all(not kv[:, :, untouched].any() for kv in dst)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wsum64_on_the_gpu_equals_the_cpu_and_catches_a_changed_word(dtype):
    data = gather_blocks(
        caches(dtype, 3), [4, 8, 15], out=torch.empty((3, LAYERS, 2, HEADS, BS, HD), dtype=dtype, device="cuda")
    )
    assert device_digests(data) == device_digests(data.cpu())  # int64 wraps alike on both
    batch = BlockBatch("fp", ["a", "b", "c"], data, (0, HEADS), digest="wsum64")
    meta, _ = parse_header(batch.header())
    raw = data.view(torch.uint8).reshape(-1)
    ok = batch_from_tensor(meta, raw.clone(), "fp")  # checked where the bytes are
    assert ok.data.is_cuda and torch.equal(ok.data, data)
    for offset in (0, raw.numel() // 2 + 1, raw.numel() - 1):
        bad = raw.clone()
        bad[offset] ^= 1
        with pytest.raises(KVFormatError, match="digest"):
            batch_from_tensor(meta, bad, "fp")
    swapped = data.clone()
    swapped[1, 0, 0, 0, 0, :2] = data[1, 0, 0, 0, 0, :2].flip(0)
    if not torch.equal(swapped, data):
        assert device_digests(swapped)[1] != device_digests(data)[1]


def storage_cfg(path, role):
    return {
        "kv_connector": "SharedStorageConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"path": str(path)},
        "kv_load_failure_policy": "fail",
    }


@pytest.mark.parametrize("prod_dev,cons_dev", [("cuda", "cpu"), ("cpu", "cuda")])
def test_shared_storage_hand_off_between_a_gpu_engine_and_a_cpu_engine(tiny_model_dir, tmp_path, prod_dev, cons_dev):
    """fp32, row-major keys on both sides: one fingerprint, so a GPU producer's blocks load
    into a CPU consumer and back. B's greedy tokens equal a plain engine's on B's device."""
    prod = engine(tiny_model_dir, storage_cfg(tmp_path, "kv_producer"), device=prod_dev)
    cons = engine(tiny_model_dir, storage_cfg(tmp_path, "kv_consumer"), core_process=False, device=cons_dev)
    ref = engine(tiny_model_dir, core_process=False, device=cons_dev)
    try:
        rng = random.Random(11)
        for length in (9, 23, 4 * BLOCK, 57):
            prompt = [rng.randrange(3, 380) for _ in range(length)]
            want, _ = run(collect(ref, prompt, greedy(8)))
            got, final, params = run(hand_off(prod, cons, prompt, 8))
            full = length // BLOCK * BLOCK
            assert params["remote_num_tokens"] == full
            assert final.num_remote_tokens == min(full, length - 1)
            assert got == want, (prod_dev, cons_dev, length)
        for eng in (prod, cons, ref):
            wait_all_free(eng)
    finally:
        for eng in (prod, cons, ref):
            eng.shutdown()
