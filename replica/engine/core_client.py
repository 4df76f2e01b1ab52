"""Where `AsyncEngine`'s EngineCore runs, behind one interface: `EngineCoreClient`.

    ProcessCoreClient (default for TP=1)          ThreadCoreClient (TP>1, or asked for)
    this process: tokenizer, detokenizer,         one process: the same, plus the EngineCore
      streams, metrics; reads results on the        stepping on a thread of its own
      callers' event loop                           (`thread_client`)
    child process (`core_process`):
      EngineCore (scheduler + model), busy loop
      (`process_client` starts and talks to it)

Why a process (vLLM v1's layout): in a Ray Serve replica the engine shares its process
with Serve's event loop, Ray's core worker threads and the per-token streaming work, all
contending for one GIL; in a child process the engine has a GIL to itself, and this
process only tokenizes, detokenizes and streams. What that buys is measured in
docs/design/engine-core.md ("Where the engine runs").

Both clients take the same commands and push every step's result to one callback,
`on_step(StepResult)`, and every failure to `on_failure(message, dead)`: from the engine
thread, or, for a core process, from the callers' event loop, which reads the child's
pipe. The commands and replies are the typed messages of `core_messages`.
"""

from __future__ import annotations

import abc
import concurrent.futures as cf
import os
import time
from typing import Callable, Optional

from fleetserve.replica.engine.core_messages import (
    Abort,
    Add,
    AddLoRA,
    CoreCommand,
    CoreInfo,
    CoreState,
    EngineLoad,
    Finish,
    RemoveLoRA,
)
from fleetserve.replica.engine.engine_args import EngineArgs
from fleetserve.replica.engine.step_result import StepResult
from fleetserve.replica.executor.base import ExecutorError
from fleetserve.scheduler import Request, SchedulerStats

StepCallback = Callable[[StepResult], None]
# (message, dead): dead means the engine cannot serve anything any more.
FailureCallback = Callable[[str, bool], None]

CORE_PROCESS_ENV = "FLEETSERVE_ENGINE_CORE_PROCESS"


def use_core_process(args: EngineArgs, requested: Optional[bool] = None) -> bool:
    """The EngineCore gets its own process unless asked otherwise (`requested`, or
    FLEETSERVE_ENGINE_CORE_PROCESS=0) or TP > 1: the TP executor's Ray actors are
    created and called from the replica's own Ray worker process."""
    if args.tensor_parallel_size > 1:
        return False
    if requested is not None:
        return requested
    return os.environ.get(CORE_PROCESS_ENV, "1") != "0"


class EngineCoreDied(ExecutorError):
    """The engine core process exited (crashed, killed, or failed to start)."""


class EngineCoreClient(abc.ABC):
    """What `AsyncEngine` asks of its EngineCore, wherever that runs.

    Commands return at once; their effects show in later steps (`on_step`) and in
    `load()` / `stats()`. A client whose core is gone raises `EngineCoreDied` (an
    `ExecutorError`) from a command, and has told `on_failure` already.
    """

    info: CoreInfo  # the model's limits, known once the core is up

    @abc.abstractmethod
    def add(self, requests: list[Request]) -> None:
        """Queue requests (a parent request's children, together) for the core."""

    @abc.abstractmethod
    def abort(self, request_ids: list[str]) -> None:
        """Drop requests (their KV blocks go back to the pool)."""

    @abc.abstractmethod
    def finish(self, request_ids: list[str]) -> None:
        """End requests as finished by a stop string (which this side's detokenizer found)."""

    @abc.abstractmethod
    def add_lora(self, lora_id: int, name: str, path: str) -> cf.Future[Optional[str]]:
        """Load a LoRA adapter as `lora_id` on every rank; the future gets the error's text
        (the adapter does not fit, the folder is bad), or None."""

    @abc.abstractmethod
    def remove_lora(self, lora_id: int) -> cf.Future[Optional[str]]:
        """Unload adapter `lora_id` once the requests running with it end."""

    @abc.abstractmethod
    def load(self) -> EngineLoad:
        """The core's latest load (what the router's policies read)."""

    @abc.abstractmethod
    def stats(self) -> SchedulerStats:
        """The core's latest scheduler stats (what the metrics export)."""

    @property
    @abc.abstractmethod
    def num_pending_adds(self) -> int:
        """Adds the core has not taken yet (they count against the waiting queue's bound)."""

    @abc.abstractmethod
    def is_alive(self) -> bool:
        """The core can still step."""

    @abc.abstractmethod
    def stall_reason(self, timeout_s: float) -> Optional[str]:
        """Why the core counts as wedged (it holds work but has moved for `timeout_s`), or None."""

    @abc.abstractmethod
    def shutdown(self) -> int:
        """Stop the core, which carries out its pending KV saves first; returns how many of
        them it dropped, when this side can know (a core process logs them itself: 0)."""


