"""Output-length-aware scheduling: shortest predicted first with aging, and KV reservation
by predicted length (the predictor: length_predictor.py).

A request's prediction is `Request.predicted_output_tokens`: the router's, when it sent one
(it sees the whole fleet's completions), else the scheduler's own predictor's at arrival.

**Order (`policy="sjf"`, and `fair_shortest_first` inside a tenant's share).** A waiting
request's key is

    key = arrival_time + predicted remaining output tokens / sjf_aging_rate

and the least key goes first. The key is fixed once the request waits (a preempted request
re-enters with what it still has to produce), so the queue is a heap, and the aging is in
the key: a request arriving `d` seconds later than another is ahead of it only if it is
predicted to be more than `d * sjf_aging_rate` tokens shorter. Starvation is therefore
bounded: a request is never passed by one that arrived more than
`predicted / sjf_aging_rate <= max_tokens / sjf_aging_rate` seconds after it, so once that
much time has passed since its arrival only the requests already waiting can go before it,
and those are finitely many (tests/scheduler/test_length_aware.py). A very large rate is
FCFS; a small one is nearly pure shortest-first.

**Preemption.** The running request with the largest key (the one the queue ranks last:
the most predicted work left, of the latest arrival) gives its blocks back; it re-enters
waiting with its own key, so two requests cannot preempt each other in turn.

**KV reservation (`capacity_policy="reserve_predicted"`).** Admit a request only when the
blocks of its prompt and its predicted output (times `reserve_margin`), on top of what the
running requests still need by their predictions, are free. Unlike guaranteed_no_evict
(which reserves to max_tokens and so admits far fewer requests) a prediction can fall
short: then the scheduler preempts as max_utilization does. Fewer requests are admitted
into a pool they would overflow, so fewer are preempted.
"""

from __future__ import annotations

import heapq
from itertools import count
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

from fleetserve.scheduler.block_pool import KVCacheBlock
from fleetserve.scheduler.fair import FairQueue, VirtualTokenCounter
from fleetserve.scheduler.kv_cache_manager import KVCacheManager
from fleetserve.scheduler.length_predictor import (
    ERROR_BUCKETS,
    LengthFeatures,
    OutputLengthPredictor,
    error_bucket,
)
from fleetserve.scheduler.request import Request, RequestStatus


def features_of(request: Request) -> LengthFeatures:
    """What the scheduler knows of `request` before it runs, as the predictor's features."""
    return LengthFeatures(
        request.num_prompt_tokens,
        request.sampling_params.max_tokens,
        request.tenant,
        request.lora_name or "",
        request.session,
    )


def predicted_remaining(request: Request) -> int:
    """Predicted output tokens still to come (0 once it passed its prediction)."""
    pred = request.predicted_output_tokens
    if pred is None:
        pred = request.max_tokens
    return max(0, pred - request.num_output_tokens)


def sjf_key(request: Request, aging_rate: float) -> float:
    return request.arrival_time + predicted_remaining(request) / aging_rate


