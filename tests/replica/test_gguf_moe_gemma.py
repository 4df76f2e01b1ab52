"""GGUF files of Gemma 3 (text), Mixtral and Qwen3-MoE, as llama.cpp's converter lays them out,
against transformers' models on the HF folders they were written from (fp32).

The writer (`_write_gguf`) follows convert_hf_to_gguf.py as far as the gguf package shows it
(its MODEL_TENSORS / tensor name map; the converter itself is not installed): Mixtral under the
`llama` architecture with Q/K permuted and the experts merged into `ffn_{gate,up,down}_exps`
[E, ...] (or, as older files have them, one `ffn_{gate,up,down}.E` per expert); Qwen3-MoE as
`qwen3moe` with key_length and expert_feed_forward_length; Gemma 3 as `gemma3` with 1 added to
every norm weight, the window but no pattern, local rope base nor query_pre_attn_scalar (so
the tiny model uses llama.cpp's values for those: every 6th layer global, base 10000, the
scalar = head_dim), and no vocab_size key (the token list's length). Each file is loaded by
`load_model` and by hf_export; both must give HF's logits within 1e-4.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fleetserve.replica.layers.attention import AttentionMetadata
from fleetserve.replica.model_loader.registry import resolve_model
from fleetserve.replica.model_loader.weights import allocate_kv_caches, gguf_model_config, load_model

gguf = pytest.importorskip("gguf")

ATOL = 1e-4
BLOCK = 4
SMALL = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _config(name: str):
    import transformers

    if name == "mixtral":
        return transformers.MixtralConfig(
            **SMALL, num_hidden_layers=2, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2
        )
    if name == "qwen3_moe":  # llama.cpp renormalises the top k: norm_topk_prob
        return transformers.Qwen3MoeConfig(
            **SMALL,
            num_hidden_layers=2,
            head_dim=16,
            intermediate_size=40,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        )
    # Gemma 3 with llama.cpp's implied values: 6 layers (5 sliding, 1 global), local base 1e4,
    # query_pre_attn_scalar = head_dim; the global table linearly scaled.
    return transformers.Gemma3TextConfig(
        **SMALL,
        num_hidden_layers=6,
        intermediate_size=48,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=4,
        sliding_window_pattern=6,
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )


NAMES = ("gemma3", "mixtral", "qwen3_moe")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (HF folder, HF model)."""
    from transformers import AutoModelForCausalLM

    from fleetserve.replica.testing import make_tiny_model

    root = tmp_path_factory.mktemp("gguf_moe_gemma")
    out = {}
    for i, name in enumerate(NAMES):
        folder = make_tiny_model(root / name, _config(name), norm_center=0.0 if name == "gemma3" else 1.0, seed=i)
        out[name] = folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return out


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (rotate-half rows to interleaved pairs, per head)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path: Path, model_dir: Path, per_expert: bool = False) -> Path:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    archs = {
        "mixtral": gguf.MODEL_ARCH.LLAMA,
        "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
        "gemma3_text": gguf.MODEL_ARCH.GEMMA3,
    }
    arch = archs[cfg.model_type]
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if cfg.model_type == "gemma3_text":
        rope = cfg.rope_parameters["full_attention"]
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(cfg.sliding_window)
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_token_list([f"<t{i}>" for i in range(cfg.vocab_size)])  # no vocab_size key
    else:
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        w.add_vocab_size(cfg.vocab_size)
        w.add_expert_count(getattr(cfg, "num_local_experts", None) or cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if cfg.model_type == "qwen3_moe":
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        else:
            w.add_rope_dimension_count(head_dim)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    # HF piece -> GGUF ffn_{gate,up,down}
    pieces = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for hf_name, t in load_file(str(model_dir / "model.safetensors")).items():
        a = t.float().numpy()
        parts = hf_name.split(".")
        if ".experts." in hf_name:  # model.layers.L.<mlp>.experts.E.<piece>.weight
            layer, expert, piece = int(parts[2]), int(parts[5]), pieces[parts[6]]
            if per_expert:
                w.add_tensor(f"blk.{layer}.ffn_{piece}.{expert}.weight", a)
            else:
                experts.setdefault((layer, piece), {})[expert] = a
            continue
        if cfg.model_type == "mixtral" and hf_name.endswith("q_proj.weight"):
            a = _permute(a, cfg.num_attention_heads)
        elif cfg.model_type == "mixtral" and hf_name.endswith("k_proj.weight"):
            a = _permute(a, cfg.num_key_value_heads)
        if cfg.model_type == "gemma3_text" and hf_name.endswith("norm.weight"):
            a = a + 1  # Gemma3Model.norm_shift
        w.add_tensor(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), a)
    for (layer, piece), per in sorted(experts.items()):
        w.add_tensor(f"blk.{layer}.ffn_{piece}_exps.weight", np.stack([per[e] for e in sorted(per)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize(
    "name,per_expert", [("gemma3", False), ("mixtral", False), ("mixtral", True), ("qwen3_moe", False)]
)
def test_gguf_round_trip_matches_hf(name, per_expert, models, tmp_path):
    """The config our loader reads from the file equals the folder's where GGUF has it, and the
    logits of load_model's model (paged cache, shuffled blocks) and of hf_export's equal HF's."""
    from fleetserve.replica.model_loader.hf_export import build_hf_model

    folder, hf = models[name]
    path = _write_gguf(tmp_path / f"{name}.gguf", folder, per_expert)
    source = resolve_model(str(path))
    model, cfg = load_model(source, torch.float32, "cpu")
    from_folder = load_model(resolve_model(str(folder)), torch.float32, "cpu")[1]
    keys = ["architectures", "model_type", "head_dim", "num_key_value_heads", "rope_parameters", "vocab_size"]
    keys += {
        "gemma3": ["layer_types", "sliding_window", "query_pre_attn_scalar", "tie_word_embeddings"],
        "mixtral": ["num_local_experts", "num_experts_per_tok", "intermediate_size"],
        "qwen3_moe": ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"],
    }[name]
    for key in keys:
        assert getattr(cfg, key) == getattr(from_folder, key), key
    ids = _prompt(14, 5, cfg.vocab_size)  # longer than Gemma's window of 4
    caches = allocate_kv_caches(cfg, 8, BLOCK, torch.float32)
    md = AttentionMetadata.build([14], [0], [[3, 1, 6, 2]], BLOCK)
    with torch.no_grad():
        ours = model.compute_logits(model(torch.tensor(ids), md.positions, caches, md))
        ref = hf(torch.tensor([ids])).logits[0]
        exported = build_hf_model(source)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(exported, ref, atol=ATOL, rtol=0)


# --------------------------------------------------------------------------- metadata only


def _meta(arch: str, **extra) -> dict:
    base = {
        "general.architecture": arch,
        f"{arch}.embedding_length": 64,
        f"{arch}.attention.head_count": 4,
        f"{arch}.feed_forward_length": 96,
        f"{arch}.block_count": 2,
        f"{arch}.vocab_size": 100,
    }
    return {**base, **{f"{arch}.{k}": v for k, v in extra.items()}}


def test_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'gemma2'; supported: .*gemma3.*qwen3moe"):
        gguf_model_config(_meta("gemma2"), set(), Path("x.gguf"))


def test_qwen3moe_with_dense_layers_is_refused():
    meta = _meta("qwen3moe", expert_count=4, expert_used_count=2, expert_feed_forward_length=16)
    with pytest.raises(ValueError, match="experts in every layer"):
        gguf_model_config(meta, {"blk.0.ffn_gate.weight", "blk.1.ffn_gate_exps.weight"}, Path("x.gguf"))


def test_gemma3_llama_cpp_defaults():
    """What llama.cpp assumes where Gemma 3's GGUF is silent: the 27B (62 layers) scales by
    hidden / heads, the others by head_dim; no window means every layer global; a bool
    sliding_window_pattern sets each layer's kind."""
    meta = _meta("gemma3", block_count=62, embedding_length=5376, **{"attention.head_count": 32})
    meta["gemma3.attention.key_length"] = 128
    meta["gemma3.attention.sliding_window"] = 1024
    cfg = gguf_model_config(meta, set(), Path("x.gguf"))
    assert cfg.query_pre_attn_scalar == 168 and cfg.head_dim == 128
    assert cfg.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert cfg.rope_parameters["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
    meta = _meta("gemma3", **{"attention.key_length": 16})
    assert gguf_model_config(meta, set(), Path("x.gguf")).layer_types == ["full_attention"] * 2
    assert gguf_model_config(meta, set(), Path("x.gguf")).query_pre_attn_scalar == 16
    meta["gemma3.attention.sliding_window"] = 8
    meta["gemma3.attention.sliding_window_pattern"] = [False, True]
    assert gguf_model_config(meta, set(), Path("x.gguf")).layer_types == ["full_attention", "sliding_attention"]
