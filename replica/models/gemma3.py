"""Gemma 3 text models (Gemma3ForCausalLM, model_type gemma3_text) on Llama's layers.

    input_ids --embed * sqrt(hidden)--> (decoder layer x N) --norm--> lm_head [--soft-cap-->] logits
    decoder layer:  x, residual = norm(x + residual); x = post_attention_norm(attn(x))
                    x, residual = pre_feedforward_norm(x + residual); x = post_feedforward_norm(mlp(x))
    attn:           q, k = q_norm(q per head), k_norm(k per head); rope (local or global table);
                    softmax(q k^T / sqrt(query_pre_attn_scalar) [soft-capped]) v, within a window
                    on sliding layers

What differs from Llama, each as transformers' Gemma3 computes it:

* every norm (four per layer, q/k per head, the final one) is `GemmaRMSNorm`, x / rms(x) * (1 + w)
  in float32 (checkpoints store w as the offset from 1);
* embeddings are scaled by sqrt(hidden_size), a float32 constant rounded to the embedding's dtype;
* the MLP is GeGLU: `hidden_activation` gelu_pytorch_tanh (or exact gelu);
* attention scales by query_pre_attn_scalar ** -0.5; `attn_logit_softcapping` soft-caps its
  scores and `final_logit_softcapping` the logits, where the config sets them (the released
  Gemma 3 configs set only none or the final one; transformers 5.24's Gemma3 attention keeps
  attn_logit_softcapping without applying it, Gemma 2 and vLLM apply it, as here);
* `config.layer_types` (model_config derives it from `sliding_window_pattern`: every 6th layer
  global) splits the layers: "sliding_attention" layers attend to the last `sliding_window`
  positions and rotate with the local table (`rope_parameters["sliding_attention"]`, base
  `rope_local_base_freq`, unscaled), "full_attention" layers attend to everything and rotate
  with the global one (`rope_parameters["full_attention"]`, with its scaling, e.g. linear 8 for
  the 4B-27B models). The two tables are shared by all layers of their kind;
* the LM head is tied to the embedding.

`use_bidirectional_attention` (EmbeddingGemma) is refused. The fused `llama_layers` CPU kernel
is Llama's layer only; Gemma's layers run as modules, over the same attention kernel (windows and
soft-cap included). GGUF checkpoints (llama.cpp's `gemma3`) load too: weights.py takes off the 1
llama.cpp's converter adds to every norm weight, and fills in what the file does not say
(layer pattern, local rope base, query_pre_attn_scalar) as llama.cpp does.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from fleetserve.replica.distributed.parallel import TPGroup
from fleetserve.replica.kernels import ops_for
from fleetserve.replica.layers import GeluAndMul, GemmaRMSNorm, RotaryEmbedding
from fleetserve.replica.layers.attention import AttentionMetadata, PagedAttention
from fleetserve.replica.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    Rope,
    _head_dim,
)
from fleetserve.replica.models.qwen3 import Qwen3Attention

# transformers' activation names -> torch's GELU approximation
_GELU = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


class Gemma3Attention(Qwen3Attention):
    """Qwen3's attention (q and k normed per head before rope) with Gemma's (1 + w) norms, its
    query_pre_attn_scalar scale and attention logit soft-cap; the layer's rope table is its own
    (`rotary_emb`: local or global, set by Gemma3Model), so with positions and no kernels it
    gathers its own (cos, sin)."""

    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, tp: TPGroup):
        super().__init__(config, rotary_emb, tp)
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 with use_bidirectional_attention (EmbeddingGemma) is not supported")
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        scalar = getattr(config, "query_pre_attn_scalar", None) or self.head_dim
        self.attn = PagedAttention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            scale=float(scalar) ** -0.5,
            logit_softcap=getattr(config, "attn_logit_softcapping", None),
        )

    def apply_rope(self, qk: torch.Tensor, rope: Rope) -> torch.Tensor:
        if isinstance(rope, torch.Tensor) and ops_for(qk) is None:  # positions (Gemma3Model.rope_inputs)
            rope = self.rotary_emb.cos_sin(rope, qk.dtype)
        return super().apply_rope(qk, rope)


class Gemma3MLP(LlamaMLP):
    """Llama's MLP with GELU: down(gelu(gate) * up)."""

    def activation(self, config: Any) -> nn.Module:
        name = getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"
        if name not in _GELU:
            raise ValueError(f"unsupported hidden_activation {name!r} for Gemma 3; supported: {', '.join(_GELU)}")
        return GeluAndMul(_GELU[name])


class Gemma3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Gemma3Attention
    mlp_cls = Gemma3MLP
    norm_cls = GemmaRMSNorm

    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, tp: TPGroup, layer_idx: int = 0):
        super().__init__(config, rotary_emb, tp, layer_idx)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: Optional[torch.Tensor],
        rope: Rope,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, rope, kv_cache, md))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3Model(LlamaModel):
    decoder_layer_cls = Gemma3DecoderLayer
    norm_cls = GemmaRMSNorm

    def __init__(self, config: Any, tp: TPGroup, max_position: int):
        super().__init__(config, tp, max_position)  # rotary_emb: the global table (full_attention)
        types = list(getattr(config, "layer_types", None) or [])
        if len(types) != config.num_hidden_layers or not set(types) <= {"sliding_attention", "full_attention"}:
            raise ValueError(
                f"Gemma 3 needs config.layer_types, one of 'sliding_attention' / 'full_attention' per layer "
                f"({config.num_hidden_layers}), got {types!r}"
            )
        rope = getattr(config, "rope_parameters", None) or {}
        if "sliding_attention" in types:
            if "sliding_attention" not in rope:
                raise ValueError("Gemma 3 needs rope_parameters per layer type ('sliding_attention', 'full_attention')")
            self.rotary_emb_local = RotaryEmbedding(_head_dim(config), max_position, rope["sliding_attention"])
            for layer, kind in zip(self.decoder_layers(), types):
                if kind == "sliding_attention":
                    attn = layer.self_attn
                    assert isinstance(attn, Gemma3Attention)
                    attn.rotary_emb = self.rotary_emb_local
        # transformers keeps sqrt(hidden_size) as a float32 tensor, cast to the embedding's dtype
        self.embed_scale = float(torch.tensor(config.hidden_size**0.5, dtype=torch.float32))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        return hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)

    def rope_inputs(self, positions: torch.Tensor, dtype: torch.dtype, kernels: bool) -> Rope:
        return positions  # each layer rotates with its own table (Gemma3Attention.apply_rope)


class Gemma3ForCausalLM(LlamaForCausalLM):
    architectures = ("Gemma3ForCausalLM",)
    model_cls = Gemma3Model

    def __init__(self, config: Any, tp_group: Optional[TPGroup] = None, max_position: Optional[int] = None):
        super().__init__(config, tp_group, max_position)
        cap = getattr(config, "final_logit_softcapping", None)
        self.final_logit_softcapping: Optional[float] = float(cap) if cap else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        if cap is not None:  # as transformers: logits / cap, tanh, * cap
            logits = logits.div_(cap).tanh_().mul_(cap)
        return logits


__all__ = ["Gemma3Attention", "Gemma3DecoderLayer", "Gemma3ForCausalLM", "Gemma3MLP", "Gemma3Model"]