class ShortestFirstQueue:
    """The waiting queue of policy "sjf": least `sjf_key` first (arrival, then id, on ties)."""

    def __init__(self, aging_rate: float) -> None:
        self.aging_rate = aging_rate
        self._heap: list[tuple[float, float, int, Request]] = []
        self._seq = count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (sjf_key(request, self.aging_rate), request.arrival_time, next(self._seq), request))

    prepend = add  # the key already puts a request back where it belongs

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove_many(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        self._heap = [e for e in self._heap if id(e[3]) not in drop]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter([e[3] for e in sorted(self._heap, key=lambda e: e[:3])])


class FairShortestFirstQueue(FairQueue):
    """Policy "fair" with fair_shortest_first: the tenant served least goes next (the
    Virtual Token Counter, as `FairQueue`), and inside its share its request with the least
    `sjf_key` (not its oldest): each tenant's queue is a heap of (key, arrival, seq, request)."""

    def __init__(self, vtc: VirtualTokenCounter, aging_rate: float) -> None:
        super().__init__(vtc)
        self.aging_rate = aging_rate
        self._seq = count()

    def _qnew(self) -> Any:
        return []

    def _qpush(self, q: Any, request: Request, front: bool) -> None:
        # (front or not: the key already puts a request back where it belongs)
        heapq.heappush(q, (sjf_key(request, self.aging_rate), request.arrival_time, next(self._seq), request))

    def _qhead(self, q: Any) -> Request:
        head: Request = q[0][3]
        return head

    def _qpop(self, q: Any) -> Request:
        request: Request = heapq.heappop(q)[3]
        return request

    def _qwithout(self, q: Any, drop: set[int]) -> Any:
        kept = [e for e in q if id(e[3]) not in drop]
        heapq.heapify(kept)
        return kept

    def _qordered(self, q: Any) -> Iterable[Request]:
        return [e[3] for e in sorted(q, key=lambda e: e[:3])]


def sjf_victim(running: list[Request], aging_rate: float) -> Request:
    """The running request the sjf queue ranks last (largest key, then arrival, then id)."""
    return max(running, key=lambda r: (sjf_key(r, aging_rate), r.arrival_time, r.request_id))


class ReservePredicted:
    """capacity_policy "reserve_predicted": admit while the blocks of every holder's prompt
    plus predicted output (times `margin`) fit the pool; preempt when a prediction was short."""

    can_preempt = True

    def __init__(self, margin: float) -> None:
        self.margin = margin
        self._reserved = 0

    def _blocks_at_prediction(self, request: Request, kv: KVCacheManager) -> int:
        pred = request.predicted_output_tokens
        out = request.max_tokens if pred is None else min(request.max_tokens, int(pred * self.margin + 0.5))
        # A request already past its prediction needs at least its next token's slot.
        final = max(request.num_prompt_tokens + out - 1, request.num_tokens)
        return kv.cdiv(final)

    def begin_step(self, holders: Callable[[], list[Request]], kv: KVCacheManager) -> None:
        owned = kv.req_to_blocks
        self._reserved = sum(
            max(0, self._blocks_at_prediction(r, kv) - len(owned.get(r.request_id, ()))) for r in holders()
        )

    def can_admit(self, request: Request, hits: Sequence[KVCacheBlock], kv: KVCacheManager) -> bool:
        if request.request_id in kv.req_to_blocks:
            return True
        need = self._blocks_at_prediction(request, kv) - len(hits)
        need += sum(1 for b in hits if b.ref_cnt == 0)
        return need <= kv.num_free_blocks - self._reserved

    def admitted(self, request: Request, kv: KVCacheManager) -> None:
        self._reserved += max(
            0, self._blocks_at_prediction(request, kv) - len(kv.req_to_blocks.get(request.request_id, ()))
        )


class LengthTracker:
    """The scheduler's side of prediction: predicts a request that arrives without one,
    learns from each that finished by itself or at its length, and counts the errors
    (|actual - predicted| in ERROR_BUCKETS, for the prediction-error histogram)."""

    def __init__(self, predictor: Optional[OutputLengthPredictor] = None) -> None:
        self.predictor = predictor or OutputLengthPredictor()
        self.error_counts = [0] * (len(ERROR_BUCKETS) + 1)
        self.error_sum = 0
        self.num_predicted = 0

    def arrive(self, request: Request) -> None:
        guess = request.predicted_output_tokens
        if guess is None:
            guess = self.predictor.predict(features_of(request))
        # (The router predicts from the client's max_tokens; the scheduler's cap may be lower.)
        request.predicted_output_tokens = max(1, min(guess, request.max_tokens))

    def finish(self, request: Request) -> None:
        if request.status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED):
            return  # aborted or failed: its length is not known
        actual = request.num_output_tokens
        if actual < 1:
            return
        self.predictor.observe(features_of(request), actual)
        pred = request.predicted_output_tokens
        if pred is not None:
            err = abs(actual - pred)
            self.error_counts[error_bucket(err)] += 1
            self.error_sum += err
            self.num_predicted += 1


def make_length_tracker(policy: str, fair_shortest_first: bool, capacity_policy: str) -> Optional[LengthTracker]:
    needed = policy == "sjf" or fair_shortest_first or capacity_policy == "reserve_predicted"
    return LengthTracker() if needed else None
