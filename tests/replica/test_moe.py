"""Mixture of experts: the FusedMoE layer against a per-token reference, its tensor- and
expert-parallel shards, Mixtral and Qwen3-MoE against transformers (fp32, paged cache), both
checkpoint layouts, and --enable-expert-parallel end to end (TP=2 over Ray and gloo)."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F

from fleetserve.replica.distributed.parallel import TPGroup
from fleetserve.replica.layers.attention import AttentionMetadata
from fleetserve.replica.layers.moe import DOWN, GATE, UP, FusedMoE, SparseMoeBlock, select_experts
from fleetserve.replica.model_loader.registry import resolve_model
from fleetserve.replica.model_loader.weights import allocate_kv_caches, load_model
from tests.replica.hf_compare import assert_same_outputs

ATOL = 1e-4
BLOCK = 4


# --------------------------------------------------------------------------- the layer


def _reference_moe(x, gate_w, w1, w3, w2, top_k, renormalize):
    """Token by token, expert by expert: what the layer must equal."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t] @ gate_w.T, dim=-1)
        weights, ids = torch.topk(probs, top_k)
        if renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights.tolist(), ids.tolist()):
            out[t] += w * (w2[e] @ (F.silu(w1[e] @ x[t]) * (w3[e] @ x[t])))
    return out


def _random_experts(E, H, N, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(E, *shape, generator=g) * 0.2 for shape in ((N, H), (N, H), (H, N))]


class _Rank(TPGroup):
    """Rank `rank` of a `world`-rank group whose collectives are not called (the test sums the
    ranks' `local_experts` itself)."""

    def __init__(self, rank: int, world: int):
        super().__init__(rank, world, group=object())


def _build(E, H, N, w1, w3, w2, tp=None, ep=False):
    moe = FusedMoE(E, H, N, tp_group=tp or TPGroup(), enable_expert_parallel=ep)
    for e in range(E):
        for shard, w in ((GATE, w1), (UP, w3), (DOWN, w2)):
            param = moe.w2_weight if shard == DOWN else moe.w13_weight
            moe.weight_loader(param, w[e], (e, shard))
    return moe


@pytest.fixture(params=["grouped_mm", "per-expert"])
def experts_path(request, monkeypatch):
    """The layer tests run with the expert matmuls as grouped GEMMs and one expert at a time."""
    if request.param == "grouped_mm" and not hasattr(F, "grouped_mm"):
        pytest.skip("this torch has no grouped_mm")
    grouped = request.param == "grouped_mm"
    monkeypatch.setattr(FusedMoE, "grouped_mm", grouped)

    def not_this_path(*args):
        raise AssertionError(f"the {request.param} test ran the other path")

    monkeypatch.setattr(FusedMoE, "_run_each" if grouped else "_run_grouped", not_this_path)
    return request.param


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("T", [1, 5, 37])
def test_layer_matches_per_token_reference(T, renormalize, experts_path):
    E, H, N, k = 8, 24, 20, 3
    w1, w3, w2 = _random_experts(E, H, N, seed=T)
    gate_w = torch.randn(E, H, generator=torch.Generator().manual_seed(100 + T))
    block = SparseMoeBlock(E, k, H, N, renormalize=renormalize)
    block.gate.weight.data.copy_(gate_w)
    block.experts = _build(E, H, N, w1, w3, w2)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(200 + T))
    ref = _reference_moe(x, gate_w, w1, w3, w2, k, renormalize)
    torch.testing.assert_close(block(x), ref, atol=1e-5, rtol=1e-5)


