"""Scheduler and cache configuration, validated when built.

Names follow vLLM's engine arguments so that `--max-num-seqs` and friends map
onto these fields directly. An invalid value raises pydantic's
`ValidationError`, which names the field.
"""

from __future__ import annotations

import copy
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.fields import FieldInfo


class SchedulerConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # The fields a user sets (EngineArgs takes them from here, description and all:
    # `same_field`); the rest the engine derives.
    max_num_batched_tokens: int = Field(
        2048, ge=1, description=("Token budget of one engine step (prefill chunks and decodes together).")
    )
    max_num_seqs: int = Field(64, ge=1, description="Most requests in the running batch.")
    max_model_len: int = Field(2048, ge=2)
    # A prefill chunk gets at most this many tokens per step (0: no cap), so a
    # long prompt cannot starve decodes of the budget.
    long_prefill_token_threshold: int = Field(
        0, ge=0, description=("Most prompt tokens one request may prefill in one step (0: no limit).")
    )
    enable_chunked_prefill: bool = Field(True, description=("Split long prompts across steps so decodes keep running."))
    policy: Literal["fcfs", "priority", "fair", "sjf"] = Field(
        "fcfs",
        description=(
            "Order of the waiting queue: first come first served, by request priority, "
            "fair (per-tenant fair share: the Virtual Token Counter, the tenant served least first), "
            "or sjf (shortest predicted output first, with aging: --sjf-aging-rate)."
        ),
    )
    # policy "fair": a tenant's service is fair_input_weight * prompt tokens computed +
    # fair_output_weight * output tokens, divided by its weight (scheduler/fair.py). The
    # paper's defaults: an output token costs about two prompt tokens.
    fair_input_weight: float = Field(1.0, ge=0, description="Fair share: the cost of a prompt token computed.")
    fair_output_weight: float = Field(2.0, ge=0, description="Fair share: the cost of an output token.")
    fair_preemption_gap: Optional[float] = Field(
        None,
        ge=0,
        description=(
            "Fair share: when every seat (--max-num-seqs) is taken and the waiting tenant served "
            "least trails the running tenant served most by more than this much weighted service, "
            "preempt one request of the latter (its last admitted) for a seat, at most one a step "
            "(unset: never; a waiting tenant waits for a free seat)."
        ),
    )
    capacity_policy: Literal["max_utilization", "guaranteed_no_evict", "reserve_predicted"] = Field(
        "max_utilization",
        description=(
            "Admission: admit while KV blocks exist and preempt under pressure "
            "(max_utilization), admit only requests whose blocks to completion are "
            "free (guaranteed_no_evict, never preempts), or admit while the blocks of every "
            "request's prompt and predicted output fit (reserve_predicted; preempts when a "
            "prediction falls short)."
        ),
    )
    # Output-length-aware scheduling (scheduler/length_aware.py, length_predictor.py).
    fair_shortest_first: bool = Field(
        False,
        description=(
            "Fair share: inside a tenant's share, its shortest predicted request first (with the "
            "aging of --sjf-aging-rate) instead of its oldest. Needs --scheduling-policy fair."
        ),
    )
    sjf_aging_rate: float = Field(
        50.0,
        gt=0,
        description=(
            "Shortest predicted first: predicted output tokens one second of waiting is worth. "
            "A request is never passed by one that arrived more than its predicted length / "
            "this many seconds after it (bounded starvation); large: FCFS."
        ),
    )
    reserve_predicted_margin: float = Field(
        1.0,
        ge=0.1,
        description=("capacity_policy reserve_predicted: reserve KV for predicted output tokens times this."),
    )
    # Qualified name ("package.module:Class" or "package.module.Class") of a
    # Scheduler subclass to use instead of ours, as vLLM's scheduler_cls.
    scheduler_cls: str = Field(
        "fleetserve.scheduler.scheduler:Scheduler", description=("The scheduler class, 'module:Class'.")
    )
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
                "or no long prompt could ever be scheduled"
            )
        if self.fair_preemption_gap is not None and self.policy != "fair":
            raise ValueError(
                f"fair_preemption_gap is for policy 'fair' (--scheduling-policy fair), not {self.policy!r}"
            )
        if self.fair_shortest_first and self.policy != "fair":
            raise ValueError(
                f"fair_shortest_first is for policy 'fair' (--scheduling-policy fair), not {self.policy!r}; "
                "--scheduling-policy sjf orders every request shortest predicted first"
            )
        if self.fair_input_weight + self.fair_output_weight <= 0:
            raise ValueError("fair_input_weight and fair_output_weight must not both be 0")
        return self


class CacheConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV cache block.")
    # None until the replica sizes the cache from its memory budget.
    num_blocks: Optional[int] = Field(None, ge=1)
    enable_prefix_caching: bool = Field(True, description=("Reuse the KV blocks of prompt prefixes seen before."))
    # Publish KV cache events (scheduler.kv_events) for the router's prefix index.
    enable_kv_cache_events: bool = Field(
        False,
        description=(
            "Publish KV cache events (block stored / removed / all cleared) for the router's "
            "prefix index (vLLM: --kv-events-config); on by itself with --routing-policy "
            "prefix_aware."
        ),
    )
    # Block hashes of the prefix cache: "builtin" (Python's tuple hash: fast, for trusted
    # traffic) or "sha256" (collision-resistant, for tenants who must not share or probe
    # each other's cached prefixes; vLLM's --prefix-caching-hash-algo).
    prefix_caching_hash_algo: Literal["builtin", "sha256"] = Field(
        "builtin",
        description=(
            "Prefix-cache block hashes: builtin (fast; trusted traffic) or sha256 (tenants that "
            "must not collide with or probe each other's prefixes; see docs, Security)."
        ),
    )
    # The window every attention layer of the model has (the largest, where they differ):
    # a running request's blocks wholly before it are given back as it advances. None: some
    # layer attends to everything, or the engine keeps every block (a KV connector, a draft
    # model, or --disable-hybrid-kv-cache-manager). Set by the engine from the model.
    sliding_window: Optional[int] = Field(None, ge=1)


def same_field(model: type[BaseModel], name: str) -> FieldInfo:
    """`model`'s field `name` (type constraints, default, description), to declare in another
    model under any name: `max_num_seqs: int = same_field(SchedulerConfig, "max_num_seqs")`.
    One declaration, so the engine's arguments and the scheduler's config cannot drift."""
    return copy.deepcopy(model.model_fields[name])
