"""Model layers: tensor-parallel linears and embeddings, norms, activations, rotary embedding,
paged attention and the batched sampler."""

from fleetserve.replica.layers.activation import GeluAndMul, SiluAndMul
from fleetserve.replica.layers.layernorm import GemmaRMSNorm, RMSNorm
from fleetserve.replica.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    pack_linear_weights,
)
from fleetserve.replica.layers.rotary import RotaryEmbedding

__all__ = [
    "ColumnParallelLinear",
    "GeluAndMul",
    "GemmaRMSNorm",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "ReplicatedLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "VocabParallelEmbedding",
    "pack_linear_weights",
]
