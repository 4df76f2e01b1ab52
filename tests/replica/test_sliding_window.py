"""Sliding-window attention (and Gemma's logit soft-cap) in PagedAttention against a dense masked
reference, on every path: the CPU kernel, and with the kernels off the PyTorch paths (SDPA per
prefill chunk, packed fresh prompts, the decode gather and the decode buffer carried between
steps). Requests are prefilled in chunks that start past the window, decode past it, and share
steps with each other; the window follows transformers (`kv_idx > q_idx - window`)."""

from __future__ import annotations

import contextlib
import math
import random

import pytest
import torch

from fleetserve.replica import kernels
from fleetserve.replica.layers.attention import AttentionMetadata, PagedAttention

H, KVH, D, BS = 4, 2, 32, 4
LENGTHS = {"a": 40, "b": 35, "c": 20}


def _steps() -> list[list[tuple[str, int, int]]]:
    """(request, start, end) token ranges per step, each request's tokens in order: prefill
    chunks (fresh prompts side by side, a continuation past the window, a decode among them),
    then one token per request per step up to its length."""
    steps = [
        [("a", 0, 15), ("b", 0, 25)],
        [("a", 15, 30), ("c", 0, 5), ("b", 25, 26)],
        [("a", 30, 31), ("b", 26, 27), ("c", 5, 12)],
    ]
    done = {"a": 31, "b": 27, "c": 12}
    while any(done[r] < n for r, n in LENGTHS.items()):
        steps.append([(r, done[r], done[r] + 1) for r in LENGTHS if done[r] < LENGTHS[r]])
        for r, _, e in steps[-1]:
            done[r] = e
    return steps


STEPS = _steps()
PATHS = ["kernel", "torch", "torch-packed", "torch-no-decode-buffer"]


