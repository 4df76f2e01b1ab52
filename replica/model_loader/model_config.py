"""A checkpoint's config as our models read it, without transformers' config classes.

transformers 5's `LlamaConfig` (and Mistral's, Qwen2's) import its type validators, which
import its activations, hub kernels, weight-conversion machinery and torch.distributed's
DTensor: seconds of CPU in every engine process that starts, for a dozen numbers
(docs/serving/config.md, "Start-up"). `ModelConfig` holds the config.json (or GGUF
metadata) keys as attributes, with the family's defaults (transformers' own, for the three
families we run: tests/replica/test_model_config.py compares them with AutoConfig's),
what transformers' config classes derive (`layer_types`, Gemma 3's per-layer-type rope), and
`rope_parameters` in transformers 5's form. `hf_export` still builds
transformers' classes, for HF's own model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

# transformers 5's defaults for what our model reads, per model_type.
_COMMON = dict(
    hidden_act="silu",
    tie_word_embeddings=False,
    attention_bias=False,
    mlp_bias=False,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    pad_token_id=None,
)
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        _COMMON,
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "mistral": dict(
        _COMMON,
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=4096 * 32,
        sliding_window=4096,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "qwen2": dict(
        _COMMON,
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        max_position_embeddings=32768,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=28,
        bos_token_id=None,
        eos_token_id=None,
    ),
    "qwen3": dict(
        _COMMON,
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=128,
        max_position_embeddings=32768,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=28,
        bos_token_id=None,
        eos_token_id=None,
    ),
    "qwen3_moe": dict(
        _COMMON,
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=32768,
        use_sliding_window=False,
        sliding_window=None,
        decoder_sparse_step=1,
        moe_intermediate_size=768,
        num_experts_per_tok=8,
        num_experts=128,
        norm_topk_prob=False,
        mlp_only_layers=[],
        bos_token_id=None,
        eos_token_id=None,
    ),
    "mixtral": dict(
        _COMMON,
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=4096 * 32,
        rms_norm_eps=1e-5,
        rope_theta=1e6,
        sliding_window=None,
        num_experts_per_tok=2,
        num_local_experts=8,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "phi3": dict(
        _COMMON,
        vocab_size=32064,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=32,
        num_attention_heads=32,
        max_position_embeddings=4096,
        original_max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        sliding_window=None,
        bos_token_id=1,
        eos_token_id=32000,
        pad_token_id=32000,
    ),
    "gemma3_text": dict(
        _COMMON,
        vocab_size=262208,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        query_pre_attn_scalar=256,
        sliding_window=4096,
        sliding_window_pattern=6,
        rope_local_base_freq=10000.0,
        rope_theta=1e6,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        use_bidirectional_attention=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    ),
}


class ModelConfig:
    """Attributes: every key of the config (absent ones from the family's defaults), plus
    num_key_value_heads, head_dim and rope_parameters always set."""

    # What `from_dict` guarantees (checked, or derived); other keys are read with getattr.
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_parameters: dict[str, Any]
    max_position_embeddings: Optional[int]  # a family default, unless the config says null

    def __init__(self, fields: dict[str, Any]) -> None:
        self.__dict__.update(fields)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in FAMILY_DEFAULTS:
            raise ValueError(
                f"unsupported model architecture {raw.get('architectures') or model_type!r}; "
                f"supported model types: {', '.join(FAMILY_DEFAULTS)}"
            )
        fields = {**FAMILY_DEFAULTS[model_type], **raw}  # an explicit null stays None, as in transformers
        for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size"):
            if not isinstance(fields[key], int) or isinstance(fields[key], bool) or fields[key] <= 0:
                raise ValueError(f"config {key} must be a positive integer, got {fields[key]!r}")
        heads = fields["num_attention_heads"]
        if not fields.get("head_dim") and fields["hidden_size"] % heads:
            raise ValueError(
                f"the hidden size ({fields['hidden_size']}) is not a multiple of the number of "
                f"attention heads ({heads})"
            )
        fields["num_key_value_heads"] = fields.get("num_key_value_heads") or heads
        fields["head_dim"] = fields.get("head_dim") or fields["hidden_size"] // heads
        if model_type == "gemma3_text":
            _derive_gemma3(fields)
        else:
            fields["rope_parameters"] = _rope_parameters(fields)
            if model_type == "phi3":
                _derive_phi3_rope(fields)
            if model_type.startswith("qwen") and not fields.get("use_sliding_window"):
                fields["sliding_window"] = None  # as transformers: the window is off unless switched on
            if model_type == "qwen3_moe":
                # transformers' attribute_map (num_local_experts -> num_experts): its save_pretrained
                # writes num_local_experts, the Hub's config.json files num_experts
                if "num_experts" not in raw and "num_local_experts" in raw:
                    fields["num_experts"] = raw["num_local_experts"]
                fields["num_local_experts"] = fields["num_experts"]
            if model_type in ("qwen2", "qwen3") and not fields.get("layer_types"):
                window = fields.get("use_sliding_window") and fields.get("sliding_window")
                fields["layer_types"] = [
                    "sliding_attention" if window and i >= fields["max_window_layers"] else "full_attention"
                    for i in range(fields["num_hidden_layers"])
                ]
        fields.pop("rope_scaling", None)
        fields.pop("rope_theta", None)
        return cls(fields)

    def __repr__(self) -> str:
        return f"ModelConfig({self.__dict__!r})"


def _rope_parameters(fields: dict[str, Any]) -> dict[str, Any]:
    """transformers 5's `rope_parameters` from either form: that dict itself, or transformers
    4's `rope_theta` + `rope_scaling` (whose "type" becomes "rope_type")."""
    given = fields.get("rope_parameters") or fields.get("rope_scaling") or {}
    if not isinstance(given, dict):
        raise ValueError(f"config rope_parameters / rope_scaling must be an object, got {given!r}")
    params = dict(given)
    params["rope_type"] = params.get("rope_type") or params.pop("type", None) or "default"
    params.pop("type", None)
    params.setdefault("rope_theta", float(fields.get("rope_theta") or 10000.0))
    return params


def _derive_phi3_rope(fields: dict[str, Any]) -> None:
    """What transformers' Phi3Config does to `rope_parameters`: a top-level partial_rotary_factor
    moves in, "su" and "yarn" (LongRoPE's earlier names) become "longrope", and LongRoPE takes the
    top-level original_max_position_embeddings over its own (transformers raises for "su" for lack
    of it; here it gets the top-level one too)."""
    rope = fields["rope_parameters"]
    rope.setdefault("partial_rotary_factor", fields.get("partial_rotary_factor", 1.0))
    if rope["rope_type"] in ("su", "yarn", "longrope"):
        rope["rope_type"] = "longrope"
        rope["original_max_position_embeddings"] = fields["original_max_position_embeddings"]


def _derive_gemma3(fields: dict[str, Any]) -> None:
    """What transformers' Gemma3TextConfig derives: `layer_types` (every
    `sliding_window_pattern`-th layer global, the rest sliding) and `rope_parameters` per
    layer type (global layers: rope_theta and the config's scaling; sliding layers:
    rope_local_base_freq, unscaled), from either config form."""
    if not fields.get("layer_types"):
        pattern = int(fields.get("sliding_window_pattern") or 6)
        fields["layer_types"] = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(fields["num_hidden_layers"])
        ]
    given = fields.get("rope_parameters")
    if isinstance(given, dict) and "full_attention" in given:
        full = _rope_parameters({"rope_parameters": given["full_attention"], "rope_theta": fields.get("rope_theta")})
        local = given.get("sliding_attention") or {"rope_theta": fields.get("rope_local_base_freq")}
        sliding = _rope_parameters({"rope_parameters": local, "rope_theta": fields.get("rope_local_base_freq")})
    else:
        full = _rope_parameters(fields)
        sliding = {"rope_type": "default", "rope_theta": float(fields.get("rope_local_base_freq") or 10000.0)}
    fields["rope_parameters"] = {"full_attention": full, "sliding_attention": sliding}


