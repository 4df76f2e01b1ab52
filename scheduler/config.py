"""Scheduler and cache configuration, validated when built.

Names follow vLLM's engine arguments so that `--max-num-seqs` and friends map
onto these fields directly. An invalid value raises pydantic's
`ValidationError`, which names the field.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SchedulerConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_num_batched_tokens: int = Field(2048, ge=1)
    max_num_seqs: int = Field(256, ge=1)
    max_model_len: int = Field(2048, ge=2)
    # A prefill chunk gets at most this many tokens per step (0: no cap), so a
    # long prompt cannot starve decodes of the budget.
    long_prefill_token_threshold: int = Field(0, ge=0)
    enable_chunked_prefill: bool = True
    policy: Literal["fcfs", "priority"] = "fcfs"
    capacity_policy: Literal["max_utilization", "guaranteed_no_evict"] = "max_utilization"
    # Qualified name ("package.module:Class" or "package.module.Class") of a
    # Scheduler subclass to use instead of ours, as vLLM's scheduler_cls.
    scheduler_cls: str = "fleetserve.scheduler.scheduler:Scheduler"
    # Speculative decoding: at most this many draft tokens per request and
    # step (0: off), and KV slots reserved past them for a draft model that
    # writes its own KV ahead of the target (0 for n-gram lookup).
    num_spec_tokens: int = Field(0, ge=0)
    num_lookahead_tokens: int = Field(0, ge=0)
    # Each request earns its draft length from its acceptance (scheduler/spec_decode.py);
    # False: always up to num_spec_tokens, as vLLM.
    adaptive_draft_length: bool = True
    # With adaptive draft lengths: when the next step (one token per running request
    # plus the earned drafts) stays under this many tokens, the room left is handed out
    # as extra drafts, up to num_spec_tokens each (a step that small costs about what a
    # one-token step costs). 0: off.
    free_draft_tokens: int = Field(0, ge=0)
    # LoRA: at most this many distinct adapters in one step (vLLM's --max-loras; 0: no LoRA).
    max_loras: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> "SchedulerConfig":
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_model_len ({self.max_model_len}) when chunked prefill is disabled, "
                "or no long prompt could ever be scheduled")
        return self


class CacheConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    block_size: int = Field(16, ge=1, le=1024)
    # None until the replica sizes the cache from its memory budget.
    num_blocks: Optional[int] = Field(None, ge=1)
    enable_prefix_caching: bool = True
    # Publish KV cache events (scheduler.kv_events) for the router's prefix index.
    enable_kv_cache_events: bool = False
    # Block hashes of the prefix cache: "builtin" (Python's tuple hash: fast, for trusted
    # traffic) or "sha256" (collision-resistant, for tenants who must not share or probe
    # each other's cached prefixes; vLLM's --prefix-caching-hash-algo).
    prefix_caching_hash_algo: Literal["builtin", "sha256"] = "builtin"
