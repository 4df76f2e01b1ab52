"""The messages between scheduler, workers and engine.

    Scheduler.schedule()            -> SchedulerOutput      (to every worker)
    worker.execute_model(...)       -> ModelRunnerOutput    (from rank 0)
    Scheduler.update_from_output()  -> list[EngineCoreOutput] (to the engine)

`SchedulerOutput` carries diffs: a request travels in full once
(`NewRequestData`), later steps send only what changed (`CachedRequestData`).
A request resumed after preemption is sent in full again: the worker dropped
its state when it saw the id in `preempted_req_ids`, which is simpler than
vLLM's in-place "resumed" delta and costs one list of ints per preemption.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from fleetserve.scheduler.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    # Output tokens produced before a preemption (empty for a fresh request);
    # the worker needs them as input and for penalties.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # The LoRA adapter (its engine-wide id; 0: the base model).
    lora_id: int = 0


@dataclass(slots=True)
class CachedRequestData:
    req_id: str
    # Tokens appended since the worker last heard of this request (the token
    # sampled in the previous step, for a decode).
    new_token_ids: list[int]
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # req_id -> tokens to compute this step.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that finished (or were aborted) since the last step: workers
    # drop their state.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: Any = None
    # req_id -> draft tokens to verify this step. They sit after the request's
    # known tokens and are counted in num_scheduled_tokens:
    #   num_scheduled = (known tokens not yet computed) + len(drafts)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # The step's grammar bitmask for constrained requests (set by the engine core,
    # read by the model runner's sampler; see replica/structured_output/manager.py).
    structured_output: Any = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    @staticmethod
    def empty() -> "SchedulerOutput":
        return SchedulerOutput([], [], {}, 0)


# One entry per sampled token: (top token ids, their logprobs, rank of the
# sampled token). The sampled token itself is always first in the lists.
Logprobs = list[tuple[list[int], list[float], int]]


@dataclass(slots=True)
class ModelRunnerOutput:
    req_ids: list[str]
    # Per request in `req_ids` order; empty for a prefill chunk that does not
    # reach the end of the prompt. With draft tokens: the accepted drafts,
    # then one token sampled by the target (the bonus or the correction).
    sampled_token_ids: list[list[int]]
    logprobs: Optional[dict[str, Logprobs]] = None
    prompt_logprobs: Optional[dict[str, Logprobs]] = None
    # From the worker side of the KV connector.
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    # Draft tokens the worker's proposer suggests for each request's next step.
    spec_token_ids: Optional[dict[str, list[int]]] = None
    # What the connector moved this step (kv_transfer.metrics), for the engine's metrics.
    kv_connector_stats: Optional[dict[str, Any]] = None
    # Saves the worker half was handed and has not finished (copy-out or export under way):
    # the engine keeps stepping while any is, so it never idles with a save pending.
    kv_saves_in_flight: int = 0
    # Requests with SamplingParams.embed whose prompt ended this step: their embedding.
    pooler_output: Optional[dict[str, list[float]]] = None
    # Requests that could not sample (their masks together forbade every token): id -> why.
    # They have no token this step; the engine core finishes them with "error".
    sampling_errors: Optional[dict[str, str]] = None

    @staticmethod
    def empty() -> "ModelRunnerOutput":
        return ModelRunnerOutput([], [])


@dataclass(slots=True)
class EngineCoreOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    new_logprobs: Optional[Logprobs] = None
    new_prompt_logprobs: Optional[Logprobs] = None
    num_cached_tokens: int = 0
    kv_transfer_params: Optional[dict[str, Any]] = None
    # Of num_cached_tokens, the prompt tokens whose KV a connector loaded.
    num_remote_tokens: int = 0
    embedding: Optional[list[float]] = None  # SamplingParams.embed: the prompt's
    # A traced request's scheduling events (Request.events), on its last output only.
    events: Optional[list[tuple[str, float, dict[str, Any]]]] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
