"""The real default model (SmolLM2-135M Q4_1 GGUF): our loader and model vs transformers' GGUF path.

Both sides dequantize the same file to float32, so with fp32 compute the
logits agree to float rounding (observed max |diff| = 0 to ~1e-5 on logits of
magnitude ~40); tolerance 1e-3. transformers' GGUF load takes ~20 s, so it is
done once per module.
"""

from __future__ import annotations

import pytest
import torch

from fleetserve.replica.layers.attention import AttentionMetadata
from fleetserve.replica.model_loader.registry import resolve_model
from fleetserve.replica.model_loader.weights import allocate_kv_caches, load_model

pytestmark = pytest.mark.real_model

PROMPT = [
    1,
    9690,
    198,
    2683,
    359,
    253,
    5356,
    5646,
    11173,
    3365,
    3714,
    314,
    1786,
    12756,
    314,
    2,
    198,
    1,
    4093,
    198,
    19556,
    28,
    638,
    359,
    346,
    47,
    2,
    198,
    1,
    520,
    9531,
    198,
]


@pytest.fixture(scope="module")
def source():
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def ours(source):
    return load_model(source, torch.float32, "cpu")


@pytest.fixture(scope="module")
def hf_logits(source):
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        source.path.parent, gguf_file=source.path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        return hf(torch.tensor([PROMPT])).logits[0]


def test_config_from_gguf(ours):
    _, cfg = ours
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    assert cfg.rope_parameters["rope_theta"] == 100000.0
    assert abs(cfg.rms_norm_eps - 1e-5) < 1e-9
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)


def test_logits_match_transformers_gguf(ours, hf_logits):
    model, cfg = ours
    caches = allocate_kv_caches(cfg, 8, 16, torch.float32)
    # Prefill 20 tokens, then the rest as a continuation chunk, then nothing recomputed.
    table = [3, 1, 6]
    with torch.no_grad():
        md = AttentionMetadata.build([20], [0], [table], 16)
        first = model.compute_logits(model(torch.tensor(PROMPT[:20]), md.positions, caches, md))
        md = AttentionMetadata.build([len(PROMPT) - 20], [20], [table], 16)
        rest = model.compute_logits(model(torch.tensor(PROMPT[20:]), md.positions, caches, md))
    got = torch.cat([first, rest])
    assert (got - hf_logits).abs().max().item() < 1e-3
    assert torch.equal(got.argmax(-1), hf_logits.argmax(-1))


@pytest.mark.parametrize("kernels_on", [True, False], ids=["cpu-kernels", "plain-torch"])
def test_bf16_tracks_fp32_greedy(source, ours, kernels_on):
    """bf16 (with the fused CPU kernels and without), teacher-forced along fp32's greedy run
    (prefill, then decode steps): logits within bf16 noise of fp32's, and the same greedy token
    wherever fp32's top-2 margin is clear of that noise. (Comparing free-running greedy tokens
    is not a fair test: on this prompt fp32's margins at steps 1-2 are 0.09 and 0.04, below
    bf16's rounding noise, and either rounding scheme may flip them.)"""
    import contextlib

    from fleetserve.replica import kernels

    model32, cfg = ours
    model16, _ = load_model(source, torch.bfloat16, "cpu")

    def run(model, dtype, seq=None, steps=8):
        caches = allocate_kv_caches(cfg, 8, 16, dtype)
        table, n0 = [0, 1, 2, 3], len(PROMPT)
        seq = list(seq or PROMPT)
        with torch.no_grad():
            md = AttentionMetadata.build([n0], [0], [table], 16)
            logits = [model.compute_logits(model(torch.tensor(seq[:n0]), md.positions, caches, md)[-1:])]
            for i in range(n0, n0 + steps):
                if len(seq) <= i:
                    seq.append(int(logits[-1].argmax()))
                md = AttentionMetadata.build([1], [i], [table], 16, request_ids=["r"])
                logits.append(model.compute_logits(model(torch.tensor(seq[i : i + 1]), md.positions, caches, md)))
        return seq, torch.cat(logits)

    seq32, ref = run(model32, torch.float32)
    with contextlib.nullcontext() if kernels_on else kernels.disabled():
        _, got = run(model16, torch.bfloat16, seq32)
    err = (got - ref).abs()
    assert err.mean() < 0.25 and err.max() < 2.5  # observed ~0.2 / ~1.3
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1.0
    assert clear.sum() >= 3
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])


def test_gguf_reader_agrees_with_gguf_package(source):
    import gguf
    import numpy as np

    from fleetserve.replica.model_loader.gguf_reader import GGUFFile

    ours = GGUFFile(source.path)
    ref = gguf.GGUFReader(source.path)
    assert set(ours.tensors) == {t.name for t in ref.tensors}
    for t in ref.tensors[:12]:
        np.testing.assert_array_equal(ours.raw(t.name).view(np.uint8).ravel(), t.data.view(np.uint8).ravel())
    assert ours.metadata["llama.attention.head_count_kv"] == 3
    assert ours.metadata["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert len(ours.metadata["tokenizer.ggml.merges"]) == len(ref.fields["tokenizer.ggml.merges"].data)
    ours.close()


def test_truncated_gguf_names_the_file(source, tmp_path):
    data = source.path.read_bytes()
    for cut in (100, len(data) // 2, len(data) - 1000):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=bad.name):
            load_model(resolve_model(str(bad)), torch.float32, "cpu")
