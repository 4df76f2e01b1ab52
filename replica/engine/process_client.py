"""The EngineCore in a child process (`python -m fleetserve.replica.engine.core_process FD`):
`EngineCoreClient` over one socketpair.

    this process                                      the core process
    commands -> outbox -> writer thread  ==frames==>  read between steps
    loop.add_reader -> read -> on_step   <==frames==  Step / State / Failed / ...

Messages are `core_messages` objects, one per frame (`framing`). Commands leave through a
writer thread of their own, so a large command never blocks the event loop, and a write
that cannot finish by its deadline kills the child rather than leave it reading half a
frame. Replies are read on the event loop of the callers (`loop.add_reader`, attached by
the first command sent from a running loop), so a step's outputs reach the streams with no
thread hand-off, as vLLM's AsyncLLM output handler does. Outside a running loop (a script
between `asyncio.run` calls, a health check), `load()`, `stats()` and `is_alive()` read
whatever has arrived first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

from fleetserve.replica.engine import core_messages as msg
from fleetserve.replica.engine.core_client import CoreClientBase, EngineCoreDied, FailureCallback, StepCallback
from fleetserve.replica.engine.engine_args import EngineArgs
from fleetserve.replica.engine.framing import ChannelBroken, FrameChannel
from fleetserve.replica.engine.progress import ProgressCounter
from fleetserve.scheduler import Request, SchedulerStats

logger = logging.getLogger(__name__)


class SpawnedCore:
    """An engine-core process started before its `Init` is known: the child imports torch
    and the engine and then waits on the socket, so `AsyncEngine` starts it first and
    loads the tokenizer meanwhile. Owned by whoever made it until a ProcessCoreClient
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
                pass_fds=[theirs.fileno()],
                env=env,
                close_fds=True,
            )
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


