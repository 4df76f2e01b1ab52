"""Weight loading (HF folders and GGUF files) and KV cache allocation.

    load_model(source, dtype, device) -> (model, hf_config)

* ``kind == "hf"``: config.json through `transformers.AutoConfig`, tensors from
  every ``*.safetensors`` file in the folder.
* ``kind == "gguf"``: metadata and tensors from the file (`replica.model_loader.gguf_reader`),
  each tensor dequantized with `gguf.quants.dequantize`, renamed to its HF name,
  and -- for the ``llama`` architecture -- Q/K rows un-permuted: llama.cpp's
  converter reorders each head's rows from HF's rotate-half layout
  ([first halves..., second halves...]) to interleaved pairs, and its
  ``permute`` is undone exactly as transformers' ``LlamaTensorProcessor`` does.
  A `LlamaConfig` is built from the GGUF metadata (no ``output.weight`` means
  tied embeddings). ``qwen3`` (attn_q_norm / attn_k_norm) and ``phi3`` (fused
  attn_qkv, gate|up fused in ffn_up, LongRoPE factors as rope_factors_* tensors)
  are not permuted by llama.cpp, so they are read as stored.

Every problem with the files (corrupt, truncated, missing tensors, wrong
shapes) raises ValueError naming the file.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from fleetserve.replica.distributed.parallel import TPGroup, get_tp_group
from fleetserve.replica.model_loader.model_config import ModelConfig, read_model_config
from fleetserve.replica.model_loader.registry import ModelSource
from fleetserve.replica.models import get_model_class

# GGUF per-layer name -> HF per-layer name
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3's per-head norms
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3's fused q|k|v
}
# Where an architecture's tensor differs from _GGUF_LAYER_NAMES: llama.cpp's Phi-3 keeps the
# checkpoint's fused gate|up in ffn_up (no ffn_gate).
_GGUF_ARCH_LAYER_NAMES: dict[str, dict[str, str]] = {"phi3": {"ffn_up": "mlp.gate_up_proj"}}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (for GGUF architecture
    `arch`); None for tensors we do not use (Phi-3's rope factors are read as config)."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    m = _LAYER_RE.match(name)
    if m:
        ours = _GGUF_ARCH_LAYER_NAMES.get(arch, {}).get(m.group(2)) or _GGUF_LAYER_NAMES.get(m.group(2))
        if ours:
            return f"model.layers.{m.group(1)}.{ours}.{m.group(3)}"
    return None


def reverse_llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of Q/K (weights [n_head*d, in] or biases [n_head*d])."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


# --------------------------------------------------------------------------- configs


# A GGUF tensor's float32 values by name (Phi-3's LongRoPE factors are tensors).
TensorReader = Callable[[str], np.ndarray]


def gguf_tensor_reader(gguf_file: Any) -> TensorReader:
    """Values of `gguf_file`'s tensors, dequantized."""
    return lambda name: np.asarray(dequantize_gguf(gguf_file.raw(name), gguf_file.tensors[name].ggml_type))


def gguf_config(meta: dict[str, Any], tensor_names: set[str], path: Path, read_tensor: TensorReader | None = None):
    """A transformers config (`LlamaConfig`, `Qwen3Config`, `Phi3Config`, ...) from GGUF metadata
    (for HF's own model: hf_export; the engine reads `gguf_model_config`)."""
    from transformers import AutoConfig

    arch, kwargs = _gguf_config_fields(meta, tensor_names, path, read_tensor)
    if arch == "qwen2":
        kwargs.pop("head_dim")
    return AutoConfig.for_model(arch, **kwargs)


def gguf_model_config(
    meta: dict[str, Any], tensor_names: set[str], path: Path, read_tensor: TensorReader | None = None
) -> ModelConfig:
    """The engine's config (model_config.ModelConfig) from GGUF metadata (and, for Phi-3's
    LongRoPE, the rope factor tensors through `read_tensor`)."""
    arch, kwargs = _gguf_config_fields(meta, tensor_names, path, read_tensor)
    return ModelConfig.from_dict({"model_type": arch, **kwargs})


