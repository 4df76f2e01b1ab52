"""Qwen3-MoE: Qwen3's attention (q/k RMSNorm per head, replica.models.qwen3) and sparse MoE MLPs.

    MLP of layer i:  dense Llama MLP (intermediate_size) when i is in `mlp_only_layers`, or
                     num_experts == 0, or (i + 1) % decoder_sparse_step != 0 (HF's rule);
                     else experts (moe_intermediate_size each): weights, experts =
                     top-k(softmax(gate(x))), divided by their sum only if `norm_topk_prob`

Checkpoint names: Qwen3's, with `mlp.gate.weight` (the router) and
`mlp.experts.N.{gate,up,down}_proj.weight` on the sparse layers.
"""

from __future__ import annotations

from typing import Any

from fleetserve.replica.distributed.parallel import TPGroup
from fleetserve.replica.layers import RotaryEmbedding
from fleetserve.replica.layers.moe import SparseMoeBlock
from fleetserve.replica.model_loader.model_config import qwen3_moe_sparse_layer
from fleetserve.replica.models.llama import LlamaMLP
from fleetserve.replica.models.moe_common import MoEForCausalLM, MoEModel
from fleetserve.replica.models.qwen3 import Qwen3DecoderLayer


class Qwen3MoeSparseMoeBlock(SparseMoeBlock):
    def __init__(self, config: Any, tp: TPGroup):
        super().__init__(
            config.num_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
            tp_group=tp,
            enable_expert_parallel=bool(getattr(config, "enable_expert_parallel", False)),
            hidden_act=getattr(config, "hidden_act", "silu"),
        )


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, tp: TPGroup, layer_idx: int = 0):
        # The MLP class is per layer here: chosen before Llama's constructor builds `mlp_cls`.
        self.mlp_cls = Qwen3MoeSparseMoeBlock if qwen3_moe_sparse_layer(config, layer_idx) else LlamaMLP
        super().__init__(config, rotary_emb, tp, layer_idx)


class Qwen3MoeModel(MoEModel):
    decoder_layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(MoEForCausalLM):
    architectures = ("Qwen3MoeForCausalLM",)
    model_cls = Qwen3MoeModel


__all__ = ["Qwen3MoeForCausalLM"]
