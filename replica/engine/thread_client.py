"""The EngineCore on a background thread of this process (TP > 1, or asked for with
`core_process=False` / FLEETSERVE_ENGINE_CORE_PROCESS=0): `EngineCoreClient` without a pipe.

Commands are the `core_messages` objects, queued in order and carried out by the engine
thread between steps; `on_step` and `on_failure` run on that thread.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import TYPE_CHECKING, Optional

from fleetserve.replica.engine.core_client import CoreClientBase, FailureCallback, StepCallback
from fleetserve.replica.engine.core_messages import Add, CoreCommand, CoreInfo, CoreState, Finish
from fleetserve.replica.engine.engine_args import EngineArgs

if TYPE_CHECKING:  # imported when the client starts: the process layout never needs it here
    from fleetserve.replica.engine.engine_core import EngineCore


class _LayerCount:
    value = 0

    def bump(self) -> None:
        self.value += 1


class ThreadCoreClient(CoreClientBase):
    """The EngineCore (`core`, readable by tests) stepping on the thread `fleetserve-engine`."""

    def __init__(
        self, args: EngineArgs, eos_token_id: Optional[int], on_step: StepCallback, on_failure: FailureCallback
    ) -> None:
        super().__init__()
        from fleetserve.replica.engine.engine_core import EngineCore

        self.core: EngineCore = EngineCore(args, eos_token_id)
        cfg = self.core.hf_config
        self.info = CoreInfo(
            self.core.max_model_len, cfg.vocab_size, getattr(cfg, "hidden_size", None), self.core.kv_bytes_per_block
        )
        self._on_step, self._on_failure = on_step, on_failure
        self._commands: collections.deque[CoreCommand] = collections.deque()
        self._wake = threading.Event()
        self._stopping = False
        self._adds_seen = 0
        self._report()
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
            self.core.apply(Finish(request_ids))
            self._report()
        else:
            super().finish(request_ids)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self) -> int:
        """Stop the thread, then the core (which carries out its pending KV saves first);
        returns how many saves it dropped."""
        if self._stopping:
            return 0
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)
        return self.core.shutdown()

    def _command(self, command: CoreCommand) -> None:
        self._commands.append(command)
        self._wake.set()

    def _report(self) -> None:
        core = self.core
        self._state = CoreState(core.get_load(), core.scheduler.get_stats(), self._adds_seen)

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
                message, dead = core.fail_in_flight(e)
                self._report()
                self._on_failure(message, dead)
                self._flush_kv_events()
                continue
            self._answer_loras()
            self._report()
            self._on_step(result)

    def _answer_loras(self) -> None:
        """LoRA commands answered (a load once installed, off the step loop: lora/loader.py)."""
        for seq, error in self.core.take_lora_answers():
            self._lora_done(seq, error)

    def _drain(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            if isinstance(command, Add):
                self._adds_seen += 1
            self.core.apply(command)
        self._answer_loras()
        self._report()
        self._flush_kv_events()

    def _flush_kv_events(self) -> None:
        """KV events that commands caused between steps reach the caller as an empty step."""
        events = self.core.take_kv_events()
        if events is not None:
            self._on_step(events)
