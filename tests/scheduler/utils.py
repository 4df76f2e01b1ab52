"""Test helpers for the scheduler: builders, a fake model runner and a fake connector.

The fake model runner keeps a simulated paged KV cache: every slot holds the
chained hash of the tokens up to its position, computed from the *previous
slot's content* (as attention would read it), and the sampled token is a
function of the last slot. A wrong block table, a stale prefix-cache hit, a
block freed while still needed, or a failed KV load that was not recomputed
all change the tokens, so comparing against `reference_tokens` checks the
scheduler's bookkeeping end to end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from fleetserve.scheduler import (
    CacheConfig,
    KVConnectorScheduler,
    ModelRunnerOutput,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from fleetserve.scheduler import create_scheduler as build_scheduler

EOS = 0
VOCAB = 97
GARBAGE = -1  # a KV slot computed from wrong or missing KV
GARBAGE_TOKEN = 1000  # what the fake model samples from such KV


def create_scheduler(connector: Optional[KVConnectorScheduler] = None, **overrides: Any) -> Scheduler:
    """A scheduler with small defaults; any SchedulerConfig/CacheConfig field may be overridden."""
    sched_fields = set(SchedulerConfig.model_fields)
    cache_fields = set(CacheConfig.model_fields)
    unknown = set(overrides) - sched_fields - cache_fields
    assert not unknown, f"unknown overrides {unknown}"
    s_kwargs = dict(max_num_batched_tokens=64, max_num_seqs=16, max_model_len=64)
    c_kwargs = dict(block_size=4, num_blocks=64, enable_prefix_caching=True)
    s_kwargs.update({k: v for k, v in overrides.items() if k in sched_fields})
    c_kwargs.update({k: v for k, v in overrides.items() if k in cache_fields})
    return build_scheduler(SchedulerConfig(**s_kwargs), CacheConfig(**c_kwargs), connector)


def create_requests(
    n: int,
    num_tokens: int = 10,
    max_tokens: int = 8,
    *,
    prefix: str = "r",
    same_prompt: bool = False,
    start: int = 0,
    priority: int = 0,
    arrival_time: Optional[float] = None,
    **sampling: Any,
) -> list[Request]:
    """`n` requests with distinct (or identical) prompts; extra kwargs go to SamplingParams."""
    sampling.setdefault("ignore_eos", True)
    out = []
    for i in range(start, start + n):
        base = 1 if same_prompt else 1 + i * 7
        prompt = [(base + j) % (VOCAB - 1) + 1 for j in range(num_tokens)]
        out.append(
            Request(
                f"{prefix}{i}",
                prompt,
                SamplingParams(max_tokens=max_tokens, **sampling),
                eos_token_id=EOS,
                priority=priority,
                arrival_time=float(i) if arrival_time is None else arrival_time,
            )
        )
    return out


# ---- the deterministic fake model --------------------------------------------------
def kv_value(prev: int, token: int) -> int:
    return hash((prev, token)) & 0xFFFFFFFF


def next_token(last_kv: int) -> int:
    return last_kv % VOCAB


def prefix_kv(tokens: list[int]) -> list[int]:
    """The correct KV slot contents for `tokens`."""
    out, prev = [], 7
    for t in tokens:
        prev = kv_value(prev, t)
        out.append(prev)
    return out


def reference_tokens(request: Request, max_model_len: int) -> list[int]:
    """What `request` produces unpreempted, with the scheduler's stop rules."""
    sp = request.sampling_params
    tokens = list(request.prompt_token_ids)
    prev = prefix_kv(tokens)[-1]
    out: list[int] = []
    while True:
        tok = next_token(prev)
        out.append(tok)
        tokens.append(tok)
        prev = kv_value(prev, tok)
        if len(out) >= sp.min_tokens and (
            (tok == request.eos_token_id and not sp.ignore_eos) or tok in sp.stop_token_ids
        ):
            return out
        if len(out) >= request.max_tokens or len(tokens) >= max_model_len:
            return out


@dataclass
class _WorkerReq:
    tokens: list[int]
    block_ids: list[int]


