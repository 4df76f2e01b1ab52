"""A PEFT LoRA adapter folder -> the (A, B, scaling) of each projection, sharded into the
model's tensor-parallel linears.

PEFT saves `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` ([r, in]) and
`...lora_B.weight` ([out, r]); the adapted projection is W x + s B A x with
s = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). Our q/k/v and gate/up are merged
linears, so an adapter's q, k and v become slices of the qkv output; each rank keeps the
rows of B its shard of the output holds (column-parallel), or the columns of A its shard
of the input holds (row-parallel: the partial deltas add up in the layer's all-reduce).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from torch import nn

from fleetserve.replica.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear
from fleetserve.replica.lora.paths import WEIGHT_FILES, LoRAFileError
from fleetserve.replica.lora.request import SUPPORTED_TARGETS, read_adapter_config

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")

# target -> (our module's attribute path in a decoder layer, shard id)
_MODULES = {
    "q_proj": ("self_attn.qkv_proj", "q"),
    "k_proj": ("self_attn.qkv_proj", "k"),
    "v_proj": ("self_attn.qkv_proj", "v"),
    "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", None),
}


@dataclass
class LoRAWeights:
    """One adapter, full size (unsharded): (layer, target) -> (A [r, in], B [out, r], scaling)."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]] = field(default_factory=dict)

    @property
    def targets(self) -> list[str]:
        return sorted({t for _, t in self.weights}, key=SUPPORTED_TARGETS.index)


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    """The weights file's tensors; LoRAFileError when there is none or it cannot be read."""
    st, pt = (os.path.join(path, f) for f in WEIGHT_FILES)
    try:
        if os.path.exists(st):
            from safetensors.torch import load_file

            return load_file(st)
        if os.path.exists(pt):
            return torch.load(pt, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - unreadable or not a tensor file: the path's problem
        raise LoRAFileError(f"LoRA adapter {path!r}: its weights cannot be read: {type(e).__name__}: {e}") from None
    raise LoRAFileError(f"LoRA adapter {path!r}: no adapter_model.safetensors (or adapter_model.bin)")


def load_lora(name: str, path: str, hf_config, max_lora_rank: int) -> LoRAWeights:
    """Read and check an adapter for a model of `hf_config`: LoRAFileError (with the path,
    for the log) when its files cannot be read, ValueError naming the adapter and what is
    wrong otherwise (a module we cannot adapt, a rank above --max-lora-rank, a shape that is
    not this model's)."""
    label = f"LoRA adapter '{name}'"
    cfg = read_adapter_config(path, label)
    tensors = _read_tensors(path)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise ValueError(
                f"{label}: {key!r} is not a LoRA weight of an attention or MLP "
                f"projection (adaptable: {', '.join(SUPPORTED_TARGETS)})"
            )
        layer, target, ab = int(m.group(1)), m.group(2), m.group(3)
        if target not in _MODULES:
            adaptable = ", ".join(SUPPORTED_TARGETS)
            raise ValueError(f"{label}: module {target!r} cannot be adapted (adaptable: {adaptable})")
        pairs.setdefault((layer, target), {})[ab] = tensor
    if not pairs:
        raise ValueError(f"{label}: holds no LoRA weights")
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    shapes = {
        "q_proj": (hidden, hf_config.num_attention_heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (hf_config.num_attention_heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    out = LoRAWeights(name, path, 0)
    for (layer, target), ab in sorted(pairs.items()):
        where = f"{label}, layer {layer} {target}"
        if not 0 <= layer < hf_config.num_hidden_layers:
            raise ValueError(f"{where}: the model has {hf_config.num_hidden_layers} layers")
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: lora_{'B' if 'A' in ab else 'A'} is missing")
        a, b = ab["A"], ab["B"]
        r = a.shape[0]
        n_in, n_out = shapes[target]
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (r, n_in) or tuple(b.shape) != (n_out, r):
            raise ValueError(
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit this "
                f"model's projection ({n_in} -> {n_out}); is the adapter for another base model?"
            )
        if r > max_lora_rank:
            raise ValueError(f"{where}: rank {r} is above --max-lora-rank ({max_lora_rank}); raise it")
        alpha = float(cfg["lora_alpha"])
        scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        out.weights[(layer, target)] = (a.float(), b.float(), scaling)
        out.rank = max(out.rank, r)
    return out


@dataclass
class LoRASlot:
    """One adapter in one linear, this rank's part: y += (x A^T) B^T, A [R, in] with the ranks
    of the adapter's targets in this linear stacked (q, k and v of a qkv linear: R = their
    ranks together), B [out, R] block-diagonal and scaled (each target's rows of the output
    take its own columns; outputs it does not adapt are zero rows). One shrink and one expand
    matmul per adapter and linear, whatever it targets."""

    a: torch.Tensor  # [R, in (this rank's input)]
    b: torch.Tensor  # [out (this rank's output), R]


def decoder_linear(model: nn.Module, layer: int, attr: str) -> LinearBase:
    """Decoder layer `layer`'s linear `attr` ("self_attn.qkv_proj", ...) of a LlamaForCausalLM."""
    module = model.get_submodule(f"model.layers.{layer}.{attr}")
    if not isinstance(module, LinearBase):
        raise TypeError(f"model.layers.{layer}.{attr} is a {type(module).__name__}, not a linear")
    return module


def num_decoder_layers(model: nn.Module) -> int:
    layers = model.get_submodule("model.layers")
    assert isinstance(layers, nn.ModuleList), "a LlamaForCausalLM's decoder layers"
    return len(layers)


def _column_part(module: LinearBase, shard_id: Union[int, str], b: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """(offset, size, this rank's rows of B) of a column-parallel shard, as its shard_loader cuts it."""
    tp = module.tp
    if isinstance(shard_id, str):
        if not isinstance(module, QKVParallelLinear):
            raise TypeError(f"shard {shard_id!r} of a {type(module).__name__}")
        if shard_id == "q":
            offset, size, rank = 0, module.q_size, tp.rank
        else:
            offset = module.q_size + (module.kv_size if shard_id == "v" else 0)
            size, rank = module.kv_size, tp.rank // module.num_kv_head_replicas
        return offset, size, b.narrow(0, rank * size, size)
    if not isinstance(module, MergedColumnParallelLinear):
        raise TypeError(f"shard {shard_id} of a {type(module).__name__}")
    offset = sum(module.output_sizes[:shard_id]) // tp.world_size
    size = module.output_sizes[shard_id] // tp.world_size
    return offset, size, b.narrow(0, tp.rank * size, size)


# This rank's slot of an adapter in each linear it adapts: (layer, attribute path) -> slot.
Slots = dict[tuple[int, str], LoRASlot]


def shard(model: nn.Module, adapter: LoRAWeights, dtype: torch.dtype, device: torch.device) -> Slots:
    """This rank's slot in each linear of `model` (a LlamaForCausalLM) that `adapter` adapts, in
    `dtype` on `device`: the costly part of a load, which touches nothing the model's forward
    reads (a loader thread runs it on the CPU while steps run: no CUDA work there, which a
    graph captured meanwhile would trip on); `install` then hands the slots over."""
    out: Slots = {}
    grouped: dict[tuple[int, str], list[tuple[Union[int, str, None], torch.Tensor, torch.Tensor, float]]] = {}
    for (layer, target), (a, b, scaling) in adapter.weights.items():
        attr, shard_id = _MODULES[target]
        grouped.setdefault((layer, attr), []).append((shard_id, a, b, scaling))
    for (layer, attr), items in grouped.items():
        module = decoder_linear(model, layer, attr)
        a_parts: list[torch.Tensor] = []
        parts: list[tuple[int, int, int, int, torch.Tensor]] = []
        r0 = 0
        for shard_id, a, b, scaling in items:
            if shard_id is None:  # o_proj, down_proj
                size_in = module.input_size  # row-parallel: this rank's columns of A, all of B
                a = a.narrow(1, module.tp.rank * size_in, size_in)
                offset, size = 0, module.output_size
            else:
                offset, size, b = _column_part(module, shard_id, b)
            r = a.shape[0]
            a_parts.append(a)
            parts.append((offset, size, r0, r0 + r, b * scaling))
            r0 += r
        b_full = torch.zeros(module.weight.shape[0], r0)
        for offset, size, c0, c1, b in parts:
            b_full[offset : offset + size, c0:c1] = b
        out[(layer, attr)] = LoRASlot(
            torch.cat(a_parts).to(dtype=dtype, device=device).contiguous(),
            b_full.to(dtype=dtype, device=device).contiguous(),
        )
    return out


def install(model: nn.Module, lora_id: int, slots: Slots, device: Optional[torch.device] = None) -> None:
    """Give each linear its slot for `lora_id`, between two steps: references, after a copy of
    the slots to `device` when they are elsewhere (prepared on the CPU for a GPU model)."""
    for (layer, attr), slot in slots.items():
        if device is not None and slot.a.device != device:
            slot = LoRASlot(slot.a.to(device), slot.b.to(device))
        module = decoder_linear(model, layer, attr)
        if module.lora is None:
            module.lora = {}
        module.lora[lora_id] = slot


def attach(model: nn.Module, lora_id: int, adapter: LoRAWeights, dtype: torch.dtype, device: torch.device) -> None:
    """Give each adapted linear of `model` (a LlamaForCausalLM) this rank's slot for `lora_id`."""
    install(model, lora_id, shard(model, adapter, dtype, device))


def detach(model: nn.Module, lora_id: int) -> None:
    """Drop adapter `lora_id` from every linear of `model`."""
    for m in model.modules():
        if isinstance(m, LinearBase) and m.lora is not None:
            m.lora.pop(lora_id, None)
            if not m.lora:
                m.lora = None  # no adapter left: its forward skips the LoRA call again


__all__ = ["LoRASlot", "LoRAWeights", "Slots", "attach", "detach", "install", "load_lora", "shard"]
