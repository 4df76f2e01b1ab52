"""KV-aware admission at each engine replica: refuse (429) what cannot be served soon.

The engine's own bound counts requests (`max_waiting_requests`); ten long prompts and
ten one-word prompts count the same. Here a replica also refuses a request when the
tokens it already has queued (waiting prompts plus what running requests still have to
compute: the engine's `num_queued_tokens`) would exceed `max_queued_kv_ratio` times its
KV cache's capacity in tokens. Beyond that the request would only wait, holding a
connection and memory, while the client could retry elsewhere or later (the 429
carries Retry-After). The first request of an idle replica is always admitted.
"""

from __future__ import annotations

from typing import Optional


def admission_refusal(load: dict, prompt_len: int, block_size: int, max_queued_kv_ratio: float) -> Optional[str]:
    """Why `load` cannot take a prompt of `prompt_len` tokens now, or None."""
    capacity = max(1, load.get("num_blocks", 0) * block_size)
    queued = load.get("num_queued_tokens", 0)
    if queued == 0 or queued + prompt_len <= max_queued_kv_ratio * capacity:
        return None
    return (
        f"the replica is overloaded: {queued} tokens are queued, more than "
        f"{max_queued_kv_ratio:g}x its KV cache of {capacity} tokens; retry later"
    )
