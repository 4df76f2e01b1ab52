"""Engine arguments: one validated model for everything a replica needs to start.

Field names are vLLM's (`--max-num-seqs` -> `max_num_seqs`), so the CLI, the
application YAML and the Helm values all map onto this schema.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from fleetserve.scheduler import CacheConfig, SchedulerConfig

DEFAULT_MODEL = "smollm2-135m"


class EngineArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model: str = DEFAULT_MODEL
    # Name reported by /v1/models; defaults to `model`.
    served_model_name: Optional[str] = None
    tokenizer: Optional[str] = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0
    max_model_len: Optional[int] = Field(None, ge=2)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    long_prefill_token_threshold: int = Field(0, ge=0)
    enable_chunked_prefill: bool = True
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    capacity_policy: Literal["max_utilization", "guaranteed_no_evict"] = "max_utilization"
    scheduler_cls: str = "fleetserve.scheduler.scheduler:Scheduler"
    block_size: int = Field(16, ge=1, le=1024)
    enable_prefix_caching: bool = True
    # KV cache size: an explicit block count wins over a memory budget (bytes).
    num_gpu_blocks_override: Optional[int] = Field(None, ge=1)
    kv_cache_memory_bytes: Optional[int] = Field(None, ge=1)
    tensor_parallel_size: int = Field(1, ge=1)
    # Placement of the TP workers' bundles (Ray placement group strategy).
    placement_strategy: Literal["PACK", "STRICT_PACK", "SPREAD"] = "PACK"
    # Bounded waiting queue per replica: a request beyond it is refused (HTTP 429).
    max_waiting_requests: int = Field(1024, ge=1)
    # Prefix-cache block hashes: "builtin" (fast; trusted traffic) or "sha256" (tenants
    # that must not collide with or probe each other's prefixes; see README "Security").
    prefix_caching_hash_algo: Literal["builtin", "sha256"] = "builtin"
    # torch threads for this process (None: chosen from the cores available).
    num_threads: Optional[int] = Field(None, ge=1)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_batched_tokens=max(self.max_num_batched_tokens,
                                       0 if self.enable_chunked_prefill else max_model_len),
            max_num_seqs=self.max_num_seqs,
            max_model_len=max_model_len,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            enable_chunked_prefill=self.enable_chunked_prefill,
            policy=self.scheduling_policy,
            capacity_policy=self.capacity_policy,
            scheduler_cls=self.scheduler_cls,
        )

    def cache_config(self, num_blocks: int) -> CacheConfig:
        return CacheConfig(block_size=self.block_size, num_blocks=num_blocks,
                           enable_prefix_caching=self.enable_prefix_caching,
                           prefix_caching_hash_algo=self.prefix_caching_hash_algo)
