"""A checkpoint's config as our models read it, without transformers' config classes.

transformers 5's `LlamaConfig` (and Mistral's, Qwen2's) import its type validators, which
import its activations, hub kernels, weight-conversion machinery and torch.distributed's
DTensor: seconds of CPU in every engine process that starts, for a dozen numbers
(docs/serving/config.md, "Start-up"). `ModelConfig` holds the config.json (or GGUF
metadata) keys as attributes, with the family's defaults (transformers' own, for the three
families our Llama model runs: tests/replica/test_model_config.py compares them with
AutoConfig's) and `rope_parameters` in transformers 5's form. `hf_export` still builds
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
        bos_token_id=None,
        eos_token_id=None,
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
                f"supported model types: {', '.join(FAMILY_DEFAULTS)} (the Llama family)"
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
        fields["rope_parameters"] = _rope_parameters(fields)
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
