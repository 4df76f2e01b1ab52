"""The in-process executor (TP=1): the worker lives in the engine core's own process."""

from __future__ import annotations

from typing import Callable, Optional

from fleetserve.replica.engine.engine_args import EngineArgs
from fleetserve.replica.executor.base import Executor
from fleetserve.scheduler import ModelRunnerOutput, SchedulerOutput


class UniProcExecutor(Executor):
    def __init__(self, args: EngineArgs, eos_token_id: Optional[int]) -> None:
        from fleetserve.replica.worker.worker import Worker

        self.worker = Worker(args, eos_token_id)
        self.hf_config = self.worker.hf_config
        self.kv_bytes_per_block = self.worker.kv_bytes_per_block()

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def add_lora(self, lora_id: int, name: str, path: str) -> None:
        self.worker.add_lora(lora_id, name, path)

    def prepare_lora(self, lora_id: int, name: str, path: str) -> None:
        self.worker.prepare_lora(lora_id, name, path)

    def install_lora(self, lora_id: int) -> None:
        self.worker.install_lora(lora_id)

    def discard_lora(self, lora_id: int) -> None:
        self.worker.discard_lora(lora_id)

    def remove_lora(self, lora_id: int) -> None:
        self.worker.remove_lora(lora_id)

    def set_kv_wakeup(self, callback: Callable[[], None]) -> bool:
        connector = self.worker.kv_connector
        if connector is None:
            return False
        connector.set_wakeup(callback)
        return True

    def add_progress_hook(self, bump: Callable[[], None]) -> bool:
        from fleetserve.replica.engine.progress import hook_layers

        return hook_layers(self.worker.runner.model, bump)

    def shutdown(self) -> None:
        self.worker.shutdown()