@dataclass
class Load:
    """One KV load the connector asked for: positions [start, end) into `block_ids`."""

    req_id: str
    tokens: list[int]
    block_ids: list[int]
    start: int
    end: int
    is_async: bool
    fail_block: Optional[int] = None  # index into block_ids whose load fails
    delay: int = 0


class FakeModelRunner:
    """Executes SchedulerOutputs against a simulated paged KV cache.

    With a `proposer`, it also verifies draft tokens as the real model runner
    does (greedy: accept while the draft equals what the model samples at
    that position, then add the model's own token) and returns the
    proposer's drafts for the next step."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        connector: Optional["TestConnector"] = None,
        proposer: Optional["FakeProposer"] = None,
        window: Optional[int] = None,
    ) -> None:
        self.block_size = block_size
        # A sliding window: a token's KV is also garbage unless every slot of the earlier
        # positions in its window holds what it should (what a windowed attention reads).
        self.window = window
        self.proposer = proposer
        self.slots: list[Optional[int]] = [None] * (num_blocks * block_size)
        self.reqs: dict[str, _WorkerReq] = {}
        self.connector = connector
        self.in_flight: list[Load] = []  # async loads, counting down

    def _slot(self, req: _WorkerReq, pos: int) -> int:
        return req.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def _load(self, load: Load) -> set[int]:
        """Write the loaded KV; a failed block is left with garbage. Returns bad block ids."""
        kv = prefix_kv(load.tokens[: load.end])
        bad: set[int] = set()
        for pos in range(load.start, load.end):
            bi = pos // self.block_size
            slot = load.block_ids[bi] * self.block_size + pos % self.block_size
            if load.fail_block is not None and bi >= load.fail_block:
                self.slots[slot] = GARBAGE
                bad.add(load.block_ids[bi])
            else:
                self.slots[slot] = kv[pos]
        return bad

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.reqs.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.reqs[new.req_id] = _WorkerReq(
                list(new.prompt_token_ids) + list(new.output_token_ids), list(new.block_ids)
            )
        for cached in so.scheduled_cached_reqs:
            req = self.reqs[cached.req_id]
            req.tokens.extend(cached.new_token_ids)
            req.block_ids.extend(cached.new_block_ids)
        invalid: set[int] = set()
        recving: set[str] = set()
        if self.connector is not None:
            for load in self.connector.take_loads(so.kv_connector_metadata):
                if load.is_async:
                    self.in_flight.append(load)
                else:
                    invalid |= self._load(load)
            still = []
            for load in self.in_flight:
                if load.delay <= 0:
                    invalid |= self._load(load)
                    recving.add(load.req_id)
                    self.connector.load_done(load.req_id)
                else:
                    load.delay -= 1
                    still.append(load)
            self.in_flight = still
        # Write every scheduled token's KV first (one forward pass), then sample.
        req_ids, sampled = [], []
        computed_start = {c.req_id: c.num_computed_tokens for c in so.scheduled_cached_reqs}
        computed_start.update({n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs})
        spec = so.scheduled_spec_decode_tokens
        for rid, n in so.num_scheduled_tokens.items():
            req = self.reqs[rid]
            start = computed_start[rid]
            drafts = spec.get(rid, [])
            tokens = req.tokens + drafts
            assert start + n <= len(tokens), "scheduled past the known and draft tokens"
            prev = 7 if start == 0 else self.slots[self._slot(req, start - 1)]
            if self.window is not None and start > 0:
                truth = prefix_kv(tokens[:start])
                lo = max(0, start - self.window + 1)
                if any(self.slots[self._slot(req, q)] != truth[q] for q in range(lo, start)):
                    prev = GARBAGE
            for pos in range(start, start + n):
                prev = GARBAGE if prev in (None, GARBAGE) else kv_value(prev, tokens[pos])
                self.slots[self._slot(req, pos)] = prev
            req_ids.append(rid)
            if start + n >= len(req.tokens):
                assert start + n == len(tokens), "drafts scheduled only in part"
                sampled.append(self._verify(req, drafts))
            else:
                sampled.append([])
        sending = self.connector.take_finished_sending() if self.connector else set()
        drafts_out = None
        if self.proposer is not None:
            drafts_out = {
                rid: self.proposer.propose(rid, self.reqs[rid].tokens + out)
                for rid, out in zip(req_ids, sampled)
                if out
            }
        return ModelRunnerOutput(
            req_ids,
            sampled,
            finished_sending=sending,
            finished_recving=recving,
            invalid_block_ids=invalid,
            spec_token_ids=drafts_out,
        )

    def _verify(self, req: _WorkerReq, drafts: list[int]) -> list[int]:
        """Accepted drafts + the model's token after them, from the KV just written."""
        out = []
        base = len(req.tokens) - 1
        for j in range(len(drafts) + 1):
            kv = self.slots[self._slot(req, base + j)]
            out.append(GARBAGE_TOKEN if kv in (None, GARBAGE) else next_token(kv))
            if j < len(drafts) and drafts[j] != out[-1]:
                break
        return out


