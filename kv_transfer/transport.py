"""How one connector moves bytes: the only part a connector supplies.

The halves every connector shares (kv_transfer.scheduler_half, kv_transfer.worker_half)
decide what moves when, check what arrives and write it into the cache; a `Transport`
exports a gathered batch of blocks and fetches one back, by the caller's transfer id or by
chain keys. It is built once per role; `export` and `fetch` run on the worker's transfer
threads, never on the engine's.
"""

from __future__ import annotations

import abc
from typing import Any, Optional

import torch

from fleetserve.kv_transfer.base import ConnectorContext, KVConnectorRole, LoadSpec, SaveSpec
from fleetserve.kv_transfer.blocks import BlockBatch
from fleetserve.kv_transfer.cache_copy import Device
from fleetserve.kv_transfer.config import KVTransferConfig
from fleetserve.kv_transfer.staging import StagingPool
from fleetserve.kv_transfer.stream import ChunkSink


class Transport(abc.ABC):
    """How one connector moves bytes. Built once per role; fetch/export run on a pool."""

    # The scheduler can find stored blocks by chain key with no params (a prefix cache).
    supports_lookup = False
    # The producer exports every finished request's full blocks, asked or not.
    saves_all = False
    # export() keeps the batch after it returns and releases it itself (BlockBatch.release).
    keeps_batch = False
    # Streams (CPU caches): export() is called before the batch is gathered (its `progress`
    # says which chunks are ready; their digests are set as they are), and fetch(spec, sink)
    # hands each chunk to `sink` as it arrives and is verified, so copies out of and into the
    # caches overlap the transport.
    streams = False
    # fetch(spec, sink) hands a load's blocks to `sink` chunk by chunk, each verified just
    # before it is written (every streaming transport does): the check overlaps the writes.
    fetches_chunks = False

    def __init__(self, config: KVTransferConfig, ctx: ConnectorContext, role: KVConnectorRole) -> None:
        self.config = config
        self.ctx = ctx
        self.role = role
        self.kv_caches: list[torch.Tensor] = []
        self.staging: Optional[StagingPool] = None

    def location(self, transfer_id: Optional[str]) -> dict[str, Any]:
        """Extra `remote_*` params a consumer needs to find this producer's blocks."""
        return {}

    def payload_device(self, cache_device: torch.device) -> Device:
        """Where exported blocks are gathered: the host, unless the transport sends
        straight from the cache's device (NCCL)."""
        return "cpu"

    def register_kv_caches(self, kv_caches: list[torch.Tensor], staging: StagingPool) -> None:
        """The worker's caches are known: fetches may stage into `staging` from now on."""
        self.kv_caches = kv_caches
        self.staging = staging

    def staging_pool(self) -> StagingPool:
        """The worker's staging buffers (fetches run only once the caches are registered)."""
        if self.staging is None:
            raise RuntimeError("the transport's KV caches are not registered yet")
        return self.staging

    def block_shape(self, num_blocks: int, heads: tuple[int, int]) -> tuple[int, ...]:
        return block_shape(self.ctx, num_blocks, heads)

    @abc.abstractmethod
    def export(self, spec: SaveSpec, batch: BlockBatch) -> None: ...

    @abc.abstractmethod
    def fetch(self, spec: LoadSpec, sink: Optional[ChunkSink] = None) -> BlockBatch:
        """The blocks of `spec` (keys in order; fewer is fine), by spec.deadline or raise.
        `sink` (only for a transport that `fetches_chunks`): where to hand them chunk by chunk
        as they are verified; the returned batch then holds the same bytes."""

    def confirm(self, spec: LoadSpec) -> None:  # noqa: B027 - optional: most transports keep nothing
        """The consumer has what it needs: the producer may release it."""

    def lookup(self, keys: list[str]) -> int:
        """How many of `keys`, from the first, can be fetched now."""
        return 0

    def shutdown(self) -> None:
        return None


def block_shape(ctx: ConnectorContext, num_blocks: int, heads: tuple[int, int]) -> tuple[int, ...]:
    """[n, layers, 2, heads, block_size, head_dim] of `num_blocks` blocks of KV heads `heads`."""
    return (num_blocks, ctx.num_layers, 2, heads[1] - heads[0], ctx.block_size, ctx.head_dim)
