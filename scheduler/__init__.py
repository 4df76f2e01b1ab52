"""fleetserve's scheduler: pure Python (standard library + pydantic), no torch, no ray.

The public names here are the contract the replica, the KV connectors and the
router rely on; they follow vLLM v1's names.
"""

from fleetserve.scheduler.block_pool import BlockPool, KVCacheBlock
from fleetserve.scheduler.config import CacheConfig, SchedulerConfig
from fleetserve.scheduler.connector import KVConnectorScheduler
from fleetserve.scheduler.kv_cache_manager import KVCacheManager, hash_token_blocks
from fleetserve.scheduler.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheMirror,
    KVEventBatch,
    KVEventLog,
    SequenceGap,
)
from fleetserve.scheduler.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from fleetserve.scheduler.policies import resolve_obj_by_qualname
from fleetserve.scheduler.request import Request, RequestStatus, prefix_salt
from fleetserve.scheduler.sampling_params import SamplingParams
from fleetserve.scheduler.scheduler import Scheduler
from fleetserve.scheduler.stats import SchedulerStats
from fleetserve.scheduler.structured_outputs import StructuredOutputsParams


def create_scheduler(
    scheduler_config: SchedulerConfig, cache_config: CacheConfig, connector: KVConnectorScheduler | None = None
) -> Scheduler:
    """Build the scheduler class named by `scheduler_config.scheduler_cls`."""
    cls = resolve_obj_by_qualname(scheduler_config.scheduler_cls)
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        raise ValueError(f"scheduler_cls {scheduler_config.scheduler_cls!r} is not a Scheduler subclass")
    return cls(scheduler_config, cache_config, connector)


__all__ = [
    "AllBlocksCleared",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CacheConfig",
    "CachedRequestData",
    "EngineCoreOutput",
    "KVCacheBlock",
    "KVCacheManager",
    "KVCacheMirror",
    "KVConnectorScheduler",
    "KVEventBatch",
    "KVEventLog",
    "ModelRunnerOutput",
    "NewRequestData",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "SequenceGap",
    "StructuredOutputsParams",
    "create_scheduler",
    "hash_token_blocks",
    "prefix_salt",
    "resolve_obj_by_qualname",
]
