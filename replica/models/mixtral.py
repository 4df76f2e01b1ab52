"""Mixtral: Llama's attention and a sparse MoE block (`block_sparse_moe` in checkpoints) as the MLP.

    MLP of every layer:  weights, experts = top-k(softmax(gate(x)))  (renormalised over the k)
                         y = sum_k weights_k * w2_k(silu(w1_k x) * w3_k x)

config: num_local_experts, num_experts_per_tok, intermediate_size (each expert's).
config.sliding_window, when set, applies to every layer, as for Mistral (replica.models.llama.layer_sliding_window).
"""

from __future__ import annotations

from typing import Any

from fleetserve.replica.distributed.parallel import TPGroup
from fleetserve.replica.layers.moe import DOWN, GATE, UP, SparseMoeBlock
from fleetserve.replica.models.llama import LlamaDecoderLayer
from fleetserve.replica.models.moe_common import MoEForCausalLM, MoEModel


class MixtralSparseMoeBlock(SparseMoeBlock):
    def __init__(self, config: Any, tp: TPGroup):
        super().__init__(
            config.num_local_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.intermediate_size,
            renormalize=True,
            tp_group=tp,
            enable_expert_parallel=bool(getattr(config, "enable_expert_parallel", False)),
            hidden_act=getattr(config, "hidden_act", "silu"),
        )


class MixtralDecoderLayer(LlamaDecoderLayer):
    mlp_cls = MixtralSparseMoeBlock


class MixtralModel(MoEModel):
    decoder_layer_cls = MixtralDecoderLayer


class MixtralForCausalLM(MoEForCausalLM):
    architectures = ("MixtralForCausalLM",)
    model_cls = MixtralModel
    expert_pieces = {"w1": GATE, "w3": UP, "w2": DOWN}
    checkpoint_renames = ((".block_sparse_moe.", ".mlp."),)


__all__ = ["MixtralForCausalLM"]
