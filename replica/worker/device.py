"""Device, dtype and thread choices, made at run time: CUDA when present, CPU otherwise."""

from __future__ import annotations

import logging
import os

import torch

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
    other (measured 5-20x slow-downs here), so ranks on one machine split the
    cores instead of each taking all of them."""
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
