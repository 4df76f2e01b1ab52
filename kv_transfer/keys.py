"""Which KV a block holds: its chain key, and the fingerprint of the format it is in.

A block's **chain key** hashes the fingerprint of the KV format (model, dtype, block size,
layers, KV heads, head dim, cache layout), the cache salt and every token up to the end of
the block:

    key_0 = blake2b(fingerprint, salt, tokens[0:B])
    key_i = blake2b(key_{i-1}, tokens[i*B:(i+1)*B])

so a block is only ever accepted where the consumer's own prompt (with its own
fingerprint) produces the same key: stale, reused or foreign KV fails closed.
Keys are 128-bit blake2b (not the scheduler's 64-bit prefix-cache hash): they name
files in a shared folder that anyone may fill, so collisions must be out of reach.
"""

from __future__ import annotations

import array
import hashlib
import json
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:  # annotations only: chain keys are computed without torch (the scheduler half)
    import torch

LAYOUT = "2HNBD-v1"  # replica.layers.attention: [2, kv_heads, num_blocks, block_size, head_dim]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def kv_geometry(hf_config: Any) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of the whole model."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return int(hf_config.num_hidden_layers), int(kv_heads), int(head_dim)


def rope_identity(hf_config: Any) -> str:
    """The rotary embedding's parameters as one string: keys are cached after rope, so engines
    whose rope differs (theta, type, scaling) must never share blocks. transformers 5 configs and
    our ModelConfig keep them all in `rope_parameters`; older configs in `rope_theta` and
    `rope_scaling`. (A fingerprint change makes a shared-storage folder written before it miss
    once, never hit wrongly: docs/design/kv-connector.md says when this one changed.)"""
    params = getattr(hf_config, "rope_parameters", None)
    if not params:
        params = {
            "rope_theta": getattr(hf_config, "rope_theta", None),
            "rope_scaling": getattr(hf_config, "rope_scaling", None),
        }
    return json.dumps(params, sort_keys=True, default=str)


def kv_fingerprint(
    model_id: str, hf_config: Any, dtype: torch.dtype | str, block_size: int, key_layout: str = "rows"
) -> str:
    """Everything two engines must share for one's KV blocks to be valid in the other.
    `key_layout`: how keys sit inside a block ("rows", or "k_tiled" where the CPU attention
    kernel keeps them tiled: replica.layers.attention.kv_cache_layout)."""
    layers, kv_heads, head_dim = kv_geometry(hf_config)
    dtype_str = dtype if isinstance(dtype, str) else dtype_name(dtype)
    parts = [
        model_id,
        str(getattr(hf_config, "model_type", "")),
        str(hf_config.hidden_size),
        str(hf_config.vocab_size),
        rope_identity(hf_config),
        dtype_str,
        f"B{block_size}",
        f"L{layers}",
        f"H{kv_heads}",
        f"D{head_dim}",
        LAYOUT,
    ]
    if key_layout != "rows":  # the fingerprints of row-major engines stay what they were
        parts.append(f"K:{key_layout}")
    return hashlib.blake2b("|".join(parts).encode(), digest_size=16).hexdigest()


def chain_keys(
    fingerprint: str, token_ids: Sequence[int], block_size: int, num_blocks: int, cache_salt: Optional[str] = None
) -> list[str]:
    """Chain keys of the first `num_blocks` full blocks of `token_ids`."""
    num_blocks = min(num_blocks, len(token_ids) // block_size)
    keys: list[str] = []
    parent = hashlib.blake2b((fingerprint + "|" + (cache_salt or "")).encode(), digest_size=16).digest()
    tokens = array.array("q", token_ids[: num_blocks * block_size])
    raw = memoryview(tokens).cast("B")
    step = block_size * tokens.itemsize
    for i in range(num_blocks):
        parent = hashlib.blake2b(parent + raw[i * step : (i + 1) * step], digest_size=16).digest()
        keys.append(parent.hex())
    return keys
