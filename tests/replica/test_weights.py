"""Weight loading errors, GGUF reading, KV cache sizing, and the tiny-model helper."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from fleetserve.replica.model_loader.registry import ModelNotFoundError, ModelSource, resolve_model
from fleetserve.replica.model_loader.weights import (
    allocate_kv_caches,
    gguf_to_hf_name,
    kv_cache_bytes_per_block,
    load_model,
    reverse_llama_cpp_permute,
)
from fleetserve.replica.testing import make_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), num_heads=4, num_kv_heads=2)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_make_tiny_llama_is_deterministic_and_complete(tmp_path, tiny):
    again = make_tiny_llama(tmp_path / "again", num_heads=4, num_kv_heads=2)
    assert (again / "model.safetensors").read_bytes() == (tiny / "model.safetensors").read_bytes()
    other = make_tiny_llama(tmp_path / "other", num_heads=4, num_kv_heads=2, seed=1)
    assert (other / "model.safetensors").read_bytes() != (tiny / "model.safetensors").read_bytes()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    cfg = json.loads((tiny / "config.json").read_text())
    assert len(tok) == cfg["vocab_size"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    text = "Hello, world! ünïcödé 🙂"
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_unknown_model_name():
    with pytest.raises(ModelNotFoundError, match="unknown model"):
        resolve_model("no-such-model-xyz")


def test_truncated_safetensors_names_the_file(tmp_path, tiny):
    d = _copy(tiny, tmp_path / "m")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(resolve_model(str(d)), torch.float32, "cpu")


def test_missing_tensor_is_reported(tmp_path, tiny):
    from safetensors.torch import load_file, save_file

    d = _copy(tiny, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match="missing.*layers.1.self_attn.k_proj.weight"):
        load_model(resolve_model(str(d)), torch.float32, "cpu")


def test_wrong_shape_is_reported(tmp_path, tiny):
    from safetensors.torch import load_file, save_file

    d = _copy(tiny, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:-1].clone()
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match="shape mismatch"):
        load_model(resolve_model(str(d)), torch.float32, "cpu")


def test_unsupported_architecture(tmp_path, tiny):
    d = _copy(tiny, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported"):
        load_model(resolve_model(str(d)), torch.float32, "cpu")


def test_garbage_gguf_names_the_file(tmp_path):
    f = tmp_path / "bad.gguf"
    f.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="bad.gguf"):
        load_model(ModelSource("bad", "gguf", f), torch.float32, "cpu")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.gguf"):
        load_model(resolve_model(str(empty)), torch.float32, "cpu")


def test_gguf_names_and_permutation():
    assert gguf_to_hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert gguf_to_hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("rope_freqs.weight") is None
    # llama.cpp's forward permutation (convert_hf_to_gguf.py LlamaModel.permute), then ours undoes it.
    n_head, d, cols = 3, 8, 5
    w = np.arange(n_head * d * cols, dtype=np.float32).reshape(n_head * d, cols)
    permuted = w.reshape(n_head, 2, d // 2, cols).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(reverse_llama_cpp_permute(permuted, n_head), w)


def test_kv_cache_sizes(tiny):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny)  # 2 layers, 2 kv heads, head_dim 16
    assert kv_cache_bytes_per_block(cfg, 16, torch.bfloat16) == 2 * 2 * 16 * 2 * 16 * 2
    assert kv_cache_bytes_per_block(cfg, 16, torch.float32, tp_size=2) == 2 * 2 * 16 * 1 * 16 * 4
    caches = allocate_kv_caches(cfg, 10, 16, torch.float32, "cpu")
    assert len(caches) == 2 and caches[0].shape == (2, 2, 10, 16, 16)
    assert caches[0].abs().sum() == 0
    assert caches[0].numel() * 4 * len(caches) == 10 * kv_cache_bytes_per_block(cfg, 16, torch.float32)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "F16"])
def test_gguf_dequantization_is_ggufs_bits(qtype):
    """Q4_0 / Q4_1 / Q8_0 are dequantized in torch (weights.dequantize_gguf): the same float32
    bits as gguf.quants, including extreme scales; other types still go through gguf."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from fleetserve.replica.model_loader.weights import dequantize_gguf

    t = GGMLQuantizationType[qtype]
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((6, 512)) * np.logspace(-6, 4, 6)[:, None]).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block: scale 0
    raw = quantize(x, t)
    ours, theirs = dequantize_gguf(raw, t), dequantize(raw, t)
    assert ours.shape == theirs.shape == x.shape and ours.dtype == np.float32
    assert np.array_equal(ours.view(np.uint32), np.asarray(theirs, dtype=np.float32).view(np.uint32))


@pytest.mark.real_model
def test_default_model_dequantizes_as_gguf_does():
    import numpy as np
    from gguf.quants import dequantize

    from fleetserve.replica.model_loader.gguf_reader import GGUFFile
    from fleetserve.replica.model_loader.registry import resolve_model
    from fleetserve.replica.model_loader.weights import dequantize_gguf

    gguf = GGUFFile(resolve_model("smollm2-135m").path)
    try:
        for name, info in gguf.tensors.items():
            raw = gguf.raw(name)
            ours, theirs = dequantize_gguf(raw, info.ggml_type), dequantize(raw, info.ggml_type)
            assert np.array_equal(np.asarray(ours).view(np.uint32), np.asarray(theirs).view(np.uint32)), name
            del raw, ours, theirs  # F32 tensors are views of the file mapping, which close() unmaps
    finally:
        gguf.close()
