"""Rotary position embedding (default, linear, llama3 and HF-initialised rope types)."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn


def _inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths slowed by `factor`, short kept, smooth between."""
    factor = float(p["factor"])
    low_freq_factor = float(p.get("low_freq_factor", 1.0))
    high_freq_factor = float(p.get("high_freq_factor", 4.0))
    old_len = float(p["original_max_position_embeddings"])
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _hf_rope_init(
    rope_type: str, rope_parameters: dict[str, Any], head_dim: int, max_position: int
) -> tuple[torch.Tensor, float]:
    """Other static rope types (yarn, longrope, ...) through transformers' own init functions."""
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type.startswith("dynamic"):
        raise ValueError(
            f"unsupported rope type {rope_type!r} (supported: default, linear, llama3, "
            f"and static types known to transformers such as yarn)"
        )
    cfg = PretrainedConfig()
    cfg.rope_parameters = dict(rope_parameters)
    cfg.head_dim, cfg.hidden_size, cfg.num_attention_heads = head_dim, head_dim, 1
    cfg.max_position_embeddings = max_position
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    return inv_freq.float(), float(attention_scaling)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding with a precomputed [max_position, head_dim] cos|sin table.

    `rope_parameters` is transformers-5's `config.rope_parameters`
    ({"rope_type", "rope_theta", "factor", ...}); transformers-4 style
    `rope_scaling` dicts ("type" instead of "rope_type") are accepted too.
    """

    cos_sin_cache: torch.Tensor  # [max_position, head_dim]: cos | sin (a buffer)

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        rope_parameters: Optional[dict[str, Any]] = None,
        rope_theta: float = 10000.0,
    ):
        super().__init__()
        p = dict(rope_parameters or {})
        rope_type = p.get("rope_type", p.get("type", "default")) or "default"
        theta = float(p.get("rope_theta", rope_theta))
        if float(p.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("partial rotary embeddings are not supported by the Llama family model")
        self.head_dim = head_dim
        self.rope_type = rope_type
        attention_scaling = 1.0
        if rope_type == "default":
            inv_freq = _inv_freq(head_dim, theta)
        elif rope_type == "linear":
            inv_freq = _inv_freq(head_dim, theta) / float(p["factor"])
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(_inv_freq(head_dim, theta), p)
        else:
            p.setdefault("rope_theta", theta)
            inv_freq, attention_scaling = _hf_rope_init(rope_type, p, head_dim, max_position)
        self.max_position = max_position
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)  # [P, d/2]
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_scaling  # [P, d]
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` [T]: each [T, 1, head_dim/2] in `dtype`; compute once per forward."""
        cs = self.cos_sin_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        cos, sin = cs.chunk(2, dim=-1)
        return cos, sin

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] -> rotated (same rounding steps as HF's rotate_half formulation)."""
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions, q.dtype)
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)
