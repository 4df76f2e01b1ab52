"""Connectors by registered name or "package.module:Class" (vLLM's KVConnectorFactory)."""

from __future__ import annotations

from typing import Any

import torch

from fleetserve.kv_transfer.base import ConnectorContext, KVConnectorBase, KVConnectorRole
from fleetserve.kv_transfer.config import KVTransferConfig
from fleetserve.kv_transfer.keys import kv_fingerprint, kv_geometry
from fleetserve.kv_transfer.registry import ALIASES, REGISTRY, connector_qualname
from fleetserve.scheduler.policies import resolve_obj_by_qualname

__all__ = ["REGISTRY", "ALIASES", "resolve_connector_class", "build_context", "make_connector"]


def resolve_connector_class(name: str) -> type[KVConnectorBase]:
    """The connector class a registered, short or "package.module:Class" name names."""
    cls = resolve_obj_by_qualname(connector_qualname(name), what="KV connector")
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase)):
        raise ValueError(f"KV connector {name!r} is not a KVConnectorBase subclass")
    return cls


def build_context(
    config: KVTransferConfig,
    model_id: str,
    hf_config: Any,
    dtype: torch.dtype | str,
    block_size: int,
    tp_size: int = 1,
    tp_rank: int = 0,
    key_layout: str = "rows",
) -> ConnectorContext:
    """What both halves of rank `tp_rank` know about their engine (`hf_config`: the model's
    config, read for its KV geometry and the fingerprint)."""
    model_id = str(config.kv_connector_extra_config.get("model_id") or model_id)
    layers, kv_heads, head_dim = kv_geometry(hf_config)
    return ConnectorContext(
        engine_id=config.engine_id or "unnamed",
        fingerprint=kv_fingerprint(model_id, hf_config, dtype, block_size, key_layout),
        block_size=block_size,
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        tp_size=tp_size,
        tp_rank=tp_rank,
    )


def make_connector(config: KVTransferConfig, role: KVConnectorRole, ctx: ConnectorContext) -> KVConnectorBase:
    return resolve_connector_class(config.kv_connector)(config, role, ctx)
