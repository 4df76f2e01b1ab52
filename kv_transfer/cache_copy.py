"""Moving blocks in and out of the paged cache.

A hand-off is gather (cache -> one contiguous buffer) + transport + scatter (buffer ->
cache). On a CPU both copy run by run of consecutive blocks (numpy byte views, GIL
released); a gather over scattered ids is one `index_select` per layer over 4 KiB rows (so
is anything on a GPU). Each layer's cache is [2, kv_heads, num_blocks, block_size,
head_dim] (replica.layers.attention); a batch of blocks is [n, layers, 2, heads,
block_size, head_dim].
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np
import numpy.typing as npt
import torch

Device = Union[torch.device, str]
# (start, stop) over positions of a batch, the cache block id at start, and +1 or -1.
Run = tuple[int, int, int, int]


def gather_blocks(
    kv_caches: list[torch.Tensor], block_ids: Sequence[int], out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Copy blocks out of the cache into `out` (default: a new CPU tensor, pinned when the
    cache is on a GPU): [n, layers, 2, heads, block_size, head_dim]. `out` may live on the
    cache's device (gathered there, e.g. for NCCL) or on the CPU (staged through the host)."""
    first = kv_caches[0]
    if out is None:
        out = torch.empty(
            (len(block_ids), len(kv_caches), *first.shape[:2], *first.shape[3:]),
            dtype=first.dtype,
            pin_memory=first.is_cuda,
        )
    idx = block_index(block_ids, first.device)
    for layer, kv in enumerate(kv_caches):
        gather_layer(kv, idx, out, layer)
    if first.is_cuda and out.device != first.device:
        torch.cuda.current_stream(first.device).synchronize()
    return out


class BlockIndex:
    """Which cache blocks a copy reads or writes, in batch order: as a tensor (for index
    ops) and as runs of consecutive ids, ascending or descending (`runs`: (start, stop,
    first id, step) over positions of the batch). A fresh cache hands out ascending ids; a
    request's freed blocks go back reversed, so reused ones come out in descending runs."""

    __slots__ = ("ids", "tensor", "runs")

    def __init__(self, ids: Sequence[int], device: Device, runs: Optional[list[Run]] = None) -> None:
        self.ids = list(ids)
        self.tensor = torch.as_tensor(self.ids, dtype=torch.long, device=device)
        self.runs = block_runs(self.ids) if runs is None else runs

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, sl: slice) -> BlockIndex:
        start, stop, _ = sl.indices(len(self.ids))
        runs: list[Run] = []
        for s, e, b, step in self.runs:
            lo, hi = max(s, start), min(e, stop)
            if lo < hi:
                runs.append((lo - start, hi - start, b + (lo - s) * step, step))
        return BlockIndex(self.ids[start:stop], self.tensor.device, runs)


def block_runs(ids: Sequence[int]) -> list[Run]:
    """Maximal runs of ids that step by +1 or -1: (start, stop, first id, step) each."""
    runs: list[Run] = []
    s, n = 0, len(ids)
    while s < n:
        e, step = s + 1, 1
        if e < n and abs(ids[e] - ids[s]) == 1:
            step = ids[e] - ids[s]
            while e < n and ids[e] - ids[e - 1] == step:
                e += 1
        runs.append((s, e, ids[s], step))
        s = e
    return runs


def block_index(block_ids: Sequence[int], device: Device) -> BlockIndex:
    return BlockIndex(block_ids, device)


# A gather runs one numpy copy per run of blocks and layer where runs average at least this
# many blocks, else one index_select per layer (faster over scattered ids). A scatter into a
# CPU cache always copies run by run, even one block at a time: it beat index_copy_
# (docs/benchmarks/results/2026-11-29-kv-transfer-zen5.md, "Copies run by run").
GATHER_RUN_BLOCKS = 8


def _bytes(t: torch.Tensor) -> npt.NDArray[np.uint8]:
    """`t` as a numpy array of bytes (its last dim in bytes), sharing its memory. Plain
    numpy copies between such views release the GIL, as torch's do."""
    return t.view(torch.uint8).numpy()


def _run_slice(b: int, k: int, step: int) -> slice:
    """Cache blocks b, b+step, ..., k of them, as a slice along the blocks dim."""
    if step == 1:
        return slice(b, b + k)
    return slice(b, b - k if b - k >= 0 else None, -1)


def _byte_copyable(kv: torch.Tensor, other: torch.Tensor) -> bool:
    return (
        kv.device.type == "cpu"
        and other.device.type == "cpu"
        and kv.dtype == other.dtype
        and kv.is_contiguous()
        and other.stride(-1) == 1
    )


def gather_layer(kv: torch.Tensor, idx: BlockIndex, out: torch.Tensor, layer: int) -> None:
    """Blocks `idx` of one layer's cache ([2, heads, nb, bs, hd]) into `out[:, layer]`:
    run by run where the ids come in long runs (CPU), else one `index_select` over the
    cache's 4 KiB rows (a block of a layer is 2*heads rows), written in place; a GPU cache
    into a host `out` copies without waiting (sync before reading)."""
    two, heads, nb, bs, hd = kv.shape
    if len(idx.runs) * GATHER_RUN_BLOCKS <= len(idx) and _byte_copyable(kv, out):
        src_bytes = _bytes(kv).transpose(2, 0, 1, 3, 4)  # [nb, 2, heads, bs, row bytes]
        dst_bytes = _bytes(out)[:, layer]
        for s, e, b, step in idx.runs:
            dst_bytes[s:e] = src_bytes[_run_slice(b, e - s, step)]
        return
    src = kv.view(two * heads, nb, bs * hd).transpose(0, 1)  # [nb, 2*heads, row]
    dst = out.view(out.shape[0], out.shape[1], two * heads, bs * hd)[:, layer]
    if dst.device == kv.device:
        torch.index_select(src, 0, idx.tensor, out=dst)
    else:
        dst.copy_(src.index_select(0, idx.tensor), non_blocking=True)


def scatter_blocks(kv_caches: list[torch.Tensor], block_ids: Sequence[int], data: torch.Tensor) -> None:
    """Write `data` ([n, layers, 2, heads, block_size, head_dim], any strides, any device)
    straight into the cache's blocks, no intermediate copy: into a CPU cache one copy per
    run of consecutive blocks and layer, else one `index_copy_` per layer (a CPU source
    for a GPU cache goes up one layer at a time)."""
    first = kv_caches[0]
    if tuple(data.shape[2:]) != (first.shape[0], first.shape[1], *first.shape[3:]) or data.shape[:2] != (
        len(block_ids),
        len(kv_caches),
    ):
        raise ValueError(
            f"blocks of shape {tuple(data.shape)} do not fit {len(block_ids)} blocks "
            f"of {len(kv_caches)} layers of {tuple(first.shape)}"
        )
    if _byte_copyable(first, data):
        src = _bytes(data)
        runs = block_runs(block_ids)
        for layer, kv in enumerate(kv_caches):
            dst = _bytes(kv).transpose(2, 0, 1, 3, 4)  # [nb, 2, heads, bs, row bytes]
            for s, e, b, step in runs:
                dst[_run_slice(b, e - s, step)] = src[s:e, layer]
        return
    idx = block_index(block_ids, first.device).tensor
    for layer, kv in enumerate(kv_caches):
        kv.permute(2, 0, 1, 3, 4).index_copy_(0, idx, data[:, layer].to(first.device, non_blocking=True))
    if first.is_cuda and data.device.type == "cpu":
        torch.cuda.current_stream(first.device).synchronize()  # before `data`'s buffer is reused
