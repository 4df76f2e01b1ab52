"""Per-tenant fair share: the Virtual Token Counter (Sheng et al., "Fairness in Serving
Large Language Models", OSDI 2024), for `policy="fair"`.

Each tenant has a counter of the service it got here, in weighted tokens divided by its
weight (`Request.tenant_weight`):

    counter[t] += (input_weight * prompt tokens computed + output_weight * output tokens) / weight

* Order: the waiting tenant with the least counter is admitted next (`FairQueue`); inside
  a tenant, first come first served, a preempted request at its tenant's front.
* Lift: when a tenant becomes active here (a request arrives and it had none waiting,
  running or loading), its counter is raised to max(own, min over the active tenants),
  or, with no tenant active, to the counter of the last tenant that left: idle time
  banks no credit, so a returning tenant cannot starve the others with old savings.
* Charges: a prompt token when it is first computed (prefix-cache hits cost nothing,
  recomputing after a preemption costs nothing again); an output token when it is
  appended (rejected draft tokens cost nothing). A prompt chunk is charged when it is
  scheduled, so the next admission in the same step already sees it.
* Preemption: from the running tenant with the largest counter (the one most over its
  share), its most recently admitted request. With `fair_preemption_gap` also for a seat:
  when every seat is taken and the waiting tenant served least trails that tenant by more
  than the gap, one such request a step makes room (`seat_victim`); without it a light
  tenant waits for the next request to finish.

The bound (tests/scheduler/test_fair.py measures it): two tenants backlogged from the
same moment, counters equal then. While f's counter is above g's, no f request is
admitted, so f's counter grows only by what its running requests still compute: their
remaining prompt chunks and output tokens, which all sit in the KV pool of M tokens, so
at most max(w_in, w_out) * M; plus the admission that crossed, at most w_in * L_in (a
prompt, charged in chunks). Hence |c_f - c_g| <= w_in * L_in + max(w_in, w_out) * M at
every step, and over any interval the service gap is at most twice that, which is the
paper's 2 * max(w_in * L_in, w_out * M) when w_out >= w_in (the default 1 and 2).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterable, Iterator, Optional

from fleetserve.scheduler.request import Request

# Idle tenants whose counters are kept; past this the lowest are forgotten (a tenant
# forgotten comes back lifted to the active minimum, as a new one).
MAX_IDLE_TENANTS = 4096


class VirtualTokenCounter:
    def __init__(self, input_weight: float = 1.0, output_weight: float = 2.0) -> None:
        if input_weight < 0 or output_weight < 0 or input_weight + output_weight <= 0:
            raise ValueError(f"fair-share token weights must be >= 0, not both 0: {input_weight}, {output_weight}")
        self.input_weight = input_weight
        self.output_weight = output_weight
        self.counters: dict[str, float] = {}
        self._active: dict[str, int] = {}  # tenant -> its unfinished requests here
        self._last_left = 0.0

    # ---- membership ------------------------------------------------------------
    def arrive(self, request: Request) -> None:
        """`request` joins the scheduler; lift its tenant if it was idle."""
        t = request.tenant
        if t not in self._active:
            floor = min((self.counters[a] for a in self._active), default=self._last_left)
            self.counters[t] = max(self.counters.get(t, 0.0), floor)
            self._active[t] = 0
        self._active[t] += 1

    def leave(self, request: Request) -> None:
        """`request` finished (or was aborted)."""
        t = request.tenant
        n = self._active.get(t)
        if n is None:
            return
        if n > 1:
            self._active[t] = n - 1
            return
        del self._active[t]
        self._last_left = self.counters[t]
        floor = min((self.counters[a] for a in self._active), default=None)
        if floor is not None and self.counters[t] <= floor:
            # Back, it would be lifted to the active minimum anyway, which never falls.
            del self.counters[t]
        elif len(self.counters) - len(self._active) > MAX_IDLE_TENANTS:
            idle = sorted((c, a) for a, c in self.counters.items() if a not in self._active)
            for _, a in idle[: len(idle) - MAX_IDLE_TENANTS]:
                del self.counters[a]

    def is_active(self, tenant: str) -> bool:
        return tenant in self._active

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    # ---- charges ---------------------------------------------------------------
    def charge_prompt(self, request: Request, num_tokens: int) -> None:
        """`num_tokens` are scheduled from `request.num_computed_tokens` on: charge the
        prompt tokens among them not charged before."""
        start = max(request.num_computed_tokens, request.num_charged_prompt_tokens)
        end = min(request.num_computed_tokens + num_tokens, request.num_prompt_tokens)
        if end > start:
            request.num_charged_prompt_tokens = end
            self._add(request, self.input_weight * (end - start))

    def charge_output(self, request: Request, num_tokens: int) -> None:
        self._add(request, self.output_weight * num_tokens)

    def _add(self, request: Request, service: float) -> None:
        t = request.tenant
        self.counters[t] = self.counters.get(t, 0.0) + service / request.tenant_weight

    # ---- preemption --------------------------------------------------------------
    def pick_victim(self, running: list[Request]) -> Request:
        """The most recently admitted request of the running tenant most over its share."""
        counters = self.counters
        top = max(counters.get(r.tenant, 0.0) for r in running)
        return next(r for r in reversed(running) if counters.get(r.tenant, 0.0) == top)


def seat_victim(vtc: VirtualTokenCounter, running: list[Request], head: Request, gap: float) -> Optional[Request]:
    """With every seat taken and `head` first in the waiting queue: the running request to
    preempt for it (`pick_victim`'s: the last admitted of the running tenant served most),
    when `head`'s tenant trails that tenant by more than `gap`; else None. The victim waits
    at its tenant's front; its prompt blocks stay in the prefix cache while nothing needs them.
    """
    if not running:
        return None
    victim = vtc.pick_victim(running)
    if victim.tenant == head.tenant or vtc.counter(head.tenant) + gap >= vtc.counter(victim.tenant):
        return None
    return victim


class FairQueue:
    """The waiting queue of `policy="fair"`: one queue per tenant, FCFS here (a deque; a
    subclass orders each tenant's queue otherwise through the `_q*` hooks); the head of the
    tenant with the least counter (then the earliest head) comes first."""

    def __init__(self, vtc: VirtualTokenCounter) -> None:
        self.vtc = vtc
        self._queues: dict[str, Any] = {}  # tenant -> its queue (never empty)
        self._len = 0

    # ---- one tenant's queue: FCFS ---------------------------------------------------
    def _qnew(self) -> Any:
        return deque()

    def _qpush(self, q: Any, request: Request, front: bool) -> None:
        if front:
            q.appendleft(request)
        else:
            q.append(request)

    def _qhead(self, q: Any) -> Request:
        head: Request = q[0]
        return head

    def _qpop(self, q: Any) -> Request:
        request: Request = q.popleft()
        return request

    def _qwithout(self, q: Any, drop: set[int]) -> Any:
        return deque(r for r in q if id(r) not in drop)

    def _qordered(self, q: Any) -> Iterable[Request]:
        ordered: Iterable[Request] = q
        return ordered

    # ---- the tenants ----------------------------------------------------------------
    def add(self, request: Request) -> None:
        self._push(request, front=False)

    def prepend(self, request: Request) -> None:
        self._push(request, front=True)

    def _push(self, request: Request, front: bool) -> None:
        q = self._queues.get(request.tenant)
        if q is None:
            q = self._queues[request.tenant] = self._qnew()
        self._qpush(q, request, front)
        self._len += 1

    def _next_tenant(self) -> str:
        if not self._len:
            raise IndexError("peek from an empty waiting queue")
        counter, queues, head = self.vtc.counter, self._queues, self._qhead
        return min(queues, key=lambda t: (counter(t), head(queues[t]).arrival_time))

    def peek(self) -> Request:
        return self._qhead(self._queues[self._next_tenant()])

    def pop(self) -> Request:
        t = self._next_tenant()
        q = self._queues[t]
        request = self._qpop(q)
        if not q:
            del self._queues[t]
        self._len -= 1
        return request

    def remove_many(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        for t in list(self._queues):
            kept = self._qwithout(self._queues[t], drop)
            self._len -= len(self._queues[t]) - len(kept)
            if kept:
                self._queues[t] = kept
            else:
                del self._queues[t]

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        for q in list(self._queues.values()):
            yield from self._qordered(q)


def make_vtc(policy: str, input_weight: float, output_weight: float) -> Optional[VirtualTokenCounter]:
    return VirtualTokenCounter(input_weight, output_weight) if policy == "fair" else None