def read_model_config(folder: Path) -> ModelConfig:
    """The ModelConfig of an HF folder's config.json (ValueError if unreadable or unsupported)."""
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the model config: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: cannot read the model config: not a JSON object")
    try:
        return ModelConfig.from_dict(raw)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


def qwen3_moe_sparse_layer(config: Any, layer_idx: int) -> bool:
    """Whether Qwen3-MoE's layer `layer_idx` has experts (else a dense MLP of intermediate_size):
    transformers' Qwen3MoeDecoderLayer's rule (mlp_only_layers, decoder_sparse_step)."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and (getattr(config, "num_experts", 0) or 0) > 0
        and (layer_idx + 1) % step == 0
    )


# Families whose configs say per layer (config.layer_types) which layers slide, as their
# transformers models read it; the others (Mistral, Mixtral, Phi-3, Qwen3-MoE) apply a config's
# sliding_window on every layer (and transformers ignores a layer_types they carry).
LAYER_TYPED_WINDOWS = ("qwen2", "qwen3", "gemma3_text")


def layer_sliding_window(config: Any, layer_idx: int) -> Optional[int]:
    """Decoder layer `layer_idx`'s sliding window as transformers applies it, or None (full
    attention): config.sliding_window on every layer, or for LAYER_TYPED_WINDOWS families on
    those config.layer_types marks "sliding_attention"."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    if getattr(config, "model_type", None) in LAYER_TYPED_WINDOWS:
        types = getattr(config, "layer_types", None) or []
        if layer_idx >= len(types) or types[layer_idx] != "sliding_attention":
            return None
    return int(window)


def model_sliding_window(config: Any) -> Optional[int]:
    """The window every decoder layer of the model attends within (the largest, where they
    differ), or None when some layer attends to everything (Gemma 3's global layers, Qwen2's
    lower ones): a request's KV blocks wholly before it are read by no layer again."""
    windows = [layer_sliding_window(config, i) for i in range(int(config.num_hidden_layers))]
    if not windows or any(w is None for w in windows):
        return None
    return max(w for w in windows if w is not None)
