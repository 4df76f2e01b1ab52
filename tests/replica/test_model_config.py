"""ModelConfig (replica.model_loader.model_config) reads what transformers' AutoConfig reads,
for every family our Llama model runs, without importing transformers in the engine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fleetserve.replica.model_loader.model_config import FAMILY_DEFAULTS, ModelConfig, read_model_config

FIELDS = [
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "hidden_act",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "architectures",
    "model_type",
]


def effective(config) -> dict:
    """What our model takes from a config (replica.models.llama's reads, with its fallbacks)."""
    from fleetserve.replica.models.llama import _head_dim, _rope_parameters

    rope = dict(_rope_parameters(config))
    rope["rope_type"] = rope.get("rope_type") or rope.pop("type", "default")
    rope.pop("type", None)
    out = {f: getattr(config, f, None) for f in FIELDS}
    out["num_key_value_heads"] = out["num_key_value_heads"] or out["num_attention_heads"]
    out.update(
        head_dim=_head_dim(config),
        rope=rope,
        attention_bias=bool(getattr(config, "attention_bias", False)),
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
    )
    return out


CASES = [
    {"model_type": "llama"},
    {"model_type": "mistral"},
    {"model_type": "qwen2"},
    {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 384,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
        "max_position_embeddings": 16384,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    {
        "model_type": "llama",
        "hidden_size": 96,
        "num_attention_heads": 4,
        "head_dim": 32,
        "attention_bias": True,
        "mlp_bias": True,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    },
    {
        "model_type": "llama",
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 4.0,
            "rope_theta": 20000.0,
            "original_max_position_embeddings": 512,
        },
    },
    {"model_type": "mistral", "sliding_window": None, "num_key_value_heads": 4, "pad_token_id": 0},
    {"model_type": "llama", "bos_token_id": None, "num_key_value_heads": None, "head_dim": None},
    {
        "model_type": "qwen2",
        "hidden_size": 128,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    {"model_type": "qwen3"},
    {"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1},
    {"model_type": "qwen3_moe", "num_experts": 16, "mlp_only_layers": [1], "norm_topk_prob": True},
    # what transformers' save_pretrained writes (its attribute_map's name for num_experts)
    {"model_type": "qwen3_moe", "num_local_experts": 6, "decoder_sparse_step": 2},
    {"model_type": "mixtral"},
    {"model_type": "phi3"},
    {  # Phi-4-mini's form: a top-level partial_rotary_factor, LongRoPE under rope_scaling
        "model_type": "phi3",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
        "original_max_position_embeddings": 16,
        "partial_rotary_factor": 0.5,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.5, 2.0, 2.5], "long_factor": [3.0] * 4},
    },
    {  # Phi-3's early "yarn" name for LongRoPE; the top-level original length wins over its own
        "model_type": "phi3",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
        "original_max_position_embeddings": 32,
        "rope_scaling": {
            "type": "yarn",
            "short_factor": [1.0] * 8,
            "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 8,
        },
    },
    {"model_type": "gemma3_text"},
    {"model_type": "gemma3_text", "num_hidden_layers": 7, "sliding_window": 16, "rope_local_base_freq": 1000.0},
]

# What a family reads beyond FIELDS, compared with transformers' config as well.
FAMILY_FIELDS = [
    "layer_types",
    "sliding_window",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
    "norm_topk_prob",
    "query_pre_attn_scalar",
    "hidden_activation",
    "final_logit_softcapping",
    "attn_logit_softcapping",
    "original_max_position_embeddings",
]


@pytest.mark.parametrize("raw", CASES, ids=lambda c: "-".join(f"{k}" for k in c)[:60])
def test_same_as_autoconfig(raw, tmp_path):
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours = read_model_config(tmp_path)
    theirs = AutoConfig.from_pretrained(str(tmp_path))
    if raw.get("model_type") == "gemma3_text":  # rope per layer type: compared whole
        assert ours.rope_parameters == theirs.rope_parameters
    else:
        assert effective(ours) == effective(theirs)
    for field in FAMILY_FIELDS:
        assert getattr(ours, field, None) == getattr(theirs, field, None), field


def test_family_defaults_cover_what_the_model_reads():
    for family, defaults in FAMILY_DEFAULTS.items():
        config = ModelConfig.from_dict({"model_type": family})
        for field in FIELDS[:-2]:
            assert hasattr(config, field), (family, field)
        assert config.head_dim == defaults.get("head_dim") or defaults["hidden_size"] // defaults["num_attention_heads"]


@pytest.mark.parametrize(
    "raw, message",
    [
        (
            {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]},
            r"unsupported model architecture \['GPT2LMHeadModel'\]",
        ),
        ({}, "unsupported model architecture None"),
        ({"model_type": "llama", "hidden_size": 100, "num_attention_heads": 3}, "not a multiple"),
        ({"model_type": "llama", "hidden_size": "big"}, "hidden_size must be a positive integer"),
        ({"model_type": "llama", "num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
        ({"model_type": "llama", "rope_scaling": "fast"}, "must be an object"),
    ],
)
def test_bad_configs_are_value_errors(raw, message, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=message):
        read_model_config(tmp_path)


def test_unreadable_config_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read the model config"):
        read_model_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2")
    with pytest.raises(ValueError, match="cannot read the model config"):
        read_model_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        read_model_config(tmp_path)


def test_gguf_config_matches_transformers(tmp_path):
    """The default model's GGUF metadata: the engine's ModelConfig equals transformers' LlamaConfig
    (what hf_export builds HF's model from) on everything our model reads."""
    from fleetserve.replica.model_loader.gguf_reader import GGUFFile
    from fleetserve.replica.model_loader.registry import ModelNotFoundError, resolve_model
    from fleetserve.replica.model_loader.weights import gguf_config, gguf_model_config

    try:
        source = resolve_model("smollm2-135m")
    except ModelNotFoundError as e:
        pytest.skip(f"real model unavailable: {e}")
    gguf = GGUFFile(source.path)
    try:
        names = set(gguf.tensors)
        ours = gguf_model_config(gguf.metadata, names, source.path)
        theirs = gguf_config(gguf.metadata, names, source.path)
    finally:
        gguf.close()
    assert effective(ours) == effective(theirs)
    assert (ours.hidden_size, ours.num_hidden_layers, ours.num_key_value_heads, ours.tie_word_embeddings) == (
        576,
        30,
        3,
        True,
    )


def test_engine_process_does_not_import_transformers(tiny_model_dir):
    """Building the engine (model, KV cache, scheduler) imports neither transformers nor its
    config machinery: ~3 s of CPU in every engine process that starts."""
    code = (
        "import sys\n"
        "from fleetserve.replica.engine.engine_args import EngineArgs\n"
        "from fleetserve.replica.engine.engine_core import EngineCore\n"
        f"core = EngineCore(EngineArgs(model={str(tiny_model_dir)!r}, max_model_len=256,"
        " num_gpu_blocks_override=32, num_threads=1), 2)\n"
        "core.shutdown()\n"
        "print(sorted(m for m in ('transformers',) if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
