"""The EngineCore process: `python -m fleetserve.replica.engine.core_process FD`, started
by `process_client.SpawnedCore` with one end of a socketpair as FD (one `core_messages`
message per frame both ways: `replica.engine.framing`).

One thread: EngineCore's busy loop (schedule -> execute -> update) reads the
commands waiting on its pipe before each step (without blocking while there is
work), sends each step's result, and blocks on the pipe when there is no work.
No thread hand-offs: a command or a result costs one pipe write and one wake-up.
The parent reads the results on its event loop (`loop.add_reader`) and writes
commands from a writer thread, so neither side blocks the other for longer than
a step, and the parent's event loop never waits on this process.

The process lives as long as its parent wants it: a `Shutdown` command, or the
end of the pipe (the parent exited or was killed, whatever the reason), ends
it. Ctrl-C in a terminal reaches every process of the group; this one ignores
SIGINT and lets its parent decide, so in-flight requests are failed cleanly by
the parent rather than by a KeyboardInterrupt here.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Optional

from fleetserve.replica.engine import core_messages as msg
from fleetserve.replica.engine.framing import ChannelBroken, FrameChannel

if TYPE_CHECKING:
    from fleetserve.replica.engine.engine_core import EngineCore

logger = logging.getLogger("fleetserve.replica.engine.core_process")


class EngineCoreLoop:
    def __init__(self, core: EngineCore, chan: FrameChannel) -> None:
        self.core = core
        self.chan = chan
        self.adds_seen = 0
        self.dead = False

    def send(self, message: msg.Reply) -> None:
        # No deadline: a parent that reads slowly only slows the steps (backpressure); a
        # parent that is gone makes the write fail at once.
        self.chan.send(msg.encode(message))

    def state(self) -> msg.CoreState:
        return msg.CoreState(self.core.get_load(), self.core.scheduler.get_stats(), self.adds_seen)

    def send_state(self) -> None:
        """The state after commands; KV events they caused travel as an empty step."""
        events = self.core.take_kv_events()
        self.send(msg.State(self.state()) if events is None else msg.Step(events, self.state()))

    def run(self) -> None:
        core = self.core
        while True:
            # Commands that arrived during the last step; with no work, sleep until one comes.
            drained = self._drain(block=not core.has_work())
            if drained is None:
                return
            self.send_lora_answers()
            if not core.has_work():
                if drained:
                    self.send_state()
                continue
            try:
                result = core.step()
            except Exception as e:  # noqa: BLE001 - the parent fails what was in flight
                message, dead = core.fail_in_flight(e)
                self.dead |= dead
                self.send(msg.Failed(message, dead))
                self.send_state()
                continue
            self.send(msg.Step(result, self.state()))
            self.send_lora_answers()

    def send_lora_answers(self) -> None:
        """LoRA commands answered (a load once installed, off the step loop: lora/loader.py)."""
        for seq, error in self.core.take_lora_answers():
            self.send(msg.LoRADone(seq, error))

    def _drain(self, block: bool) -> Optional[int]:
        """Carry out the commands waiting on the pipe (waiting for one first if `block`);
        returns how many, or None on shutdown (asked for, or the parent is gone). A command
        still arriving (part of its frame) waits in the channel's buffer for the next drain."""
        try:
            frames = self.chan.recv_ready()
            while block and not frames:
                self.chan.wait_readable(None)
                frames = self.chan.recv_ready()
        except EOFError:
            return None  # the parent is gone
        for frame in frames:
            if not self._handle(msg.decode(frame)):
                return None
        return len(frames)

    def _handle(self, command: msg.Message) -> bool:
        """One command; False for `Shutdown`."""
        match command:
            case msg.Shutdown():
                return False
            case msg.Ping(seq):  # liveness: answered between steps (the parent's health check)
                self.send(msg.Pong(seq))
            case msg.AddLoRA() | msg.RemoveLoRA():  # adapters at run time: answered by send_lora_answers
                self.core.apply(command)
            case msg.Add():
                self.adds_seen += 1
                if not self.dead:  # the parent refuses new requests once it hears of it
                    self.core.apply(command)
            case msg.Abort() | msg.Finish():
                self.core.apply(command)
            case _:
                raise msg.ProtocolError(f"{command.KIND.name} is not a command the core takes now")
        return True


def _read_init(chan: FrameChannel) -> Optional[msg.Init]:
    """The parent's first message; None when the parent went away before sending it."""
    try:
        frame = chan.recv()
    except (EOFError, OSError):
        return None
    init = None if frame is None else msg.decode(frame)
    if init is not None and not isinstance(init, msg.Init):
        raise msg.ProtocolError(f"expected INIT first, got {init.KIND.name}")
    return init


def _start(chan: FrameChannel, init: msg.Init) -> Optional[EngineCore]:
    """Build the core `init` asks for and answer `Ready`, or `InitFailed` and None;
    ChannelBroken (nothing left running) when the parent is gone."""
    try:
        from fleetserve.replica.engine.engine_args import EngineArgs
        from fleetserve.replica.engine.engine_core import EngineCore

        core = EngineCore(EngineArgs.model_validate(init.args), init.eos_token_id)
    except Exception as e:  # noqa: BLE001 - the parent raises it with this message
        logger.exception("engine core failed to start")
        chan.send(msg.encode(msg.InitFailed(f"{type(e).__name__}: {e}")))
        return None
    progress = False
    if init.progress_path:  # the parent's layer counter (replica.engine.progress)
        from fleetserve.replica.engine.progress import ProgressCounter

        try:
            progress = core.add_progress_hook(ProgressCounter(init.progress_path).bump)
        except OSError:  # gone already (the parent timed out): steps alone will count
            logger.warning("no layer progress counter: %s", init.progress_path)
    cfg = core.hf_config
    info = msg.CoreInfo(core.max_model_len, cfg.vocab_size, getattr(cfg, "hidden_size", None), core.kv_bytes_per_block)
    state = msg.CoreState(core.get_load(), core.scheduler.get_stats(), 0)
    try:
        chan.send(msg.encode(msg.Ready(info, state, progress)))
    except ChannelBroken:
        core.shutdown()  # the parent went away while the core started
        raise
    return core


def main(fd: int) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=os.environ.get("FLEETSERVE_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s engine-core[%(process)d] %(name)s: %(message)s",
    )
    chan = FrameChannel(fd)
    init = _read_init(chan)
    if init is None:
        return 0  # nobody to serve
    try:
        core = _start(chan, init)
    except ChannelBroken:
        return 0  # the parent went away while the core started
    if core is None:
        return 1
    try:
        EngineCoreLoop(core, chan).run()
    except ChannelBroken:
        pass  # the parent is gone: nobody to send to
    finally:
        core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
