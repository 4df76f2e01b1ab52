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
         │                             (compiles.py: one per (kind, spec), cached,
         │                             at most max_workers at once; tokenizer loaded once)
         │ free                        │
         ▼                             ▼  grammar ready (vLLM's WAITING_FOR_FSM ends)
    scheduler.add_request ◀── manager.take_ready() at the start of a step
    schedule() ─▶ manager.bitmask(scheduled) ─▶ execute_model ─▶ update_from_output
                                                  ─▶ manager.accept(outputs): advance the
                                                     matchers; a terminated grammar
                                                     finishes its request with "stop"

A request waiting for its grammar is held here, not in the scheduler: the scheduler
stays pure Python, and a request enters it only when it can run (it holds no KV block
while it waits). It waits at most `compile_timeout_s`; then it ends with finish_reason
"error" and a `GRAMMAR_ERRORS` stop_reason, and an abort ends its wait at once.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from fleetserve.replica.structured_output.backend import Matcher, XgrammarBackend
from fleetserve.replica.structured_output.compiles import Compile, GrammarCompiles, first_done
from fleetserve.scheduler import EngineCoreOutput, Request
from fleetserve.scheduler.structured_outputs import StructuredOutputsParams, grammar_error

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse (least recently used dropped first).
_CACHE_SIZE = 256
# How long a request may wait for its grammar by default (--structured-outputs-compile-timeout).
DEFAULT_COMPILE_TIMEOUT_S = 15.0


@dataclass(slots=True)
class _Waiting:
    """A request held for its grammar: the compile it waits for, and until when."""

    request: Request
    entry: Compile
    deadline: float  # time.monotonic()


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
    """Holds constrained requests until their grammar compiles (or its deadline passes), then
    keeps their matchers. `compile_timeout_s` bounds a request's wait from its submission:
    past it the request ends with an error and the others go on (compiles.py says what
    happens to the compile). `compile_fn(params)` replaces the backend's compile (tests)."""

    def __init__(
        self,
        make_backend: Callable[[], XgrammarBackend],
        max_workers: int = 2,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        compile_fn: Optional[Callable[[StructuredOutputsParams], Any]] = None,
        cache_size: int = _CACHE_SIZE,
    ) -> None:
        self._make_backend = make_backend
        self._backend: Optional[XgrammarBackend] = None
        self._backend_lock = threading.Lock()
        self.compile_timeout_s = compile_timeout_s
        self.compiles = GrammarCompiles(
            compile_fn or self._compile,
            max_workers,
            cache_size,
            prepare_fn=self.backend,
        )
        self._pending: dict[str, _Waiting] = {}  # compiling: not scheduled yet
        self._matchers: dict[str, Matcher] = {}

    # ---- requests in -----------------------------------------------------------
    def submit(self, request: Request) -> None:
        """Start (or join, or reuse) the compilation of the request's grammar; hold the request."""
        params = request.sampling_params.structured_outputs
        if params is None:
            raise ValueError(f"request {request.request_id} has no structured output to compile")
        entry = self.compiles.join(params.key(), params, request.request_id)
        deadline = time.monotonic() + self.compile_timeout_s
        self._pending[request.request_id] = _Waiting(request, entry, deadline)

    def has_pending(self) -> bool:
        return bool(self._pending)

    def pending_requests(self) -> list[Request]:
        """The requests still waiting for their grammar."""
        return [w.request for w in self._pending.values()]

    def pending_ids(self) -> list[str]:
        """Requests still waiting for their grammar (not in the scheduler yet)."""
        return list(self._pending)

    def is_pending(self, request_id: str) -> bool:
        return request_id in self._pending

    def compiling(self) -> bool:
        """A compile is running (waited for or not): the core keeps stepping meanwhile, so its
        reported state (`stalled_since`) stays current."""
        return bool(self.compiles.running())

    def has_matchers(self) -> bool:
        return bool(self._matchers)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def take_ready(self, wait_s: float = 0.0) -> tuple[list[Request], list[EngineCoreOutput]]:
        """Requests whose grammar is compiled (their matchers made), and outputs finishing
        those whose compilation failed or missed its deadline. Waits up to `wait_s` (never
        past the nearest deadline) for one when none is ready."""
        if not self._pending:
            first_done(self.compiles.running(), wait_s)  # compiles nobody waits for: no spin
            return [], []
        now = time.monotonic()
        nearest = min(w.deadline for w in self._pending.values())
        first_done([w.entry for w in self._pending.values()], min(wait_s, nearest - now))
        now = time.monotonic()
        ready, failed = [], []
        for rid, waiting in list(self._pending.items()):
            entry = waiting.entry
            if not entry.future.done() and now < waiting.deadline:
                continue
            del self._pending[rid]
            if not entry.future.done():  # past its deadline (leave may cancel the compile)
                failed.append(EngineCoreOutput(rid, [], "error", self._timeout_reason(entry, now)))
                self.compiles.leave(entry, rid)
                continue
            self.compiles.leave(entry, rid)
            error = entry.future.exception()
            if error is not None:
                # check() accepted it, so this is xgrammar failing, not the user: say so and end it.
                logger.error("grammar compilation failed for %s: %s", rid, error)
                reason = grammar_error(
                    "grammar_compile_failed", f"structured_outputs: grammar compilation failed: {error}"
                )
                failed.append(EngineCoreOutput(rid, [], "error", reason))
                continue
            output = self._start_matcher(waiting.request, entry.future.result())
            if output is not None:
                failed.append(output)
            else:
                ready.append(waiting.request)
        return ready, failed

    def stalled_since(self, now: Optional[float] = None) -> float:
        """Since when (time.monotonic()) no new grammar can compile, or 0.0: every compile
        worker busy with a compile that has run past the deadline (xgrammar's compiles cannot
        be stopped). Requests past their deadline are not counted: take_ready ends them
        between steps, so one long model step would hold them past it without any stall."""
        now = time.monotonic() if now is None else now
        youngest = self.compiles.youngest_start()
        if youngest and youngest + self.compile_timeout_s < now:
            return youngest + self.compile_timeout_s
        return 0.0

    def _timeout_reason(self, entry: Compile, now: float) -> str:
        """Why a request's grammar missed its deadline: its compile ran for most of it (at
        least half: the grammar is too slow), or it waited for a worker (the others were busy)."""
        t = self.compile_timeout_s
        if entry.running_s(now) >= t / 2:
            logger.warning("grammar compile of %s ran past its %g s deadline", entry.key[0], t)
            message = (
                f"structured_outputs: the grammar did not compile within {t:g} s "
                "(--structured-outputs-compile-timeout); simplify the schema"
            )
            return grammar_error("grammar_compile_timeout", message)
        message = (
            f"structured_outputs: the grammar waited {t:g} s to compile: the "
            f"{self.compiles.max_workers} grammar compile workers were busy with other grammars; retry later"
        )
        return grammar_error("grammar_compile_busy", message)

    def _start_matcher(self, request: Request, compiled) -> Optional[EngineCoreOutput]:
        """The request's matcher, made; or the output ending it when a migrated request's
        output so far does not follow the grammar."""
        rid = request.request_id
        matcher = Matcher(compiled)
        k = request.sampling_params.continued_output_tokens
        if k:  # a migration continuation: the grammar resumes after the output so far
            prompt = request.prompt_token_ids
            if not all(matcher.accept(t) for t in prompt[len(prompt) - k :]) or matcher.terminated:
                return EngineCoreOutput(rid, [], "abort", "the continued output does not follow the request's grammar")
        self._matchers[rid] = matcher
        return None

    def remove(self, request_ids) -> None:
        """Forget finished or aborted requests (pending ones included: they stop waiting,
        and a compile nobody waits for any more is dropped if it has not started)."""
        for rid in request_ids:
            waiting = self._pending.pop(rid, None)
            if waiting is not None:
                self.compiles.leave(waiting.entry, rid)
            self._matchers.pop(rid, None)

    # ---- the step ------------------------------------------------------------------
    def bitmask(self, sampling_req_ids: list[str]) -> Optional[GrammarBitmask]:
        """The bitmask rows of the constrained requests among those that sample this step."""
        ids = [rid for rid in sampling_req_ids if rid in self._matchers]
        if not ids:
            return None
        bitmask = self.backend().allocate_bitmask(len(ids))
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
        self.compiles.shutdown()

    # ---- compilation (pool threads) ------------------------------------------------
    def _compile(self, params):
        return self.backend().compile(params)

    def backend(self) -> XgrammarBackend:
        """The backend, built on first use (by the first compile, before its running time
        starts; once per engine)."""
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend
