"""Structured outputs inside the engine core: grammars compiled off the step, one matcher
per constrained request, and the step's token bitmask.

Where the state lives (vLLM v1's layout): grammars and matchers live with the
scheduler, in the EngineCore (its own process for TP=1, the replica's thread for
TP>1), never in the model runner. Each step the core asks the manager for the
bitmask of the constrained requests that sample this step and ships it inside the
`SchedulerOutput` (`structured_output`, opaque to the scheduler) to the model runner,
whose batched sampler applies it; then the core feeds the sampled tokens back to the
matchers. Workers stay stateless about grammars, so TP ranks (Ray actors) and
preemption need nothing more, and the pickled step carries [R, ceil(V/32)] int32.

    add_request ── constrained? ──▶ manager.submit: compile on the thread pool
         │                             (cached by (kind, spec); tokenizer loaded once)
         │ free                        │
         ▼                             ▼  grammar ready (vLLM's WAITING_FOR_FSM ends)
    scheduler.add_request ◀── manager.take_ready() at the start of a step
    schedule() ─▶ manager.bitmask(scheduled) ─▶ execute_model ─▶ update_from_output
                                                  ─▶ manager.accept(outputs): advance the
                                                     matchers; a terminated grammar
                                                     finishes its request with "stop"

A request waiting for its grammar is held here, not in the scheduler: the scheduler
stays pure Python, and a request enters it only when it can run.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import logging
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from fleetserve.replica.structured_output.backend import Matcher, XgrammarBackend
from fleetserve.scheduler import EngineCoreOutput, Request

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse (least recently used dropped first).
_CACHE_SIZE = 256


@dataclass(slots=True)
class GrammarBitmask:
    """What the model runner needs: which request uses which row of `bitmask`."""

    rows: dict[str, int]  # request id -> row
    bitmask: torch.Tensor  # [len(rows), ceil(V/32)] int32, xgrammar's packing

    def for_rows(self, req_ids: list[str], device) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(sampler rows, their bitmask rows) for a batch that samples `req_ids` in order."""
        pairs = [(i, self.rows[rid]) for i, rid in enumerate(req_ids) if rid in self.rows]
        if not pairs:
            return None
        rows = torch.tensor([i for i, _ in pairs], dtype=torch.long)
        mask = self.bitmask.index_select(0, torch.tensor([r for _, r in pairs], dtype=torch.long))
        return rows.to(device), mask.to(device)


class StructuredOutputManager:
    def __init__(self, make_backend: Callable[[], XgrammarBackend], max_workers: int = 2) -> None:
        self._make_backend = make_backend
        self._backend: Optional[XgrammarBackend] = None
        self._backend_lock = threading.Lock()
        self._pool = cf.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="fleetserve-grammar")
        self._cache: collections.OrderedDict[tuple, cf.Future] = collections.OrderedDict()
        self._pending: dict[str, tuple[Request, cf.Future]] = {}  # compiling: not scheduled yet
        self._matchers: dict[str, Matcher] = {}

    # ---- requests in -----------------------------------------------------------
    def submit(self, request: Request) -> None:
        """Start (or reuse) the compilation of the request's grammar; hold the request."""
        params = request.sampling_params.structured_outputs
        if params is None:
            raise ValueError(f"request {request.request_id} has no structured output to compile")
        key = params.key()
        future = self._cache.get(key)
        if future is None or (future.done() and future.exception() is not None):
            future = self._pool.submit(self._compile, params)
            self._cache[key] = future
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        self._pending[request.request_id] = (request, future)

    def has_pending(self) -> bool:
        return bool(self._pending)

    def pending_requests(self) -> list[Request]:
        """The requests still waiting for their grammar."""
        return [r for r, _ in self._pending.values()]

    def pending_ids(self) -> list[str]:
        """Requests still waiting for their grammar (not in the scheduler yet)."""
        return list(self._pending)

    def is_pending(self, request_id: str) -> bool:
        return request_id in self._pending

    def has_matchers(self) -> bool:
        return bool(self._matchers)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def take_ready(self, wait_s: float = 0.0) -> tuple[list[Request], list[EngineCoreOutput]]:
        """Requests whose grammar is compiled (their matchers made), and outputs finishing
        those whose compilation failed. Waits up to `wait_s` for one when none is ready."""
        if not self._pending:
            return [], []
        if wait_s > 0 and not any(f.done() for _, f in self._pending.values()):
            cf.wait([f for _, f in self._pending.values()], timeout=wait_s, return_when=cf.FIRST_COMPLETED)
        ready, failed = [], []
        for rid, (request, future) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[rid]
            error = future.exception()
            if error is not None:
                # check() accepted it, so this is xgrammar failing, not the user: say so and end it.
                logger.error("grammar compilation failed for %s: %s", rid, error)
                failed.append(EngineCoreOutput(rid, [], "abort", f"grammar compilation failed: {error}"))
                continue
            matcher = Matcher(future.result())
            k = request.sampling_params.continued_output_tokens
            if k:  # a migration continuation: the grammar resumes after the output so far
                prompt = request.prompt_token_ids
                if not all(matcher.accept(t) for t in prompt[len(prompt) - k :]) or matcher.terminated:
                    failed.append(
                        EngineCoreOutput(rid, [], "abort", "the continued output does not follow the request's grammar")
                    )
                    continue
            self._matchers[rid] = matcher
            ready.append(request)
        return ready, failed

    def remove(self, request_ids) -> None:
        """Forget finished or aborted requests (pending ones included)."""
        for rid in request_ids:
            self._pending.pop(rid, None)
            self._matchers.pop(rid, None)

    # ---- the step ------------------------------------------------------------------
    def bitmask(self, sampling_req_ids: list[str]) -> Optional[GrammarBitmask]:
        """The bitmask rows of the constrained requests among those that sample this step."""
        ids = [rid for rid in sampling_req_ids if rid in self._matchers]
        if not ids:
            return None
        bitmask = self._get_backend().allocate_bitmask(len(ids))
        for row, rid in enumerate(ids):
            self._matchers[rid].fill(bitmask, row)
        return GrammarBitmask({rid: row for row, rid in enumerate(ids)}, bitmask)

    def accept(self, outputs: list[EngineCoreOutput]) -> list[str]:
        """Advance matchers by the sampled tokens; returns the ids of unfinished requests
        whose grammar just terminated (the caller finishes them with "stop")."""
        terminated = []
        for out in outputs:
            matcher = self._matchers.get(out.request_id)
            if matcher is None:
                continue
            for token in out.new_token_ids:
                if not matcher.accept(token):
                    # The bitmask allowed only grammar tokens, so this is a sampler bug.
                    logger.error("request %s: token %d rejected by its grammar", out.request_id, token)
                    break
            if out.finished:
                self._matchers.pop(out.request_id, None)
            elif matcher.terminated:
                terminated.append(out.request_id)
        return terminated

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- compilation (pool threads) ------------------------------------------------
    def _compile(self, params):
        return self._get_backend().compile(params)

    def _get_backend(self) -> XgrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend
