"""The Qwen3 family (dense): Llama's layers with q and k normalized per head before rope.

    qkv = qkv_proj(x); q, k = q_norm(q per head), k_norm(k per head); rope(q, k); attention

Everything else is Llama's (replica.models.llama): GQA, SiLU MLP, RMSNorm between layers, tied
embeddings for the small sizes. `head_dim` is its own config key (Qwen3's heads are 128 wide
whatever hidden_size / num_attention_heads is); `attention_bias` biases q/k/v and o (off in
the released models). The norms are per head, [head_dim] each, so with tensor parallelism
every rank holds them whole. Checkpoint names: Llama's plus
`model.layers.N.self_attn.q_norm.weight` and `.k_norm.weight`.

`Qwen3Attention` is the attention of Qwen3-MoE too (replica.models.qwen3_moe).
"""

from __future__ import annotations

from typing import Any

import torch

from fleetserve.replica.distributed.parallel import TPGroup
from fleetserve.replica.layers import RMSNorm, RotaryEmbedding
from fleetserve.replica.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Qwen3Attention(LlamaAttention):
    """LlamaAttention with an RMSNorm over each q head (`q_norm`) and each k head (`k_norm`),
    applied after the qkv projection and before rope (the fused rotary kernel or (cos, sin))."""

    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, tp: TPGroup):
        super().__init__(config, rotary_emb, tp)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def qk_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        T = qkv.shape[0]
        q = qkv[:, : self.q_size].reshape(T, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].reshape(T, self.num_kv_heads, self.head_dim)
        return torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)  # [T, H + KVH, d]


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    decoder_layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    architectures = ("Qwen3ForCausalLM",)
    model_cls = Qwen3Model


__all__ = ["Qwen3Attention", "Qwen3DecoderLayer", "Qwen3ForCausalLM", "Qwen3Model"]
