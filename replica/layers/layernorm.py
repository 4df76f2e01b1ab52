"""RMSNorm, plain and fused with the residual add; Gemma's (1 + weight) form."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from fleetserve.replica.kernels import ops_for
from fleetserve.replica.layers.linear import _check_shape, _new_param, set_weight_loader


class RMSNorm(nn.Module):
    """y = weight * x / rms(x), computed in float32 like HF's LlamaRMSNorm.

    `forward(x, residual)` is the fused variant used between layers: it adds
    the residual first and returns (normed, new_residual), saving one pass.
    """

    # bf16/fp16: torch's fused `F.rms_norm` (float32 accumulation inside, no float32 copy of
    # the hidden states: faster on long steps, see docs/deployment/cpu.md, "Figures behind the code").
    # float32 keeps HF's exact formula.
    fused = True

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = _new_param(hidden_size)
        set_weight_loader(self.weight, self.weight_loader)

    @staticmethod
    def weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        _check_shape(param, loaded_weight, "a norm")
        param.data.copy_(loaded_weight)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        ops = ops_for(x)
        if ops is not None:
            return ops.rms_norm(x, self.weight, self.eps)
        if self.fused and x.dtype != torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is None:
            return self._norm(x)
        ops = ops_for(x)
        if ops is not None:
            return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        residual = x + residual
        return self._norm(residual), residual


class GemmaRMSNorm(RMSNorm):
    """y = x / rms(x) * (1 + weight), all in float32 and rounded to x's dtype once, as
    transformers' Gemma3RMSNorm (Llama's rounds x / rms(x) first, then multiplies): checkpoints
    store the offset from 1. `forward(x, residual)` adds the residual in x's dtype first, as
    transformers' decoder layer does."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual
