"""Qwen3 and Phi-3 (replica/models/qwen3.py, phi3.py) against transformers' own models, fp32.

Tiny random models of each: Qwen3 with head_dim decoupled from hidden/heads (tied embeddings;
one with attention_bias; one whose second layer slides), Phi-3 with LongRoPE (distinct short and long factors, an
original length of 16 inside a 64-token max) and Phi-4-mini style partial rotary with
LongRoPE. Logits through the paged cache (prefill, chunked prefill, paged decode; shuffled
block tables) equal HF's model run pass by pass on its own KV cache within 1e-4 (Phi-3's
decodes cross the original length and switch to the long factor there), with the CPU kernels
and with plain torch; greedy tokens through the engine (`LLM`) equal HF
`generate`'s; a Qwen3 LoRA adapter equals PEFT's; TP=2 equals TP=1 (slow).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from fleetserve.replica.layers.attention import AttentionMetadata
from fleetserve.replica.model_loader.registry import resolve_model
from fleetserve.replica.model_loader.weights import allocate_kv_caches, load_model
from fleetserve.replica.testing import make_tiny_model
from fleetserve.scheduler import SamplingParams
from tests.replica.hf_compare import assert_same_outputs

ATOL = 1e-4
BLOCK = 4
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
ORIGINAL = 16  # Phi-3's original_max_position_embeddings here


def _longrope(n: int) -> dict:
    return {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.25 * i for i in range(n)],
        "long_factor": [2.0 + 1.5 * i for i in range(n)],
    }


# name -> (transformers config class, fields over SMALL)
MODELS = {
    "qwen3": ("Qwen3Config", dict(head_dim=24, tie_word_embeddings=True, max_position_embeddings=128)),
    "qwen3_bias": ("Qwen3Config", dict(head_dim=32, attention_bias=True, max_position_embeddings=128)),
    # layer 1 of 2 slides (max_window_layers=1) over 6 tokens
    "qwen3_sliding": (
        "Qwen3Config",
        dict(use_sliding_window=True, sliding_window=6, max_window_layers=1, max_position_embeddings=128),
    ),
    "phi3_longrope": (
        "Phi3Config",
        dict(max_position_embeddings=64, original_max_position_embeddings=ORIGINAL, rope_parameters=_longrope(8)),
    ),
    "phi4mini_partial": (
        "Phi3Config",
        dict(
            max_position_embeddings=64,
            original_max_position_embeddings=ORIGINAL,
            rope_parameters={**_longrope(4), "partial_rotary_factor": 0.5},
            tie_word_embeddings=True,
        ),
    ),
}


def _make(root, name: str, seed: int = 0):
    import transformers

    cls, fields = MODELS[name]
    return make_tiny_model(root / name, getattr(transformers, cls)(**SMALL, **fields), seed=seed)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_phi3")
    return {name: _make(root, name, seed=i) for i, name in enumerate(MODELS)}


@pytest.fixture(scope="module")
def hf_models(model_dirs):
    from transformers import AutoModelForCausalLM

    return {n: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for n, p in model_dirs.items()}


@pytest.fixture(params=["cpu-kernels", "plain-torch"])
def attention_path(request):
    from fleetserve.replica import kernels

    if request.param == "cpu-kernels":
        yield request.param
    else:
        with kernels.disabled():
            yield request.param


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _hf_incremental(hf, ids: list[int], n_prefill: int) -> torch.Tensor:
    """HF's logits [len(ids), V] as generate computes them: one pass over ids[:n_prefill], then
    one token per pass with its KV cache."""
    with torch.no_grad():
        out = hf(torch.tensor([ids[:n_prefill]]), use_cache=True)
        logits, cache = [out.logits[0]], out.past_key_values
        for t in range(n_prefill, len(ids)):
            out = hf(torch.tensor([[ids[t]]]), cache=cache, use_cache=True)
            logits.append(out.logits[0])
            cache = out.past_key_values
    return torch.cat(logits)


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_match_hf(name, model_dirs, hf_models, attention_path):
    model, cfg = load_model(resolve_model(str(model_dirs[name])), torch.float32, "cpu")
    assert type(model).__name__ == MODELS[name][0].replace("Config", "ForCausalLM")
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert windows == ([None, 6] if name == "qwen3_sliding" else [None, None])
    free = list(range(1, 40))
    random.Random(1).shuffle(free)
    caches = allocate_kv_caches(cfg, 40, BLOCK, torch.float32)

    def step(chunks):
        md = AttentionMetadata.build([len(c[0]) for c in chunks], [c[1] for c in chunks], [c[2] for c in chunks], BLOCK)
        with torch.no_grad():
            logits = model.compute_logits(
                model(torch.tensor([t for c in chunks for t in c[0]]), md.positions, caches, md)
            )
        return logits.split([len(c[0]) for c in chunks])

    # a: 11-token prefill, then decodes up to 26 tokens (past Phi-3's original 16);
    # b: a prefill in uneven chunks (its 14 tokens within the original length), in the same
    # steps as a's prefill and first decodes
    a, b = _prompt(26, 1, cfg.vocab_size), _prompt(14, 2, cfg.vocab_size)
    ta, tb = [free.pop() for _ in range(7)], [free.pop() for _ in range(4)]
    got_a, got_b = [], []
    for a_chunk, b_chunk in [((0, 11), (0, 5)), ((11, 12), (5, 6)), ((12, 13), (6, 14))]:
        la, lb = step([(a[slice(*a_chunk)], a_chunk[0], ta), (b[slice(*b_chunk)], b_chunk[0], tb)])
        got_a.append(la)
        got_b.append(lb)
    for t in range(13, len(a)):
        (la,) = step([(a[t : t + 1], t, ta)])
        got_a.append(la)
    hf = hf_models[name]
    torch.testing.assert_close(torch.cat(got_a), _hf_incremental(hf, a, 11), atol=ATOL, rtol=0)
    with torch.no_grad():
        ref_b = hf(torch.tensor([b])).logits[0]
    torch.testing.assert_close(torch.cat(got_b), ref_b, atol=ATOL, rtol=0)


def test_longrope_table_switches_at_the_original_length(model_dirs):
    """Rows below the original length rotate with the short factor, from it on with the long one
    (what HF's generate does once a sequence passes it), both with HF's attention factor."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model, _ = load_model(resolve_model(str(model_dirs["phi3_longrope"])), torch.float32, "cpu", max_model_len=96)
    table = model.model.rotary_emb.cos_sin_cache
    assert table.shape == (96, 16)
    hf_cfg = AutoConfig.from_pretrained(model_dirs["phi3_longrope"])
    for seq_len, rows in ((None, range(0, ORIGINAL)), (ORIGINAL + 1, range(ORIGINAL, 96))):
        inv_freq, scaling = ROPE_INIT_FUNCTIONS["longrope"](hf_cfg, "cpu", seq_len=seq_len)
        assert scaling > 1.0  # max_position_embeddings / original = 4: the factor of the config, not of 96
        freqs = torch.outer(torch.tensor(list(rows), dtype=torch.float32), inv_freq)
        want = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * scaling
        torch.testing.assert_close(table[rows.start : rows.stop], want, atol=1e-6, rtol=0)


def test_engine_greedy_equals_hf_generate(model_dirs, hf_models):
    """Through LLM (scheduler, chunked prefill beside decodes, tokenizer): HF generate's tokens,
    for prompts of different lengths (Phi-3's within its original length: past it HF's
    generate recomputes the whole cache with the long factor, see rotary._longrope_cos_sin)."""
    from fleetserve.replica.llm import LLM

    prompts = ["Hello", "The quick", "def add(a, b):"]
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    for name in ("qwen3", "phi3_longrope"):
        llm = LLM(
            str(model_dirs[name]),
            dtype="float32",
            block_size=BLOCK,
            num_gpu_blocks_override=48,
            num_threads=1,
            max_num_batched_tokens=16,
            long_prefill_token_threshold=6,
        )
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.shutdown()
        lengths = [len(o.prompt_token_ids) for o in outs]
        assert len(set(lengths)) == 3 and max(lengths) + 7 <= ORIGINAL, lengths
        for out in outs:
            ids = torch.tensor([out.prompt_token_ids])
            with torch.no_grad():
                ref = hf_models[name].generate(
                    ids, max_new_tokens=7, do_sample=False, eos_token_id=None, pad_token_id=2
                )
            assert list(out.outputs[0].token_ids) == ref[0, ids.shape[1] :].tolist(), (name, out.prompt)


def test_qwen3_lora_equals_peft(model_dirs, hf_models, tmp_path):
    """A PEFT adapter on all seven projections of Qwen3 (q/k/v into the fused qkv with the q/k
    norms after it): greedy tokens equal PEFT's model, beside a base-model request."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fleetserve.replica.llm import LLM
    from fleetserve.replica.lora import LoRARequest
    from fleetserve.replica.testing import make_tiny_lora

    adapter = make_tiny_lora(model_dirs["qwen3"], tmp_path / "a", seed=3)
    base = AutoModelForCausalLM.from_pretrained(model_dirs["qwen3"], dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(adapter)).eval()
    llm = LLM(
        str(model_dirs["qwen3"]),
        dtype="float32",
        block_size=BLOCK,
        num_gpu_blocks_override=48,
        num_threads=1,
        enable_lora=True,
    )
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompt = "The quick brown fox jumps"
    try:
        with_a, plain = llm.generate(
            [prompt, prompt], params, use_tqdm=False, lora_request=[LoRARequest("a", 1, str(adapter)), None]
        )
    finally:
        llm.shutdown()
    ids = torch.tensor([with_a.prompt_token_ids])
    for out, ref_model in ((with_a, peft), (plain, hf_models["qwen3"])):
        with torch.no_grad():
            ref = ref_model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=2)
        assert list(out.outputs[0].token_ids) == ref[0, ids.shape[1] :].tolist()
    assert with_a.outputs[0].token_ids != plain.outputs[0].token_ids  # the adapter is not a no-op


def test_phi3_checkpoint_problems_are_named(model_dirs, tmp_path):
    """A fused tensor of the wrong size, or one missing, is a ValueError naming the checkpoint's
    (fused) tensor."""
    from safetensors.torch import load_file, save_file

    from fleetserve.replica.models.phi3 import Phi3ForCausalLM

    src = model_dirs["phi3_longrope"]
    model, _ = load_model(resolve_model(str(src)), torch.float32, "cpu")
    assert isinstance(model, Phi3ForCausalLM)
    weights = load_file(str(src / "model.safetensors"))
    assert "model.layers.0.self_attn.qkv_proj.weight" in model.expected_weight_names()
    assert model.load_weights(weights.items()) == set(weights)
    short = dict(weights)
    short["model.layers.1.mlp.gate_up_proj.weight"] = weights["model.layers.1.mlp.gate_up_proj.weight"][:-2]
    with pytest.raises(ValueError, match=r"gate_up_proj.weight: 190 rows, expected 192 \(96 \+ 96\)"):
        model.load_weights(short.items())
    missing = {k: v for k, v in weights.items() if k != "model.layers.0.self_attn.qkv_proj.weight"}
    with pytest.raises(ValueError, match=r"1 weight\(s\) missing, e.g. model.layers.0.self_attn.qkv_proj.weight"):
        model.load_weights(missing.items())
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (bad / f.name).write_bytes(f.read_bytes())
    save_file(short, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="190 rows"):
        load_model(resolve_model(str(bad)), torch.float32, "cpu")


def test_partial_rotary_refused_when_it_leaves_odd_dims():
    from fleetserve.replica.layers import RotaryEmbedding

    assert RotaryEmbedding(16, 32, {"rope_type": "default", "partial_rotary_factor": 0.3}).rotary_dim == 4  # int(4.8)
    with pytest.raises(ValueError, match="partial_rotary_factor 0.2 gives 3 rotary dims of a 16-dim head"):
        RotaryEmbedding(16, 32, {"rope_type": "default", "partial_rotary_factor": 0.2})
    with pytest.raises(ValueError, match=r"a factor in \(0, 1\]"):
        RotaryEmbedding(16, 32, {"rope_type": "default", "partial_rotary_factor": 1.5})


@pytest.mark.slow
def test_tp2_matches_tp1(local_ray, model_dirs):
    """Both families over two ranks (Qwen3's q/k norms replicated, Phi-3's fused tensors split
    per rank): TP=1's tokens and logprobs."""
    from fleetserve.replica.llm import LLM

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompts = ["The quick brown fox", "def add(a, b):"]
    for name in ("qwen3", "phi4mini_partial"):
        outs = []
        for tp in (1, 2):
            llm = LLM(
                str(model_dirs[name]),
                dtype="float32",
                block_size=BLOCK,
                num_gpu_blocks_override=48,
                num_threads=1,
                tensor_parallel_size=tp,
            )
            try:
                outs.append(llm.generate(prompts, params, use_tqdm=False))
            finally:
                llm.shutdown()
        tp1, tp2 = ([o.outputs[0] for o in run] for run in outs)
        assert_same_outputs(tp1, tp2, name)


def _write_gguf(path, model_dir, name: str):
    """A float32 GGUF of the HF folder as llama.cpp's converter lays it out: the gguf package's own
    HF -> GGUF tensor names, its metadata keys (Qwen3's key_length; Phi-3's rotary dims,
    original context length and LongRoPE factors as rope_factors_* tensors), no Q/K permute."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    arch = {"qwen3": gguf.MODEL_ARCH.QWEN3, "phi3": gguf.MODEL_ARCH.PHI3}[cfg.model_type]
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
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    if cfg.model_type == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_dimension_count(head_dim)
    else:
        rope = cfg.rope_parameters
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    for hf_name, t in load_file(str(model_dir / "model.safetensors")).items():
        w.add_tensor(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("name", ["qwen3_bias", "phi4mini_partial"])
def test_gguf_round_trip_matches_hf(name, model_dirs, hf_models, tmp_path):
    """Qwen3 (q/k norms, biases, no permute) and Phi-3 (fused attn_qkv, gate|up in ffn_up,
    partial rotary, LongRoPE factor tensors) from a GGUF file: the config and the logits of
    HF's model on the folder the file was written from."""
    pytest.importorskip("gguf")
    from fleetserve.replica.model_loader.hf_export import build_hf_model

    path = _write_gguf(tmp_path / f"{name}.gguf", model_dirs[name], name)
    source = resolve_model(str(path))
    model, cfg = load_model(source, torch.float32, "cpu")
    hf = hf_models[name]
    ours_from_folder = load_model(resolve_model(str(model_dirs[name])), torch.float32, "cpu")[1]
    for key in ("head_dim", "num_key_value_heads", "rope_parameters", "tie_word_embeddings", "attention_bias"):
        assert getattr(cfg, key) == getattr(ours_from_folder, key), key
    ids = _prompt(14, 5, cfg.vocab_size)
    caches = allocate_kv_caches(cfg, 8, BLOCK, torch.float32)
    md = AttentionMetadata.build([14], [0], [[3, 1, 6, 2]], BLOCK)
    with torch.no_grad():
        ours = model.compute_logits(model(torch.tensor(ids), md.positions, caches, md))
        ref = hf(torch.tensor([ids])).logits[0]
        exported = build_hf_model(source)(torch.tensor([ids])).logits[0]  # hf_export reads the file too
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(exported, ref, atol=ATOL, rtol=0)
