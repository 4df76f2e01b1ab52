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
* Mixture of experts: ``llama`` with ``llama.expert_count`` > 0 is Mixtral (Q/K permuted as
  Llama's), ``qwen3moe`` Qwen3-MoE (experts in every layer, as llama.cpp's graph has them;
  top-k weights renormalised unless ``expert_weights_norm`` says otherwise, as llama.cpp and
  transformers' GGUF loader do). ``ffn_gate_inp`` is the router; the experts are read from
  llama.cpp's merged ``ffn_{gate,up,down}_exps`` [E, ...] tensors or its older per-expert
  ``ffn_{gate,up,down}.E`` ones, and handed out per expert (views of one tensor, no copies)
  under the names the family's model class loads.
* ``gemma3``: llama.cpp's converter stores every RMSNorm weight as 1 + w (``*norm.weight``);
  the 1 is taken off again for our (1 + w) norms, as transformers' GGUF loader does. Its
  ``ffn_norm`` is the pre-feedforward norm, ``post_attention_norm`` / ``post_ffw_norm`` the
  post norms. The converter writes the window but not the layer pattern, the local rope base or
  query_pre_attn_scalar; those are llama.cpp's: every 6th layer global, base 10000 (keys
  ``attention.sliding_window_pattern`` / ``rope.freq_base_swa`` are read where present), the
  scale 1 / sqrt(head_dim), or 1 / sqrt(hidden / heads) for the 62-layer 27B.

Every problem with the files (corrupt, truncated, missing tensors, wrong
shapes) raises ValueError naming the file.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any, Callable, Iterator, cast

import numpy as np
import torch

