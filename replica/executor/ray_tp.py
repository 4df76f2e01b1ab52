"""Tensor parallelism across Ray actors: one worker per rank, one process group per replica.

    driver (EngineCore)                    rank 0 actor        rank 1 actor ...
      SchedulerOutput (a diff) ---------->  execute_model       execute_model
                                            all-reduce <------> all-reduce  (gloo / NCCL)
      rank 0's result <-------------------  ModelRunnerOutput   None

The step input is the scheduler's diff (new requests once, then only new
tokens and block ids), sent to each rank with the call; only rank 0 samples
and returns a `ModelRunnerOutput`. Ray's compiled graphs (shared-memory
channels) would cut the per-call cost further; not done yet.
Workers live in a placement group (one bundle per rank, PACK by default) and
rendezvous over TCP on a free port chosen by rank 0's node (never a fixed
port). The process group uses NCCL when CUDA is present and gloo otherwise,
chosen inside `replica.distributed.parallel.init_tp_group`.

A worker that dies or stops answering fails the step with `ExecutorError`
within `step_timeout_s`; the engine then fails its in-flight requests and
reports itself dead, so the replica can be restarted.

Not run on a GPU yet: the NCCL path (device selection per rank, NCCL group)
is written device-agnostically but has only been exercised with gloo on CPU.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import time
from typing import TYPE_CHECKING, Any, Optional

import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from fleetserve.kv_transfer.aggregate import KVOutputAggregator, kv_part
from fleetserve.replica.engine.engine_args import EngineArgs
from fleetserve.replica.executor.base import Executor, ExecutorError
from fleetserve.replica.model_loader.model_config import ModelConfig
from fleetserve.scheduler import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:  # imported in the actor, where the rank runs
    from fleetserve.replica.worker.worker import Worker

logger = logging.getLogger(__name__)

# The actors' concurrency group for adapter loads (TPWorkerActor.prepare_lora).
LORA_LOAD_GROUP = "lora_load"


class TPWorkerActor:
    """Runs in a Ray actor; wraps one rank's `replica.worker.worker.Worker`. Its methods are
    `ray.method`s, so the driver's `.remote` calls are typed."""

    def __init__(self) -> None:
        self._worker: Optional[Worker] = None

    @property
    def worker(self) -> Worker:
        if self._worker is None:
            raise ExecutorError("the tensor-parallel worker was not initialised (init_worker)")
        return self._worker

    @ray.method(num_returns=1)
    def get_rendezvous_address(self) -> tuple[str, int]:
        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ip, port

    @ray.method
    def init_worker(
        self, args: EngineArgs, eos_token_id: Optional[int], rank: int, world_size: int, init_method: str
    ) -> dict[str, Any]:
        from fleetserve.replica.worker.worker import Worker

        self._worker = worker = Worker(
            args, eos_token_id, rank=rank, world_size=world_size, init_method=init_method, threads_share=world_size
        )
        return {
            "vocab_size": worker.hf_config.vocab_size,
            "num_threads": worker.num_threads,
            "pid": os.getpid(),
            "kv_bytes_per_block": worker.kv_bytes_per_block(),
        }

    @ray.method(num_returns=1)
    def get_hf_config(self) -> ModelConfig:
        return self.worker.hf_config

    @ray.method
    def add_lora(self, lora_id: int, name: str, path: str) -> None:
        self.worker.add_lora(lora_id, name, path)

    # In a concurrency group of its own (a thread beside the default group's): a rank reads
    # and cuts an adapter while its steps go on.
    @ray.method(concurrency_group=LORA_LOAD_GROUP)
    def prepare_lora(self, lora_id: int, name: str, path: str) -> Optional[tuple[bool, str]]:
        """None, or (a file problem?, the message) of the ValueError it raised: the driver
        raises it again as such (lora/loader.py tells a client only what a file problem is)."""
        from fleetserve.replica.lora.paths import LoRAFileError

        try:
            self.worker.prepare_lora(lora_id, name, path)
        except ValueError as e:
            return isinstance(e, LoRAFileError), str(e)
        return None

    @ray.method
    def install_lora(self, lora_id: int) -> None:
        self.worker.install_lora(lora_id)

    @ray.method
    def discard_lora(self, lora_id: int) -> None:
        self.worker.discard_lora(lora_id)

    @ray.method
    def remove_lora(self, lora_id: int) -> None:
        self.worker.remove_lora(lora_id)

    @ray.method(num_returns=1)
    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    @ray.method
    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    @ray.method
    def execute_model(self, scheduler_output: SchedulerOutput) -> tuple[Optional[ModelRunnerOutput], float]:
        """(rank 0's output or None, seconds this rank spent in the step)."""
        t0 = time.perf_counter()
        worker = self.worker
        out: Optional[ModelRunnerOutput] = worker.execute_model(scheduler_output)
        if worker.rank != 0:
            # With a KV connector every rank reports its own transfers (kv_transfer.aggregate).
            out = None if worker.kv_connector is None or out is None else kv_part(out)
        return out, time.perf_counter() - t0

    @ray.method(num_returns=1)
    def shutdown(self) -> None:
        from fleetserve.replica.distributed.parallel import destroy_tp_group

        if self._worker is not None:
            self._worker.shutdown()
        destroy_tp_group()

    @ray.method(num_returns=1)
    def pid(self) -> int:
        return os.getpid()


