"""Executors run a step on the workers. In-process for TP=1; Ray actors for TP>1
(`replica.tp_executor`)."""

from __future__ import annotations

import abc
from typing import Optional

from replica.engine_args import EngineArgs
from scheduler import ModelRunnerOutput, SchedulerOutput


class ExecutorError(RuntimeError):
    """A worker died or stopped answering; in-flight requests fail with this."""


class Executor(abc.ABC):
    hf_config = None

    @abc.abstractmethod
    def determine_num_blocks(self) -> int: ...

    @abc.abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    @abc.abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None:
        return None


class UniProcExecutor(Executor):
    def __init__(self, args: EngineArgs, eos_token_id: Optional[int]) -> None:
        from replica.worker import Worker

        self.worker = Worker(args, eos_token_id)
        self.hf_config = self.worker.hf_config

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)


def make_executor(args: EngineArgs, eos_token_id: Optional[int]) -> Executor:
    if args.tensor_parallel_size > 1:
        from replica.tp_executor import RayTPExecutor

        return RayTPExecutor(args, eos_token_id)
    return UniProcExecutor(args, eos_token_id)