class CoreClientBase(EngineCoreClient):
    """What both layouts share: commands as `core_messages` objects handed to `_command`,
    LoRA answers matched to their futures, the core's latest state, and liveness."""

    _adds_submitted = 0
    _state: CoreState  # the latest the core reported
    _lora_seq = 0
    _lora_waiters: dict[int, cf.Future[Optional[str]]]
    _last_progress = 0.0  # monotonic time of the core's latest step or state report
    # () -> the core's layer counter (replica.engine.progress), which moves inside long steps;
    # None when the model has no layers to hook (then steps alone count).
    _progress: Optional[Callable[[], int]] = None
    _progress_seen = -1

    def __init__(self) -> None:
        self._lora_waiters = {}

    @abc.abstractmethod
    def _command(self, command: CoreCommand) -> None:
        """Carry `command` to the core."""

    def add(self, requests: list[Request]) -> None:
        self._adds_submitted += 1
        self._command(Add(requests))

    def abort(self, request_ids: list[str]) -> None:
        self._command(Abort(request_ids))

    def finish(self, request_ids: list[str]) -> None:
        self._command(Finish(request_ids))

    def add_lora(self, lora_id: int, name: str, path: str) -> cf.Future[Optional[str]]:
        seq, future = self._lora_future()
        self._command(AddLoRA(seq, lora_id, name, path))
        return future

    def remove_lora(self, lora_id: int) -> cf.Future[Optional[str]]:
        seq, future = self._lora_future()
        self._command(RemoveLoRA(seq, lora_id))
        return future

    def load(self) -> EngineLoad:
        return self._state.load

    def stats(self) -> SchedulerStats:
        return self._state.stats

    @property
    def num_pending_adds(self) -> int:
        return self._adds_submitted - self._state.adds_seen

    def stall_reason(self, timeout_s: float) -> Optional[str]:
        """Wedged: the core holds work (or has adds it has not taken) but made no progress
        for `timeout_s`: no step, and no layer of a long step; or its grammar compile workers
        have all been stuck past the compile deadline for `timeout_s`."""
        self._note_progress()
        idle_s = time.monotonic() - self._last_progress
        load = self._state.load
        has_work = self.num_pending_adds > 0 or load["num_running"] + load["num_waiting"] > 0
        if has_work and idle_s > timeout_s:
            return f"the engine core holds work but has made no progress for {idle_s:.0f} s (limit {timeout_s:g} s)"
        # Steps while only grammars compile are empty: they move the clock above, not the
        # requests. The grammar path counts as stuck once every compile worker has been busy
        # past the compile deadline (the core's own report) for `timeout_s`.
        since = load.get("grammar_stalled_since", 0.0)
        if since and time.monotonic() - since > timeout_s:
            stuck_s = time.monotonic() - since
            return (
                f"grammar compile stalled: every grammar compile worker has been busy past the "
                f"compile deadline for {stuck_s:.0f} s (limit {timeout_s:g} s); no new grammar can compile"
            )
        return None

    # -- for the layouts ------------------------------------------------------------

    def _lora_future(self) -> tuple[int, cf.Future[Optional[str]]]:
        self._lora_seq += 1
        future: cf.Future[Optional[str]] = cf.Future()
        self._lora_waiters[self._lora_seq] = future
        return self._lora_seq, future

    def _lora_done(self, seq: int, error: Optional[str]) -> None:
        future = self._lora_waiters.pop(seq, None)
        if future is not None and not future.done():
            future.set_result(error)

    def _fail_lora_waiters(self, why: str) -> None:
        for seq in list(self._lora_waiters):
            self._lora_done(seq, why)

    def _note_progress(self) -> None:
        if self._progress is not None:
            value = self._progress()
            if value != self._progress_seen:
                self._progress_seen = value
                self._last_progress = max(self._last_progress, time.monotonic())
