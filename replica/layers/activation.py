"""Activations: the gated products of the merged gate/up projection (SiLU: Llama's; GELU: Gemma's)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fleetserve.replica.kernels import ops_for


class SiluAndMul(nn.Module):
    """[..., 2d] -> silu(x[..., :d]) * x[..., d:] (the gate/up halves of the merged projection)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = ops_for(x)
        if ops is not None:
            return ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """[..., 2d] -> gelu(x[..., :d]) * x[..., d:] (GeGLU), in the input's dtype as transformers
    computes it; approximate="tanh" is transformers' gelu_pytorch_tanh, "none" its exact gelu."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU approximation must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up