def check_tp_size(args: EngineArgs) -> None:
    """Refuse a TP size the model cannot be split by before starting any worker."""
    from fleetserve.replica.model_loader import model_info
    from fleetserve.replica.model_loader.registry import resolve_model

    model_info.check_tp_size(resolve_model(args.model), args.tensor_parallel_size, args.enable_expert_parallel)


class RayTPExecutor(Executor):
    def __init__(
        self,
        args: EngineArgs,
        eos_token_id: Optional[int],
        step_timeout_s: float = 60.0,
        start_timeout_s: float = 300.0,
    ) -> None:
        check_tp_size(args)
        self._kv_aggregator: Optional[KVOutputAggregator] = None
        if args.kv_transfer_config is not None:
            self._kv_aggregator = KVOutputAggregator(args.tensor_parallel_size)
        self.step_timeout_s = step_timeout_s
        # (driver wall seconds, slowest rank's seconds) per step, for benchmarks.
        self.step_timings: collections.deque[tuple[float, float]] = collections.deque(maxlen=10_000)
        tp = args.tensor_parallel_size
        if not ray.is_initialized():
            # Offline use (LLM / fleetserve generate): an embedded local Ray on loopback.
            # One logical CPU per rank even on a machine with fewer cores: the
            # ranks split the real cores between them (see Worker threads_share).
            from fleetserve.replica.worker.device import available_cores

            ray.init(
                address=os.environ.get("RAY_ADDRESS") or "local",
                include_dashboard=False,
                log_to_driver=False,
                num_cpus=max(available_cores(), tp + 1),
                _node_ip_address="127.0.0.1",
            )
        use_gpu = args.device != "cpu" and torch.cuda.is_available()
        bundle = {"CPU": 1.0, "GPU": 1.0} if use_gpu else {"CPU": 1.0}
        pg = placement_group([dict(bundle) for _ in range(tp)], strategy=args.placement_strategy)
        self.pg: Optional[PlacementGroup] = pg
        try:
            ray.get(pg.ready(), timeout=start_timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            ray.util.remove_placement_group(pg)
            raise ExecutorError(
                f"could not reserve {tp} x {bundle} for tensor parallelism within "
                f"{start_timeout_s:.0f} s; the cluster lacks resources"
            ) from e
        # (Ray's stubs lack concurrency_groups, which its ray.remote takes for actor classes)
        actor_cls = ray.remote(concurrency_groups={LORA_LOAD_GROUP: 1})(TPWorkerActor)  # type: ignore[call-overload]
        self.workers = [
            actor_cls.options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank
                ),
            ).remote()
            for rank in range(tp)
        ]
        try:
            ip, port = ray.get(self.workers[0].get_rendezvous_address.remote(), timeout=start_timeout_s)
            init_method = f"tcp://{ip}:{port}"
            infos = self._get(
                [
                    w.init_worker.remote(args, eos_token_id, rank, tp, init_method)
                    for rank, w in enumerate(self.workers)
                ],
                start_timeout_s,
            )
            self.hf_config = self._get([self.workers[0].get_hf_config.remote()], start_timeout_s)[0]
            self.kv_bytes_per_block = sum(int(i["kv_bytes_per_block"]) for i in infos)
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "tensor parallel group of %d ranks up at %s (%s); threads per rank: %s",
            tp,
            init_method,
            "nccl" if use_gpu else "gloo",
            [i["num_threads"] for i in infos],
        )

    def _get(self, refs: list[ray.ObjectRef[Any]], timeout: float) -> list[Any]:
        """Wait for every ref; the first failure (or the timeout) fails the whole call."""
        deadline = time.monotonic() + timeout
        pending = list(refs)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ExecutorError(f"a tensor-parallel worker did not answer within {timeout:.0f} s")
            done, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            for ref in done:
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as e:
                    raise ExecutorError(f"a tensor-parallel worker failed: {e}") from e
        return ray.get(refs)

    def determine_num_blocks(self) -> int:
        # Every rank holds the same share of each block: take the smallest budget.
        return min(self._get([w.determine_num_blocks.remote() for w in self.workers], 120))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._get([w.initialize_kv_cache.remote(num_blocks) for w in self.workers], 120)

    def add_lora(self, lora_id: int, name: str, path: str) -> None:
        self._get([w.add_lora.remote(lora_id, name, path) for w in self.workers], 120)

    def prepare_lora(self, lora_id: int, name: str, path: str) -> None:
        # (the engine's loader enforces --lora-load-timeout; this bounds a rank that hangs)
        from fleetserve.replica.lora.paths import LoRAFileError

        for failed in self._get([w.prepare_lora.remote(lora_id, name, path) for w in self.workers], 600):
            if failed is not None:
                raise (LoRAFileError if failed[0] else ValueError)(failed[1])

    def install_lora(self, lora_id: int) -> None:
        self._get([w.install_lora.remote(lora_id) for w in self.workers], 120)

    def discard_lora(self, lora_id: int) -> None:
        self._get([w.discard_lora.remote(lora_id) for w in self.workers], 120)

    def remove_lora(self, lora_id: int) -> None:
        self._get([w.remove_lora.remote(lora_id) for w in self.workers], 120)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        # Passed by value: a step's diff is small enough for Ray to inline it in each call,
        # cheaper than ray.put and a reference (figures: docs/deployment/cpu.md, "Figures behind the code").
        results = self._get([w.execute_model.remote(scheduler_output) for w in self.workers], self.step_timeout_s)
        wall = time.perf_counter() - t0
        # What the fan-out (put, calls, result return) costs on top of the ranks' own work.
        self.step_timings.append((wall, max(t for _, t in results)))
        if self._kv_aggregator is not None:
            return self._kv_aggregator.aggregate([out for out, _ in results])
        out: Optional[ModelRunnerOutput] = results[0][0]
        assert out is not None, "rank 0 always returns its output"
        return out

    def shutdown(self) -> None:
        for w in getattr(self, "workers", []):
            try:
                ray.kill(w)
            except Exception:  # noqa: BLE001 - already dead is fine at shutdown
                logger.debug("worker already gone at shutdown")
        self.workers = []
        if getattr(self, "pg", None) is not None:
            try:
                ray.util.remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001
                logger.debug("placement group already removed")
            self.pg = None
