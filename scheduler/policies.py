"""The small policy objects the scheduling loop delegates to.

* a waiting queue (FCFS deque, priority heap, per-tenant fair share: fair.py, or shortest
  predicted output first: length_aware.py): the order of admission;
* a preemption choice: which running request gives its blocks back;
* a capacity policy: may a waiting request be admitted, and may the running
  pass preempt at all.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Any, Callable, Iterable, Iterator, Optional, Protocol, Sequence

from fleetserve.scheduler.block_pool import KVCacheBlock
from fleetserve.scheduler.fair import FairQueue, VirtualTokenCounter
from fleetserve.scheduler.kv_cache_manager import KVCacheManager
from fleetserve.scheduler.length_aware import FairShortestFirstQueue, ReservePredicted, ShortestFirstQueue, sjf_victim
from fleetserve.scheduler.request import Request


# ---- waiting queues ---------------------------------------------------------
class WaitingQueue(Protocol):
    """The order of admission. `prepend` puts a request back at the front (a preempted
    one, or one skipped this step); iteration is in admission order."""

    def add(self, request: Request) -> None: ...
    def prepend(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove_many(self, requests: Iterable[Request]) -> None: ...
    def __len__(self) -> int: ...
    def __bool__(self) -> bool: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def prepend(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove_many(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        self._q = deque(r for r in self._q if id(r) not in drop)

    def __len__(self) -> int:
        return len(self._q)

    def __bool__(self) -> bool:
        return bool(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """Lowest (priority, arrival_time) first. A preempted request keeps its key,
    so "to the front" is automatic for the request that was ahead anyway."""

    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    prepend = add

    def peek(self) -> Request:
        return self._heap[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)

    def remove_many(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        self._heap = [r for r in self._heap if id(r) not in drop]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._heap))


def make_waiting_queue(
    policy: str,
    vtc: Optional[VirtualTokenCounter] = None,
    sjf_aging_rate: float = 50.0,
    fair_shortest_first: bool = False,
) -> WaitingQueue:
    if policy == "fair":
        if vtc is None:
            raise ValueError('policy "fair" needs its VirtualTokenCounter')
        return FairShortestFirstQueue(vtc, sjf_aging_rate) if fair_shortest_first else FairQueue(vtc)
    if policy == "sjf":
        return ShortestFirstQueue(sjf_aging_rate)
    return PriorityQueue() if policy == "priority" else FCFSQueue()


# ---- preemption choice --------------------------------------------------------
def pick_victim(
    running: list[Request], policy: str, vtc: Optional[VirtualTokenCounter] = None, sjf_aging_rate: float = 50.0
) -> Request:
    """FCFS: the most recently admitted; priority: the largest (priority, arrival); fair:
    the most recently admitted of the tenant most over its share; sjf: the one its queue
    ranks last (the largest key: scheduler/length_aware.py)."""
    if vtc is not None:
        return vtc.pick_victim(running)
    if policy == "sjf":
        return sjf_victim(running, sjf_aging_rate)
    if policy == "priority":
        # The full waiting-queue key, so the victim is the request the queue
        # ranks last. On (priority, arrival) ties vLLM's key picks the first
        # running one, which can be the request being scheduled: two equal
        # requests then preempt themselves in turn forever.
        return max(running, key=lambda r: (r.priority, r.arrival_time, r.request_id))
    return running[-1]


# ---- capacity ----------------------------------------------------------------
class CapacityPolicy(Protocol):
    """May a waiting request be admitted, and may the running pass preempt at all."""

    @property
    def can_preempt(self) -> bool: ...

    def begin_step(self, holders: Callable[[], list[Request]], kv: KVCacheManager) -> None:
        """Called once per waiting pass, before any `can_admit`."""

    def can_admit(self, request: Request, hits: Sequence[KVCacheBlock], kv: KVCacheManager) -> bool: ...

    def admitted(self, request: Request, kv: KVCacheManager) -> None:
        """`request` got its first blocks (it runs, or parks for a remote load)."""


class MaxUtilization:
    """vLLM: admit while blocks exist for this step's tokens, preempt under pressure."""

    can_preempt = True

    def begin_step(self, holders: Callable[[], list[Request]], kv: KVCacheManager) -> None:
        pass

    def can_admit(self, request: Request, hits: Sequence[KVCacheBlock], kv: KVCacheManager) -> bool:
        return True

    def admitted(self, request: Request, kv: KVCacheManager) -> None:
        pass


class GuaranteedNoEvict:
    """TensorRT-LLM's GuaranteedNoEvict: admit a request only if the blocks it
    needs to run to completion (prompt + max_tokens) can be reserved on top of
    what the running requests still need. Running requests therefore never run
    out of blocks, and nothing is ever preempted."""

    can_preempt = False

    def __init__(self) -> None:
        self._reserved = 0

    @staticmethod
    def _blocks_to_completion(request: Request, kv: KVCacheManager) -> int:
        # The last output token is never fed back, so it needs no KV slot.
        final_len = request.num_prompt_tokens + request.max_tokens - 1
        return kv.cdiv(final_len)

    def begin_step(self, holders: Callable[[], list[Request]], kv: KVCacheManager) -> None:
        """`holders()`: every unfinished request that owns blocks (running, and
        parked for or back from a remote KV load): their future blocks are
        reserved."""
        owned = kv.req_to_blocks
        self._reserved = sum(
            max(0, self._blocks_to_completion(r, kv) - len(owned.get(r.request_id, ()))) for r in holders()
        )

    def can_admit(self, request: Request, hits: Sequence[KVCacheBlock], kv: KVCacheManager) -> bool:
        if request.request_id in kv.req_to_blocks:
            return True  # a holder: its blocks to completion are already reserved
        need = self._blocks_to_completion(request, kv) - len(hits)
        need += sum(1 for b in hits if b.ref_cnt == 0)
        return need <= kv.num_free_blocks - self._reserved

    def admitted(self, request: Request, kv: KVCacheManager) -> None:
        self._reserved += max(
            0, self._blocks_to_completion(request, kv) - len(kv.req_to_blocks.get(request.request_id, ()))
        )


def make_capacity_policy(name: str, reserve_predicted_margin: float = 1.0) -> CapacityPolicy:
    if name == "reserve_predicted":
        return ReservePredicted(reserve_predicted_margin)
    return GuaranteedNoEvict() if name == "guaranteed_no_evict" else MaxUtilization()


def resolve_obj_by_qualname(qualname: str, what: str = "scheduler_cls") -> Any:
    """ "pkg.mod:Class" or "pkg.mod.Class" -> the object; ValueError naming `what` (the
    setting that gave the name) otherwise. Every "module:Class" setting resolves here."""
    import importlib

    if ":" in qualname:
        module_name, _, attr = qualname.partition(":")
    else:
        module_name, _, attr = qualname.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{what} {qualname!r} is not a qualified name like 'pkg.mod:Class'")
    try:
        module = importlib.import_module(module_name)
        return getattr(module, attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what} {qualname!r} cannot be imported: {e}") from e
