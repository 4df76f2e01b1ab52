"""Gemma 3 text (Gemma3ForCausalLM) against transformers' own on tiny random checkpoints, float32:
sliding layers with a window of 8 and global layers in one model, prompts of 20-40 tokens
chunked past the window and decoded past it, the (1 + w) norms with weights around 0, and a
config with attention and final logit soft-capping. Both attention paths (the CPU kernels and
the PyTorch ones). Then the engine (fleetserve.replica.llm.LLM) with prefix caching."""

from __future__ import annotations

import contextlib

import pytest
import torch

from fleetserve.replica import kernels
from tests.replica.hf_compare import ATOL, HFCompare, prompt

BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=24,  # not head_dim: the scale is its own
    sliding_window=8,
    sliding_window_pattern=3,  # sliding, sliding, full
    max_position_embeddings=256,
    rope_theta=1e6,
    rope_local_base_freq=1e4,
)
CONFIGS = {
    "plain": dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),  # the global table scaled
    "softcapped": dict(attn_logit_softcapping=1.5, final_logit_softcapping=3.0),
}


def gemma_dir(tmp_path_factory, name: str):
    from transformers import Gemma3TextConfig

    from fleetserve.replica.testing import make_tiny_model

    config = Gemma3TextConfig(**BASE, **CONFIGS[name])
    return make_tiny_model(tmp_path_factory.mktemp(f"gemma3-{name}"), config, norm_center=0.0, seed=3)


@pytest.fixture(scope="module", autouse=True)
def hf_applies_attention_softcap():
    """transformers 5.24's Gemma3Attention keeps config.attn_logit_softcapping but never passes it
    to its attention function (released Gemma 3 configs set it to null); we apply it, as Gemma 2
    does. The reference gets it the same way Gemma 2's does: transformers' own eager attention
    with `softcap` (the layer's attn_logit_softcapping)."""
    from transformers.models.gemma3 import modeling_gemma3

    eager = modeling_gemma3.eager_attention_forward

    def with_softcap(module, *args, **kwargs):
        kwargs.setdefault("softcap", module.attn_logit_softcapping)
        return eager(module, *args, **kwargs)

    modeling_gemma3.eager_attention_forward = with_softcap
    yield
    modeling_gemma3.eager_attention_forward = eager


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def gemma(request, tmp_path_factory):
    return request.param, HFCompare(gemma_dir(tmp_path_factory, request.param))


@pytest.fixture(params=["cpu-kernels", "plain-torch"])
def attention_path(request):
    with contextlib.nullcontext() if request.param == "cpu-kernels" else kernels.disabled():
        yield request.param


def test_layers_built_as_configured(gemma):
    name, cmp = gemma
    model = cmp.model.model
    attns = [layer.self_attn for layer in model.layers]
    assert [a.attn.sliding_window for a in attns] == [8, 8, None]
    assert [a.rotary_emb is model.rotary_emb_local for a in attns] == [True, True, False]
    assert all(a.attn.scale == 24**-0.5 for a in attns)
    assert [a.attn.logit_softcap for a in attns] == [1.5 if name == "softcapped" else None] * 3
    assert cmp.model.lm_head.weight is model.embed_tokens.weight  # tied


def test_chunked_prefill_and_decode_match_transformers(gemma, attention_path):
    _, cmp = gemma
    for n, cuts, seed in ((33, [13, 22], 1), (40, [9], 2)):
        ids = prompt(n, seed, cmp.cfg.vocab_size)
        torch.testing.assert_close(cmp.chunked_logits(ids, cuts), cmp.reference(ids), atol=ATOL, rtol=0)


def test_mixed_batch_matches_transformers(gemma, attention_path):
    """A fresh prompt, a continuation past the window and a decode in one forward."""
    _, cmp = gemma
    v = cmp.cfg.vocab_size
    fresh, cont, dec = prompt(21, 4, v), prompt(30, 5, v), prompt(25, 6, v)
    tables = [cmp.blocks_for(len(s)) for s in (fresh, cont, dec)]
    cmp.step([(cont[:12], 0, tables[1]), (dec[:24], 0, tables[2])])
    got = cmp.step([(fresh, 0, tables[0]), (cont[12:], 12, tables[1]), (dec[24:], 24, tables[2])])
    torch.testing.assert_close(got[0], cmp.reference(fresh), atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1], cmp.reference(cont)[12:], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[2][0], cmp.reference(dec)[24], atol=ATOL, rtol=0)


def test_greedy_tokens_match_transformers(gemma, attention_path):
    _, cmp = gemma
    ours, theirs = cmp.greedy(prompt(20, 7, cmp.cfg.vocab_size), 16)  # 36 positions: past the window
    assert ours == theirs


def test_unsupported_gemma_configs_are_clear_errors():
    from fleetserve.replica.model_loader.model_config import ModelConfig
    from fleetserve.replica.models.gemma3 import Gemma3ForCausalLM

    raw = dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], **BASE, vocab_size=64)
    Gemma3ForCausalLM(ModelConfig.from_dict(raw))  # builds
    with pytest.raises(ValueError, match="bidirectional"):
        Gemma3ForCausalLM(ModelConfig.from_dict({**raw, "use_bidirectional_attention": True}))
    with pytest.raises(ValueError, match="hidden_activation"):
        Gemma3ForCausalLM(ModelConfig.from_dict({**raw, "hidden_activation": "relu"}))


def test_engine_prefix_caching_keeps_greedy_tokens(tmp_path_factory):
    """Through the engine with prefix caching: a second request sharing a prompt prefix longer
    than the window (whole blocks cached) decodes the same greedy tokens as without the cache,
    and as transformers."""
    from fleetserve.replica.llm import LLM
    from fleetserve.scheduler import SamplingParams

    path = gemma_dir(tmp_path_factory, "plain")
    cmp = HFCompare(path)
    shared = prompt(24, 8, cmp.cfg.vocab_size)
    second = shared + prompt(5, 9, cmp.cfg.vocab_size)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM(
        str(path),
        dtype="float32",
        block_size=8,
        enable_prefix_caching=True,
        max_model_len=128,
        num_gpu_blocks_override=64,
    )
    try:
        first_out = llm.generate([{"prompt_token_ids": shared}], params, use_tqdm=False)[0]
        second_out = llm.generate([{"prompt_token_ids": second}], params, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    assert second_out.num_cached_tokens >= 16  # the shared prefix's whole blocks came from the cache
    for ids, out in ((shared, first_out), (second, second_out)):
        _, theirs = cmp.greedy(ids, 12)
        assert list(out.outputs[0].token_ids) == theirs
