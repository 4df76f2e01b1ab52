"""The one interface every proposer implements (spec_decode/factory.py builds them).

A proposer runs in the worker right after the target's step has been sampled
and verified: it sees the step's forward inputs (a draft model mirrors them
into its own KV cache) and, for every request that got tokens this step, the
whole token sequence including those tokens. It returns up to k draft tokens
per request; the scheduler schedules them next step (see
scheduler/spec_decode.py). A proposer's drafts are deterministic (a point
mass), which is what makes the runner's verification exact (see
ModelRunner._sample_and_verify).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(slots=True)
class ProposeInput:
    # The target's forward of this step (a draft model replays it).
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_metadata: Any
    # One entry per request that got tokens this step (these want drafts).
    req_ids: list[str]
    token_ids: list[list[int]]  # prompt + every output token, this step's included
    block_ids: list[list[int]]  # the request's KV blocks (room for the draft model's slots)


class Proposer(Protocol):
    def propose(self, inp: ProposeInput) -> dict[str, list[int]]: ...

    # KV cache for proposers that keep one (0 bytes: none).
    def bytes_per_block(self) -> int: ...

    def initialize_kv_cache(self, num_blocks: int) -> None: ...
