"""Executors run a step on the workers: in-process for TP=1 (`uniproc`), one Ray actor
per rank for TP>1 (`ray_tp`). Both implement `base.Executor`."""

from __future__ import annotations

from typing import Optional

from fleetserve.replica.engine.engine_args import EngineArgs
from fleetserve.replica.executor.base import Executor, ExecutorError


def make_executor(args: EngineArgs, eos_token_id: Optional[int]) -> Executor:
    if args.tensor_parallel_size > 1:
        from fleetserve.replica.executor.ray_tp import RayTPExecutor

        return RayTPExecutor(args, eos_token_id)
    from fleetserve.replica.executor.uniproc import UniProcExecutor

    return UniProcExecutor(args, eos_token_id)


__all__ = ["Executor", "ExecutorError", "make_executor"]
