"""A worker: one rank's model shard, KV cache shard and model runner.

The in-process executor holds one; the tensor-parallel executor runs one per
Ray actor. The same class either way, so TP=1 and TP>1 share every line of
model code.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import torch

from fleetserve.replica.engine.engine_args import EngineArgs
from fleetserve.replica.kv_connectors import make_kv_connector
from fleetserve.replica.model_loader.registry import resolve_model
from fleetserve.replica.model_loader.weights import kv_cache_bytes_per_block
from fleetserve.replica.worker.device import (
    available_cores,
    bind_cpus,
    default_kv_cache_bytes,
    select_device,
    select_dtype,
    set_num_threads,
)
from fleetserve.replica.worker.heap import HeapTrimmer, tune_malloc
from fleetserve.replica.worker.model_runner import ModelRunner
from fleetserve.scheduler import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from fleetserve.kv_transfer.base import KVConnectorBase

logger = logging.getLogger(__name__)


class Worker:
    def __init__(
        self,
        args: EngineArgs,
        eos_token_id: Optional[int],
        *,
        rank: int = 0,
        world_size: int = 1,
        init_method: Optional[str] = None,
        threads_share: int = 1,
    ) -> None:
        self.args = args
        self.rank = rank
        self.world_size = world_size
        # Bound first: the OpenMP threads the next line's pool starts inherit the cores.
        # With "auto" or one list per rank each rank has cores of its own; ranks that share one
        # list (or run unbound) split the cores they see, as before.
        self.cpus = bind_cpus(args.cpu_bind, args.num_threads or max(1, available_cores() // threads_share), rank)
        bind = args.cpu_bind or ""
        own = self.cpus is not None and (bind == "auto" or "|" in bind)
        self.num_threads = set_num_threads(args.num_threads, 1 if own else threads_share)
        self.heap = HeapTrimmer()
        self.malloc_tuned = tune_malloc()  # before the weights and the KV cache are allocated
        self.device = select_device(args.device)
        if self.device.type == "cuda" and world_size > 1:
            self.device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        self.dtype = select_dtype(args.dtype, self.device)
        if world_size > 1:
            from fleetserve.replica.distributed.parallel import init_tp_group

            if init_method is None:
                raise ValueError(f"a worker of a {world_size}-rank group needs the group's init_method")
            init_tp_group(world_size, rank, init_method)
        torch.manual_seed(args.seed)
        source = resolve_model(args.model)
        self.runner = ModelRunner.load(
            source,
            device=self.device,
            dtype=self.dtype,
            block_size=args.block_size,
            eos_token_id=eos_token_id,
            tp_size=world_size,
            tp_rank=rank,
            enable_expert_parallel=args.enable_expert_parallel,
        )
        if args.speculative_config is not None:
            from fleetserve.replica.spec_decode.factory import make_proposer

            self.runner.proposer = make_proposer(
                args.speculative_config,
                device=self.device,
                dtype=self.dtype,
                block_size=args.block_size,
                target_hf_config=self.runner.hf_config,
            )
        self._prepared_loras: dict = {}  # lora_id -> model_runner.PreparedLoRA (prepare_lora)
        # --lora-modules, every rank its shard, ids as EngineArgs.lora_table numbers them
        for lora_id, m in enumerate(args.lora_modules or (), start=1):
            self.add_lora(lora_id, m.name, m.path)
        self.kv_connector = self._make_kv_connector()

    def add_lora(self, lora_id: int, name: str, path: str) -> None:
        self.runner.add_lora_adapter(lora_id, name, path, self.args.max_lora_rank)

    def prepare_lora(self, lora_id: int, name: str, path: str) -> None:
        """Read and cut an adapter (on a loader thread, while steps run); kept until
        install_lora or discard_lora."""
        prepared = self.runner.prepare_lora_adapter(lora_id, name, path, self.args.max_lora_rank)
        self._prepared_loras[lora_id] = prepared

    def install_lora(self, lora_id: int) -> None:
        """Attach what prepare_lora read (between steps)."""
        prepared = self._prepared_loras.pop(lora_id, None)
        if prepared is None:
            raise ValueError(f"LoRA adapter id {lora_id} was not prepared on this rank")
        self.runner.install_lora_adapter(prepared)

    def discard_lora(self, lora_id: int) -> None:
        self._prepared_loras.pop(lora_id, None)

    def remove_lora(self, lora_id: int) -> None:
        self._prepared_loras.pop(lora_id, None)
        self.runner.remove_lora_adapter(lora_id)

    def _make_kv_connector(self) -> Optional[KVConnectorBase]:
        """The worker half of the KV connector: this rank moves its own KV heads."""
        if self.args.kv_transfer_config is None:
            return None
        from fleetserve.kv_transfer.base import KVConnectorRole
        from fleetserve.replica.worker.omp_bind import one_core_per_thread

        connector = make_kv_connector(
            self.args, KVConnectorRole.WORKER, self.hf_config, self.dtype, self.device, self.world_size, self.rank
        )
        if connector is not None:  # its copy threads' torch ops run on one core, beside the forward's
            connector.set_thread_initializer(one_core_per_thread)
        return connector

    @property
    def hf_config(self):
        return self.runner.hf_config

    def kv_bytes_per_block(self) -> int:
        """This rank's bytes of one block of the model's KV (K and V, every layer; a draft
        model's cache not counted): what handing one block to another engine moves from here."""
        r = self.runner
        return kv_cache_bytes_per_block(r.hf_config, r.block_size, r.dtype, r.tp_size)

    def determine_num_blocks(self) -> int:
        """Blocks that fit this rank's KV memory budget (or the explicit override)."""
        if self.args.num_gpu_blocks_override is not None:
            self.kv_cache_sizing = "--num-gpu-blocks-override"
            return self.args.num_gpu_blocks_override
        budget = self.args.kv_cache_memory_bytes or default_kv_cache_bytes(self.device)
        self.kv_cache_sizing = (
            "--kv-cache-memory-bytes"
            if self.args.kv_cache_memory_bytes
            else "default: 85% of free GPU memory"
            if self.device.type == "cuda"
            else "default on CPU: min(1 GiB, 10% of available memory); "
            "--kv-cache-memory-bytes or --num-gpu-blocks-override to change"
        )
        num_blocks = budget // self.runner.bytes_per_block()
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget ({budget} bytes) holds no block of "
                f"{self.runner.bytes_per_block()} bytes; raise --kv-cache-memory-bytes"
            )
        return int(num_blocks)

    def _decode_graph_config(self):
        """CUDA graphs for decode steps on a GPU, unless something needs the step eager."""
        if self.device.type != "cuda" or self.args.enforce_eager:
            return None
        why = [
            reason
            for cond, reason in (
                (self.world_size > 1, "tensor parallelism"),
                (self.kv_connector is not None, "a KV connector"),
                (self.runner.proposer is not None, "speculative decoding"),
                # the experts' grouping reads each expert's token count on the host
                (not getattr(self.runner.model, "cuda_graphs", True), "mixture of experts"),
            )
            if cond
        ]
        if why:
            logger.info("CUDA graphs off (%s): decode steps run eagerly", ", ".join(why))
            return None
        from fleetserve.replica.worker.cuda_graph import DecodeGraphConfig

        max_len = min(self.args.max_seq_len_to_capture, self.args.max_model_len or self.runner.model.max_position)
        lora_slots = 0
        if self.args.enable_lora:  # slots for every adapter held (more: the stacks grow, graphs are recaptured)
            lora_slots = self.args.max_cpu_loras or max(4, self.args.max_loras, len(self.args.lora_modules or ()))
        return DecodeGraphConfig(
            max_batch=self.args.max_num_seqs,
            max_len=max_len,
            lora_slots=lora_slots,
            max_lora_rank=self.args.max_lora_rank,
        )

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks, decode_graphs=self._decode_graph_config())
        graphs = self.runner.decode_graphs
        if graphs is not None:
            logger.info(
                "decode steps of up to %d rows and %d tokens per row replay CUDA graphs "
                "(wider shapes than those captured at start-up are captured on first use; "
                "--enforce-eager turns graphs off)",
                graphs.max_batch,
                graphs.max_blocks * self.args.block_size,
            )
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(self.runner.kv_caches)
            if self.kv_connector.uses_layer_hooks:
                self.runner.kv_hooks = self.kv_connector
        logger.info(
            "rank %d: KV cache of %d blocks x %d tokens (%.1f MiB, %s) on %s, %s, %d threads",
            self.rank,
            num_blocks,
            self.args.block_size,
            num_blocks * self.runner.bytes_per_block() / 2**20,
            getattr(self, "kv_cache_sizing", "set by the caller"),
            self.device,
            str(self.dtype).removeprefix("torch."),
            self.num_threads,
        )

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.kv_connector is None:
            out = self.runner.execute_model(scheduler_output)
        else:
            from fleetserve.kv_transfer.base import run_connector_step

            out = run_connector_step(self.kv_connector, scheduler_output, self.runner.execute_model)
        self.heap.maybe_trim()  # free heap pages that steps of other sizes left behind
        return out

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
