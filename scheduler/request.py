"""A request as the scheduler sees it: token ids, two counters and a status.

    prompt_token_ids          output_token_ids
    |--------------------------|-----------|
    |<--- num_computed_tokens --->|            (KV cache holds these)
    |<------------------ num_tokens ---------->|
    |<------------------ num_tokens_with_spec ---------->|   (+ spec_token_ids)

Each step the scheduler hands out tokens so that `num_computed_tokens`
catches up with `num_tokens_with_spec`; a decode is simply a gap of one, a
speculative decode a gap of one plus the draft tokens. Draft tokens are not
part of `all_token_ids` (nor of its block hashes) until verified.
"""

from __future__ import annotations

import enum
import time
from typing import Any, Optional

from fleetserve.scheduler.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this line is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    # A remote KV load failed under kv_load_failure_policy "fail".
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> Optional[str]:
        """The OpenAI `finish_reason` for a finished status, None otherwise."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    # vLLM reports a prompt that can never fit as "length" too.
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ERROR: "error",
}


def prefix_salt(cache_salt: Optional[str], lora_name: Optional[str] = None) -> Optional[str]:
    """What a request's prefix-cache block hashes are salted with: its `cache_salt` and,
    for a request that runs with a LoRA adapter, the adapter's key (`name@digest` of its
    files, or its name: the adapter changes every layer's keys and values, so its blocks
    must never match the base model's or another adapter's). The engine's hashes, the
    router's prefix index and the KV connectors' keys all take it from here (it is only
    ever hashed)."""
    if not lora_name:
        return cache_salt
    return f"{cache_salt or ''}\x00lora:{lora_name}"


# The tenant of a request that names none (router: no key file entry, no x-tenant-id).
DEFAULT_TENANT = "default"


class Request:
    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "eos_token_id",
        "arrival_time",
        "priority",
        "cache_salt",
        "kv_transfer_params",
        "status",
        "num_computed_tokens",
        "output_token_ids",
        "_all_token_ids",
        "num_cached_tokens",
        "num_preemptions",
        "stop_reason",
        "block_hashes",
        "max_tokens",
        "num_external_computed_tokens",
        "spec_token_ids",
        "lora_id",
        "lora_name",
        "events",
        "tenant",
        "tenant_weight",
        "num_charged_prompt_tokens",
        "num_draft_tokens",
        "num_accepted_draft_tokens",
        "session",
        "predicted_output_tokens",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: Optional[SamplingParams] = None,
        eos_token_id: Optional[int] = None,
        arrival_time: Optional[float] = None,
        priority: int = 0,
        cache_salt: Optional[str] = None,
        kv_transfer_params: Optional[dict[str, Any]] = None,
        lora_name: Optional[str] = None,
        lora_id: int = 0,
        lora_key: Optional[str] = None,
        tenant: Optional[str] = None,
        tenant_weight: float = 1.0,
        session: Optional[str] = None,
        predicted_output_tokens: Optional[int] = None,
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if len(prompt_token_ids) == 0:
            raise ValueError(f"request {request_id}: the prompt is empty")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params or SamplingParams()
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        # The LoRA adapter the request runs with (id 0, name None: the base model). Its
        # KV differs from the base model's, so the adapter is part of the prefix-cache salt:
        # `lora_key` (the engine's `name@digest` of its files) or else its name.
        self.lora_id = lora_id
        self.lora_name = lora_name
        self.cache_salt = prefix_salt(cache_salt, lora_key or lora_name)
        self.kv_transfer_params = kv_transfer_params
        # Who the request belongs to, and its share (scheduler/fair.py: policy "fair").
        if not tenant_weight > 0:
            raise ValueError(f"request {request_id}: tenant_weight must be positive, got {tenant_weight}")
        self.tenant = tenant or DEFAULT_TENANT
        self.tenant_weight = float(tenant_weight)
        # Prompt tokens the fair-share counter charged (each once, not again on recompute).
        self.num_charged_prompt_tokens = 0
        # Output-length-aware scheduling (scheduler/length_aware.py): the chat the request
        # continues (its earlier turns' lengths are a feature) and its predicted output length
        # (the router's, or the scheduler's own predictor's at arrival).
        self.session = session
        if predicted_output_tokens is not None and predicted_output_tokens < 1:
            raise ValueError(f"request {request_id}: predicted_output_tokens must be >= 1")
        self.predicted_output_tokens = predicted_output_tokens
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.output_token_ids: list[int] = []
        self._all_token_ids = list(self.prompt_token_ids)
        # Tokens found in the prefix cache (local + external) at admission.
        self.num_cached_tokens = 0
        self.num_external_computed_tokens = 0
        self.num_preemptions = 0
        # The stop token id (or stop string, set by the detokenizer) that ended it.
        self.stop_reason: int | str | None = None
        # Chained hashes of the full blocks of `all_token_ids`, kept up to date
        # by the KV cache manager (kv_cache_manager.update_block_hashes).
        self.block_hashes: list[int] = []
        # Resolved by the scheduler once max_model_len is known.
        self.max_tokens: int = self.sampling_params.max_tokens or 0
        # Draft tokens proposed for the next step (unverified; see module doc).
        self.spec_token_ids: list[int] = []
        # Speculative decoding over the request's life: drafts verified, drafts accepted.
        self.num_draft_tokens = 0
        self.num_accepted_draft_tokens = 0
        # A traced request's scheduling events, (name, time.monotonic(), attributes): what
        # the replica turns into its queue, prefill and kv_transfer spans (router/tracing.py).
        # None (the default) records nothing: an untraced request costs one None check at
        # each of its state changes, and none per step.
        self.events: Optional[list[tuple[str, float, dict[str, Any]]]] = None

    def record(self, name: str, **attributes: Any) -> None:
        """One scheduling event of a traced request (a no-op when not traced)."""
        if self.events is not None:
            self.events.append((name, time.monotonic(), attributes))

    # ---- token views -------------------------------------------------------
    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)

    def append_output_token(self, token_id: int) -> None:
        """One token (the common decode step: no list built for it)."""
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    # ---- status ------------------------------------------------------------
    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def get_finished_reason(self) -> Optional[str]:
        return self.status.finish_reason

    def __lt__(self, other: "Request") -> bool:
        # Heap order for the priority queue: lower priority value first, then
        # earlier arrival, then id for a total order.
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
