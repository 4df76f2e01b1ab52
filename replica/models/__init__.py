"""Model implementations, by HF architecture name.

A family is one module here; `MODELS` maps each HF architecture (config.json's
`architectures`) to its module and class, imported on first use, so a process that
serves Llama never imports the MoE code. Adding a family: its module, a line here, its
config defaults in `replica.model_loader.model_config.FAMILY_DEFAULTS`, and its tests.
"""

from __future__ import annotations

import importlib
from typing import Any

# HF architecture -> (module under fleetserve.replica.models, class name)
MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}
# model_type -> architecture, for configs that name no architecture
MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def model_class(arch: str) -> type:
    """The class of one registered architecture (KeyError if it is not registered)."""
    module, name = MODELS[arch]
    cls = getattr(importlib.import_module(f"fleetserve.replica.models.{module}"), name)
    assert isinstance(cls, type)
    return cls


def architecture_of(config: Any) -> str:
    """The registered architecture a config names (its `architectures`, else its model_type);
    ValueError, naming what is supported, if none."""
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in MODELS:
            return str(arch)
    model_type = getattr(config, "model_type", None)
    if not archs and model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    raise ValueError(f"unsupported model architecture {archs or model_type!r}; supported: {', '.join(sorted(MODELS))}")


def get_model_class(config: Any) -> type:
    """The model class for an HF config; ValueError if none of ours fits."""
    return model_class(architecture_of(config))


__all__ = ["MODELS", "MODEL_TYPES", "architecture_of", "get_model_class", "model_class"]
