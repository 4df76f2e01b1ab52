"""KV-aware admission at each engine replica: refuse (429) what cannot be served soon.

The engine's own bound counts requests (`max_waiting_requests`); ten long prompts and
ten one-word prompts count the same. Here a replica also refuses a request when the
tokens it already has queued (waiting prompts plus what running requests still have to
compute: the engine's `num_queued_tokens`) would exceed `max_queued_kv_ratio` times its
KV cache's capacity in tokens. Beyond that the request would only wait, holding a
connection and memory, while the client could retry elsewhere or later (the 429
carries Retry-After). The first request of an idle replica is always admitted.

With P/D the decode replica admits a request before its prefill runs elsewhere
(`Reservations`): a refusal then costs no prefill, and the reserved prompts count as
queued work here until they arrive, are released, or their deadline passes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional


def admission_refusal(
    load: dict, prompt_len: int, block_size: int, max_queued_kv_ratio: float, reserved_tokens: int = 0
) -> Optional[str]:
    """Why `load` cannot take a prompt of `prompt_len` tokens now, or None. `reserved_tokens`:
    the prompts of decode slots reserved here and not used yet (queued work to come)."""
    capacity = max(1, load.get("num_blocks", 0) * block_size)
    queued = load.get("num_queued_tokens", 0) + reserved_tokens
    if queued == 0 or queued + prompt_len <= max_queued_kv_ratio * capacity:
        return None
    return (
        f"the replica is overloaded: {queued} tokens are queued, more than "
        f"{max_queued_kv_ratio:g}x its KV cache of {capacity} tokens; retry later"
    )


RESERVATION_KEY = "_fleetserve_reservation"  # a generate body's reservation (its owner's id)


@dataclass
class _Held:
    prompt_len: int
    deadline: float  # time.monotonic()


class Reservations:
    """Decode slots the P/D router holds before it runs a prefill elsewhere (router.routing.pd).

    `reserve` admits a request here before its prefill runs, so a decode replica that would
    refuse it says so before any prefill work is done; the request that arrives with the
    owner's id then `take`s its slot and is admitted. A reservation counts against admission
    (its prompt's tokens are queued work to come) until it is taken, released by its owner
    (the prefill failed, the client went away) or its deadline passes, whichever comes first:
    an owner that never comes back holds nothing past its deadline."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._held: dict[str, _Held] = {}

    def reserve(self, owner: str, prompt_len: int, ttl_s: float) -> None:
        self._sweep()
        self._held[owner] = _Held(prompt_len, self._clock() + ttl_s)

    def take(self, owner: str) -> bool:
        """Use `owner`'s reservation; False when it has none (never made, released, expired)."""
        self._sweep()
        return self._held.pop(owner, None) is not None

    def release(self, owner: str) -> bool:
        return self._held.pop(owner, None) is not None

    def tokens(self) -> int:
        """Prompt tokens of the live reservations."""
        self._sweep()
        return sum(h.prompt_len for h in self._held.values())

    def __len__(self) -> int:
        self._sweep()
        return len(self._held)

    def _sweep(self) -> None:
        now = self._clock()
        for owner in [o for o, h in self._held.items() if h.deadline <= now]:
            del self._held[owner]
