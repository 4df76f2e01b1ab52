"""The P/D router's decisions as pure functions: what `PDRouter.open_stream` (router/routing/pd.py)
decides for a request, and what the fleet simulator (fleetserve.sim) decides with the very same
functions. Nothing here imports Ray, asyncio or torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class PDSettings:
    """The router's side of `cluster.config.PDOptions`."""

    min_prefill_tokens: int = 64
    max_attempts: int = 2
    prefill_timeout_s: float = 60.0


def cached_prompt_tokens(cached_blocks: int, block_size: int, prompt_len: int) -> int:
    """The prompt tokens the decode replica caches, from the leading blocks its router's index
    says it holds. The engine never serves the last prompt token from cache (it computes logits)."""
    return max(0, min(cached_blocks * block_size, prompt_len - 1))


def wants_remote_prefill(
    prompt_len: int, cached_tokens: int, sampling_params: Mapping[str, Any], settings: PDSettings
) -> bool:
    """Whether a request's prompt is prefilled on the prefill pool and its KV handed to the
    decode replica: its uncached part is at least `min_prefill_tokens`, and it needs nothing the
    decode engine must compute from the prompt itself (n > 1, prompt logprobs)."""
    return (
        prompt_len - cached_tokens >= max(1, settings.min_prefill_tokens)
        and sampling_params.get("n", 1) == 1
        and sampling_params.get("prompt_logprobs") is None
    )
