"""Tensor parallelism: which KV heads each rank holds, and how a consumer rank finds its
heads among the producer's ranks (the two sides may run different TP sizes)."""

from __future__ import annotations

import torch

from fleetserve.kv_transfer.blocks import BlockBatch


def local_head_range(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """The model's KV heads [h0, h1) that rank `tp_rank` of `tp_size` holds
    (with more ranks than KV heads, each head is replicated on tp/heads ranks)."""
    if num_kv_heads >= tp_size:
        per = num_kv_heads // tp_size
        return tp_rank * per, (tp_rank + 1) * per
    h = tp_rank // (tp_size // num_kv_heads)
    return h, h + 1


def producer_shards(heads: tuple[int, int], num_kv_heads: int, producer_tp: int) -> list[tuple[int, tuple[int, int]]]:
    """(producer rank, its head range) of the shards that together hold `heads`, in head
    order, one rank per distinct range: a consumer rank takes the heads it owns from
    whatever TP size the producer ran with."""
    found: dict[tuple[int, int], int] = {}
    for rank in range(producer_tp):
        rng = local_head_range(num_kv_heads, producer_tp, rank)
        if rng not in found and rng[0] < heads[1] and heads[0] < rng[1]:
            found[rng] = rank
    return sorted(((r, rng) for rng, r in found.items()), key=lambda x: x[1][0])


def readers_of(shard: tuple[int, int], num_kv_heads: int, consumer_tp: int) -> int:
    """How many consumer ranks read a producer shard (its owner frees it after all did)."""
    return sum(1 for r in range(consumer_tp) if _overlap(shard, local_head_range(num_kv_heads, consumer_tp, r)))


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def join_shards(batches: list[BlockBatch]) -> BlockBatch:
    """Head shards of the same blocks side by side, cut to the blocks every shard agrees on."""
    if len(batches) == 1:
        return batches[0]
    n = 0
    while all(n < len(b.keys) for b in batches) and len({b.keys[n] for b in batches}) == 1:
        n += 1
    data = torch.cat([b.data[:n] for b in batches], dim=3)
    for b in batches:
        b.release()
    return BlockBatch(
        batches[0].fingerprint,
        batches[0].keys[:n],
        data,
        (batches[0].heads[0], batches[-1].heads[1]),
        digest=batches[0].digest,
    )
