"""Our weights as a `transformers` model / HF folder, for comparisons and baselines.

A GGUF checkpoint is dequantized exactly as `replica.model_loader.weights.load_model` does,
so HF transformers (and vLLM, which needs an HF folder) run the very same
weights as fleetserve: that is what makes token-for-token comparisons and
same-weights benchmarks meaningful.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, cast

import torch

from fleetserve.replica.model_loader.registry import ModelSource, resolve_model
from fleetserve.replica.model_loader.weights import (
    gguf_config,
    gguf_tensor_reader,
    iter_gguf_weights,
    iter_safetensors_weights,
    load_hf_config,
)

_EXPERT_NAME = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<piece>\w+)\.weight$")


def build_hf_model(source: ModelSource | str, dtype: torch.dtype = torch.float32):
    """A `transformers.AutoModelForCausalLM` holding the source's weights (eval mode)."""
    from transformers import AutoModelForCausalLM

    if isinstance(source, str):
        source = resolve_model(source)
    if source.kind == "hf":
        return AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype).eval()
    from fleetserve.replica.model_loader.gguf_reader import GGUFFile

    gguf_file = GGUFFile(source.path)
    try:
        config = gguf_config(gguf_file.metadata, set(gguf_file.tensors), source.path, gguf_tensor_reader(gguf_file))
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        state = {name: t.to(dtype) for name, t in iter_gguf_weights(source.path, gguf_file, config)}
    finally:
        gguf_file.close()
    if config.tie_word_embeddings:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    if any(name.endswith(".experts.gate_up_proj") for name in model.state_dict()):
        state = _fused_experts(state, config)
    model.load_state_dict(state, strict=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def _fused_experts(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Per-expert weights (`...experts.E.<piece>.weight`, as `iter_gguf_weights` names them)
    stacked as transformers 5's MoE modules hold them: `experts.gate_up_proj` [E, 2I, H] (gate
    rows, then up rows) and `experts.down_proj` [E, H, I]."""
    from fleetserve.replica.layers.moe import DOWN, GATE, UP
    from fleetserve.replica.models import get_model_class

    pieces: dict[str, int] = cast(Any, get_model_class(config)).expert_pieces
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[int, torch.Tensor]]] = {}
    for name, t in state.items():
        m = _EXPERT_NAME.match(name)
        if m is None or m["piece"] not in pieces:
            out[name] = t
            continue
        experts.setdefault(m["prefix"], {}).setdefault(int(m["expert"]), {})[pieces[m["piece"]]] = t
    for prefix, per_expert in experts.items():
        order = [per_expert[e] for e in sorted(per_expert)]
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([w[GATE], w[UP]]) for w in order])
        out[f"{prefix}.down_proj"] = torch.stack([w[DOWN] for w in order])
    return out


def export_hf_folder(model: str, out: Path) -> Path:
    """Write `model` (a registry name, GGUF or HF folder) as an fp32 HF folder once."""
    out = Path(out)
    if (out / "config.json").exists():
        return out
    from fleetserve.replica.engine.tokenizer import load_tokenizer

    source = resolve_model(model)
    hf = build_hf_model(source, torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out)
    load_tokenizer(source).save_pretrained(out)
    return out


__all__ = ["build_hf_model", "export_hf_folder", "iter_safetensors_weights", "load_hf_config"]