def test_a_gpu_that_refuses_grouped_mm_falls_back(monkeypatch, caplog):
    """Off the CPU, a grouped GEMM the device's build refuses switches the layers to the
    per-expert matmuls (logged once) instead of failing the step; shapes only, on 'meta'."""
    from fleetserve.replica.layers import moe as moe_module

    def refuse(*args):
        raise RuntimeError("grouped gemm is only supported on CUDA devices with compute capability = 9.0")

    monkeypatch.setattr(FusedMoE, "grouped_mm", True)
    monkeypatch.setattr(FusedMoE, "_run_grouped", refuse)
    monkeypatch.setattr(moe_module, "_grouped_mm_runs", lambda x: True)
    with torch.device("meta"):
        layer = FusedMoE(4, 16, 8)
        xs = torch.empty(6, 16)
    ys = layer.run_experts(xs, torch.tensor([2, 0, 3, 1]))
    assert ys.shape == (6, 16) and FusedMoE.grouped_mm is False
    assert "grouped_mm refused" in caplog.text


def test_select_experts_normalisation():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w, ids = select_experts(logits, 2, renormalize=True)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(w, torch.softmax(torch.tensor([[2.0, 1.0]]), dim=-1))  # softmax of the top k
    w, _ = select_experts(logits, 2, renormalize=False)
    torch.testing.assert_close(w, torch.softmax(logits, dim=-1)[:, :2])
    assert w.sum() < 1


