"""The Phi-3 family (Phi-3 mini/medium, Phi-3.5-mini, Phi-4-mini): Llama's layers exactly.

What differs from Llama is outside the layers:

* the checkpoint's projections are already fused: `self_attn.qkv_proj.weight`
  [(H + 2 KVH) d, hidden] (q | k | v rows) and `mlp.gate_up_proj.weight` [2 I, hidden]
  (gate | up rows). `load_weights` splits them into their q / k / v and gate / up pieces
  and hands each to the QKVParallelLinear / MergedColumnParallelLinear shard loader, so a
  tensor-parallel rank keeps its own heads and its own slice of the MLP;
* rope: LongRoPE ("longrope", or its earlier names "su" / "yarn" in Phi-3 configs) with
  short_factor / long_factor and original_max_position_embeddings
  (replica.layers.rotary._longrope_cos_sin says which factor a position gets: the short one
  below the original length, the long one from there on, and how that differs from
  transformers past the original length); and partial rotary (`partial_rotary_factor` < 1, Phi-4-mini): only the first
  rotary_dim of each head rotates.

With full rotary the layers are Llama's own classes, so the fused `llama_layers` kernel
runs them where it runs Llama's; with partial rotary they run as modules.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from fleetserve.replica.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    architectures = ("Phi3ForCausalLM",)
    # The checkpoint's fused names -> the split names our parameters load by (through
    # LlamaForCausalLM.packed_modules_mapping).
    fused_modules = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) with each fused qkv / gate|up tensor cut into its pieces along the
        rows (dim 0: weights and, if a checkpoint has them, biases), under the pieces' names;
        a fused tensor of the wrong size is a ValueError."""
        head_dim = self.model.rotary_emb.head_dim
        heads = self.config.num_attention_heads
        kv_heads = getattr(self.config, "num_key_value_heads", None) or heads
        sizes = {
            "qkv_proj": [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim],
            "gate_up_proj": [self.config.intermediate_size] * 2,
        }
        for name, tensor in weights:
            fused = next((f for f in self.fused_modules if f".{f}." in name), None)
            if fused is None:
                yield name, tensor
                continue
            if tensor.shape[0] != sum(sizes[fused]):
                parts = " + ".join(map(str, sizes[fused]))
                raise ValueError(f"{name}: {tensor.shape[0]} rows, expected {sum(sizes[fused])} ({parts})")
            for piece, part in zip(self.fused_modules[fused], tensor.split(sizes[fused], dim=0), strict=True):
                yield name.replace(f".{fused}.", f".{piece}."), part

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint") -> set[str]:
        """Phi-3's fused checkpoint tensors into this rank's shards (see the module docstring);
        returns the checkpoint's names that were loaded."""
        loaded = super().load_weights(self._split_fused(weights), source)
        return {self._fused_name(name) for name in loaded}

    def check_complete(self, loaded: set[str], source: str = "checkpoint") -> None:
        super().check_complete({self._fused_name(name) for name in loaded}, source)

    def expected_weight_names(self) -> set[str]:
        """The checkpoint names, fused as Phi-3 stores them."""
        return {self._fused_name(name) for name in super().expected_weight_names()}

    def _fused_name(self, name: str) -> str:
        for fused, pieces in self.fused_modules.items():
            for piece in pieces:
                if f".{piece}." in name:
                    return name.replace(f".{piece}.", f".{fused}.")
        return name


__all__ = ["Phi3ForCausalLM"]
