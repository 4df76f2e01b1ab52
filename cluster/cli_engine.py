"""Engine flags shared by `fleetserve serve` and `fleetserve generate` (vLLM's spelling)."""

from __future__ import annotations

import argparse
from typing import Any

# CLI flag -> EngineArgs field type. Flags not given stay unset (argparse.SUPPRESS),
# so the EngineArgs defaults (or a YAML file) apply.
ENGINE_FLAGS = {
    "model": str, "served_model_name": str, "max_num_seqs": int, "max_num_batched_tokens": int,
    "max_model_len": int, "tensor_parallel_size": int, "dtype": str, "block_size": int,
    "num_gpu_blocks_override": int, "kv_cache_memory_bytes": int, "max_waiting_requests": int,
    "long_prefill_token_threshold": int, "scheduling_policy": str, "capacity_policy": str,
    "seed": int, "num_threads": int, "device": str, "prefix_caching_hash_algo": str,
}
BOOL_FLAGS = ("enable_prefix_caching", "enable_chunked_prefill")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine (vLLM flag names)")
    for name, typ in ENGINE_FLAGS.items():
        group.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, default=argparse.SUPPRESS)
    for name in BOOL_FLAGS:
        group.add_argument("--" + name.replace("_", "-"), dest=name, default=argparse.SUPPRESS,
                           action=argparse.BooleanOptionalAction)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineArgs fields given on the command line (a positional model tag included)."""
    given = vars(args)
    out = {k: given[k] for k in (*ENGINE_FLAGS, *BOOL_FLAGS) if k in given}
    if given.get("model_tag"):
        out.setdefault("model", given["model_tag"])
    return out
