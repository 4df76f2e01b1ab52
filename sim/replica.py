"""One simulated replica: the real scheduler, stepped in virtual time.

`SimReplica` owns a real `fleetserve.scheduler.Scheduler`, built by `create_scheduler` from
the `SchedulerConfig` and `CacheConfig` that `EngineArgs` derives for `fleetserve serve`,
and drives it as `replica/engine/engine_core.py`'s `step()` does:

    schedule()  ->  SchedulerOutput  ->  StepShape  ->  cost.step_seconds(shape)
    ... that much virtual time later ...
    ModelRunnerOutput (one token per request that reached the end of its tokens)
    ->  update_from_output()  ->  token times, finishes, KV events

Only the model forward is replaced (by the cost model); queueing, chunked prefill, prefix
caching, preemption and admission are the scheduler's own. Assumptions, stated once:

* The engine is synchronous: a step's outputs are applied before the next `schedule()`
  (the real engine's asynchronous scheduling, which overlaps the two, is not modelled).
* Requests that arrive during a step enter the scheduler's waiting queue at once; the next
  `schedule()` is the first to see them, as the engine core adds requests between steps.
* Sampled token ids are deterministic (a function of the request's output position), never
  the EOS token: requests run with `ignore_eos`, so each finishes at the trace's output
  length (or earlier where `max_model_len` caps it, as the real engine does). A trace
  request with a client `max_tokens` above its output length instead runs with that cap and
  samples EOS (`EOS_TOKEN`) as its last token: it ends by itself, at the same length.
* The scheduler's own CPU time is not virtual time: the profile's per-step overhead covers it.
* With a KV connector (P/D: `Cluster(pd=...)`), its real scheduler half runs in the scheduler;
  the worker half is the cluster's cost model: the transfers the cluster finishes are reported
  in the next step end's `finished_sending` / `finished_recving`, as `get_finished` reports
  what ended by the time the forward is done.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from fleetserve.scheduler import (
    EngineCoreOutput,
    KVEventBatch,
    ModelRunnerOutput,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerOutput,
    create_scheduler,
)
from fleetserve.scheduler.config import CacheConfig, SchedulerConfig
from fleetserve.scheduler.connector import KVConnectorScheduler
from fleetserve.sim.shape import StepCostModel, StepShape, step_shape

# The EOS token of requests that end by themselves (sampled ids otherwise start at 1).
EOS_TOKEN = 0


class ReplicaStalled(RuntimeError):
    """The scheduler holds unfinished requests but schedules nothing: no step could ever
    change that, so the simulation stops instead of idling forever."""


@dataclass(slots=True)
class StepStart:
    """A step that was scheduled and is now running for `seconds` of virtual time."""

    output: SchedulerOutput
    shape: StepShape
    runner_output: ModelRunnerOutput  # what the model returns at the step's end
    seconds: float


class SimReplica:
    """A replica in virtual time: the real scheduler plus a step-cost model."""

    def __init__(
        self,
        replica_id: str,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        cost_model: StepCostModel,
        vocab_size: int = 32000,
        connector: Optional[KVConnectorScheduler] = None,
        pool: Optional[str] = None,
    ) -> None:
        self.replica_id = replica_id
        self.pool = pool  # "prefill" / "decode" in a P/D fleet, None when colocated
        self.scheduler: Scheduler = create_scheduler(scheduler_config, cache_config, connector)
        # What the connector's worker half would report at the next step's end.
        self.finished_sending: set[str] = set()
        self.finished_recving: set[str] = set()
        self.cost = cost_model
        self.max_model_len = scheduler_config.max_model_len
        self.block_size = cache_config.block_size
        self.vocab_size = vocab_size
        # The requests this replica holds, by id, until they finish (the scheduler forgets a
        # request when it frees it; its counters are read after that).
        self.requests: dict[str, Request] = {}
        self.busy = False  # a step is in flight
        self.busy_s = 0.0  # virtual seconds spent in steps
        self.num_steps = 0
        self.num_tokens = 0  # tokens computed in all steps
        # Requests that end by EOS (a client max_tokens above their length): the output
        # position whose token is EOS.
        self._eos_at: dict[str, int] = {}

    # ---- requests ------------------------------------------------------------------
    def max_prompt_tokens(self) -> int:
        """The longest prompt this replica accepts: the engine refuses one that leaves no room
        for an output token in `max_model_len` (processor.py), and the scheduler finishes at
        once one its whole KV pool could not hold (`Scheduler.add_request`)."""
        pool = self.scheduler.kv.num_blocks * self.block_size
        return min(self.max_model_len - 1, pool)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_tokens: int,
        arrival_s: float,
        priority: int = 0,
        kv_transfer_params: Optional[dict[str, Any]] = None,
        tenant: Optional[str] = None,
        session: Optional[str] = None,
        max_tokens: Optional[int] = None,
    ) -> Request:
        """`max_tokens`: the client's cap, when the request ends by itself (EOS) after
        `output_tokens`; unset, it asks for exactly `output_tokens` (with ignore_eos)."""
        if max_tokens is None or max_tokens <= output_tokens:
            sp = SamplingParams(max_tokens=output_tokens, ignore_eos=True)
        else:
            sp = SamplingParams(max_tokens=max_tokens)
            self._eos_at[request_id] = output_tokens
        request = Request(
            request_id,
            prompt_token_ids,
            sp,
            eos_token_id=None if sp.ignore_eos else EOS_TOKEN,
            arrival_time=arrival_s,
            priority=priority,
            kv_transfer_params=kv_transfer_params,
            tenant=tenant,
            session=session,
        )
        self.scheduler.add_request(request)
        self.requests[request_id] = request
        return request

    def has_work(self) -> bool:
        return self.scheduler.has_requests()

    # ---- the step --------------------------------------------------------------------
    def start_step(self) -> StepStart:
        """Schedule a step and price it. A step with nothing to compute (only finishes the
        workers must hear of) costs 0 s; the caller applies it with `finish_step` at once."""
        so = self.scheduler.schedule()
        shape, ro = self.model_step(so)
        if so.total_num_scheduled_tokens == 0:
            s = self.scheduler
            # Stalled unless a transfer in flight (a load, a send holding blocks) frees it.
            if s.has_unfinished_requests() and not (s.running or s.waiting_for_remote_kvs or s.sending):
                raise ReplicaStalled(
                    f"replica {self.replica_id}: {self.scheduler.get_num_unfinished_requests()} requests "
                    "unfinished but nothing schedulable"
                )
            return StepStart(so, shape, ro, 0.0)
        seconds = float(self.cost.step_seconds(shape))
        if not seconds >= 0.0:
            raise ValueError(f"the cost model returned {seconds!r} s for {shape}")
        self.busy = True
        self.busy_s += seconds
        self.num_steps += 1
        self.num_tokens += so.total_num_scheduled_tokens
        return StepStart(so, shape, ro, seconds)

    def model_step(self, so: SchedulerOutput) -> tuple[StepShape, ModelRunnerOutput]:
        """The step as token counts (`step_shape`), and what a model runner returns for it.

        The runner samples one token for each request whose step reaches the end of its
        known tokens and none for a prompt chunk short of it; the token id is a function of
        the request's length, so runs repeat."""
        reqs = self.scheduler.requests
        shape = step_shape(so.num_scheduled_tokens, reqs)
        vocab = self.vocab_size - 1
        empty: list[int] = []
        sampled: list[list[int]] = []
        eos_at = self._eos_at
        for rid in so.num_scheduled_tokens:
            r = reqs[rid]
            num_tokens = r.num_tokens
            if r.num_computed_tokens < num_tokens:
                sampled.append(empty)
            elif eos_at and eos_at.get(rid) == len(r.output_token_ids) + 1:
                sampled.append([EOS_TOKEN])
            else:
                sampled.append([1 + (num_tokens * 7919) % vocab])
        return shape, ModelRunnerOutput(list(so.num_scheduled_tokens), sampled)

    def finish_step(self, step: StepStart) -> tuple[list[EngineCoreOutput], Optional[KVEventBatch]]:
        """Apply the step's model output; returns the outputs and the step's KV events."""
        self.busy = False
        ro = step.runner_output
        if self.finished_sending or self.finished_recving:
            ro.finished_sending, self.finished_sending = self.finished_sending, set()
            ro.finished_recving, self.finished_recving = self.finished_recving, set()
        outputs = self.scheduler.update_from_output(step.output, ro)
        return outputs, self.scheduler.take_kv_events()

    def forget(self, request_id: str) -> Optional[Request]:
        self._eos_at.pop(request_id, None)
        return self.requests.pop(request_id, None)

    # ---- checks ------------------------------------------------------------------------
    def leaked_blocks(self) -> int:
        """Blocks still referenced once every request is done (0 when none leaked): a free
        block may keep its prefix-cache hash, but must be back in the free queue."""
        kv = self.scheduler.kv
        return kv.num_blocks - kv.num_free_blocks
