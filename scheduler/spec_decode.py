"""The scheduler's half of speculative decoding: draft bookkeeping and counters.

vLLM v1's model, which needs no new request state beyond the drafts:

    step t   update_from_output: the worker's proposer returned drafts d1..dk
             for request r; they are kept on r.spec_token_ids (capped so that
             no draft lies past max_tokens).
    step t+1 schedule: r's gap is num_tokens_with_spec - num_computed_tokens,
             i.e. 1 + k for a decode; the drafts travel in
             SchedulerOutput.scheduled_spec_decode_tokens and get KV slots like
             any token. They are never hashed into the prefix cache (hashes
             cover all_token_ids only, which drafts are not part of).
             update_from_output: the worker returns a+1 tokens (a accepted
             drafts + the target's own token); num_computed_tokens rolls back
             by the k - a rejected drafts, so their KV slots are simply
             overwritten next step; each returned token passes the stop checks
             in order, and the rest are dropped at the first stop.

Drafts cost compute whether or not they are accepted: at a large batch a
rejected draft token costs about as much as a decoded one. `DraftLengthPolicy`
lets each request earn its draft length (HF assisted generation's heuristic:
+2 after a fully accepted draft, the accepted length + 1 after a partial one),
and a request whose drafts are rejected outright stops drafting for an
exponentially growing number of proposals. Copying requests keep k drafts;
requests where the proposer only guesses cost almost nothing.

That price holds in a large batch only. A step of a few tokens costs about
what a one-token step costs (reading the weights bounds it, not arithmetic;
docs/serving/spec-decode.md, "Free drafts in small steps", has the figures),
so a lone request, or the last few of a batch, pays nothing for a rejected
draft and gains a step for each accepted one. `free_draft_tokens` is that
step size: while the next step (a token per running request plus the earned
drafts) stays under it and no prefill waits to join, the room left is filled
with more of the offered drafts, up to k each (`assign_drafts`). The tail of
a batch is where that pays: the request that copies least sets how many
steps the batch takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

from fleetserve.scheduler.request import Request, RequestStatus


@dataclass(slots=True)
class SpecDecodingStats:
    """Cumulative counters, as vLLM's `vllm:spec_decode_*` metrics."""

    num_spec_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Position i: how many times the (i+1)-th draft token was accepted.
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1

    def snapshot(self) -> "SpecDecodingStats":
        return SpecDecodingStats(
            self.num_spec_tokens,
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.num_accepted_tokens_per_pos),
        )


def cap_drafts(request: Request, drafts: list[int], num_spec_tokens: int) -> list[int]:
    """Drafts worth verifying: a step yields at most len(drafts) + 1 tokens,
    so more than max_tokens - outputs - 1 drafts would be computed for nothing."""
    room = min(num_spec_tokens, request.max_tokens - request.num_output_tokens - 1)
    return list(drafts[:room]) if room > 0 else []


class DraftLengthPolicy:
    """Per request: how many drafts it may send next (see the module doc)."""

    START = 2  # a fresh request proves itself first
    MAX_WAIT = 64

    __slots__ = ("k", "_limit", "_misses", "_wait")

    def __init__(self, k: int) -> None:
        self.k = k
        self._limit: dict[str, int] = {}
        self._misses: dict[str, int] = {}  # consecutive drafts with nothing accepted
        self._wait: dict[str, int] = {}  # proposals to skip before trying again

    def limit(self, rid: str) -> int:
        """Called once per proposal the worker makes for `rid`."""
        wait = self._wait.get(rid, 0)
        if wait:
            self._wait[rid] = wait - 1
            return 0
        return self._limit.get(rid, min(self.k, self.START))

    def observe(self, rid: str, num_drafts: int, num_accepted: int) -> None:
        if num_accepted == num_drafts:
            self._limit[rid] = min(self.k, num_drafts + 2)
            self._misses.pop(rid, None)
        elif num_accepted:
            self._limit[rid] = num_accepted + 1
            self._misses.pop(rid, None)
        else:
            misses = self._misses[rid] = self._misses.get(rid, 0) + 1
            self._limit[rid] = 1
            self._wait[rid] = min(self.MAX_WAIT, 2**misses)

    def forget(self, rid: str) -> None:
        self._limit.pop(rid, None)
        self._misses.pop(rid, None)
        self._wait.pop(rid, None)


def assign_drafts(
    offered: dict[str, list[int]],
    requests: Mapping[str, Request],
    num_spec_tokens: int,
    policy: Optional[DraftLengthPolicy],
    free_room: int,
) -> None:
    """Set each request's drafts for its next step from the worker's `offered` ones.

    Drafts follow the last known token, so only a running request whose KV is complete
    up to it (not mid-prefill, not rolled back) takes any: those worth verifying
    (`cap_drafts`), as many as `policy` lets it earn. `free_room` (tokens the next step
    may still take at about a one-token step's cost; 0: none) then goes, in order, to
    more of the offered drafts, up to `num_spec_tokens` each.
    """
    # (request, every draft worth verifying, how many of them it sends)
    chosen: list[tuple[Request, list[int], int]] = []
    running = RequestStatus.RUNNING
    for rid, tokens in offered.items():
        request = requests.get(rid)
        if request is not None and request.status == running and request.num_computed_tokens == request.num_tokens - 1:
            pool = cap_drafts(request, tokens, num_spec_tokens)
            n = len(pool) if policy is None else min(len(pool), policy.limit(rid))
            chosen.append((request, pool, n))
    room = free_room - sum(n for _, _, n in chosen)
    for request, pool, n in chosen:
        extra = min(room, len(pool) - n) if room > 0 else 0
        if extra > 0:
            n += extra
            room -= extra
        request.spec_token_ids = pool[:n]


def lookahead_slots(request: Request, num_new_tokens: int, num_lookahead: int) -> int:
    """Extra KV slots for a draft model when this step reaches the end of the
    known tokens (it then runs ahead of the target); never past the request's
    last possible token, so capacity reservations still hold."""
    if not num_lookahead:
        return 0
    end = request.num_computed_tokens + num_new_tokens
    if end < request.num_tokens:
        return 0  # a prefill chunk: nothing is sampled, nothing drafted
    last = request.num_prompt_tokens + request.max_tokens - 1
    return max(0, min(num_lookahead, last - end))
