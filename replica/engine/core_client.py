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

Wire format between the processes: pickled tuples over a socketpair, in length-prefixed
frames that are written whole or not at all (`replica.engine.framing`: the parent's end
is non-blocking under uvloop, and a frame torn by EAGAIN once wedged a replica for good).
This process writes from a thread of its own (`_writer`), so a large command never blocks
the event loop, and a write that cannot finish by its deadline kills the child rather
than leave it reading half a frame. Commands:
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
import concurrent.futures as cf
import logging
import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable, Optional

from fleetserve.replica.engine.engine_args import EngineArgs
from fleetserve.replica.engine.step_result import StepResult
from fleetserve.replica.engine.framing import ChannelBroken, FrameChannel
from fleetserve.replica.engine.progress import ProgressCounter
from fleetserve.replica.executor import ExecutorError
from fleetserve.scheduler import Request, RequestStatus

if TYPE_CHECKING:  # the replica side never imports the engine (torch): only the core does
    from fleetserve.replica.engine.engine_core import EngineCore

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

    # -- LoRA adapters at run time: a command the core answers (EngineCore.lora_command) --
    _lora_seq = 0
    _lora_waiters: Optional[dict] = None

    def lora(self, op: str, args: tuple) -> cf.Future:
        """Send a LoRA command; the future gets the core's answer (an error's text, or None)."""
        if self._lora_waiters is None:
            self._lora_waiters = {}
        self._lora_seq += 1
        future: cf.Future = cf.Future()
        self._lora_waiters[self._lora_seq] = future
        self._command(("lora", (self._lora_seq, op, args)))
        return future

    def _lora_done(self, seq: int, error: Optional[str]) -> None:
        future = (self._lora_waiters or {}).pop(seq, None)
        if future is not None and not future.done():
            future.set_result(error)

    def _fail_lora_waiters(self, why: str) -> None:
        for seq in list(self._lora_waiters or ()):
            self._lora_done(seq, why)

    # -- liveness: dead is not the only way to fail; a core can also stop moving --------
    _last_progress = 0.0  # monotonic time of the core's latest step or state report
    # () -> the core's layer counter (replica.engine.progress), which moves inside long steps;
    # None when the model has no layers to hook (then steps alone count).
    _progress: Optional[Callable[[], int]] = None
    _progress_seen = -1

    def _note_progress(self) -> None:
        if self._progress is not None:
            value = self._progress()
            if value != self._progress_seen:
                self._progress_seen = value
                self._last_progress = max(self._last_progress, time.monotonic())

    def _has_work(self) -> bool:
        load = self.load
        return self.num_pending_adds > 0 or load.get("num_running", 0) + load.get("num_waiting", 0) > 0

    def stall_reason(self, timeout_s: float) -> Optional[str]:
        """Why the core counts as wedged, or None: it holds work (or has adds it has not
        taken) but made no progress for `timeout_s`: no step, and no layer of a long step."""
        self._note_progress()
        idle_s = time.monotonic() - self._last_progress
        if self._has_work() and idle_s > timeout_s:
            return (f"the engine core holds work but has made no progress for {idle_s:.0f} s "
                    f"(limit {timeout_s:g} s)")
        return None


class _LayerCount:
    value = 0

    def bump(self) -> None:
        self.value += 1


class ThreadCoreClient(_CoreClient):
    """The EngineCore on a background thread of this process."""

    def __init__(self, args: EngineArgs, eos_token_id: Optional[int], on_step: StepCallback,
                 on_failure: FailureCallback) -> None:
        from fleetserve.replica.engine.engine_core import EngineCore

        self.core = EngineCore(args, eos_token_id)
        self.max_model_len = self.core.max_model_len
        self.vocab_size = self.core.hf_config.vocab_size
        self.hidden_size = getattr(self.core.hf_config, "hidden_size", None)
        self._on_step, self._on_failure = on_step, on_failure
        self._commands: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._stopping = False
        self.load, self.stats = load_of(self.core)
        self._last_progress = time.monotonic()
        layers = _LayerCount()
        if self.core.add_progress_hook(layers.bump):
            self._progress = lambda: layers.value
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

    def shutdown(self) -> int:
        """Stop the thread, then the core (which carries out its pending KV saves first);
        returns how many saves it dropped."""
        if self._stopping:
            return 0
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)
        return self.core.shutdown()

    def _command(self, command: tuple) -> None:
        self._commands.append(command)
        self._wake.set()

    def _run(self) -> None:
        core = self.core
        while not self._stopping:
            if self._commands:
                self._drain()
            if not core.has_work():
                self._last_progress = time.monotonic()
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                result = core.step()
                self._last_progress = time.monotonic()
            except Exception as e:  # noqa: BLE001 - every in-flight request must hear of it
                message, dead = fail_in_flight(core, e)
                self.load, self.stats = load_of(core)
                self._on_failure(message, dead)
                self._flush_kv_events()
                continue
            self.load, self.stats = load_of(core)
            self._on_step(result)

    def _drain(self) -> None:
        while self._commands:
            kind, payload = self._commands.popleft()
            if kind == "add":
                self._adds_seen += 1
            if kind == "lora":
                seq, op, args = payload
                self._lora_done(seq, self.core.lora_command(op, args))
                continue
            apply_command(self.core, kind, payload)
        self.load, self.stats = load_of(self.core)
        self._flush_kv_events()

    def _flush_kv_events(self) -> None:
        """KV events that commands caused between steps reach the caller as an empty step."""
        events = self.core.take_kv_events()
        if events is not None:
            self._on_step(events)