@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
@pytest.mark.parametrize("world", [2, 4])
def test_rank_shares_sum_to_the_whole(world, ep, experts_path):
    """Each rank's share (an intermediate slice of every expert, or whole experts with EP),
    summed as the all-reduce would, is the one-rank output; with EP each rank holds E/world."""
    E, H, N, k, T = 8, 16, 16, 2, 19  # sizes whose shards stay 16-byte aligned for grouped_mm
    w1, w3, w2 = _random_experts(E, H, N, seed=world)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    weights, ids = select_experts(torch.randn(T, E, generator=torch.Generator().manual_seed(2)), k, True)
    whole = _build(E, H, N, w1, w3, w2)(x, weights, ids)
    ranks = [_build(E, H, N, w1, w3, w2, tp=_Rank(r, world), ep=ep) for r in range(world)]
    for r, moe in enumerate(ranks):
        if ep:
            assert moe.w13_weight.shape == (E // world, 2 * N, H) and moe.expert_start == r * E // world
        else:
            assert moe.w13_weight.shape == (E, 2 * N // world, H) and moe.w2_weight.shape == (E, H, N // world)
    total = sum(moe.local_experts(x, weights, ids) for moe in ranks)
    torch.testing.assert_close(total, whole, atol=1e-5, rtol=1e-5)


def test_layer_refuses_what_does_not_split():
    with pytest.raises(ValueError, match=r"number of experts \(6\) is not divisible by the tensor-parallel size \(4\)"):
        FusedMoE(6, 16, 8, tp_group=_Rank(0, 4), enable_expert_parallel=True)
    with pytest.raises(ValueError, match="intermediate size"):
        FusedMoE(8, 16, 6, tp_group=_Rank(0, 4))
    moe = FusedMoE(4, 16, 8)
    with pytest.raises(ValueError, match="shape mismatch loading expert 1"):
        moe.weight_loader(moe.w13_weight, torch.zeros(8, 15), (1, GATE))
    with pytest.raises(ValueError, match="expert 4 out of range"):
        moe.weight_loader(moe.w13_weight, torch.zeros(8, 16), (4, GATE))


# --------------------------------------------------------------------------- the models

SMALL = dict(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def _config(family: str):
    from transformers import MixtralConfig, Qwen3MoeConfig

    if family == "mixtral":
        return MixtralConfig(**SMALL, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)
    # Layer 0 dense (mlp_only_layers), 1 sparse, 2 dense ((2 + 1) % 2): both MLP kinds and HF's rule.
    return Qwen3MoeConfig(
        **SMALL,
        head_dim=16,
        intermediate_size=80,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=3,
        decoder_sparse_step=2 if family == "qwen3_moe" else 1,
        mlp_only_layers=[0] if family == "qwen3_moe" else [],
        norm_topk_prob=family == "qwen3_moe_norm_topk",
    )


FAMILIES = ["mixtral", "qwen3_moe", "qwen3_moe_norm_topk"]


@pytest.fixture(scope="module", params=FAMILIES)
def moe_dir(request, tmp_path_factory):
    from fleetserve.replica.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp(request.param), _config(request.param), seed=3)


class Setup:
    def __init__(self, path):
        from transformers import AutoModelForCausalLM

        self.model, self.cfg = load_model(resolve_model(str(path)), torch.float32, "cpu")
        self.hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.free = list(range(1, 64))
        random.Random(0).shuffle(self.free)
        self.caches = allocate_kv_caches(self.cfg, 64, BLOCK, torch.float32)

    def blocks_for(self, n: int) -> list[int]:
        return [self.free.pop() for _ in range(-(-n // BLOCK))]

    def reference(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.hf(torch.tensor([ids])).logits[0]

    def step(self, chunks):
        md = AttentionMetadata.build([len(c[0]) for c in chunks], [c[1] for c in chunks], [c[2] for c in chunks], BLOCK)
        ids = torch.tensor([t for c in chunks for t in c[0]])
        with torch.no_grad():
            logits = self.model.compute_logits(self.model(ids, md.positions, self.caches, md))
        return list(logits.split([len(c[0]) for c in chunks]))


@pytest.fixture(scope="module")
def setup(moe_dir):
    return Setup(moe_dir)


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_model_structure(setup):
    layers = list(setup.model.model.decoder_layers())
    kinds = [type(layer.mlp).__name__ for layer in layers]
    if setup.cfg.model_type == "mixtral":
        assert kinds == ["MixtralSparseMoeBlock"] * 3
    elif setup.cfg.decoder_sparse_step == 2:
        assert kinds == ["LlamaMLP", "Qwen3MoeSparseMoeBlock", "LlamaMLP"]
    else:
        assert kinds == ["Qwen3MoeSparseMoeBlock"] * 3
    if setup.cfg.model_type == "qwen3_moe":
        assert type(layers[0].self_attn).__name__ == "Qwen3Attention"


@pytest.mark.parametrize("path", ["cpu-kernels", "plain-torch"])
def test_batched_prompts_then_greedy_decode_match_hf(setup, path):
    """Three prompts of different lengths prefilled in one step (the experts see all their
    tokens together), then decoded greedily together: logits close to HF's full forward at
    every position and the same greedy tokens as HF's argmax. With fleetserve's CPU kernels
    (when built: attention, rope by positions) and with plain PyTorch ops (what GPUs run)."""
    import contextlib

    from fleetserve.replica import kernels

    with kernels.disabled() if path == "plain-torch" else contextlib.nullcontext():
        _batched_then_greedy(setup)


def _batched_then_greedy(setup):
    v = setup.cfg.vocab_size
    seqs = [_prompt(n, 10 + n, v) for n in (3, 11, 23)]
    tables = [setup.blocks_for(len(s) + 6) for s in seqs]
    got = setup.step([(s, 0, t) for s, t in zip(seqs, tables)])
    for s, g in zip(seqs, got):
        torch.testing.assert_close(g, setup.reference(s), atol=ATOL, rtol=0)
    for _ in range(6):
        nxt = [int(g[-1].argmax()) for g in got]
        for s, t in zip(seqs, nxt):
            assert t == int(setup.reference(s)[-1].argmax())
            s.append(t)
        got = setup.step([(s[-1:], len(s) - 1, t) for s, t in zip(seqs, tables)])
        for s, g in zip(seqs, got):
            torch.testing.assert_close(g[0], setup.reference(s)[-1], atol=ATOL, rtol=0)


def test_fused_checkpoint_layout_loads_the_same(setup):
    """transformers 5's in-module layout (experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I], Mixtral's block under `mlp`) loads into the same weights as the per-expert files."""
    fused = {k: v for k, v in setup.hf.state_dict().items()}
    assert any(k.endswith(".experts.gate_up_proj") for k in fused)
    model, _ = load_model(resolve_model(str(setup.hf.name_or_path)), torch.float32, "cpu")
    model.load_weights(fused.items())
    for (name, a), (_, b) in zip(model.state_dict().items(), setup.model.state_dict().items()):
        assert torch.equal(a, b), name


def test_missing_expert_is_named(setup):
    from safetensors.torch import load_file

    weights = load_file(str(setup.hf.name_or_path) + "/model.safetensors")
    victim = next(k for k in sorted(weights) if ".experts.3." in k)
    del weights[victim]
    with pytest.raises(ValueError, match=r"1 weight\(s\) missing, e\.g\. .*experts\.3\."):
        setup.model.load_weights(weights.items())


def test_expert_parallel_refused_for_a_dense_model(tiny_model_dir):
    from fleetserve.replica.model_loader import model_info

    with pytest.raises(ValueError, match="--enable-expert-parallel: .* is not a mixture-of-experts model"):
        load_model(resolve_model(str(tiny_model_dir)), torch.float32, "cpu", enable_expert_parallel=True)
    with pytest.raises(ValueError, match="not a mixture-of-experts model"):
        model_info.check_tp_size(resolve_model(str(tiny_model_dir)), 1, expert_parallel=True)
    from fleetserve.replica.llm import LLM  # the flag reaches the worker's model loading

    with pytest.raises(ValueError, match="--enable-expert-parallel: LlamaForCausalLM is not a mixture-of-experts"):
        LLM(str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=16, enable_expert_parallel=True)


def test_tp_sizes_of_a_moe_model(tmp_path):
    """With EP the experts must split over the ranks, without it each expert's intermediate size."""
    from fleetserve.replica.model_loader import model_info

    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen3_moe",
                "architectures": ["Qwen3MoeForCausalLM"],
                "hidden_size": 96,
                "num_attention_heads": 12,
                "num_key_value_heads": 12,
                "num_hidden_layers": 2,
                "num_experts": 8,
                "moe_intermediate_size": 36,
                "intermediate_size": 100,  # no dense layer: not split, so not checked
            }
        )
    )
    source = resolve_model(str(tmp_path))
    shape = model_info.read_model_shape(source)
    assert (shape.num_experts, shape.expert_intermediate_size, shape.intermediate_size) == (8, 36, 0)
    with pytest.raises(ValueError, match=r"8 experts .*the sizes this model allows are 1, 2, 4$"):
        model_info.check_tp_size(source, 3, expert_parallel=True)
    model_info.check_tp_size(source, 3)  # 36 / 3
    with pytest.raises(ValueError, match=r"the experts' intermediate size 36 .*allows are 1, 2, 3, 4, 6, 12$"):
        model_info.check_tp_size(source, 8)
    model_info.check_tp_size(source, 4, expert_parallel=True)


# --------------------------------------------------------------------------- TP / EP end to end


@pytest.mark.slow
def test_tp2_and_expert_parallel_tp2_match_tp1(local_ray, tmp_path_factory):
    """Qwen3-MoE (dense and sparse layers) through LLM: TP=2 (each expert's intermediate size
    split) and TP=2 with --enable-expert-parallel (4 experts per rank) give TP=1's tokens and
    logprobs."""
    from fleetserve.replica.llm import LLM
    from fleetserve.replica.testing import make_tiny_model
    from fleetserve.scheduler import SamplingParams

    path = make_tiny_model(tmp_path_factory.mktemp("qwen3_moe_tp"), _config("qwen3_moe"), seed=5)
    prompts = ["The quick brown fox", "Hello, world! How are you today?", "def add(a, b):"]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    outs = {}
    for name, tp, ep in (("tp1", 1, False), ("tp2", 2, False), ("ep2", 2, True)):
        llm = LLM(
            str(path),
            dtype="float32",
            num_gpu_blocks_override=64,
            block_size=4,
            tensor_parallel_size=tp,
            enable_expert_parallel=ep,
            num_threads=1,
            max_num_batched_tokens=16,
            long_prefill_token_threshold=12,
        )
        try:
            outs[name] = [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]
        finally:
            llm.core.shutdown()
    for name in ("tp2", "ep2"):
        assert_same_outputs(outs["tp1"], outs[name], name)
