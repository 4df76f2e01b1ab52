"""Where `AsyncEngine`'s EngineCore runs: a thread of this process, or a process of its own.

    ProcessCoreClient (default for TP=1)          ThreadCoreClient (TP>1, or asked for)
    this process: tokenizer, detokenizer,         one process: the same, plus the EngineCore
      streams, metrics; reads results on the        stepping on a thread of its own
      callers' event loop
    child process (replica.engine_proc):
      EngineCore (scheduler + model), busy loop

Why a process (vLLM v1's layout): in a Ray Serve replica the engine shares its
process with Serve's event loop, Ray's core worker threads and the per-token
streaming work, all contending for one GIL. Measured (issue 5): torch calls in the
engine thread waited on a GIL that the replica's other threads held about a
quarter of the time, and inter-token latency p90 over HTTP was 6.85 ms with the
core on a thread vs 4.09 ms in its own process (benchmarks/serving.py, the two
interleaved round by round). In a child process the engine has a GIL to itself;
this process only tokenizes, detokenizes and streams.

Both clients take the same calls (`add`, `abort`, `finish`, `shutdown`) and push
every step's result to one callback, `on_step(StepResult)`: from the engine thread,
or, for a core process, from the callers' event loop, which reads the child's pipe
(`attach`). `load` / `stats` are the engine's latest load and scheduler stats.

Wire format between the processes: pickled tuples over a socketpair, framed by
`multiprocessing.connection.Connection` (length-prefixed). Commands:
("add", [Request]), ("abort", [ids]), ("finish", [ids]), ("shutdown",). Replies:
("ready", info) | ("init_failed", message), then ("step", StepResult, load, stats,
adds_seen) per step, ("state", load, stats, adds_seen) after commands that change
state without a step, ("failed", message) for a step that raised and ("dead",
message) for an executor that cannot go on (either way the child has aborted
everything in flight: `fail_in_flight`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Callable, Optional

from fleetserve.replica.engine.engine_args import EngineArgs
from fleetserve.replica.engine.engine_core import EngineCore, StepResult
from fleetserve.replica.executor import ExecutorError
from fleetserve.scheduler import Request, RequestStatus

logger = logging.getLogger(__name__)

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


def load_of(core: EngineCore) -> tuple[dict, object]:
    return core.get_load(), core.scheduler.get_stats()


def apply_command(core: EngineCore, kind: str, payload) -> None:
    """A client's command on the core (either layout): "add" a list of Requests, "abort" or
    "finish" (a stop string matched) request ids."""
    if kind == "add":
        for r in payload:
            core.add_request(r)
    elif kind == "abort":
        core.abort_requests(payload)
    elif kind == "finish":
        core.finish_requests(payload, RequestStatus.FINISHED_STOPPED)


def fail_in_flight(core: EngineCore, error: Exception) -> tuple[str, bool]:
    """After a step raised (call it in the `except` block): abort everything in flight, log,
    and return (message, dead); dead when the executor cannot go on (a worker died)."""
    core.abort_requests(list(core.scheduler.requests) + core.structured.pending_ids())
    if isinstance(error, ExecutorError):
        logger.error("engine executor failed: %s", error)
        return str(error), True
    logger.exception("engine step failed; failing the in-flight requests")
    return f"{type(error).__name__}: {error}", False


class _CoreClient:
    """The commands both layouts take; `_command` carries one to the core."""

    _adds_submitted = 0
    _adds_seen = 0

    @property
    def num_pending_adds(self) -> int:
        """Adds the core has not taken yet (they count against the waiting queue's bound)."""
        return self._adds_submitted - self._adds_seen

    def add(self, requests: list[Request]) -> None:
        self._adds_submitted += 1
        self._command(("add", requests))

    def abort(self, request_ids: list[str]) -> None:
        self._command(("abort", request_ids))

    def finish(self, request_ids: list[str]) -> None:
        self._command(("finish", request_ids))

    def _command(self, command: tuple) -> None:
        raise NotImplementedError


class ThreadCoreClient(_CoreClient):
    """The EngineCore on a background thread of this process."""

    def __init__(self, args: EngineArgs, eos_token_id: Optional[int], on_step: StepCallback,
                 on_failure: FailureCallback) -> None:
        self.core = EngineCore(args, eos_token_id)
        self.max_model_len = self.core.max_model_len
        self.vocab_size = self.core.hf_config.vocab_size
        self._on_step, self._on_failure = on_step, on_failure
        self._commands: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._stopping = False
        self.load, self.stats = load_of(self.core)
        self._thread = threading.Thread(target=self._run, name="fleetserve-engine", daemon=True)
        self._thread.start()

    def finish(self, request_ids: list[str]) -> None:
        """Stop-string finishes come from `on_step`, on the engine thread: applied at once, so
        the load the caller reads next already has their blocks back in the pool."""
        if threading.current_thread() is self._thread:
            apply_command(self.core, "finish", request_ids)
            self.load, self.stats = load_of(self.core)
        else:
            super().finish(request_ids)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def attach(self, loop) -> None:
        """Nothing to read: the engine thread delivers (interface of ProcessCoreClient)."""

    def poll(self) -> None:
        """Nothing to read: the engine thread delivers (interface of ProcessCoreClient)."""

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)
        self.core.shutdown()

    def _command(self, command: tuple) -> None:
        self._commands.append(command)
        self._wake.set()

    def _run(self) -> None:
        core = self.core
        while not self._stopping:
            if self._commands:
                self._drain()
            if not core.has_work():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                result = core.step()
            except Exception as e:  # noqa: BLE001 - every in-flight request must hear of it
                message, dead = fail_in_flight(core, e)
                self.load, self.stats = load_of(core)
                self._on_failure(message, dead)
                continue
            self.load, self.stats = load_of(core)
            self._on_step(result)

    def _drain(self) -> None:
        while self._commands:
            kind, payload = self._commands.popleft()
            if kind == "add":
                self._adds_seen += 1
            apply_command(self.core, kind, payload)
        self.load, self.stats = load_of(self.core)