from fleetserve.replica.distributed.parallel import TPGroup, get_tp_group
from fleetserve.replica.layers.moe import DOWN, GATE, UP
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
    "ffn_gate_inp": "mlp.gate",  # the MoE router (Mixtral, Qwen3-MoE)
}
# Where an architecture's tensor differs from _GGUF_LAYER_NAMES: llama.cpp's Phi-3 keeps the
# checkpoint's fused gate|up in ffn_up (no ffn_gate).
# llama.cpp's Gemma 3 has four norms per layer.
_GGUF_ARCH_LAYER_NAMES: dict[str, dict[str, str]] = {
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
    "gemma3": {
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
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
    "gemma3": "Gemma3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
# GGUF architecture -> transformers model_type, where they differ (and `llama` with experts: mixtral)
_GGUF_MODEL_TYPES = {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# llama.cpp's experts: merged [E, out, in] (`ffn_gate_exps`) or, in older files, one per expert
_EXPERTS_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")
_EXPERT_SHARDS = {"gate": GATE, "up": UP, "down": DOWN}


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

    model_type, kwargs = _gguf_config_fields(meta, tensor_names, path, read_tensor)
    if model_type == "qwen2":
        kwargs.pop("head_dim")
    return AutoConfig.for_model(model_type, **kwargs)


def gguf_model_config(
    meta: dict[str, Any], tensor_names: set[str], path: Path, read_tensor: TensorReader | None = None
) -> ModelConfig:
    """The engine's config (model_config.ModelConfig) from GGUF metadata (and, for Phi-3's
    LongRoPE, the rope factor tensors through `read_tensor`)."""
    model_type, kwargs = _gguf_config_fields(meta, tensor_names, path, read_tensor)
    return ModelConfig.from_dict({"model_type": model_type, **kwargs})


def _gguf_config_fields(
    meta: dict[str, Any], tensor_names: set[str], path: Path, read_tensor: TensorReader | None = None
) -> tuple[str, dict[str, Any]]:
    """(transformers model_type, config fields) of a GGUF file's metadata and tensor names."""
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
    model_type, architecture = _GGUF_MODEL_TYPES.get(arch, arch), _GGUF_ARCHITECTURES[arch]
    if arch == "phi3":
        head_dim, extra = _gguf_phi3_rope(get, hidden // heads, rope, tensor_names, path, read_tensor)
    elif arch in ("qwen3", "qwen3moe"):  # GGUF has no key for it: the tensors are there or not
        extra["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    if arch == "qwen3moe":
        extra.update(_gguf_qwen3moe_fields(get, tensor_names, path))
    elif arch == "llama" and int(get("expert_count", 0) or 0) > 0:
        model_type, architecture = "mixtral", "MixtralForCausalLM"
        extra.update(
            num_local_experts=int(get("expert_count")),
            num_experts_per_tok=int(get("expert_used_count", required=True)),
            sliding_window=None,
        )
    elif arch == "gemma3":
        extra.update(_gguf_gemma3_fields(get, int(head_dim), hidden, heads, rope))
        rope = extra.pop("rope_parameters")
    kwargs = dict(
        architectures=[architecture],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length", required=True)),  # Mixtral's: each expert's
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
    return model_type, kwargs


def _gguf_qwen3moe_fields(get: Callable[..., Any], tensor_names: set[str], path: Path) -> dict[str, Any]:
    """Qwen3-MoE's expert fields. llama.cpp's qwen3moe has experts in every layer (no
    decoder_sparse_step / mlp_only_layers in GGUF; its tensor list has no dense ffn_gate), so a
    file with a dense layer is refused. llama.cpp always renormalises the top-k weights, which is
    norm_topk_prob=True (transformers' GGUF loader sets that too); `expert_weights_norm`, where
    written, decides."""
    dense = sorted(n for n in tensor_names if re.match(r"^blk\.\d+\.ffn_(gate|up|down)\.weight$", n))
    if dense:
        raise ValueError(
            f"{path}: qwen3moe GGUF with dense MLP layers ({dense[0]}, ...) is not supported: llama.cpp's "
            "qwen3moe has experts in every layer (decoder_sparse_step 1, no mlp_only_layers)"
        )
    norm = get("expert_weights_norm")
    return dict(
        num_experts=int(get("expert_count", required=True)),
        num_experts_per_tok=int(get("expert_used_count", required=True)),
        moe_intermediate_size=int(get("expert_feed_forward_length", required=True)),
        norm_topk_prob=True if norm is None else bool(norm),
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


def _gguf_gemma3_fields(
    get: Callable[..., Any], head_dim: int, hidden: int, heads: int, rope: dict[str, Any]
) -> dict[str, Any]:
    """Gemma 3's attention fields as llama.cpp reads its GGUF (llama-model.cpp, LLM_ARCH_GEMMA3):
    with a sliding window, every 6th layer global (or `attention.sliding_window_pattern`: a
    period, or one bool per layer, true for sliding) and the sliding layers' rope base 10000
    (or `rope.freq_base_swa`), unscaled; no window: every layer global. The attention scale is
    1 / sqrt(head_dim), for the 62-layer 27B 1 / sqrt(hidden / heads) (transformers' GGUF loader
    leaves query_pre_attn_scalar at its default 256 instead). Soft-caps where the keys are
    written (Gemma 3's converter writes neither)."""
    layers = int(get("block_count", required=True))
    window = int(get("attention.sliding_window", 0) or 0)
    pattern = get("attention.sliding_window_pattern", 6)
    if not window:
        layer_types = ["full_attention"] * layers
    elif isinstance(pattern, (list, tuple)):
        if len(pattern) != layers:
            raise ValueError(f"attention.sliding_window_pattern has {len(pattern)} entries for {layers} layers")
        layer_types = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        layer_types = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(layers)]
    local = float(get("rope.freq_base_swa", 10000.0))
    fields: dict[str, Any] = dict(
        layer_types=layer_types,
        sliding_window=window or None,
        rope_local_base_freq=local,
        rope_parameters={"full_attention": rope, "sliding_attention": {"rope_type": "default", "rope_theta": local}},
        query_pre_attn_scalar=hidden // heads if layers == 62 else head_dim,
    )
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if get(key):
            fields[key] = float(get(key))
    return fields


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
    """(hf_name, float32 tensor) for every tensor we use, dequantized and un-permuted; experts
    one per name, `model.layers.N.mlp.experts.E.<piece>.weight` with the pieces of the
    config's model class (Mixtral w1/w3/w2, Qwen3-MoE gate_proj/up_proj/down_proj), as views of
    the merged tensor."""
    arch = gguf_file.metadata.get("general.architecture")
    # As transformers does: only llama.cpp's llama converter permutes (not qwen2/qwen3/phi3's).
    unpermute = arch == "llama"
    pieces: dict[int, str] = {}
    if getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None):
        pieces = {shard: piece for piece, shard in cast(Any, get_model_class(config)).expert_pieces.items()}
    for name, info in gguf_file.tensors.items():
        merged, single = _EXPERTS_RE.match(name), _EXPERT_RE.match(name)
        expert = merged or single
        if expert and pieces:
            layer, piece = expert.group(1), pieces[_EXPERT_SHARDS[expert.group(2)]]
            w = _gguf_tensor(path, gguf_file, name, info)
            prefix = f"model.layers.{layer}.mlp.experts"
            if single:
                yield f"{prefix}.{single.group(3)}.{piece}.weight", w
            else:
                for e in range(w.shape[0]):
                    yield f"{prefix}.{e}.{piece}.weight", w[e]
            continue
        hf_name = gguf_to_hf_name(name, arch)
        if hf_name is None:
            continue
        shift = -1.0 if arch == "gemma3" and name.endswith("norm.weight") else 0.0  # stored as 1 + w
        head_count = 0
        if unpermute and ".self_attn.q_proj." in hf_name:
            head_count = config.num_attention_heads
        elif unpermute and ".self_attn.k_proj." in hf_name:
            head_count = config.num_key_value_heads
        yield hf_name, _gguf_tensor(path, gguf_file, name, info, head_count, shift)


def _gguf_tensor(
    path: Path, gguf_file: Any, name: str, info: Any, unpermute_heads: int = 0, shift: float = 0.0
) -> torch.Tensor:
    """One GGUF tensor as a writable float32 torch tensor of its HF shape: dequantized, its
    llama.cpp Q/K permute undone over `unpermute_heads` heads (0: none), `shift` added."""
    try:
        w = dequantize_gguf(gguf_file.raw(name), info.ggml_type)
    except (ValueError, NotImplementedError) as e:
        raise ValueError(f"{path}: cannot dequantize {name} ({info.ggml_type.name}): {e}") from e
    w = np.asarray(w).reshape(info.shape)
    if unpermute_heads:
        w = reverse_llama_cpp_permute(w, unpermute_heads)
    if shift:
        w = np.add(w, np.float32(shift), dtype=np.float32)
    w = np.ascontiguousarray(w, dtype=np.float32)
    if not w.flags.writeable:  # an F32 tensor is a view of the read-only file mapping
        w = w.copy()
    return torch.from_numpy(w)


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
