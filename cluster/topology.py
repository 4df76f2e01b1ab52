"""Checks that refuse an impossible `fleetserve serve` in seconds, before anything deploys.

    check_model(config)          # when the arguments are read: the model exists, TP divides it
    needs = resource_needs(config)
    check_fits(config)           # after connecting to Ray, before Serve starts

What a topology reserves from Ray: each engine replica actor takes
`num_cpus_per_replica` CPUs; with tensor parallelism each replica also places
one worker actor per rank in a placement group, 1 CPU (and 1 GPU on CUDA) per
rank. The ingress and Serve's own actors reserve nothing. A placement group that
cannot be placed waits forever in Ray, so without this check an oversized
topology hangs in deployment (the TP executor gives up after minutes, and Serve
retries it) instead of failing.

The embedded Ray (no `--address`) is sized from these needs (`embedded_num_cpus`):
on a machine with fewer cores the replicas and ranks share them (slower, and
logged). A joined cluster has what it has: the check compares the needs with the
cluster's available resources and, for `STRICT_PACK`, with its largest node.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Optional

from fleetserve.cluster.config import AppConfig

logger = logging.getLogger(__name__)


class TopologyError(ValueError):
    """The requested topology cannot run here; the message says what it needs and what there is."""


@dataclass(frozen=True)
class ResourceNeeds:
    cpus: float
    gpus: float
    per_replica: str  # how one replica adds up, for messages

    def describe(self, num_replicas: int) -> str:
        what = f"{_num(self.cpus)} CPU{'s' * (self.cpus != 1)}"
        if self.gpus:
            what += f" and {_num(self.gpus)} GPU{'s' * (self.gpus != 1)}"
        return f"{what} ({num_replicas} replica{'s' * (num_replicas != 1)} x {self.per_replica})"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def check_model(config: AppConfig) -> None:
    """The model resolves and the TP size divides it, the LoRA adapters' folders are adapters;
    reads only metadata (config.json, a GGUF's header) and loads no weights."""
    from fleetserve.replica.model_loader import model_info
    from fleetserve.replica.model_loader.registry import resolve_model

    source = resolve_model(config.engine.model)
    model_info.check_model_files(source)
    model_info.check_tp_size(source, config.engine.tensor_parallel_size, config.engine.enable_expert_parallel)
    model_info.check_max_model_len(source, config.engine.max_model_len)
    if config.pd.enabled:  # a pool may set its own (pd.prefill.engine, pd.decode.engine)
        for pool_cfg in (config.pd.prefill, config.pd.decode):
            model_info.check_max_model_len(source, pool_cfg.engine.get("max_model_len"))
    model_info.generation_defaults(source, config.engine.generation_config)
    config.engine.check_lora_files()
    if config.pd.enabled:
        for pool in ("prefill", "decode"):
            config.pool_engine(pool).check_lora_files()


def _mem_available() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def _may_use_a_gpu(engine) -> bool:
    if engine.device == "cuda":
        return True
    return engine.device == "auto" and any(os.path.exists(f"/dev/nvidia{i}") for i in range(16))


def check_kv_memory(config: AppConfig, available: Optional[int] = None) -> None:
    """ValueError when the KV caches that an embedded Ray's engine replicas allocate at
    start-up cannot fit in this machine's available memory (--kv-cache-memory-bytes per
    engine rank, or --num-gpu-blocks-override blocks): said before anything starts, where
    the replicas would otherwise zero (fault in) their whole caches at start-up, past what
    the machine has: into swap or the kernel's OOM killer. Block sizes are a lower bound (`auto` dtype
    counted as 2 bytes), so only what cannot fit is refused. A cache of one block too
    small is refused too. GPU caches and a joined cluster's machines are not checked here."""
    from fleetserve.replica.model_loader.model_info import read_model_shape
    from fleetserve.replica.model_loader.registry import resolve_model

    if config.pd.enabled:
        pools = [(p, config.pool_engine(p), getattr(config.pd, p).num_replicas) for p in ("prefill", "decode")]
    else:
        n = max(1, config.autoscaling.min_replicas) if config.autoscaling else config.num_replicas
        pools = [("", config.engine, n)]
    shape = read_model_shape(resolve_model(config.engine.model))
    total, parts = 0, []
    for name, engine, replicas in pools:
        tp = engine.tensor_parallel_size
        block = shape.kv_bytes_per_block(engine.block_size, 4 if engine.dtype == "float32" else 2, tp)
        if (
            engine.kv_cache_memory_bytes is not None
            and engine.num_gpu_blocks_override is None
            and block
            and engine.kv_cache_memory_bytes < block
        ):
            size = f"{block} bytes" if engine.dtype != "auto" else f"at least {block} bytes (bfloat16)"
            whose = f"the {name} pool's" if name else "the"
            raise ValueError(
                f"{whose} KV cache budget "
                f"({engine.kv_cache_memory_bytes} bytes, --kv-cache-memory-bytes) holds no "
                f"block of {engine.block_size} tokens: {size}; raise it"
            )
        if config.address or _may_use_a_gpu(engine):
            continue
        if engine.num_gpu_blocks_override is not None:
            per_rank, flag = engine.num_gpu_blocks_override * block, "--num-gpu-blocks-override"
        elif engine.kv_cache_memory_bytes is not None:
            per_rank, flag = engine.kv_cache_memory_bytes, "--kv-cache-memory-bytes"
        else:
            continue  # the default budget is a share of what is available
        total += per_rank * tp * replicas
        ranks = f" x {tp} ranks" if tp > 1 else ""
        parts.append(
            f"{replicas} {name + ' ' if name else ''}replica{'s' * (replicas != 1)}{ranks} "
            f"x {per_rank / 2**30:.2f} GiB ({flag})"
        )
    available = _mem_available() if available is None else available
    if parts and available is not None and total > available:
        raise ValueError(
            f"the KV caches need {' + '.join(parts)} = {total / 2**30:.2f} GiB, and this "
            f"machine has {available / 2**30:.2f} GiB of memory available; lower "
            "--kv-cache-memory-bytes or --num-gpu-blocks-override, or run fewer replicas"
        )


def check_ports(config: AppConfig) -> None:
    """ValueError when an embedded Ray's HTTP or gRPC port is already taken on this machine
    (another server, an earlier `fleetserve serve` still running): said before anything starts,
    where Serve would start everything, fail to bind and only then give up. Probed as uvicorn
    binds (SO_REUSEADDR: a just-stopped server's TIME_WAIT sockets do not count). A joined
    cluster's ports are on its head node, not here: not checked."""
    import socket

    if config.address:
        return
    wanted = [("HTTP", config.http.port, "--port")]
    if config.grpc.enabled:
        wanted.append(("gRPC", config.grpc.port, "--grpc-port"))
    for what, port, flag in wanted:
        if not port:
            continue
        try:
            infos = socket.getaddrinfo(config.http.host, port, type=socket.SOCK_STREAM)
        except OSError:
            continue  # an unresolvable --host is for the server to report
        family, _, _, _, addr = infos[0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as e:
                raise ValueError(
                    f"{what} port {port} on {config.http.host} is not free ({e.strerror}): "
                    f"another server (or fleetserve serve) is using it; stop it or "
                    f"choose another with {flag}"
                ) from None


def resource_needs(config: AppConfig) -> ResourceNeeds:
    tp = config.engine.tensor_parallel_size
    per_cpu, parts = config.cpus_per_replica, [f"{_num(config.cpus_per_replica)} CPU for the replica"]
    per_gpu = 0.0
    if tp > 1:
        per_cpu += tp
        parts.append(f"{tp} tensor-parallel ranks x 1 CPU")
        if config.engine.device == "cuda":
            per_gpu = float(tp)
            parts[-1] += " + 1 GPU"
    n = config.num_replicas
    return ResourceNeeds(n * per_cpu, n * per_gpu, "(" + " + ".join(parts) + ")")


def split_cores(config: AppConfig) -> AppConfig:
    """`config` with an unset `num_cpus_per_replica` made this machine's share per engine
    replica, for an embedded Ray (no address): the engine replicas split the cores, so one
    replica gets every core (its torch threads), as `vllm serve` uses the machine. With
    tensor parallelism the ranks take the cores, and on a GPU the replica needs few: 1."""
    if config.num_cpus_per_replica is not None or config.address:
        return config
    if config.engine.tensor_parallel_size > 1 or config.engine.device == "cuda":
        return config.model_copy(update={"num_cpus_per_replica": 1.0})
    share = max(1, _cores() // max(1, config.max_engine_replicas))
    return config.model_copy(update={"num_cpus_per_replica": float(share)})


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def embedded_num_cpus(config: AppConfig) -> int:
    """Logical CPUs for the embedded Ray: the machine's cores, or what the topology needs."""
    cores = os.cpu_count() or 1
    needed = math.ceil(resource_needs(config).cpus)
    if needed > cores:
        logger.warning(
            "this topology needs %s; the machine has %d cores, which the replicas and ranks will share (slower)",
            resource_needs(config).describe(config.num_replicas),
            cores,
        )
    return max(cores, needed)


def check_fits(config: AppConfig) -> None:
    """Compare the needs with the connected cluster's resources; TopologyError if it cannot fit."""
    import ray

    needs = resource_needs(config)
    total, available = ray.cluster_resources(), ray.available_resources()
    for key, need in (("CPU", needs.cpus), ("GPU", needs.gpus)):
        have = available.get(key, 0.0)
        if need > have + 1e-9:
            raise TopologyError(
                f"this topology needs {needs.describe(config.num_replicas)}; the Ray cluster has "
                f"{_num(have)} {key}{'s' * (have != 1)} available ({_num(total.get(key, 0.0))} in "
                "total). Use fewer "
                "--num-replicas, a smaller --tensor-parallel-size, a smaller "
                "--num-cpus-per-replica, or a larger cluster."
            )
    tp = config.engine.tensor_parallel_size
    if tp > 1 and config.engine.placement_strategy == "STRICT_PACK":
        largest = max((n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")), default=0.0)
        if tp > largest:
            raise TopologyError(
                f"STRICT_PACK puts all {tp} tensor-parallel ranks of a replica on one node, "
                f"but the largest node has {_num(largest)} CPUs"
            )
