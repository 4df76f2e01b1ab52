"""What a cost model sees of one engine step, and what it answers.

The simulator turns a real `SchedulerOutput` into a `StepShape` (token counts only) and
asks a `StepCostModel` how long the step takes on the profiled hardware. The profile
module implements the model (fitted or analytic); the simulator only needs this
protocol, so the two are built and tested apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol


@dataclass(frozen=True, slots=True)
class StepShape:
    """One engine step as token counts.

    A prefill chunk of `n` new tokens for a request with `c` tokens already computed (or
    loaded from the prefix cache) adds `n` to `prefill_tokens` and `n * (c + n / 2)` to
    `prefill_attn_tokens` (the chunk's causal attention work against its context). A
    decode row with context `c` (its tokens so far) adds 1 to `decode_seqs`, 1 plus its
    draft tokens to `decode_tokens` and `c` to `decode_context_tokens`.
    """

    prefill_tokens: int = 0  # new tokens computed in prefill chunks
    prefill_seqs: int = 0  # requests with a prefill chunk in this step
    prefill_attn_tokens: float = 0.0  # sum over chunks of n * (c + n / 2)
    decode_seqs: int = 0  # requests decoding one token (plus drafts) this step
    decode_tokens: int = 0  # tokens computed for decode rows (1 each, + draft tokens)
    decode_context_tokens: int = 0  # sum of the decode rows' context lengths

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    @property
    def empty(self) -> bool:
        return self.num_tokens == 0


class StepCostModel(Protocol):
    """Seconds for one step on the profiled hardware, and for moving KV between replicas."""

    def step_seconds(self, shape: StepShape) -> float: ...

    def kv_transfer_seconds(self, nbytes: int, connector: str) -> float: ...

    def kv_bytes_per_token(self) -> int: ...


def step_shape(num_scheduled_tokens: Mapping[str, int], requests: Mapping[str, Any]) -> StepShape:
    """The shape of a step the scheduler just scheduled (`SchedulerOutput.num_scheduled_tokens`
    over `Scheduler.requests`), for the simulator and for `fleetserve profile` alike.

    `schedule()` has already advanced every scheduled request's `num_computed_tokens` by its
    tokens, so the context a chunk computes against is `num_computed_tokens - n` (prefix-cache
    hits included). A row is a decode when everything before the token(s) it computes is
    computed and the request has produced output; anything else (a prompt chunk, a recompute
    after a preemption, a prompt's last token after a full prefix hit) is a prefill chunk.
    Drafts are counted in `n` already."""
    p_tokens = p_seqs = d_seqs = d_tokens = d_ctx = 0
    p_attn = 0.0
    for rid, n in num_scheduled_tokens.items():
        r = requests[rid]
        num_tokens = r.num_tokens
        before = r.num_computed_tokens - n
        if before >= num_tokens - 1 and num_tokens > r.num_prompt_tokens:
            d_seqs += 1
            d_tokens += n
            d_ctx += num_tokens
        else:
            p_tokens += n
            p_seqs += 1
            p_attn += n * (before + n / 2)
    return StepShape(p_tokens, p_seqs, p_attn, d_seqs, d_tokens, d_ctx)
