"""LoRA adapter loads off the engine's step loop, each with a deadline.

A load (the engine core's AddLoRA) reads the adapter's files and cuts every rank's slots
of it: the executor's `prepare_lora`, on a loader thread of this process (Ray TP: the
ranks' own load threads), while the engine goes on stepping. Between two steps
(`poll`, from the step loop) a load that finished is installed (`install_lora`: the
linears' references swapped in) and answered; a load past its deadline
(--lora-load-timeout) is answered with an error at once and its weights, whenever the
read ends, are dropped, never installed. A RemoveLoRA of an adapter still loading
cancels the load the same way.

Answers are (seq, error text or None), taken by the core's loop (`take_answers`) and sent
to the client as LoRADone. A file problem (lora.paths.LoRAFileError, an OSError) is
answered with the generic "not found or cannot be loaded" and logged with its reason.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from dataclasses import dataclass
from typing import Optional

from fleetserve.replica.lora.paths import LoRAFileError, LoRANotLoadable

logger = logging.getLogger(__name__)


@dataclass
class _Load:
    seq: int
    lora_id: int
    name: str
    future: cf.Future
    deadline: float


def answer_text(name: str, error: BaseException) -> str:
    """What the client hears of a failed load: nothing about the file system."""
    if isinstance(error, (LoRAFileError, OSError)):
        logger.warning("LoRA adapter %r could not be loaded: %s", name, error)
        return str(LoRANotLoadable(name))
    if isinstance(error, ValueError):  # the adapter's content (rank, shapes, modules): named, no path
        return str(error) or type(error).__name__
    logger.error("LoRA adapter %r: loading failed", name, exc_info=error)
    return f"LoRA adapter '{name}': loading failed ({type(error).__name__})"


class LoRALoader:
    """The engine core's adapter loads in flight: lora_id -> load (see the module doc)."""

    def __init__(self, executor, timeout_s: float) -> None:
        self._executor = executor
        self.timeout_s = timeout_s
        # One load at a time: a load that hangs delays the next ones, which fail at their own
        # deadline (counted from their command), and never blocks a step.
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fleetserve-lora-load")
        self._loads: dict[int, _Load] = {}
        self._answers: list[tuple[int, Optional[str]]] = []

    def start(self, seq: int, lora_id: int, name: str, path: str) -> None:
        """Begin loading `path` as `lora_id`; answered under `seq` once installed or failed."""
        if lora_id in self._loads:
            self._answers.append((seq, f"LoRA adapter id {lora_id} is loading already"))
            return
        future = self._pool.submit(self._executor.prepare_lora, lora_id, name, path)
        self._loads[lora_id] = _Load(seq, lora_id, name, future, time.monotonic() + self.timeout_s)

    def answer(self, seq: int, error: Optional[str]) -> None:
        """Queue the answer of a command carried out at once (RemoveLoRA)."""
        self._answers.append((seq, error))

    def take_answers(self) -> list[tuple[int, Optional[str]]]:
        answers, self._answers = self._answers, []
        return answers

    def busy(self) -> bool:
        return bool(self._loads)

    def cancel(self, lora_id: int) -> bool:
        """Drop the load of `lora_id` in flight (answered with an error; its weights are never
        installed); False when none is."""
        load = self._loads.pop(lora_id, None)
        if load is None:
            return False
        self._answers.append((load.seq, f"LoRA adapter '{load.name}' was unloaded before its load finished"))
        self._abandon(load)
        return True

    def poll(self) -> None:
        """Install the loads that finished and fail those past their deadline (between steps)."""
        now = time.monotonic()
        for lora_id, load in list(self._loads.items()):
            if load.future.done():
                del self._loads[lora_id]
                self._answers.append((load.seq, self._finish(load)))
            elif now >= load.deadline:
                del self._loads[lora_id]
                logger.warning(
                    "LoRA adapter %r: not loaded within --lora-load-timeout %g s; gave up", load.name, self.timeout_s
                )
                self._answers.append(
                    (
                        load.seq,
                        f"loading LoRA adapter '{load.name}' took over {self.timeout_s:g} s "
                        "(--lora-load-timeout); gave up",
                    )
                )
                self._abandon(load)

    def wait(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for a load to finish (an engine with nothing else to do)."""
        if self._loads:
            cf.wait([load.future for load in self._loads.values()], timeout=timeout_s, return_when=cf.FIRST_COMPLETED)

    def load_now(self, lora_id: int, name: str, path: str) -> None:
        """Load and install at once, within the deadline (nothing else steps: the offline LLM);
        raises what the load raised (with its reason: the caller is the operator)."""
        future = self._pool.submit(self._executor.prepare_lora, lora_id, name, path)
        try:
            future.result(timeout=self.timeout_s)
        except cf.TimeoutError:
            self._abandon(_Load(0, lora_id, name, future, 0.0))
            raise ValueError(
                f"loading LoRA adapter '{name}' took over {self.timeout_s:g} s (--lora-load-timeout); gave up"
            ) from None
        except BaseException:
            self._discard(lora_id)
            raise
        self._install(lora_id)

    def shutdown(self) -> None:
        for load in self._loads.values():
            load.future.cancel()
        self._loads.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _finish(self, load: _Load) -> Optional[str]:
        error = load.future.exception()
        if error is None:
            try:
                self._install(load.lora_id)
                return None
            except Exception as e:  # noqa: BLE001 - answered; the engine serves on
                error = e
        else:
            self._discard(load.lora_id)  # the ranks that read it before one failed
        return answer_text(load.name, error)

    def _install(self, lora_id: int) -> None:
        try:
            self._executor.install_lora(lora_id)
        except BaseException:
            self._executor.remove_lora(lora_id)  # ranks that installed it before one failed
            raise

    def _abandon(self, load: _Load) -> None:
        """Drop a load's weights once its read ends (now, if it has); one not begun never runs."""
        if load.future.cancel():
            return
        load.future.add_done_callback(lambda _: self._discard(load.lora_id))

    def _discard(self, lora_id: int) -> None:
        try:
            self._executor.discard_lora(lora_id)
        except Exception as e:  # noqa: BLE001 - a dead rank holds nothing to drop
            logger.warning("LoRA adapter id %d: dropping its prepared weights failed: %s", lora_id, e)


__all__ = ["LoRALoader", "answer_text"]