class FakeProposer:
    """Drafts for the fake model: a random-length prefix of the true
    continuation, then random tokens (so acceptance varies from 0 to all)."""

    def __init__(self, k: int, seed: int) -> None:
        import random

        self.k = k
        self.rng = random.Random(seed)

    def propose(self, rid: str, tokens: list[int]) -> list[int]:
        num = self.rng.randint(0, self.k)
        num_right = self.rng.randint(0, num)
        prev = prefix_kv(tokens)[-1]
        out = []
        for _ in range(num_right):
            tok = next_token(prev)
            out.append(tok)
            prev = kv_value(prev, tok)
        out += [self.rng.randint(0, VOCAB - 1) for _ in range(num - num_right)]
        return out


@dataclass
class ConnectorPlan:
    """How the test connector treats one request."""

    num_external: int = 0  # tokens it can supply beyond the local hits
    is_async: bool = False
    load_delay: int = 0  # steps before finished_recving
    fail_block: Optional[int] = None  # index (in the request's blocks) of the first bad block
    ask_later: int = 0  # answer None this many times first
    delay_free: int = -1  # >= 0: keep blocks this many steps after finishing
    policy: str = "recompute"  # what a failed load does: "recompute" or "fail"


class TestConnector(KVConnectorScheduler):
    """A scheduler-side connector driven by per-request plans (default: no hits)."""

    __test__ = False

    def __init__(self, plans: Optional[dict[str, ConnectorPlan]] = None) -> None:
        self.plans = plans or {}
        self.calls: list[tuple[str, str]] = []  # (method, req_id)
        self._local: dict[str, int] = {}
        self._pending: list[Load] = []
        self._sending: dict[str, int] = {}  # req_id -> steps left
        self.finished_params: dict[str, Any] = {}
        self._loading: set[str] = set()  # async loads in flight
        self._abandoned: set[str] = set()  # finished while their load was in flight

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        self.calls.append(("get_num_new_matched_tokens", request.request_id))
        plan = self.plans.get(request.request_id)
        if plan is None:
            return 0, False
        if plan.ask_later > 0:
            plan.ask_later -= 1
            return None, False
        self._local[request.request_id] = num_computed_tokens
        ext = min(plan.num_external, request.num_tokens - 1 - num_computed_tokens)
        return max(0, ext), plan.is_async and ext > 0

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        self.calls.append(("update_state_after_alloc", request.request_id))
        if num_external_tokens <= 0:
            return
        plan = self.plans[request.request_id]
        start = self._local[request.request_id]
        self._pending.append(
            Load(
                request.request_id,
                list(request.all_token_ids),
                list(block_ids),
                start,
                start + num_external_tokens,
                plan.is_async,
                plan.fail_block,
                plan.load_delay,
            )
        )
        plan.fail_block = None  # a retry (after preemption) loads fine
        if plan.is_async:
            self._loading.add(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        self.calls.append(("build_connector_meta", ""))
        meta, self._pending = self._pending, []
        return meta

    def request_finished(self, request: Request, block_ids: list[int]):
        self.calls.append(("request_finished", request.request_id))
        plan = self.plans.get(request.request_id)
        params = {"remote_blocks": list(block_ids)}
        self.finished_params[request.request_id] = params
        if request.request_id in self._loading:
            # Aborted mid-load: the worker still writes into these blocks.
            self._abandoned.add(request.request_id)
            return True, params
        if plan is not None and plan.delay_free >= 0 and block_ids:
            self._sending[request.request_id] = plan.delay_free
            return True, params
        return False, params

    def load_failure_policy(self, request: Request) -> str:
        plan = self.plans.get(request.request_id)
        return plan.policy if plan is not None else "recompute"

    # ---- the worker half, used by FakeModelRunner ----
    def take_loads(self, meta: Any) -> list[Load]:
        return list(meta or [])

    def load_done(self, req_id: str) -> None:
        self._loading.discard(req_id)
        if req_id in self._abandoned:
            self._abandoned.discard(req_id)
            self._sending[req_id] = 0

    def take_finished_sending(self) -> set[str]:
        done = {rid for rid, left in self._sending.items() if left <= 0}
        for rid in list(self._sending):
            if rid in done:
                del self._sending[rid]
            else:
                self._sending[rid] -= 1
        return done


def assert_invariants(sched: Scheduler) -> None:
    """Block conservation, ref counts, queue membership, max_num_seqs."""
    kv = sched.kv
    kv.check_invariants()
    referenced = set()
    for rid in sched.requests:
        referenced.update(kv.get_block_ids(rid))
    referenced.discard(-1)  # places given back outside a sliding window
    assert kv.num_free_blocks + len(referenced) == kv.num_blocks
    running = [r.request_id for r in sched.running]
    waiting = [r.request_id for r in sched.waiting]
    remote = list(sched.waiting_for_remote_kvs)
    everyone = running + waiting + remote
    assert len(everyone) == len(set(everyone)), "a request sits in two queues"
    assert len(running) <= sched.config.max_num_seqs
    from fleetserve.scheduler import RequestStatus

    for r in sched.running:
        assert r.status == RequestStatus.RUNNING
    for r in sched.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    for r in sched.waiting_for_remote_kvs.values():
        assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS


def step(sched: Scheduler, runner: Optional[FakeModelRunner] = None, sampled: Optional[dict[str, list[int]]] = None):
    """One engine step; returns (SchedulerOutput, outputs by request id)."""
    so = sched.schedule()
    assert so.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
    if runner is not None:
        ro = runner.execute(so)
    else:
        ids = list(so.num_scheduled_tokens)
        ro = ModelRunnerOutput(ids, [list((sampled or {}).get(i, [1])) for i in ids])
    outs = sched.update_from_output(so, ro)
    assert_invariants(sched)
    return so, {o.request_id: o for o in outs}


def run_to_completion(sched: Scheduler, runner: FakeModelRunner, max_steps: int = 2000):
    """Step until nothing is left; returns every output token by request id."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for _ in range(max_steps):
        if not sched.has_requests():
            break
        _, outs = step(sched, runner)
        for rid, o in outs.items():
            tokens.setdefault(rid, []).extend(o.new_token_ids)
            if o.finished:
                reasons[rid] = o.finish_reason
    else:
        raise AssertionError(f"not idle after {max_steps} steps: {sched.get_stats()}")
    return tokens, reasons


def assert_serves_and_no_leaks(sched: Scheduler, runner: FakeModelRunner | None = None) -> None:
    """After whatever happened, a new request still runs to the right tokens and,
    once idle, every block is free. `runner`: the one that ran so far, if any."""
    if runner is not None:
        run_to_completion(sched, runner)  # drain what is left
    else:
        for _ in range(1000):
            if not sched.has_requests():
                break
            step(sched)
    # A prompt no other test uses: a fresh runner's empty KV cache cannot
    # serve prefix hits that an earlier runner computed.
    req = Request("after0", [VOCAB - 1 - i for i in range(6)], SamplingParams(max_tokens=3))
    sched.add_request(req)
    tokens, reasons = run_to_completion(
        sched, runner or FakeModelRunner(sched.kv.num_blocks, sched.block_size, sched.connector)
    )
    assert tokens["after0"] == reference_tokens(req, sched.config.max_model_len)
    assert reasons["after0"] == "length"
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert not sched.has_requests()
