"""Activations: the SiLU-gated product of the merged gate/up projection."""

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
