"""Every registered family through the engine's features, on a tiny random model of each:
prefix caching, n-gram speculative decoding, structured outputs, and a KV hand-off between
two engines of the same model (SharedStorageConnector). Numerical agreement with HF
transformers is each family's own test (test_model_vs_hf, test_qwen3_phi3, test_gemma3,
test_moe); here the features must not change a family's greedy tokens and must leave the
engine idle with every block back in the pool."""

from __future__ import annotations

import json

import pytest

from fleetserve.replica.llm import LLM
from fleetserve.replica.models import MODELS, architecture_of
from fleetserve.scheduler import SamplingParams
from fleetserve.scheduler.structured_outputs import StructuredOutputsParams
from tests.replica.hf_compare import assert_same_outputs

BS = 8
SMALL = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
# family -> (transformers config class, its fields over SMALL, make_tiny_model kwargs)
FAMILIES: dict[str, tuple[str, dict, dict]] = {
    "llama": ("LlamaConfig", {}, {}),
    "mistral": ("MistralConfig", {"sliding_window": 24}, {}),
    "qwen2": ("Qwen2Config", {}, {}),
    "qwen3": ("Qwen3Config", {"head_dim": 24}, {}),
    "phi3": ("Phi3Config", {"pad_token_id": 0}, {}),
    "gemma3": (
        "Gemma3TextConfig",
        {"head_dim": 16, "sliding_window": 24, "query_pre_attn_scalar": 16, "layer_types": None},
        {"norm_center": 0.0},
    ),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}, {}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
        {},
    ),
}


def _implemented(arch: str) -> bool:
    import importlib.util

    module = MODELS[arch][0]
    return importlib.util.find_spec(f"fleetserve.replica.models.{module}") is not None


def _family_model(name: str, tmp_path_factory):
    import transformers

    from fleetserve.replica.testing import make_tiny_model

    cls_name, fields, make_kwargs = FAMILIES[name]
    config = getattr(transformers, cls_name)(**{**SMALL, **fields})
    arch = architecture_of(config)
    if not _implemented(arch):
        pytest.skip(f"{arch} is registered but its module is not written yet")
    return make_tiny_model(tmp_path_factory.mktemp(name), config, **make_kwargs)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_dir(request, tmp_path_factory):
    return request.param, _family_model(request.param, tmp_path_factory)


PROMPTS = [
    [5 + (7 * i) % 300 for i in range(21)],
    [9 + (11 * i) % 350 for i in range(43)],
    # repeats, so that n-gram lookup finds drafts
    [20, 21, 22, 23, 24] * 9,
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _storage(path) -> dict:
    return {
        "kv_connector": "SharedStorageConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"path": str(path)},
    }


def _generate(llm: LLM, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


def _assert_idle(llm: LLM) -> None:
    core = llm.core
    # (not has_work: a grammar compile may still run after its request, and the workers hear of
    # finished requests with the next step)
    assert not core.scheduler.has_unfinished_requests() and not core.kv_pending()
    assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.num_blocks
    core.scheduler.kv.check_invariants()


def test_features_keep_greedy_tokens(family_dir, tmp_path):
    family, model = family_dir
    common = dict(dtype="float32", block_size=BS, num_gpu_blocks_override=96, max_model_len=256)

    plain = LLM(str(model), enable_prefix_caching=True, **common)
    try:
        first = _generate(plain)
        want = [list(o.outputs[0].token_ids) for o in first]
        assert all(len(t) == 12 for t in want)
        assert all(o.num_cached_tokens == 0 for o in first)
        # Prefix caching: the same prompts again are served from cached blocks, tokens unchanged.
        again = _generate(plain)
        assert [list(o.outputs[0].token_ids) for o in again] == want
        for o, p in zip(again, PROMPTS, strict=True):
            assert o.num_cached_tokens >= (len(p) - 1) // BS * BS > 0, (family, o.num_cached_tokens)
        # Structured outputs: a choice and a JSON schema under sampling.
        choice = SamplingParams(
            temperature=1.0, seed=1, max_tokens=16, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
        )
        (out,) = plain.generate("Answer:", choice, use_tqdm=False)
        assert out.outputs[0].text in ("yes", "no"), (family, out.outputs[0].text)
        schema = {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "required": ["a"],
            "additionalProperties": False,
        }
        js = SamplingParams(
            temperature=1.0, seed=2, max_tokens=48, structured_outputs=StructuredOutputsParams(json=schema)
        )
        (out,) = plain.generate("JSON:", js, use_tqdm=False)
        if out.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(out.outputs[0].text)["a"], int)
        _assert_idle(plain)
    finally:
        plain.shutdown()

    # n-gram speculative decoding, writing every full block to a shared folder.
    store = tmp_path / "kv"
    spec = LLM(str(model), speculative_config=NGRAM, kv_transfer_config=_storage(store), **common)
    try:
        assert [list(o.outputs[0].token_ids) for o in _generate(spec)] == want, family
        _assert_idle(spec)
    finally:
        spec.shutdown()

    # A second engine of the same model loads those blocks instead of computing them.
    loader = LLM(str(model), kv_transfer_config=_storage(store), **common)
    try:
        outs = _generate(loader)
        assert [list(o.outputs[0].token_ids) for o in outs] == want, family
        for o, p in zip(outs, PROMPTS, strict=True):
            assert o.num_remote_tokens >= (len(p) - 1) // BS * BS > 0, (family, o.num_remote_tokens)
        _assert_idle(loader)
    finally:
        loader.shutdown()


# Families whose TP=2 runs are not in their own module (Qwen3/Phi-3: test_qwen3_phi3, MoE:
# test_moe, Llama: test_tp): Gemma 3's sliding and global layers, (1 + w) norms and GeGLU.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3"])
def test_tp2_equals_tp1(name, local_ray, tmp_path_factory):
    model = _family_model(name, tmp_path_factory)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = []
    for tp in (1, 2):
        llm = LLM(
            str(model),
            dtype="float32",
            block_size=BS,
            num_gpu_blocks_override=64,
            max_model_len=256,
            num_threads=1,
            tensor_parallel_size=tp,
        )
        try:
            outs.append(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False))
        finally:
            llm.shutdown()
    tp1, tp2 = ([o.outputs[0] for o in run] for run in outs)
    assert_same_outputs(tp1, tp2, name)
