"""Our LlamaForCausalLM + paged attention vs transformers' LlamaForCausalLM on the same weights.

Tolerance (fp32): max |logit difference| <= 1e-4 (observed ~1e-6); logits of
these tiny models are O(1). Every scenario goes through the paged cache with
shuffled, non-contiguous block tables.
"""

from __future__ import annotations

import random

import pytest
import torch

from fleetserve.replica.layers.attention import AttentionMetadata
from fleetserve.replica.model_loader.registry import resolve_model
from fleetserve.replica.model_loader.weights import allocate_kv_caches, load_model
from fleetserve.replica.testing import make_tiny_llama

ATOL = 1e-4
BLOCK = 4

CONFIGS = {
    "gqa": dict(num_heads=4, num_kv_heads=2),
    "mha_tied": dict(num_heads=4, num_kv_heads=4, tie_word_embeddings=True),
    "mqa_bias": dict(num_heads=6, num_kv_heads=1, hidden_size=96, attention_bias=True),
    "linear_rope": dict(num_heads=4, num_kv_heads=2, rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "llama3_rope": dict(
        num_heads=8,
        num_kv_heads=2,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "yarn_rope": dict(
        num_heads=4,
        num_kv_heads=2,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    ),
    "three_layers_headdim32": dict(num_layers=3, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32),
}


@pytest.fixture(autouse=True, params=["cpu-kernels", "plain-torch"])
def attention_path(request):
    """Every test here runs twice: with fleetserve's fused CPU kernels (when built) and with the
    plain PyTorch ops (what GPUs and compiler-less machines run: SDPA prefill, decode buffer)."""
    from fleetserve.replica import kernels

    if request.param == "cpu-kernels":
        yield request.param
    else:
        with kernels.disabled():
            yield request.param


class Setup:
    def __init__(self, path):
        from transformers import LlamaForCausalLM as HFLlama

        self.model, self.cfg = load_model(resolve_model(str(path)), torch.float32, "cpu")
        self.hf = HFLlama.from_pretrained(path, dtype=torch.float32).eval()
        self.free_blocks = list(range(1, 64))
        random.Random(0).shuffle(self.free_blocks)
        self.caches = allocate_kv_caches(self.cfg, 64, BLOCK, torch.float32)

    def blocks_for(self, n_tokens: int) -> list[int]:
        return [self.free_blocks.pop() for _ in range(-(-n_tokens // BLOCK))]

    def reference(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.hf(torch.tensor([ids])).logits[0]

    def step(self, chunks: list[tuple[list[int], int, list[int]]]) -> list[torch.Tensor]:
        """chunks: (new token ids, context_len, block table) per request -> logits per request [q, V]."""
        md = AttentionMetadata.build([len(c[0]) for c in chunks], [c[1] for c in chunks], [c[2] for c in chunks], BLOCK)
        ids = torch.tensor([t for c in chunks for t in c[0]])
        with torch.no_grad():
            logits = self.model.compute_logits(self.model(ids, md.positions, self.caches, md))
        assert logits.dtype == torch.float32
        out, start = [], 0
        for c in chunks:
            out.append(logits[start : start + len(c[0])])
            start += len(c[0])
        return out


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model_dir(request, tmp_path_factory):
    return make_tiny_llama(
        tmp_path_factory.mktemp(request.param), seed=sorted(CONFIGS).index(request.param), **CONFIGS[request.param]
    )


@pytest.fixture
def setup(model_dir):
    return Setup(model_dir)


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def test_full_prefill_then_paged_decode(setup):
    ids = _prompt(23, 1, setup.cfg.vocab_size)
    ref = setup.reference(ids)
    table = setup.blocks_for(len(ids))
    (prefill,) = setup.step([(ids[:15], 0, table)])
    torch.testing.assert_close(prefill, ref[:15], atol=ATOL, rtol=0)
    for t in range(15, len(ids)):
        (dec,) = setup.step([(ids[t : t + 1], t, table)])
        torch.testing.assert_close(dec[0], ref[t], atol=ATOL, rtol=0)


def test_chunked_prefill_with_cached_context(setup):
    ids = _prompt(30, 2, setup.cfg.vocab_size)
    ref = setup.reference(ids)
    table = setup.blocks_for(len(ids))
    got = []
    for start, end in [(0, 7), (7, 8), (8, 21), (21, 30)]:  # uneven chunks, one of a single token
        (logits,) = setup.step([(ids[start:end], start, table)])
        got.append(logits)
    torch.testing.assert_close(torch.cat(got), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("order", ["interleaved", "decodes_first"])
def test_mixed_batch(setup, order):
    """Fresh prefill, prefill continuation and two decodes in one forward."""
    v = setup.cfg.vocab_size
    fresh, cont, dec1, dec2 = _prompt(9, 3, v), _prompt(17, 4, v), _prompt(12, 5, v), _prompt(6, 6, v)
    tables = {
        name: setup.blocks_for(len(s)) for name, s in [("fresh", fresh), ("cont", cont), ("dec1", dec1), ("dec2", dec2)]
    }
    # Earlier steps: the continuation has 10 tokens cached, the decodes all but their last token.
    setup.step([(cont[:10], 0, tables["cont"]), (dec1[:11], 0, tables["dec1"])])
    setup.step([(dec2[:5], 0, tables["dec2"])])
    chunks = {
        "fresh": (fresh, 0, tables["fresh"]),
        "cont": (cont[10:], 10, tables["cont"]),
        "dec1": (dec1[11:], 11, tables["dec1"]),
        "dec2": (dec2[5:], 5, tables["dec2"]),
    }
    names = ["fresh", "dec1", "cont", "dec2"] if order == "interleaved" else ["dec1", "dec2", "fresh", "cont"]
    got = dict(zip(names, setup.step([chunks[n] for n in names])))
    torch.testing.assert_close(got["fresh"], setup.reference(fresh), atol=ATOL, rtol=0)
    torch.testing.assert_close(got["cont"], setup.reference(cont)[10:], atol=ATOL, rtol=0)
    torch.testing.assert_close(got["dec1"][0], setup.reference(dec1)[11], atol=ATOL, rtol=0)
    torch.testing.assert_close(got["dec2"][0], setup.reference(dec2)[5], atol=ATOL, rtol=0)


@pytest.mark.parametrize("max_pack", [2048, 20])
def test_packed_fresh_prompts(setup, monkeypatch, max_pack):
    """Several new prompts in one step: adjacent ones are attended in one packed call (the
    plain-torch path; the CPU kernel takes every token itself), a continuation between them
    breaks the pack, and the token cap splits it. Each prompt's logits equal its own forward."""
    from fleetserve.replica.layers.attention import PagedAttention

    monkeypatch.setattr(AttentionMetadata, "max_pack_tokens", max_pack)
    monkeypatch.setattr(PagedAttention, "pack_prefills", True)  # GPU only by default
    v = setup.cfg.vocab_size
    fresh = [_prompt(n, 30 + n, v) for n in (9, 14, 5, 11)]
    cont = _prompt(12, 7, v)
    tables = [setup.blocks_for(len(s)) for s in fresh]
    cont_table = setup.blocks_for(len(cont))
    setup.step([(cont[:4], 0, cont_table)])
    # tokens: fresh0 [0, 9), fresh1 [9, 23) | cont [23, 31) | fresh2 [31, 36), fresh3 [36, 47)
    chunks = [
        (fresh[0], 0, tables[0]),
        (fresh[1], 0, tables[1]),
        (cont[4:], 4, cont_table),
        (fresh[2], 0, tables[2]),
        (fresh[3], 0, tables[3]),
    ]
    md = AttentionMetadata.build([len(c[0]) for c in chunks], [c[1] for c in chunks], [c[2] for c in chunks], BLOCK)
    packs = [(p.start, p.end, p.seg_lens) for p in md.prefill_packs]
    if max_pack == 2048:
        assert packs == [(0, 23, [9, 14]), (31, 47, [5, 11])]
    else:  # 9 + 14 tokens exceed the cap: those two run one by one
        assert packs == [(31, 47, [5, 11])]
    assert [c.packed for c in md.prefills] == [max_pack == 2048, max_pack == 2048, False, True, True]
    got = setup.step(chunks)
    for c, g in zip(chunks, got):
        ids = c[0] if c[1] == 0 else cont
        torch.testing.assert_close(g, setup.reference(ids)[c[1] :], atol=ATOL, rtol=0)


def test_decode_batch_of_different_lengths(setup):
    v = setup.cfg.vocab_size
    seqs = [_prompt(n, 10 + n, v) for n in (2, 5, 9, 13, 4)]
    tables = [setup.blocks_for(len(s)) for s in seqs]
    setup.step([(s[:-1], 0, t) for s, t in zip(seqs, tables)])
    got = setup.step([(s[-1:], len(s) - 1, t) for s, t in zip(seqs, tables)])
    for s, g in zip(seqs, got):
        torch.testing.assert_close(g[0], setup.reference(s)[-1], atol=ATOL, rtol=0)


def test_bf16_close_to_hf(tmp_path):
    """bf16 end to end (both attention paths, see the fixture): as close to HF's float32 logits as
    HF's own bf16 run is (within 1.5x its error), and the same argmax wherever float32's top-2
    margin is wider than that noise (a random tiny model has near-ties that any rounding flips)."""
    from transformers import LlamaForCausalLM as HFLlama

    path = make_tiny_llama(tmp_path, num_heads=4, num_kv_heads=2)
    model, cfg = load_model(resolve_model(str(path)), torch.bfloat16, "cpu")
    hf16 = HFLlama.from_pretrained(path, dtype=torch.bfloat16).eval()
    hf32 = HFLlama.from_pretrained(path, dtype=torch.float32).eval()
    for seed in (7, 8, 9):
        ids = _prompt(20, seed, cfg.vocab_size)
        caches = allocate_kv_caches(cfg, 8, BLOCK, torch.bfloat16)
        md = AttentionMetadata.build([20], [0], [list(range(1, 6))], BLOCK)
        with torch.no_grad():
            ours = model.compute_logits(model(torch.tensor(ids), md.positions, caches, md))
            ref16 = hf16(torch.tensor([ids])).logits[0].float()
            ref = hf32(torch.tensor([ids])).logits[0].float()
        noise = (ref16 - ref).abs().max()
        assert (ours - ref).abs().max() <= 1.5 * noise + 1e-3
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * noise
        assert clear.sum() >= 5  # the check below is not vacuous
        assert torch.equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear])


def test_metadata_indices():
    md = AttentionMetadata.build([3, 1, 2], [0, 5, 4], [[7], [2, 9], [4, 6]], 4)
    assert md.positions.tolist() == [0, 1, 2, 5, 4, 5]
    assert md.slot_mapping.tolist() == [28, 29, 30, 37, 24, 25]
    assert md.last_token_indices.tolist() == [2, 3, 5]
    assert md.num_decodes == 1 and md.decode_slice == slice(3, 4)
    assert [(c.start, c.end, c.context_len) for c in md.prefills] == [(0, 3, 0), (4, 6, 4)]
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionMetadata.build([4], [1], [[0]], 4)


@pytest.mark.parametrize(
    "dtype,fused_silu",
    [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)],
    ids=["fp32", "bf16", "bf16-unfused"],
)
def test_kernel_layer_loop_equals_the_modules_bit_for_bit(tmp_path, monkeypatch, attention_path, dtype, fused_silu):
    """Where every linear is packed for the small-M kernel (one rank, CPU kernels built),
    LlamaModel runs its layers in one kernel call (`llama_layers`, a C++ loop over the same kernels;
    _kernel_plan) instead of through the modules. Same ops, same order: logits and KV caches equal
    the modules' (FLEETSERVE_KERNEL_LAYERS=0)
    bit for bit, on a mixed step (fresh prompt, continuation, decodes; biases on q/k/v and o),
    in every ISA build (test_cpu_kernel_isas.py). An edited weight, too many rows, or a
    layer-wise KV hook send it back to the modules; a repack brings the loop back, and a
    replaced Parameter is what the loop uses next."""
    from fleetserve.replica.layers import pack_linear_weights
    from fleetserve.replica.layers.linear import _can_pack_small_m, small_m_rows

    if not fused_silu:  # bf16 gate|up through linear_bf16 and silu_and_mul
        monkeypatch.setenv("FLEETSERVE_FUSED_SILU_MUL", "0")
    path = make_tiny_llama(tmp_path, num_heads=6, num_kv_heads=2, hidden_size=96, attention_bias=True, num_layers=3)
    model, cfg = load_model(resolve_model(str(path)), dtype, "cpu")
    layer_calls = []
    model.model.layers[0].register_forward_pre_hook(lambda *_: layer_calls.append(1))
    v = cfg.vocab_size
    seqs = [_prompt(n, 40 + n, v) for n in (9, 17, 12, 6)]
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(4)]
    first = [(seqs[1][:10], 0, tables[1]), (seqs[2][:11], 0, tables[2]), (seqs[3][:5], 0, tables[3])]
    mixed = [
        (seqs[0], 0, tables[0]),
        (seqs[2][11:], 11, tables[2]),
        (seqs[1][10:], 10, tables[1]),
        (seqs[3][5:], 5, tables[3]),
    ]

    def run(kernel_layers: bool, kv_hooks=None):
        monkeypatch.setenv("FLEETSERVE_KERNEL_LAYERS", "1" if kernel_layers else "0")
        caches = allocate_kv_caches(cfg, 40, BLOCK, dtype)
        layer_calls.clear()
        out = []
        for chunks in (first, mixed):
            md = AttentionMetadata.build(
                [len(c[0]) for c in chunks], [c[1] for c in chunks], [c[2] for c in chunks], BLOCK
            )
            ids = torch.tensor([t for c in chunks for t in c[0]])
            with torch.no_grad():
                out.append(model.compute_logits(model(ids, md.positions, caches, md, kv_hooks)))
        return out, caches, len(layer_calls)

    expect_loop = attention_path == "cpu-kernels" and _can_pack_small_m(model.model.layers[0].mlp.down_proj.weight)
    ref, ref_caches, calls = run(False)
    assert calls == 2
    got, caches, calls = run(True)
    assert calls == (0 if expect_loop else 2)
    for a, b in zip(got + caches, ref + ref_caches):
        assert torch.equal(a, b)

    class Hooks:  # a KV connector's layer-wise hooks: they need the modules' per-layer loop
        def wait_for_layer_load(self, i):
            pass

        def save_kv_layer(self, i, kv, md):
            pass

    hooked, _, calls = run(True, Hooks())
    assert calls == 2 and all(torch.equal(a, b) for a, b in zip(hooked, ref))
    if not expect_loop:
        return
    # 20 rows at most: the first step (26 rows) goes through the modules, the mixed one (18) not.
    monkeypatch.setenv("FLEETSERVE_SMALL_M_ROWS", "20")
    pack_linear_weights(model)
    assert small_m_rows(dtype) == 20
    ref, ref_caches, calls = run(False)
    got, caches, calls = run(True)
    assert calls == 1 and all(torch.equal(a, b) for a, b in zip(got + caches, ref + ref_caches))
    monkeypatch.delenv("FLEETSERVE_SMALL_M_ROWS")
    pack_linear_weights(model)
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight.mul_(1.5)  # edited: its packed copies are stale
    ref, ref_caches, _ = run(False)
    got, caches, calls = run(True)
    assert calls == 2 and all(torch.equal(a, b) for a, b in zip(got + caches, ref + ref_caches))
    pack_linear_weights(model)  # repacked: the loop again, with the edited weight
    ref, ref_caches, _ = run(False)
    got, caches, calls = run(True)
    assert calls == 0 and all(torch.equal(a, b) for a, b in zip(got + caches, ref + ref_caches))
    down = model.model.layers[2].mlp.down_proj
    kept, down._small_m = down._small_m, None  # a packing set aside (benchmarks/decode_step.py does)
    assert run(True)[2] == 2
    down._small_m = kept
    assert run(True)[2] == 0
    norm = model.model.layers[1].post_attention_layernorm
    norm.weight = torch.nn.Parameter(norm.weight.detach() * 1.25, requires_grad=False)  # a new Parameter
    ref, ref_caches, _ = run(False)
    got, caches, calls = run(True)  # the loop, rebuilt with the new Parameter
    assert calls == 0 and all(torch.equal(a, b) for a, b in zip(got + caches, ref + ref_caches))