def _gguf_config_fields(
    meta: dict[str, Any], tensor_names: set[str], path: Path, read_tensor: TensorReader | None = None
) -> tuple[str, dict[str, Any]]:
    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {sorted(_GGUF_ARCHITECTURES)}")
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(f"{path}: per-frequency rope factors (rope_freqs.weight, Llama 3.1 style) are not supported")

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        full = f"{arch}.{key}"
        if required and full not in meta:
            raise ValueError(f"{path}: GGUF metadata lacks {full!r}")
        return meta.get(full, default)

    hidden = int(get("embedding_length", required=True))
    heads = int(get("attention.head_count", required=True))
    vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ())) or None
    if vocab is None:
        raise ValueError(f"{path}: cannot tell the vocabulary size (no vocab_size nor tokenizer tokens)")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))}
    scaling = get("rope.scaling.type")
    if scaling and scaling != "none":
        rope["rope_type"] = scaling
        rope["factor"] = float(get("rope.scaling.factor", 1.0))
        if get("rope.scaling.original_context_length"):
            rope["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
    head_dim = get("attention.key_length") or get("rope.dimension_count") or hidden // heads
    extra: dict[str, Any] = {}
    if arch == "phi3":
        head_dim, extra = _gguf_phi3_rope(get, hidden // heads, rope, tensor_names, path, read_tensor)
    elif arch == "qwen3":  # GGUF has no key for it: the tensors are there or not
        extra["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    kwargs = dict(
        architectures=[_GGUF_ARCHITECTURES[arch]],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length", required=True)),
        num_hidden_layers=int(get("block_count", required=True)),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(head_dim),
        max_position_embeddings=int(get("context_length", 2048)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters=rope,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        **extra,
    )
    return arch, kwargs


def _gguf_phi3_rope(
    get: Callable[..., Any],
    head_dim: int,
    rope: dict[str, Any],
    tensor_names: set[str],
    path: Path,
    read_tensor: TensorReader | None,
) -> tuple[int, dict[str, Any]]:
    """Phi-3 as llama.cpp's converter writes it: heads of hidden / heads (no key_length), the
    rotary part as rope.dimension_count (partial rotary when smaller), LongRoPE as the
    rope_factors_short / rope_factors_long tensors with rope.scaling.original_context_length.
    `rope` gets the rope parameters; returns (head_dim, extra config fields). The attention
    factor is derived from context_length / original as transformers does (llama.cpp's
    rope.scaling.attn_factor is that same number, rounded to float32)."""
    extra: dict[str, Any] = {}
    rotary = get("rope.dimension_count")
    if rotary and int(rotary) != head_dim:
        rope["partial_rotary_factor"] = int(rotary) / head_dim
    original = get("rope.scaling.original_context_length")
    if original:
        extra["original_max_position_embeddings"] = int(original)
    factors = {"short_factor": "rope_factors_short.weight", "long_factor": "rope_factors_long.weight"}
    present = [name for name in factors.values() if name in tensor_names]
    if present:
        if len(present) != 2 or not original or read_tensor is None:
            raise ValueError(
                f"{path}: LongRoPE needs both rope_factors_short and rope_factors_long tensors and "
                "rope.scaling.original_context_length"
            )
        rope["rope_type"] = "longrope"
        for key, name in factors.items():
            rope[key] = [float(x) for x in read_tensor(name).reshape(-1)]
    return head_dim, extra


# --------------------------------------------------------------------------- tensor iterators


# Block layouts (bytes) of the llama.cpp types dequantized here in torch: fp16 scale d, for
# Q4_1 an fp16 minimum m, then the quants. Each value is computed with gguf.quants' operations
# in its order (float32, no fused multiply-add), so the results are the same bits, and several
# times faster than gguf's numpy code, 16 rows at a time (figures: docs/deployment/cpu.md, "Figures behind the code").
_TORCH_QUANTS = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def dequantize_gguf(raw: np.ndarray, ggml_type: Any) -> np.ndarray:
    """float32 values of a stored GGUF tensor (`GGUFFile.raw`), flattened per row as gguf.quants
    returns them; types other than Q4_0 / Q4_1 / Q8_0 go through gguf.quants."""
    block_bytes = _TORCH_QUANTS.get(getattr(ggml_type, "name", ""))
    if block_bytes is None or raw.shape[-1] % block_bytes:
        from gguf.quants import dequantize

        return dequantize(raw, ggml_type)
    # A copy: `raw` is a read-only view of the file mapping (the quantized bytes are small).
    blocks = torch.from_numpy(np.array(raw, copy=True)).view(-1, block_bytes)
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()
    if ggml_type.name == "Q8_0":
        w = blocks[:, 2:].contiguous().view(torch.int8).float() * d
    else:
        qs = blocks[:, 4:] if ggml_type.name == "Q4_1" else blocks[:, 2:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=1)
        if ggml_type.name == "Q4_1":
            m = blocks[:, 2:4].contiguous().view(torch.float16).float()
            w = d * q.float() + m
        else:
            w = d * (q.to(torch.int8) - 8).float()
    return w.numpy().reshape(*raw.shape[:-1], raw.shape[-1] // block_bytes * 32)


def iter_gguf_weights(path: Path, gguf_file: Any, config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, float32 tensor) for every tensor we use, dequantized and un-permuted."""
    arch = gguf_file.metadata.get("general.architecture")
    # As transformers does: only llama.cpp's llama converter permutes (not qwen2/qwen3/phi3's).
    unpermute = arch == "llama"
    for name, info in gguf_file.tensors.items():
        hf_name = gguf_to_hf_name(name, arch)
        if hf_name is None:
            continue
        try:
            w = dequantize_gguf(gguf_file.raw(name), info.ggml_type)
        except (ValueError, NotImplementedError) as e:
            raise ValueError(f"{path}: cannot dequantize {name} ({info.ggml_type.name}): {e}") from e
        w = np.asarray(w).reshape(info.shape)
        if unpermute and ".self_attn.q_proj." in hf_name:
            w = reverse_llama_cpp_permute(w, config.num_attention_heads)
        elif unpermute and ".self_attn.k_proj." in hf_name:
            w = reverse_llama_cpp_permute(w, config.num_key_value_heads)
        w = np.ascontiguousarray(w, dtype=np.float32)
        if not w.flags.writeable:  # an F32 tensor is a view of the read-only file mapping
            w = w.copy()
        yield hf_name, torch.from_numpy(w)


def iter_safetensors_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no *.safetensors files (only safetensors checkpoints are supported)")
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    yield key, st.get_tensor(key)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ValueError(f"corrupt or unreadable weight file {f}: {e}") from e


# --------------------------------------------------------------------------- loading


def load_hf_config(folder: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder))
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{folder}/config.json: cannot read the model config: {e}") from e


def load_model(
    source: ModelSource,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    tp_group: TPGroup | None = None,
    max_model_len: int | None = None,
    enable_expert_parallel: bool = False,
):
    """Build our model for `source` on `device` in `dtype` and load this rank's weight shards.

    Returns (model in eval mode, hf_config). `max_model_len` extends the rotary
    table past the config's max_position_embeddings if a longer length is served.
    `enable_expert_parallel`: whole experts per rank (replica.layers.moe); ValueError for a
    model class without experts (one whose `supports_expert_parallel` is not set).
    """
    tp = tp_group or get_tp_group()
    t0 = time.perf_counter()
    gguf_file = None
    if source.kind == "hf":
        config = read_model_config(source.path)
    elif source.kind == "gguf":
        from fleetserve.replica.model_loader.gguf_reader import GGUFFile

        gguf_file = GGUFFile(source.path)
        config = gguf_model_config(
            gguf_file.metadata, set(gguf_file.tensors), source.path, gguf_tensor_reader(gguf_file)
        )
    else:
        raise ValueError(f"unknown model source kind {source.kind!r}")
    model_cls = get_model_class(config)
    extra: dict[str, Any] = {}
    if enable_expert_parallel:
        if not getattr(model_cls, "supports_expert_parallel", False):
            raise ValueError(
                f"--enable-expert-parallel: {model_cls.__name__} is not a mixture-of-experts model "
                "(supported: Mixtral, Qwen3-MoE); leave the flag off for a dense model"
            )
        extra["enable_expert_parallel"] = True
    device = torch.device(device)
    prev_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(config, tp_group=tp, max_position=max_model_len, **extra)
    finally:
        torch.set_default_dtype(prev_dtype)
    try:
        if gguf_file is not None:
            model.load_weights(iter_gguf_weights(source.path, gguf_file, config), source=str(source.path))
        else:
            model.load_weights(iter_safetensors_weights(source.path), source=str(source.path))
    finally:
        if gguf_file is not None:
            gguf_file.close()
    model.eval()
    from fleetserve.replica.layers import pack_linear_weights

    pack_linear_weights(model)  # CPU: oneDNN-blocked copies of the weights (see PackedWeightMixin)
    model.load_seconds = time.perf_counter() - t0
    return model, config


# --------------------------------------------------------------------------- KV cache


def kv_cache_shape(hf_config: Any, num_blocks: int, block_size: int, tp_size: int = 1) -> tuple[int, ...]:
    """One layer's cache: [2 (K, V), local kv heads, num_blocks, block_size, head_dim] (see replica.attention)."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    local_kv_heads = max(1, kv_heads // tp_size)
    return (2, local_kv_heads, num_blocks, block_size, head_dim)


def kv_cache_bytes_per_block(hf_config: Any, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes one block takes on one rank, summed over all layers (K and V)."""
    per_layer = int(np.prod(kv_cache_shape(hf_config, 1, block_size, tp_size)))
    return per_layer * hf_config.num_hidden_layers * torch.empty((), dtype=dtype).element_size()


def allocate_kv_caches(
    hf_config: Any,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    tp_size: int = 1,
) -> list[torch.Tensor]:
    """One zeroed cache tensor per layer (zeros: masked-out slots must not hold NaN, since 0 * NaN = NaN).

    On CPU with the fused kernels, each is backed by transparent huge pages when the OS allows
    (blocks are read scattered across the whole cache: fewer TLB misses). The zeroing also
    faults every page in now, at start-up, on purpose: faulted in lazily (a fresh anonymous
    map, pages faulted in when a block is first written), each first-written huge page cost
    its fault inside a step, and long prompts ran slower and noisier (figures:
    docs/deployment/cpu.md, "Figures behind the code").
    """
    from fleetserve.replica.kernels import ops_for

    shape = kv_cache_shape(hf_config, num_blocks, block_size, tp_size)
    caches = []
    for _ in range(hf_config.num_hidden_layers):
        cache = torch.empty(shape, dtype=dtype, device=device)
        ops = ops_for(cache)
        if ops is not None:
            ops.advise_hugepages(cache)  # before the first touch (zero_ below)
        caches.append(cache.zero_())
    return caches
