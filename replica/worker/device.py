"""Device, dtype and thread choices, made at run time: CUDA when present, CPU otherwise."""

from __future__ import annotations

import errno
import logging
import os
import tempfile
from pathlib import Path
from typing import Optional

import torch

from fleetserve.replica.worker.cpu_list import parse_cpu_list

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def select_device(name: str = "auto") -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but CUDA is not available on this machine")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def cpu_supports_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def select_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_supports_bf16() else torch.float32


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def set_num_threads(requested: int | None, share: int = 1) -> int:
    """Give this process `requested` threads, or its share of the cores.

    Several processes with one OpenMP thread per core each spin against each
    other at their pools' barriers, so ranks on one machine split the cores
    instead of each taking all of them (docs/benchmarks/results/2026-11-22-epyc-avx2-first-figures.md,
    "Threads per engine process")."""
    n = requested or max(1, available_cores() // max(1, share))
    torch.set_num_threads(n)
    return n


def default_kv_cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * 0.85)
    try:
        with open("/proc/meminfo") as f:
            avail_kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable"))
        avail = avail_kb * 1024
    except (OSError, StopIteration):
        avail = 8 << 30
    # On CPU the KV cache is ordinary process memory next to Ray, the other
    # replicas and everything else on the host: 1 GiB holds ~46k tokens of
    # SmolLM2-135M in bf16 (23 KB per token), several full 8k contexts; more is
    # an explicit choice (kv_cache_memory_bytes or num_gpu_blocks_override).
    return int(min(1 << 30, avail * 0.1))


# ---- binding a process to cores (vLLM CPU: VLLM_CPU_OMP_THREADS_BIND) ------------------------
# Open lock files of the cores this process claimed with cpu_bind="auto": held (and so the
# cores reserved) for the life of the process; the OS drops the locks when it exits or dies.
_claimed: list = []


def _lock_dir() -> Path:
    d = Path(os.environ.get("FLEETSERVE_CPU_LOCK_DIR") or Path(tempfile.gettempdir()) / "fleetserve-cpus")
    d.mkdir(parents=True, exist_ok=True)
    return d


def claim_cpus(count: int, allowed: list[int]) -> list[int]:
    """Take `count` cores of `allowed` that no other process on this machine has claimed (one
    lock file per core, flock'ed for as long as this process lives). Empty when too few are
    free: the caller runs unbound rather than doubling up on a claimed core."""
    import fcntl

    taken: list[tuple[int, int]] = []
    for cpu in allowed:
        if len(taken) == count:
            break
        fd = os.open(_lock_dir() / f"cpu-{cpu}.lock", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                continue
            raise
        taken.append((cpu, fd))
    if len(taken) < count:
        for _, fd in taken:
            os.close(fd)  # closing the file drops its lock
        return []
    _claimed.extend(fd for _, fd in taken)
    return [cpu for cpu, _ in taken]


def bind_cpus(spec: Optional[str], num_threads: Optional[int], rank: int = 0) -> Optional[list[int]]:
    """Pin this process (its threads started from now on: the OpenMP pool included) to cores.

    `spec`: None or "nobind" (leave it), "auto" (claim `num_threads` cores, default 1, that no
    other fleetserve engine on this machine holds: two replicas never share a core), a core list
    "0-3,8", or one list per TP rank "0-1|2-3". Returns the cores, or None when unbound (with
    "auto" and too few free cores, logged). Call it before the first parallel op."""
    if spec is None or spec == "nobind":
        return None
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not allowed:
        logger.warning("cpu_bind=%s: this OS cannot bind threads to cores; running unbound", spec)
        return None
    if spec == "auto":
        want = num_threads or 1
        cpus = claim_cpus(want, allowed)
        if not cpus:
            logger.warning(
                "cpu_bind=auto: fewer than %d of this process's cores %s are unclaimed; running unbound", want, allowed
            )
            return None
    else:
        ranks = spec.split("|")
        if len(ranks) > 1 and rank >= len(ranks):
            raise ValueError(f"cpu_bind {spec!r} names {len(ranks)} ranks' cores; rank {rank} has none")
        cpus = parse_cpu_list(ranks[rank] if len(ranks) > 1 else ranks[0])
        outside = sorted(set(cpus) - set(allowed))
        if outside:
            raise ValueError(
                f"cpu_bind {spec!r}: cores {outside} are not available to this process (it may run on {allowed})"
            )
    os.sched_setaffinity(0, cpus)
    logger.info("bound to cores %s (cpu_bind=%s)", cpus, spec)
    return cpus
