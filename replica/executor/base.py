"""The executor interface: run one step on the workers and return rank 0's result."""

from __future__ import annotations

import abc
from typing import Callable

from fleetserve.replica.model_loader.model_config import ModelConfig
from fleetserve.scheduler import ModelRunnerOutput, SchedulerOutput


class ExecutorError(RuntimeError):
    """A worker died or stopped answering; in-flight requests fail with this."""


class Executor(abc.ABC):
    hf_config: ModelConfig  # the model's, as the workers loaded it
    kv_bytes_per_block: int  # one KV block over every rank (K and V, every layer)

    @abc.abstractmethod
    def determine_num_blocks(self) -> int: ...

    @abc.abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    @abc.abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    @abc.abstractmethod
    def add_lora(self, lora_id: int, name: str, path: str) -> None:
        """Load a LoRA adapter on every rank as `lora_id` (ValueError when it does not fit)."""

    @abc.abstractmethod
    def prepare_lora(self, lora_id: int, name: str, path: str) -> None:
        """Read an adapter and cut every rank's slots of it, attaching nothing: called from a
        loader thread while steps run (replica/lora/loader.py), so it must not wait on a step
        (ValueError when it does not fit). The ranks keep it until install_lora/discard_lora."""

    @abc.abstractmethod
    def install_lora(self, lora_id: int) -> None:
        """Attach a prepared adapter on every rank (between steps: a swap of references)."""

    @abc.abstractmethod
    def discard_lora(self, lora_id: int) -> None:
        """Drop a prepared adapter that will not be installed (nothing where there is none)."""

    @abc.abstractmethod
    def remove_lora(self, lora_id: int) -> None:
        """Drop adapter `lora_id` from every rank (nothing where it is not loaded)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the workers (and their KV connector halves)."""

    def set_kv_wakeup(self, callback: Callable[[], None]) -> bool:
        """Hand the workers' KV connector halves the engine core's wake-up (the connector's
        `set_wakeup`); False when none lives in this process (the engine polls them)."""
        return False

    def add_progress_hook(self, bump: Callable[[], None]) -> bool:
        """`bump` at each decoder layer of the model this process runs (replica.engine.progress);
        False when there is none here (ranks in other processes: steps alone count)."""
        return False
