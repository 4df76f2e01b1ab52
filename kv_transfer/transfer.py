"""A connector made of the halves every connector shares and one `Transport`.

    TransferConnector (role SCHEDULER) -> TransferScheduler(config, ctx, transport)
    TransferConnector (role WORKER)    -> TransferWorker(config, ctx, transport)

The scheduler half (kv_transfer.scheduler_half) decides what a request loads and saves and
keeps a finished request's blocks while they are copied out; the worker half
(kv_transfer.worker_half) copies, checks and writes blocks and runs the transport in the
background; the transport (kv_transfer.transport) only moves bytes. A connector
(kv_transfer.connectors) is a subclass naming its `transport_cls`.
"""

from __future__ import annotations

from typing import Union

from fleetserve.kv_transfer.base import KVConnectorBase, KVConnectorRole
from fleetserve.kv_transfer.scheduler_half import TransferScheduler
from fleetserve.kv_transfer.transport import Transport
from fleetserve.kv_transfer.worker_half import TransferWorker


class TransferConnector(KVConnectorBase):
    """A connector made of the shared halves and a `transport_cls`."""

    transport_cls: type[Transport]

    def build_half(self, role: KVConnectorRole) -> Union[TransferScheduler, TransferWorker]:
        transport = self.transport_cls(self.config, self.ctx, role)
        if role is KVConnectorRole.SCHEDULER:
            return TransferScheduler(self.config, self.ctx, transport)
        return TransferWorker(self.config, self.ctx, transport)