class ProcessCoreClient(_CoreClient):
    """The EngineCore in a child process (`python -m replica.engine_proc`).

    Results are read on the event loop of the callers (`attach(loop)`, done by every
    `AsyncEngine.generate`): `loop.add_reader` on the pipe, so a step's outputs reach the
    streams with no thread hand-off, as vLLM's AsyncLLM output handler does. Outside a
    running loop (a script between `asyncio.run` calls, a health check), `poll()` reads
    whatever has arrived.
    """

    def __init__(self, args: EngineArgs, eos_token_id: Optional[int], on_step: StepCallback,
                 on_failure: FailureCallback, start_timeout_s: float = 600.0) -> None:
        self._on_step, self._on_failure = on_step, on_failure
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stopping = False
        self._failed = False
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        # The child imports what this process can import (a Ray worker's sys.path may hold
        # entries, e.g. a runtime_env working_dir, that PYTHONPATH does not).
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        if "ray" in sys.modules and sys.modules["ray"].is_initialized():
            # A KV connector in the child that uses Ray joins this process's cluster.
            env.setdefault("RAY_ADDRESS", sys.modules["ray"].get_runtime_context().gcs_address)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "fleetserve.replica.engine.core_process", str(theirs.fileno())],
            pass_fds=[theirs.fileno()], env=env, close_fds=True)
        theirs.close()
        ours.setblocking(True)
        self._conn = Connection(ours.detach())
        try:
            self._send(("init", args.model_dump(), eos_token_id))
            reply = self._recv_startup(start_timeout_s)
        except BaseException:
            self._kill()
            raise
        if reply[0] == "init_failed":
            self._kill()
            raise RuntimeError(f"the engine core failed to start: {reply[1]}")
        info = reply[1]
        self.max_model_len = info["max_model_len"]
        self.vocab_size = info["vocab_size"]
        self.pid = self._proc.pid
        self.load, self.stats = info["load"], info["stats"]

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read results on `loop` (the running loop of the caller) from now on, unless another
        loop that is still running reads them already."""
        if self._loop is loop or self._stopping:
            return
        if self._loop is not None and self._loop.is_running() and not self._loop.is_closed():
            return
        self._loop = loop
        loop.add_reader(self._conn.fileno(), self.poll)

    def poll(self) -> None:
        """Handle every message that has arrived, without waiting (one reader at a time)."""
        if not self._recv_lock.acquire(blocking=False):
            return  # another thread is reading right now
        try:
            while not self._failed and self._conn.poll(0):
                try:
                    message = pickle.loads(self._conn.recv_bytes())
                except (EOFError, OSError):
                    self._core_gone()
                    return
                self._handle(message)
        except (OSError, ValueError):  # the pipe was closed under us (shutdown)
            if not self._stopping:
                self._core_gone()
        finally:
            self._recv_lock.release()

    def is_alive(self) -> bool:
        if self._loop is None or not self._loop.is_running():
            self.poll()
        return not self._failed and self._proc.poll() is None

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        try:
            self._send(("shutdown",))
        except EngineCoreDied:
            pass
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            logger.warning("engine core process %d did not stop in 30 s; killing it", self._proc.pid)
            self._kill()
        self._detach()
        self._conn.close()

    # -- plumbing ----------------------------------------------------------------

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "step":
            _, result, self.load, self.stats, self._adds_seen = message
            self._on_step(result)
        elif kind == "state":
            _, self.load, self.stats, self._adds_seen = message
        elif kind in ("failed", "dead"):
            self._on_failure(message[1], kind == "dead")

    def _core_gone(self) -> None:
        """End of the pipe: the child exited. Fail everything (once) and stop reading."""
        if self._failed:
            return
        self._failed = True
        self._detach()
        if self._stopping:
            return
        try:
            self._proc.wait(timeout=1)  # for its exit code in the message (it is exiting)
        except subprocess.TimeoutExpired:
            pass
        message = f"the engine core process exited ({self._exit_text()})"
        logger.error("%s; failing all requests", message)
        self._on_failure(message, True)

    def _detach(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop or not loop.is_running():
            loop.remove_reader(self._conn.fileno())
        else:
            loop.call_soon_threadsafe(loop.remove_reader, self._conn.fileno())

    def _command(self, command: tuple) -> None:
        self._send(command)

    def _send(self, message: tuple) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            with self._send_lock:
                self._conn.send_bytes(data)
        except (OSError, ValueError) as e:  # the child is gone (or we closed the pipe)
            raise EngineCoreDied(f"the engine core process is gone: {self._exit_text()}") from e

    def _recv_startup(self, timeout_s: float) -> tuple:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(0.5):
            if self._proc.poll() is not None:
                raise RuntimeError(f"the engine core process exited while starting "
                                   f"({self._exit_text()}); its log says why")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine core did not start within {timeout_s:.0f} s")
        try:
            return pickle.loads(self._conn.recv_bytes())
        except EOFError as e:
            raise RuntimeError(f"the engine core process exited while starting "
                               f"({self._exit_text()})") from e

    def _exit_text(self) -> str:
        code = self._proc.poll()
        if code is None:
            return "still running"
        if code < 0:
            return f"killed by signal {-code}"
        return f"exit code {code}"

    def _kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=10)
