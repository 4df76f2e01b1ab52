"""What a cost model sees of one engine step, and what it answers.

The simulator turns a real `SchedulerOutput` into a `StepShape` (token counts only) and
asks a `StepCostModel` how long the step takes on the profiled hardware. The profile
module implements the model (fitted or analytic); the simulator only needs this
protocol, so the two are built and tested apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


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
