"""A connector that wraps a real one and breaks it on purpose (tests, chaos drills).

    {"kv_connector": "FaultInjectionConnector",
     "kv_connector_extra_config": {
         "inner": "SharedStorageConnector", "inner_extra": {"path": "/tmp/kv"},
         "faults": {"drop": 1.0, "delay_s": 0.5, "corrupt": 0.0, "stale": 0.0,
                    "duplicate": 0.0, "lose_notice": 0.0},
         "seed": 0}}

Each fault fires with its probability, per transfer:

* ``drop``: the consumer's fetch finds nothing (as if the bytes never came);
* ``delay_s``: the fetch is held back this long (past the deadline, it is late);
* ``corrupt``: the producer exports flipped bytes under the original checksums;
* ``stale``: the producer exports the blocks under other chain keys (another
  prompt's KV, as a reused block id would deliver);
* ``duplicate``: the export is written twice, and the worker reports each
  finished load twice (in two steps);
* ``lose_notice``: the worker loads, but never tells the scheduler.

Every one must end in the right tokens or a clear error, within the deadline,
with every block free afterwards (tests/kv_transfer/test_faults.py).
"""

from __future__ import annotations

import random
import time
from typing import Any, Optional, Union

import torch

from fleetserve.kv_transfer.base import ConnectorContext, KVConnectorBase, KVConnectorRole, LoadSpec, SaveSpec
from fleetserve.kv_transfer.blocks import BlockBatch
from fleetserve.kv_transfer.cache_copy import Device
from fleetserve.kv_transfer.config import KVTransferConfig
from fleetserve.kv_transfer.errors import TransferError
from fleetserve.kv_transfer.factory import resolve_connector_class
from fleetserve.kv_transfer.scheduler_half import TransferScheduler
from fleetserve.kv_transfer.staging import StagingPool
from fleetserve.kv_transfer.stream import ChunkSink
from fleetserve.kv_transfer.transfer import TransferConnector
from fleetserve.kv_transfer.transport import Transport
from fleetserve.kv_transfer.worker_half import TransferWorker

FAULTS = ("drop", "delay_s", "corrupt", "stale", "duplicate", "lose_notice")


class FaultyTransport(Transport):
    def __init__(self, inner: Transport, faults: dict[str, float], seed: int) -> None:
        super().__init__(inner.config, inner.ctx, inner.role)
        self.inner = inner
        self.faults = faults
        self.supports_lookup = inner.supports_lookup
        self.saves_all = inner.saves_all
        self.keeps_batch = inner.keeps_batch
        # (not `streams`: damage is done to a whole gathered batch; a load is still handed
        # over chunk by chunk where the inner transport can)
        self.fetches_chunks = inner.fetches_chunks
        self._rng = random.Random(seed)

    def fires(self, name: str) -> bool:
        p = float(self.faults.get(name, 0.0))
        return p > 0 and self._rng.random() < p

    def location(self, transfer_id: Optional[str]) -> dict[str, Any]:
        return self.inner.location(transfer_id)

    def payload_device(self, cache_device: torch.device) -> Device:
        return self.inner.payload_device(cache_device)

    def register_kv_caches(self, kv_caches: list[torch.Tensor], staging: StagingPool) -> None:
        super().register_kv_caches(kv_caches, staging)
        self.inner.register_kv_caches(kv_caches, staging)

    def export(self, spec: SaveSpec, batch: BlockBatch) -> None:
        sums = batch.checksums()  # taken where the blocks were gathered: damage comes after
        if self.fires("corrupt"):
            data = batch.data.clone()
            data.view(torch.uint8).view(-1)[:: max(1, data.numel() // 7)] ^= 0x55
            batch.release()
            batch = BlockBatch(batch.fingerprint, batch.keys, data, batch.heads, sums, batch.digest)
        elif self.fires("stale"):
            release, batch.on_release = batch.on_release, None  # the new batch owns the buffer
            batch = BlockBatch(
                batch.fingerprint, [k[::-1] for k in batch.keys], batch.data, batch.heads, sums, batch.digest, release
            )
        self.inner.export(spec, batch)
        if self.fires("duplicate"):
            self.inner.export(spec, batch)

    def fetch(self, spec: LoadSpec, sink: Optional[ChunkSink] = None) -> BlockBatch:
        delay = float(self.faults.get("delay_s", 0.0))
        if delay:
            time.sleep(delay)
        if self.fires("drop"):
            raise TransferError("dropped by fault injection")
        return self.inner.fetch(spec) if sink is None else self.inner.fetch(spec, sink)

    def confirm(self, spec: LoadSpec) -> None:
        self.inner.confirm(spec)

    def lookup(self, keys: list[str]) -> int:
        return self.inner.lookup(keys)

    def shutdown(self) -> None:
        self.inner.shutdown()


class FaultyWorker(TransferWorker):
    def __init__(self, config: KVTransferConfig, ctx: ConnectorContext, transport: FaultyTransport) -> None:
        super().__init__(config, ctx, transport)
        self.faulty = transport
        self._again: set[str] = set()
        self.lost_notices: set[str] = set()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        sending, recving = super().get_finished(finished_req_ids)
        again, self._again = self._again, set()
        for rid in list(recving):
            if self.faulty.fires("lose_notice"):
                recving.discard(rid)
                self.lost_notices.add(rid)
            elif self.faulty.fires("duplicate"):
                self._again.add(rid)
        return sending, recving | again


class FaultInjectionConnector(KVConnectorBase):
    def build_half(self, role: KVConnectorRole) -> Union[TransferScheduler, FaultyWorker]:
        extra = self.config.kv_connector_extra_config
        inner_name = extra.get("inner")
        if not inner_name:
            raise ValueError("FaultInjectionConnector needs kv_connector_extra_config.inner")
        faults = dict(extra.get("faults", {}))
        unknown = set(faults) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; known: {FAULTS}")
        inner_cls = resolve_connector_class(inner_name)
        if not issubclass(inner_cls, TransferConnector):
            raise ValueError(
                f"FaultInjectionConnector wraps a transfer connector (shared storage, Ray, P2P), not {inner_name!r}"
            )
        inner_cfg: KVTransferConfig = self.config.model_copy(
            update={"kv_connector": inner_name, "kv_connector_extra_config": extra.get("inner_extra", {})}
        )
        transport = FaultyTransport(
            inner_cls.transport_cls(inner_cfg, self.ctx, role), faults, int(extra.get("seed", 0)) + self.ctx.tp_rank
        )
        if role is KVConnectorRole.SCHEDULER:
            return TransferScheduler(self.config, self.ctx, transport)
        return FaultyWorker(self.config, self.ctx, transport)