def reference(q, k, v, window, softcap, scale):
    """q [n, H, D], k/v [n, KVH, D] of one whole sequence -> [n, H, D], float64, dense masked."""
    n = q.shape[0]
    kk = k.double().repeat_interleave(H // KVH, 1).transpose(0, 1)  # [H, n, D]
    vv = v.double().repeat_interleave(H // KVH, 1).transpose(0, 1)
    s = torch.bmm(q.double().transpose(0, 1), kk.transpose(1, 2)) * scale  # [H, n, n]
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    mask = j <= i
    if window:
        mask &= j > i - window
    s = s.masked_fill(~mask, float("-inf"))
    return torch.bmm(torch.softmax(s, -1), vv).transpose(0, 1)


@contextlib.contextmanager
def path(name, monkeypatch):
    if name == "kernel":
        if kernels.cpu_ops() is None:
            pytest.skip(f"CPU kernels unavailable: {kernels.unavailable_reason()}")
        yield
        return
    monkeypatch.setattr(PagedAttention, "pack_prefills", name == "torch-packed")
    monkeypatch.setattr(PagedAttention, "use_decode_buffer", name != "torch-no-decode-buffer")
    with kernels.disabled():
        yield


def run_steps(attn, seqs, steps, dtype):
    """Feed `steps` through `attn` over one paged cache (shuffled blocks) -> outputs per request."""
    blocks = list(range(1, 64))
    random.Random(1).shuffle(blocks)
    tables = {r: [blocks.pop() for _ in range(-(-LENGTHS[r] // BS))] for r in LENGTHS}
    cache = torch.zeros(2, KVH, 64, BS, D, dtype=dtype)
    out = {r: torch.zeros(LENGTHS[r], H, D, dtype=dtype) for r in LENGTHS}
    for step in steps:
        md = AttentionMetadata.build(
            [e - s for _, s, e in step],
            [s for _, s, _ in step],
            [tables[r] for r, _, _ in step],
            BS,
            request_ids=[r for r, _, _ in step],
        )
        q = torch.cat([seqs[r][0][s:e] for r, s, e in step]).view(-1, H * D)
        k = torch.cat([seqs[r][1][s:e] for r, s, e in step]).view(-1, KVH * D)
        v = torch.cat([seqs[r][2][s:e] for r, s, e in step]).view(-1, KVH * D)
        o = attn(q, k, v, cache, md).view(-1, H, D)
        t = 0
        for r, s, e in step:
            out[r][s:e] = o[t : t + e - s]
            t += e - s
    return out


@pytest.fixture(scope="module")
def seqs():
    g = torch.Generator().manual_seed(0)
    return {
        r: (torch.randn(n, H, D, generator=g), torch.randn(n, KVH, D, generator=g), torch.randn(n, KVH, D, generator=g))
        for r, n in LENGTHS.items()
    }


@pytest.mark.parametrize("name", PATHS)
@pytest.mark.parametrize("window,softcap", [(None, None), (1, None), (8, None), (64, None), (None, 2.0), (8, 2.0)])
def test_window_and_softcap_match_dense_reference(name, window, softcap, seqs, monkeypatch):
    scale = 1 / math.sqrt(D)
    attn = PagedAttention(H, KVH, D, sliding_window=window, logit_softcap=softcap)
    with path(name, monkeypatch):
        got = run_steps(attn, seqs, STEPS, torch.float32)
    for r, (q, k, v) in seqs.items():
        torch.testing.assert_close(got[r].double(), reference(q, k, v, window, softcap, scale), atol=2e-5, rtol=1e-5)


def test_window_changes_the_result(seqs):
    """The window is applied at all: outputs past it differ from full attention's, and not before."""
    with kernels.disabled():
        full = run_steps(PagedAttention(H, KVH, D), seqs, STEPS, torch.float32)
        windowed = run_steps(PagedAttention(H, KVH, D, sliding_window=8), seqs, STEPS, torch.float32)
    for r in LENGTHS:
        assert torch.equal(full[r][:8], windowed[r][:8])
        assert (full[r][8:] - windowed[r][8:]).abs().amax(dim=(1, 2)).min() > 1e-4


def test_bad_window_or_softcap_is_a_clear_error():
    with pytest.raises(ValueError, match="sliding_window"):
        PagedAttention(H, KVH, D, sliding_window=0)
    with pytest.raises(ValueError, match="soft-cap"):
        PagedAttention(H, KVH, D, logit_softcap=-1.0)


# ----------------------------------------------------------------------------- models vs transformers

SMALL = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
WINDOWED = {
    # every layer slides
    "mistral": ("MistralConfig", dict(sliding_window=8)),
    # layers from max_window_layers on slide (transformers' layer_types), here the second
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "qwen3": ("Qwen3Config", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1, head_dim=16)),
    "phi3": ("Phi3Config", dict(sliding_window=8, pad_token_id=0)),
}


@pytest.fixture(scope="module", params=sorted(WINDOWED))
def windowed(request, tmp_path_factory):
    import transformers

    from fleetserve.replica.testing import make_tiny_model
    from tests.replica.hf_compare import HFCompare

    cls, extra = WINDOWED[request.param]
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), getattr(transformers, cls)(**SMALL, **extra))
    return request.param, HFCompare(path)


@pytest.mark.parametrize("kernels_on", [True, False], ids=["cpu-kernels", "plain-torch"])
def test_windowed_families_match_transformers(windowed, kernels_on):
    """Mistral, Phi-3 (every layer) and Qwen2/Qwen3 (the layers from max_window_layers on) with a
    window of 8 over 30-token prompts (chunks that start past the window, decodes past it):
    logits as transformers', greedy tokens identical."""
    from tests.replica.hf_compare import ATOL, prompt

    family, cmp = windowed
    windows = [layer.self_attn.attn.sliding_window for layer in cmp.model.model.layers]
    assert windows == ([8, 8] if family in ("mistral", "phi3") else [None, 8])
    ctx = contextlib.nullcontext() if kernels_on else kernels.disabled()
    with ctx:
        ids = prompt(30, 1, cmp.cfg.vocab_size)
        torch.testing.assert_close(cmp.chunked_logits(ids, [13, 22]), cmp.reference(ids), atol=ATOL, rtol=0)
        ours, theirs = cmp.greedy(prompt(11, 2, cmp.cfg.vocab_size), 14)
    assert ours == theirs


# ----------------------------------------------------------------------------- blocks given back


@pytest.fixture(scope="module")
def mistral_w8(tmp_path_factory):
    import transformers

    from fleetserve.replica.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("mistral-w8"), transformers.MistralConfig(**SMALL, sliding_window=8))


@pytest.mark.parametrize("kernels_on", [True, False], ids=["cpu-kernels", "plain-torch"])
def test_engine_gives_back_blocks_outside_the_window(mistral_w8, kernels_on):
    """Four 14-token prompts decoding 36 tokens each (13 blocks of 4 each to completion) in a pool
    of 17 blocks: the engine gives back what the window (8, every layer) left behind, so they run
    side by side without a preemption. Blocks given back go to the other requests while their
    first owners still decode with the old ids in the workers' block tables (read, and weighed
    by zero, by the torch paths); greedy tokens equal transformers'. With
    --disable-hybrid-kv-cache-manager the same pool preempts; a prompt run again hits the blocks
    its first run gave back; n-gram drafts stay exact. (tests/scheduler/test_sliding_window.py
    checks that no block inside a window is given back.)"""
    from transformers import AutoModelForCausalLM

    from fleetserve.replica.llm import LLM
    from fleetserve.scheduler import SamplingParams
    from tests.replica.hf_compare import prompt

    hf = AutoModelForCausalLM.from_pretrained(mistral_w8, dtype=torch.float32, attn_implementation="eager").eval()
    prompts = [prompt(14, seed, hf.config.vocab_size) for seed in range(4)]
    want = []
    with torch.no_grad():
        for ids in prompts:
            seq = list(ids)
            for _ in range(36):
                seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
            want.append(seq[len(ids) :])
    params = SamplingParams(temperature=0.0, max_tokens=36, ignore_eos=True)
    ctx = contextlib.nullcontext() if kernels_on else kernels.disabled()
    runs = {}
    for name, extra in {
        "free": {},
        "keep": {"disable_hybrid_kv_cache_manager": True},
        "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    }.items():
        with ctx:
            llm = LLM(
                str(mistral_w8),
                dtype="float32",
                block_size=BS,
                num_gpu_blocks_override=17,
                max_num_seqs=4,
                num_threads=1,
                **extra,
            )
            try:
                kv = llm.core.scheduler.kv
                # One prompt twice (its 13 blocks fit the pool: none evicted), then all four.
                for _ in range(2):
                    (one,) = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
                    assert one.outputs[0].token_ids == want[0], name
                    hit = one.num_cached_tokens
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                assert [o.outputs[0].token_ids for o in outs] == want, name
                kv.check_invariants()
                assert kv.num_free_blocks == kv.num_blocks
                runs[name] = (llm.core.scheduler.num_preemptions, kv.num_window_freed_blocks, hit)
            finally:
                llm.shutdown()
    assert runs["free"][0] == 0 and runs["free"][1] > 0
    assert runs["free"][2] == 12  # the prompt's 3 full blocks, given back during the first run
    assert runs["keep"][0] > 0 and runs["keep"][1] == 0
    assert runs["ngram"][1] > 0


def test_the_engine_frees_blocks_only_when_every_layer_slides():
    """model_sliding_window (what the engine gives the scheduler): the window for Mistral and
    Phi-3 (every layer), none for Qwen2/Qwen3 with global lower layers or Gemma 3 (global
    every sixth layer; a Gemma 3 of fewer layers slides on all), none without windows."""
    import transformers

    from fleetserve.replica.model_loader.model_config import ModelConfig, model_sliding_window

    def window(cls, **extra):
        cfg = getattr(transformers, cls)(**SMALL, **extra).to_dict()
        return model_sliding_window(ModelConfig.from_dict(cfg))

    assert {family: window(cls, **extra) for family, (cls, extra) in WINDOWED.items()} == {
        "mistral": 8,
        "phi3": 8,
        "qwen2": None,
        "qwen3": None,
    }
    gemma = {**SMALL, "num_hidden_layers": 6}  # layers 0-4 slide, 5 is global
    assert (
        model_sliding_window(ModelConfig.from_dict(transformers.Gemma3TextConfig(**gemma, sliding_window=8).to_dict()))
        is None
    )
    assert window("MistralConfig", sliding_window=None) is None
