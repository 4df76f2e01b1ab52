"""One step's batch, as `Scheduler.schedule()` builds it, and the SchedulerOutput it becomes.

The running pass and then the waiting pass fill a `StepBatch`: tokens per request out of
one budget, the blocks each got, who was admitted and who was preempted. `to_output()`
then commits the step:

* a request the workers do not know (admitted from waiting, fresh or resumed after a
  preemption) travels in full (`NewRequestData`); a known one as a diff
  (`CachedRequestData`: the tokens and blocks its worker has not seen yet);
* the drafts scheduled this step travel in `scheduled_spec_decode_tokens`; those the
  budget cut off are dropped;
* `num_computed_tokens` advances by what was scheduled at once (optimistically):
  `update_from_output` only rolls back rejected drafts and failed KV loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fleetserve.scheduler.kv_cache_manager import KVCacheManager
from fleetserve.scheduler.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from fleetserve.scheduler.request import Request


@dataclass(slots=True)
class StepBatch:
    budget: int  # tokens still to hand out this step
    num_scheduled: dict[str, int] = field(default_factory=dict)
    # Ids of the blocks each request got this step (requests that got none are absent).
    new_blocks: dict[str, list[int]] = field(default_factory=dict)
    new_reqs: list[Request] = field(default_factory=list)  # admitted from waiting
    preempted: list[Request] = field(default_factory=list)

    def add(self, request: Request, num_tokens: int, block_ids: list[int]) -> None:
        rid = request.request_id
        self.num_scheduled[rid] = num_tokens
        if block_ids:
            self.new_blocks[rid] = block_ids
        self.budget -= num_tokens

    def drop(self, request: Request) -> None:
        """`request` is preempted: what it got earlier in this pass goes back to the budget."""
        rid = request.request_id
        self.budget += self.num_scheduled.pop(rid, 0)
        self.new_blocks.pop(rid, None)
        self.preempted.append(request)

    def to_output(
        self,
        running: list[Request],
        requests: dict[str, Request],
        kv: KVCacheManager,
        num_tokens_sent: dict[str, int],
        finished_req_ids: set[str],
    ) -> SchedulerOutput:
        """The step as the workers get it. `num_tokens_sent` (tokens each worker-known
        request has been sent) is brought up to date; requests advance their counters."""
        new_data = _new_request_data(self.new_reqs, kv, num_tokens_sent)
        cached_data = _cached_request_data(running, self, num_tokens_sent)
        spec = _advance(self.num_scheduled, requests)
        return SchedulerOutput(
            scheduled_new_reqs=new_data,
            scheduled_cached_reqs=cached_data,
            num_scheduled_tokens=self.num_scheduled,
            total_num_scheduled_tokens=sum(self.num_scheduled.values()),
            finished_req_ids=finished_req_ids,
            preempted_req_ids={r.request_id for r in self.preempted},
            scheduled_spec_decode_tokens=spec,
        )


def _new_request_data(
    new_reqs: list[Request], kv: KVCacheManager, num_tokens_sent: dict[str, int]
) -> list[NewRequestData]:
    out = []
    for r in new_reqs:
        out.append(
            NewRequestData(
                r.request_id,
                r.prompt_token_ids,
                list(r.output_token_ids),
                r.sampling_params,
                kv.get_block_ids(r.request_id),
                r.num_computed_tokens,
                r.lora_id,
            )
        )
        num_tokens_sent[r.request_id] = r.num_tokens
    return out


def _cached_request_data(
    running: list[Request], batch: StepBatch, num_tokens_sent: dict[str, int]
) -> list[CachedRequestData]:
    """Diffs for the scheduled running requests the workers already hold."""
    new_ids = {r.request_id for r in batch.new_reqs}
    num_scheduled, new_blocks = batch.num_scheduled, batch.new_blocks
    sent = num_tokens_sent
    empty: list[int] = []
    out = []
    for r in running:
        rid = r.request_id
        if rid in new_ids or rid not in num_scheduled:
            continue
        num_tokens = r.num_tokens
        old = sent[rid]
        new_tokens = r.all_token_ids[old:] if old < num_tokens else empty
        sent[rid] = num_tokens
        out.append(CachedRequestData(rid, new_tokens, new_blocks.get(rid, empty), r.num_computed_tokens))
    return out


def _advance(num_scheduled: dict[str, int], requests: dict[str, Request]) -> dict[str, list[int]]:
    """Advance every scheduled request's `num_computed_tokens` and take its drafts off it;
    returns the drafts scheduled this step, by request id."""
    spec: dict[str, list[int]] = {}
    for rid, n in num_scheduled.items():
        r = requests[rid]
        if r.spec_token_ids:
            # The budget may have cut the drafts short; the rest are dropped.
            num_spec = r.num_computed_tokens + n - r.num_tokens
            if num_spec > 0:
                spec[rid] = r.spec_token_ids[:num_spec]
            r.spec_token_ids = []
        r.num_computed_tokens += n
    return spec
