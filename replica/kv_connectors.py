"""The replica's two halves of a KV connector, built from `EngineArgs`.

The scheduler half lives in the EngineCore (`engine_core`), the worker half on every rank
(`worker.worker`). Both build their context here, so the core and the worker share it
without importing each other: the core imports the executor, which imports the worker.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any, Optional

from fleetserve.replica.engine.engine_args import EngineArgs

if TYPE_CHECKING:
    import torch

    from fleetserve.kv_transfer.base import KVConnectorBase, KVConnectorRole


def name_kv_engine(args: EngineArgs) -> EngineArgs:
    """Give the KV connector an engine id (the same one on every TP rank) when none is set."""
    cfg = args.kv_transfer_config
    if cfg is None or cfg.engine_id is not None:
        return args
    return args.model_copy(update={"kv_transfer_config": cfg.model_copy(update={"engine_id": uuid.uuid4().hex})})


def kv_model_id(args: EngineArgs) -> str:
    """The model's name in KV fingerprints: the file or folder name of its weights, so
    one model at two paths (or under an alias) still matches (set kv_connector_extra_config.model_id to
    tell apart two fine-tunes of one architecture under one name)."""
    from fleetserve.replica.model_loader.registry import resolve_model

    return resolve_model(args.model).path.name


def make_kv_connector(
    args: EngineArgs,
    role: KVConnectorRole,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device,
    world_size: int = 1,
    rank: int = 0,
) -> Optional[KVConnectorBase]:
    """One half of the connector `args.kv_transfer_config` names (None when there is none); the
    worker half moves rank `rank`'s share of the KV heads."""
    cfg = args.kv_transfer_config
    if cfg is None:
        return None
    from fleetserve.kv_transfer.factory import build_context, make_connector
    from fleetserve.kv_transfer.keys import kv_geometry
    from fleetserve.replica.layers.attention import kv_cache_layout

    layout = kv_cache_layout(dtype, args.block_size, kv_geometry(hf_config)[2], device)
    ctx = build_context(cfg, kv_model_id(args), hf_config, dtype, args.block_size, world_size, rank, key_layout=layout)
    return make_connector(cfg, role, ctx)


def make_scheduler_connector(args: EngineArgs, hf_config: Any) -> Optional[KVConnectorBase]:
    """The scheduler half, for the EngineCore (the dtype and device the workers will pick)."""
    if args.kv_transfer_config is None:
        return None
    from fleetserve.kv_transfer.base import KVConnectorRole
    from fleetserve.replica.worker.device import select_device, select_dtype

    device = select_device(args.device)
    return make_kv_connector(
        args, KVConnectorRole.SCHEDULER, hf_config, select_dtype(args.dtype, device), device, args.tensor_parallel_size
    )
