"""Model implementations, by HF architecture name."""

from __future__ import annotations

from typing import Any

from fleetserve.replica.models.llama import SUPPORTED_ARCHITECTURES, LlamaForCausalLM

MODEL_REGISTRY: dict[str, type] = {arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES}


def get_model_class(config: Any) -> type:
    """The model class for an HF config (by `config.architectures`); ValueError if none of ours fits."""
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    if not archs and getattr(config, "model_type", None) in ("llama", "mistral", "qwen2"):
        return LlamaForCausalLM
    raise ValueError(
        f"unsupported model architecture {archs or getattr(config, 'model_type', None)!r}; "
        f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
    )


__all__ = ["LlamaForCausalLM", "MODEL_REGISTRY", "get_model_class"]
