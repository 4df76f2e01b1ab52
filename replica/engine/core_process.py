"""The EngineCore process: `python -m fleetserve.replica.engine.core_process FD`, started
by `core_client.ProcessCoreClient` with one end of a socketpair as FD (whole frames both
ways: `replica.engine.framing`).

One thread: EngineCore's busy loop (schedule -> execute -> update) reads the
commands waiting on its pipe before each step (without blocking while there is
work), sends each step's result, and blocks on the pipe when there is no work.
No thread hand-offs: a command or a result costs one pipe write and one wake-up.
The parent reads results on a thread of its own, so neither side can block the
other for longer than a step.

The process lives as long as its parent wants it: a ("shutdown",) command, or
the end of the pipe (the parent exited or was killed, whatever the reason), ends
it. Ctrl-C in a terminal reaches every process of the group; this one ignores
SIGINT and lets its parent decide, so in-flight requests are failed cleanly by
the parent rather than by a KeyboardInterrupt here.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys

from fleetserve.replica.engine.core_client import apply_command, fail_in_flight
from fleetserve.replica.engine.framing import ChannelBroken, FrameChannel

logger = logging.getLogger("fleetserve.replica.engine.core_process")


class EngineCoreLoop:
    def __init__(self, core, chan: FrameChannel) -> None:
        self.core = core
        self.chan = chan
        self.adds_seen = 0
        self.dead = False

    def send(self, message: tuple) -> None:
        # No deadline: a parent that reads slowly only slows the steps (backpressure); a
        # parent that is gone makes the write fail at once.
        self.chan.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def state(self) -> tuple:
        return self.core.get_load(), self.core.scheduler.get_stats(), self.adds_seen

    def send_state(self) -> None:
        """The state after commands; KV events they caused travel as an empty step."""
        events = self.core.take_kv_events()
        self.send(("state", *self.state()) if events is None else ("step", events, *self.state()))

    def run(self) -> None:
        core = self.core
        while True:
            # Commands that arrived during the last step; with no work, sleep until one comes.
            drained = self._drain(block=not core.has_work())
            if drained is None:
                return
            if not core.has_work():
                if drained:
                    self.send_state()
                continue
            try:
                result = core.step()
            except Exception as e:  # noqa: BLE001 - the parent fails what was in flight
                message, dead = fail_in_flight(core, e)
                self.dead |= dead
                self.send(("dead" if dead else "failed", message))
                self.send_state()
                continue
            self.send(("step", result, *self.state()))

    def _drain(self, block: bool):
        """Apply the commands waiting on the pipe (waiting for one first if `block`); returns
        how many, or None on shutdown (asked for, or the parent is gone). A command still
        arriving (part of its frame) waits in the channel's buffer for the next drain."""
        try:
            frames = self.chan.recv_ready()
            while block and not frames:
                self.chan.wait_readable(None)
                frames = self.chan.recv_ready()
        except EOFError:
            return None  # the parent is gone
        for frame in frames:
            kind, *rest = pickle.loads(frame)
            if kind == "shutdown":
                return None
            if kind == "ping":  # liveness: answered between steps (the parent's health check)
                self.send(("pong", rest[0]))
                continue
            if kind == "lora":  # a LoRA adapter loaded or unloaded at run time: answered
                seq, op, args = rest[0]
                self.send(("lora_done", seq, self.core.lora_command(op, args)))
                continue
            if kind == "add":
                self.adds_seen += 1
                if self.dead:
                    continue  # the parent refuses new requests once it hears of it
            apply_command(self.core, kind, rest[0])
        return len(frames)


def main(fd: int) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=os.environ.get("FLEETSERVE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s engine-core[%(process)d] %(name)s: %(message)s")
    chan = FrameChannel(fd)
    try:
        _, args_dict, eos_token_id, *extra = pickle.loads(chan.recv())
    except (EOFError, OSError):
        return 0  # the parent went away before sending anything
    try:
        from fleetserve.replica.engine.engine_args import EngineArgs
        from fleetserve.replica.engine.engine_core import EngineCore

        core = EngineCore(EngineArgs.model_validate(args_dict), eos_token_id)
    except Exception as e:  # noqa: BLE001 - the parent raises it with this message
        logger.exception("engine core failed to start")
        chan.send(pickle.dumps(("init_failed", f"{type(e).__name__}: {e}")))
        return 1
    progress = False
    if extra and extra[0]:  # the parent's layer counter (replica.engine.progress)
        from fleetserve.replica.engine.progress import ProgressCounter

        try:
            progress = core.add_progress_hook(ProgressCounter(extra[0]).bump)
        except OSError:  # gone already (the parent timed out): steps alone will count
            logger.warning("no layer progress counter: %s", extra[0])
    try:
        chan.send(pickle.dumps(("ready", {
            "max_model_len": core.max_model_len, "vocab_size": core.hf_config.vocab_size,
            "hidden_size": getattr(core.hf_config, "hidden_size", None),
            "progress": progress,
            "load": core.get_load(), "stats": core.scheduler.get_stats()})))
        EngineCoreLoop(core, chan).run()
    except ChannelBroken:
        pass  # the parent is gone: nobody to send to
    finally:
        core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