class SpawnedCore:
    """An engine-core process started before its `init` is known: the child imports torch
    and the engine (~1.5 s) and then waits on the socket, so `AsyncEngine` starts it first
    and loads the tokenizer meanwhile. Owned by whoever made it until a ProcessCoreClient
    takes it over; `kill()` otherwise (a failure in between)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        # The child imports what this process can import (a Ray worker's sys.path may hold
        # entries, e.g. a runtime_env working_dir, that PYTHONPATH does not).
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        if "ray" in sys.modules and sys.modules["ray"].is_initialized():
            # A KV connector in the child that uses Ray joins this process's cluster.
            env.setdefault("RAY_ADDRESS", sys.modules["ray"].get_runtime_context().gcs_address)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "fleetserve.replica.engine.core_process", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], env=env, close_fds=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock: Optional[socket.socket] = ours

    def take_socket(self) -> int:
        """The parent's end, as a file descriptor the caller now owns."""
        sock, self._sock = self._sock, None
        assert sock is not None, "taken already"
        return sock.detach()

    def kill(self) -> None:
        """Stop the child and close the parent's end (both no-ops once taken over and done)."""
        if self._sock is not None:
            self._sock.close()  # the child reads EOF before an init: it exits
            self._sock = None
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


class ProcessCoreClient(_CoreClient):
    """The EngineCore in a child process (`python -m fleetserve.replica.engine.core_process`).

    Results are read on the event loop of the callers (`attach(loop)`, done by every
    `AsyncEngine.generate`): `loop.add_reader` on the pipe, so a step's outputs reach the
    streams with no thread hand-off, as vLLM's AsyncLLM output handler does. Outside a
    running loop (a script between `asyncio.run` calls, a health check), `poll()` reads
    whatever has arrived. Commands leave through a writer thread (see the module doc).
    """

    def __init__(self, args: EngineArgs, eos_token_id: Optional[int], on_step: StepCallback,
                 on_failure: FailureCallback, start_timeout_s: float = 600.0,
                 send_timeout_s: float = 30.0, spawned: Optional["SpawnedCore"] = None) -> None:
        self._on_step, self._on_failure = on_step, on_failure
        self._send_timeout_s = send_timeout_s
        self._recv_lock = threading.Lock()
        self._fail_lock = threading.Lock()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stopping = False
        self._failed = False
        spawned = spawned or SpawnedCore()
        self._proc = spawned.proc
        self._chan = FrameChannel(spawned.take_socket())
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._writer_thread = threading.Thread(target=self._writer, name="fleetserve-core-writer",
                                               daemon=True)
        self._writer_thread.start()
        try:  # the core maps it by path, and it is unlinked once the core is up
            layers: Optional[ProgressCounter] = ProgressCounter()
        except OSError as e:  # no shared file (a full /dev/shm): steps alone count
            logger.warning("no layer progress counter for the engine core: %s", e)
            layers = None
        try:
            self._send(("init", args.model_dump(), eos_token_id, layers and layers.path))
            reply = self._recv_startup(start_timeout_s)
        except BaseException:
            self._kill()
            self._outbox.put(None)
            raise
        finally:
            if layers is not None:
                layers.unlink()
        if reply[0] == "init_failed":
            self._kill()
            self._outbox.put(None)
            raise RuntimeError(f"the engine core failed to start: {reply[1]}")
        info = reply[1]
        self.max_model_len = info["max_model_len"]
        self.vocab_size = info["vocab_size"]
        self.hidden_size = info.get("hidden_size")
        self.pid = self._proc.pid
        self.load, self.stats = info["load"], info["stats"]
        self._last_progress = time.monotonic()
        if layers is not None and info.get("progress"):
            self._progress = layers.read
        self._ping_seq = 0
        self._ping_sent: Optional[float] = None  # when the unanswered ping left, if any

    def stall_reason(self, timeout_s: float) -> Optional[str]:
        """Wedged (see the base class), or silent: a ping (answered between steps, and while
        idle) got no answer within `timeout_s`. Each call sends a ping if none is out."""
        if self._loop is None or not self._loop.is_running():
            self.poll()
        reason = super().stall_reason(timeout_s)
        now = time.monotonic()
        # A core inside a long step answers the ping after it; its layers moving will do.
        if reason is None and self._ping_sent is not None and \
                now - max(self._ping_sent, self._last_progress) > timeout_s:
            reason = f"the engine core did not answer a ping within {timeout_s:g} s"
        if self._ping_sent is None and not self._failed:
            self._ping_seq += 1
            self._ping_sent = now
            try:
                self._send(("ping", self._ping_seq))
            except EngineCoreDied:
                pass
        return reason

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read results on `loop` (the running loop of the caller) from now on, unless another
        loop that is still running reads them already."""
        if self._loop is loop or self._stopping or self._failed:
            return
        if self._loop is not None and self._loop.is_running() and not self._loop.is_closed():
            return
        self._loop = loop
        loop.add_reader(self._chan.fileno(), self.poll)

    def poll(self) -> None:
        """Handle every message that has arrived, without waiting (one reader at a time)."""
        if self._failed or not self._recv_lock.acquire(blocking=False):
            return  # gone, or another thread is reading right now
        try:
            try:
                frames = self._chan.recv_ready()
            except EOFError:
                frames = None
            for frame in frames or ():
                self._handle(pickle.loads(frame))
            if frames is None:
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
        self._outbox.put(None)  # the writer sends what is queued, then stops
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            logger.warning("engine core process %d did not stop in 30 s; killing it", self._proc.pid)
            self._kill()
        self._writer_thread.join(timeout=5)
        self._detach()
        self._chan.close()

    # -- plumbing ----------------------------------------------------------------

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind in ("step", "state", "pong"):
            self._last_progress = time.monotonic()
        if kind == "step":
            _, result, self.load, self.stats, self._adds_seen = message
            self._on_step(result)
        elif kind == "state":
            _, self.load, self.stats, self._adds_seen = message
        elif kind == "pong" and message[1] == self._ping_seq:
            self._ping_sent = None
        elif kind in ("failed", "dead"):
            self._on_failure(message[1], kind == "dead")
        elif kind == "lora_done":
            self._lora_done(message[1], message[2])

    def _core_gone(self, why: Optional[str] = None) -> None:
        """The child exited (end of the pipe) or the pipe is torn (`why`): fail everything,
        once, and stop reading. A torn pipe cannot be resynchronised: the child is killed."""
        with self._fail_lock:
            if self._failed:
                return
            self._failed = True
        if why is not None:
            self._kill()
        self._detach()
        if self._stopping:
            return
        try:
            self._proc.wait(timeout=1)  # for its exit code in the message (it is exiting)
        except subprocess.TimeoutExpired:
            pass
        message = f"the engine core process exited ({self._exit_text()})"
        if why is not None:
            message = f"the pipe to the engine core broke ({why}); the core was stopped"
        logger.error("%s; failing all requests", message)
        self._fail_lora_waiters(message)
        self._on_failure(message, True)

    def _detach(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        fd = self._chan.fileno()
        if running is loop or not loop.is_running():
            loop.remove_reader(fd)
        else:
            loop.call_soon_threadsafe(loop.remove_reader, fd)

    def _command(self, command: tuple) -> None:
        self._send(command)

    def _send(self, message: tuple) -> None:
        """Queue a message for the writer; EngineCoreDied when the core is known to be gone."""
        if self._failed or self._chan.broken is not None or self._proc.poll() is not None:
            raise EngineCoreDied(f"the engine core process is gone: {self._exit_text()}")
        self._outbox.put(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def _writer(self) -> None:
        """Writes queued messages in order, each whole, each within the send deadline."""
        while True:
            data = self._outbox.get()
            if data is None:
                return
            try:
                self._chan.send(data, timeout_s=self._send_timeout_s)
            except ChannelBroken as e:
                if not self._stopping:
                    self._core_gone(why=str(e))
                return

    def _recv_startup(self, timeout_s: float) -> tuple:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                frame = self._chan.recv(0.5)
            except EOFError as e:
                raise RuntimeError(f"the engine core process exited while starting "
                                   f"({self._exit_text()})") from e
            if frame is not None:
                return pickle.loads(frame)
            if self._proc.poll() is not None:
                raise RuntimeError(f"the engine core process exited while starting "
                                   f"({self._exit_text()}); its log says why")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine core did not start within {timeout_s:.0f} s")

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
