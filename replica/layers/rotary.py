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
    rope_type: str, rope_parameters: dict[str, Any], head_dim: int, max_position: int, seq_len: Optional[int] = None
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
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu", seq_len=seq_len)
    return inv_freq.float(), float(attention_scaling)


def _cos_sin(inv_freq: torch.Tensor, start: int, end: int, scaling: float) -> torch.Tensor:
    """cos | sin rows for positions [start, end): [end - start, 2 * len(inv_freq)], float32."""
    freqs = torch.outer(torch.arange(start, end, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * scaling


def _longrope_cos_sin(p: dict[str, Any], head_dim: int, max_position: int) -> torch.Tensor:
    """LongRoPE (Phi-3 / Phi-4-mini): the cos|sin table with `short_factor` for positions below
    `original_max_position_embeddings` and `long_factor` from there on, both scaled by
    transformers' attention factor (from `factor`, else max_position_embeddings / original).

    Within the original length this is transformers exactly (short factor everywhere). Past
    it, transformers' model picks one factor per forward pass from the pass's longest
    position (long for every token of a pass that reaches past the original length), and
    its Phi-3 `generate` drops the KV cache the first time a sequence crosses the original
    length, so that the whole sequence is recomputed with the long factor. Here a position's
    rotation is fixed (it never depends on the rest of the batch, on chunking, or on later
    tokens) and cached keys are kept: a token at or past the original length rotates with
    the long factor, the ones before it keep the short one. That is transformers' model run
    pass by pass on its own KV cache (what tests/replica/test_qwen3_phi3.py compares), not
    its generate past the crossing, nor a one-pass prompt longer than the original length
    (there transformers rotates the first original-length tokens with the long factor too).
    """
    original = int(p["original_max_position_embeddings"])
    short, _ = _hf_rope_init("longrope", p, head_dim, max_position, seq_len=None)
    long, scaling = _hf_rope_init("longrope", p, head_dim, max_position, seq_len=original + 1)
    split = min(original, max_position)
    return torch.cat([_cos_sin(short, 0, split, scaling), _cos_sin(long, split, max_position, scaling)])


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
        if rope_type == "su":  # LongRoPE's first name (Phi-3's early configs), as transformers maps it
            rope_type = p["rope_type"] = "longrope"
        factor = float(p.get("partial_rotary_factor", 1.0))
        rotary_dim = int(head_dim * factor)  # as transformers rounds it
        if not 0.0 < factor <= 1.0 or rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor {factor} gives {rotary_dim} rotary dims of a {head_dim}-dim head; "
                "supported: a factor in (0, 1] that leaves an even number of them"
            )
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim  # the first rotary_dim of each head rotate, the rest pass through
        self.rope_type = rope_type
        attention_scaling = 1.0
        if rope_type == "default":
            inv_freq = _inv_freq(rotary_dim, theta)
        elif rope_type == "linear":
            inv_freq = _inv_freq(rotary_dim, theta) / float(p["factor"])
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(_inv_freq(rotary_dim, theta), p)
        elif rope_type == "longrope":
            p.setdefault("rope_theta", theta)
            cos_sin = _longrope_cos_sin(p, head_dim, max_position)
        else:
            p.setdefault("rope_theta", theta)
            inv_freq, attention_scaling = _hf_rope_init(rope_type, p, head_dim, max_position)
        self.max_position = max_position
        if rope_type != "longrope":
            cos_sin = _cos_sin(inv_freq, 0, max_position, attention_scaling)  # [P, rotary_dim]
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` [T]: each [T, 1, head_dim/2] in `dtype`; compute once per forward."""
        cs = self.cos_sin_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        cos, sin = cs.chunk(2, dim=-1)
        return cos, sin

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] -> rotated (same rounding steps as HF's rotate_half formulation);
        with cos/sin narrower than half a head (partial rotary), its first 2 * cos.shape[-1]
        dims, the rest passed through (as HF's Phi-3 / NeoX)."""
        rotary_dim = 2 * cos.shape[-1]
        if rotary_dim < x.shape[-1]:
            rotated = RotaryEmbedding.rotate(x[..., :rotary_dim], cos, sin)
            return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions, q.dtype)
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)