class ProcessCoreClient(CoreClientBase):
    """The EngineCore in the child process `pid` (see the module doc)."""

    def __init__(
        self,
        args: EngineArgs,
        eos_token_id: Optional[int],
        on_step: StepCallback,
        on_failure: FailureCallback,
        start_timeout_s: float = 600.0,
        send_timeout_s: float = 30.0,
        spawned: Optional[SpawnedCore] = None,
    ) -> None:
        super().__init__()
        self._on_step, self._on_failure = on_step, on_failure
        self._send_timeout_s = send_timeout_s
        self._recv_lock = threading.Lock()
        self._fail_lock = threading.Lock()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stopping = False
        self._failed = False
        self._ping_seq = 0
        self._ping_sent: Optional[float] = None  # when the unanswered ping left, if any
        spawned = spawned or SpawnedCore()
        self._proc = spawned.proc
        self.pid = self._proc.pid
        self._chan = FrameChannel(spawned.take_socket())
        self._outbox: queue.SimpleQueue[Optional[bytes]] = queue.SimpleQueue()
        self._writer_thread = threading.Thread(target=self._writer, name="fleetserve-core-writer", daemon=True)
        self._writer_thread.start()
        ready = self._start(args, eos_token_id, start_timeout_s)
        self.info, self._state = ready.info, ready.state
        self._last_progress = time.monotonic()

    def _start(self, args: EngineArgs, eos_token_id: Optional[int], timeout_s: float) -> msg.Ready:
        """Send `Init` and wait for the core to be up; RuntimeError naming why it is not."""
        try:  # the core maps it by path, and it is unlinked once the core is up
            layers: Optional[ProgressCounter] = ProgressCounter()
        except OSError as e:  # no shared file (a full /dev/shm): steps alone count
            logger.warning("no layer progress counter for the engine core: %s", e)
            layers = None
        try:
            self._send(msg.Init(args.model_dump(), eos_token_id, layers.path if layers is not None else None))
            reply = self._recv_startup(timeout_s)
            if isinstance(reply, msg.InitFailed):
                raise RuntimeError(f"the engine core failed to start: {reply.message}")
            if not isinstance(reply, msg.Ready):
                raise RuntimeError(f"the engine core answered its start-up with {reply.KIND.name}")
        except BaseException:
            self._kill()
            self._outbox.put(None)
            raise
        finally:
            if layers is not None:
                layers.unlink()
        if layers is not None and reply.progress:
            self._progress = layers.read
        return reply

    # -- the interface -------------------------------------------------------------

    def add(self, requests: list[Request]) -> None:
        self._attach_running_loop()  # this caller's loop reads the outputs
        super().add(requests)

    def add_lora(self, lora_id: int, name: str, path: str) -> cf.Future[Optional[str]]:
        self._attach_running_loop()  # and the answer
        return super().add_lora(lora_id, name, path)

    def load(self) -> msg.EngineLoad:
        self._catch_up()
        return super().load()

    def stats(self) -> SchedulerStats:
        self._catch_up()
        return super().stats()

    def is_alive(self) -> bool:
        self._catch_up()
        return not self._failed and self._proc.poll() is None

    def stall_reason(self, timeout_s: float) -> Optional[str]:
        """Wedged (see the base class), or silent: a ping (answered between steps, and while
        idle) got no answer within `timeout_s`. Each call sends a ping if none is out."""
        self._catch_up()
        reason = super().stall_reason(timeout_s)
        now = time.monotonic()
        # A core inside a long step answers the ping after it; its layers moving will do.
        if (
            reason is None
            and self._ping_sent is not None
            and now - max(self._ping_sent, self._last_progress) > timeout_s
        ):
            reason = f"the engine core did not answer a ping within {timeout_s:g} s"
        if self._ping_sent is None and not self._failed:
            self._ping_seq += 1
            self._ping_sent = now
            try:
                self._send(msg.Ping(self._ping_seq))
            except EngineCoreDied:
                pass
        return reason

    def shutdown(self) -> int:
        """Stop the core; the saves it drops are logged in its own log (0 here)."""
        if self._stopping:
            return 0
        self._stopping = True
        try:
            self._send(msg.Shutdown())
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
        return 0

    # -- reading -------------------------------------------------------------------

    def _read_replies(self) -> None:
        """Handle every reply that has arrived, without waiting (one reader at a time)."""
        if self._failed or not self._recv_lock.acquire(blocking=False):
            return  # gone, or another thread is reading right now
        try:
            try:
                frames: Optional[list[bytes]] = self._chan.recv_ready()
            except EOFError:
                frames = None
            try:
                for frame in frames or ():
                    self._handle(msg.decode(frame))
            except msg.ProtocolError as e:
                self._core_gone(why=str(e))
                return
            if frames is None:
                self._core_gone()
        finally:
            self._recv_lock.release()

    def _handle(self, reply: msg.Message) -> None:
        match reply:
            case msg.Step(result, state):
                self._last_progress = time.monotonic()
                self._state = state
                self._on_step(result)
            case msg.State(state):
                self._last_progress = time.monotonic()
                self._state = state
            case msg.Pong(seq):
                self._last_progress = time.monotonic()
                if seq == self._ping_seq:
                    self._ping_sent = None
            case msg.Failed(message, dead):
                self._on_failure(message, dead)
            case msg.LoRADone(seq, error):
                self._lora_done(seq, error)
            case _:
                logger.warning("engine core: unexpected %s reply ignored", reply.KIND.name)

    def _catch_up(self) -> None:
        """Read what has arrived when no running loop reads it."""
        if self._loop is None or not self._loop.is_running():
            self._read_replies()

    def _attach_running_loop(self) -> None:
        """Read replies on the caller's running loop from now on, unless another loop that is
        still running reads them already."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop here: `load()` and the like read them (`_catch_up`)
        if self._loop is loop or self._stopping or self._failed:
            return
        if self._loop is not None and self._loop.is_running() and not self._loop.is_closed():
            return
        self._loop = loop
        loop.add_reader(self._chan.fileno(), self._read_replies)

    def _detach(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None or loop.is_closed():
            return
        try:
            running: Optional[asyncio.AbstractEventLoop] = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        fd = self._chan.fileno()
        if running is loop or not loop.is_running():
            loop.remove_reader(fd)
        else:
            loop.call_soon_threadsafe(loop.remove_reader, fd)

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

    def _recv_startup(self, timeout_s: float) -> msg.Message:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                frame = self._chan.recv(0.5)
            except EOFError as e:
                raise RuntimeError(f"the engine core process exited while starting ({self._exit_text()})") from e
            if frame is not None:
                return msg.decode(frame)
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"the engine core process exited while starting ({self._exit_text()}); its log says why"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine core did not start within {timeout_s:.0f} s")

    # -- writing -------------------------------------------------------------------

    def _command(self, command: msg.CoreCommand) -> None:
        self._send(command)

    def _send(self, message: msg.Command) -> None:
        """Queue a message for the writer; EngineCoreDied when the core is known to be gone."""
        if self._failed or self._chan.broken is not None or self._proc.poll() is not None:
            raise EngineCoreDied(f"the engine core process is gone: {self._exit_text()}")
        self._outbox.put(msg.encode(message))

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

    # -- the child -----------------------------------------------------------------

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
