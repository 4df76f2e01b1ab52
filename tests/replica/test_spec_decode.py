"""Speculative decoding end to end on a tiny model: exact greedy and seeded output,
the target distribution preserved under sampling, n-gram lookup, bad configs."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from pydantic import ValidationError

from fleetserve.replica.engine.engine_args import EngineArgs
from fleetserve.replica.llm import LLM
from fleetserve.replica.spec_decode.ngram import NgramProposer
from fleetserve.scheduler import SamplingParams

PROMPTS = [
    "The quick brown fox",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "Hello, world! How are you today? I am fine, thank you. Paged attention stores keys",
    "A",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _tokens(llm, ids, sp):
    return [o.outputs[0].token_ids for o in llm.generate(ids, sp, use_tqdm=False)]


def _assert_idle(llm):
    sched = llm.core.scheduler
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    sched.kv.check_invariants()


GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=256)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    return llm, ids, _tokens(llm, ids, GREEDY)


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory):
    from fleetserve.replica.testing import make_tiny_llama

    # Same tokenizer, different random weights: most drafts are rejected.
    return make_tiny_llama(
        tmp_path_factory.mktemp("tiny-draft"), num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, seed=7
    )


VARIANTS = {
    "ngram": dict(),
    # 18 blocks x 4 tokens: the requests preempt each other while they speculate.
    "ngram_preemption": dict(num_gpu_blocks_override=18, block_size=4),
    "ngram_small_budget": dict(max_num_batched_tokens=6, long_prefill_token_threshold=5),
    # Earned draft lengths only, and every step's drafts topped up to k.
    "ngram_no_free_drafts": dict(spec_extra={"free_draft_tokens": 0}),
    "ngram_all_free_drafts": dict(spec_extra={"free_draft_tokens": 64}),
    "draft_self": dict(spec="self"),
    "draft_other": dict(spec="other", num_gpu_blocks_override=24, block_size=4),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_output_identical_to_plain_decoding(tiny_model_dir, other_draft_dir, plain, variant):
    _, ids, want = plain
    kwargs = dict(dtype="float32", num_gpu_blocks_override=256)
    kwargs.update(VARIANTS[variant])
    which = kwargs.pop("spec", None)
    draft = {"self": tiny_model_dir, "other": other_draft_dir}.get(which)
    spec = NGRAM if draft is None else {"model": str(draft), "num_speculative_tokens": 3}
    spec = {**spec, **kwargs.pop("spec_extra", {})}
    llm = LLM(str(tiny_model_dir), speculative_config=spec, **kwargs)
    for _ in range(2 if variant == "ngram" else 1):  # a second pass hits the prefix cache
        assert _tokens(llm, ids, GREEDY) == want
    stats = llm.core.scheduler.get_stats().spec_decoding
    assert stats.num_draft_tokens > 0
    if which == "self":  # a draft model identical to the target: every draft is right
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    elif which == "other":  # random weights: drafts are rejected, output unchanged
        assert stats.num_accepted_tokens < stats.num_draft_tokens
    else:
        assert stats.num_accepted_tokens > 0
    if variant == "ngram_preemption":
        assert llm.core.scheduler.num_preemptions > 0
    _assert_idle(llm)


def test_seeded_sampling_with_penalties_and_logprobs_unchanged(tiny_model_dir, plain):
    """Every position is drawn with the seeded draw of its output index and the
    penalties of the outputs before it: the same tokens and logprobs as plain decoding."""
    base, ids, _ = plain
    ids = ids + [base.tokenizer.encode("a b c a b c a b c a b c")] * 2
    penalties = dict(
        repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2, min_tokens=5, top_k=50, top_p=0.95
    )
    # Penalised rows rarely repeat themselves (few drafts); the low-temperature
    # ones do, so drafts are both accepted and rejected.
    sps = [
        SamplingParams(
            temperature=0.9 if i % 2 else 0.05,
            seed=11 + i,
            max_tokens=20,
            ignore_eos=True,
            logprobs=2,
            **(penalties if i % 2 else {}),
        )
        for i in range(len(ids))
    ]
    want = base.generate(ids, sps, use_tqdm=False)
    llm = LLM(str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=256, speculative_config=NGRAM)
    got = llm.generate(ids, sps, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            assert lw.keys() == lg.keys()
            assert all(abs(lw[t] - lg[t]) < 1e-4 for t in lw)
    assert llm.core.scheduler.get_stats().spec_decoding.num_accepted_tokens > 0
    _assert_idle(llm)


def test_sampling_preserves_the_target_distribution(tiny_model_dir):
    """Unseeded temperature sampling, many requests with and without drafts:
    the empirical distribution of each output position must agree. The draft
    model is the target itself, proposing its argmax at every position, so
    every position after the first goes through verification and drafts are
    accepted about a third of the time (T=0.3 here). Chi-square test of
    homogeneity per position (rare tokens pooled), Bonferroni over positions,
    alpha = 1e-3: a correct verifier fails this one run in a thousand; one that
    keeps the greedy draft whenever it is plausible, or resamples wrongly after
    a rejection, shifts the mass on the argmax by tens of percent and fails."""
    from scipy.stats import chi2_contingency

    num, positions = 1000, (1, 2, 3)
    sp = SamplingParams(temperature=0.3, max_tokens=4, ignore_eos=True)
    samples = {}
    for name, spec in (("plain", None), ("spec", {"model": str(tiny_model_dir), "num_speculative_tokens": 3})):
        llm = LLM(
            str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=512, max_num_seqs=256, speculative_config=spec
        )
        ids = llm.tokenizer.encode("The quick brown fox")
        samples[name] = np.array(_tokens(llm, [ids] * num, sp))
        if spec is not None:
            stats = llm.core.scheduler.get_stats().spec_decoding
            # Drafts were both accepted and rejected: both paths of the verifier ran.
            assert 0.1 * stats.num_draft_tokens < stats.num_accepted_tokens < 0.9 * stats.num_draft_tokens
    for pos in positions:
        a, b = samples["plain"][:, pos], samples["spec"][:, pos]
        cats, counts = np.unique(np.concatenate([a, b]), return_counts=True)
        common = cats[counts >= 20]  # expected >= 10 per cell; the rest pooled in one column
        table = np.array([[np.sum(x == c) for c in common] + [np.sum(~np.isin(x, common))] for x in (a, b)])
        table = table[:, table.sum(0) > 0]
        p = chi2_contingency(table)[1]
        assert p > 1e-3 / len(positions), (pos, p, table)


def test_async_engine_core_process_streams_drafts_and_exports_metrics(tiny_model_dir, plain):
    """The default serving path (engine core in its own process): several
    tokens per step stream correctly, and the counters reach /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    from fleetserve.replica.engine.async_engine import AsyncEngine

    _, ids, want = plain
    engine = AsyncEngine(
        model=str(tiny_model_dir),
        dtype="float32",
        num_gpu_blocks_override=128,
        core_process=True,
        speculative_config=NGRAM,
    )
    try:

        async def collect(prompt, rid):
            tokens = []
            async for out in engine.generate(prompt, GREEDY, rid):
                tokens += out.outputs[0].token_ids
            return tokens

        async def main():
            return await asyncio.gather(*[collect(p, f"s{i}") for i, p in enumerate(ids)])

        assert asyncio.run(main()) == want
        samples = {
            (s.name, s.labels.get("position")): s.value
            for fam in text_string_to_metric_families(engine.metrics_text())
            for s in fam.samples
            if fam.name.startswith("vllm:spec_decode")
        }
        drafts = samples[("vllm:spec_decode_num_draft_tokens_total", None)]
        accepted = samples[("vllm:spec_decode_num_accepted_tokens_total", None)]
        assert samples[("vllm:spec_decode_num_drafts_total", None)] > 0 and 0 < accepted <= drafts
        assert samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", "0")] > 0
        assert (
            sum(v for (name, pos), v in samples.items() if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total")
            == accepted
        )
        assert engine.get_load()["num_free_blocks"] == engine.get_load()["num_blocks"]
    finally:
        engine.shutdown()


def test_ngram_lookup():
    p = NgramProposer(4, 2, 4)
    assert p.propose_one(np.array([1, 2, 3, 4, 5, 9, 9, 1, 2, 3])) == [4, 5, 9, 9]
    assert p.propose_one(np.array([1, 2, 3, 4, 5, 6, 7, 8])) == []  # no repeated n-gram
    # The longest match wins over a more recent shorter one.
    assert p.propose_one(np.array([5, 2, 3, 9, 1, 2, 3, 8, 7, 2, 3, 6, 1, 2, 3])) == [8, 7, 2, 3]
    # Equal lengths: the latest occurrence; a match near the end proposes fewer tokens.
    assert p.propose_one(np.array([7, 8, 1, 7, 8, 2, 7, 8])) == [2, 7, 8]
    assert NgramProposer(4, 3, 3).propose_one(np.array([1, 2, 1, 2])) == []  # shorter than min


def test_free_draft_tokens_default_per_device_and_explicit():
    def resolved(device="cpu", **extra):
        args = EngineArgs(device=device, speculative_config={**NGRAM, **extra})
        return args.scheduler_config(256).free_draft_tokens

    assert resolved() == 8
    assert resolved("cuda") == 64
    assert resolved(free_draft_tokens=0) == 0 and resolved("cuda", free_draft_tokens=3) == 3
    assert EngineArgs(device="cpu").scheduler_config(256).free_draft_tokens == 0  # no speculation
    with pytest.raises(ValidationError, match="free_draft_tokens"):
        EngineArgs(speculative_config={**NGRAM, "free_draft_tokens": -1})


def test_bad_speculative_configs_are_refused_clearly(tiny_model_dir, other_draft_dir, tmp_path):
    with pytest.raises(ValidationError, match="not valid JSON"):
        EngineArgs(speculative_config="{method: ngram")
    with pytest.raises(ValidationError, match="num_speculative_tokens"):
        EngineArgs(speculative_config={"method": "ngram"})
    with pytest.raises(ValidationError, match="prompt_lookup_min"):
        EngineArgs(
            speculative_config={
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            }
        )
    with pytest.raises(ValidationError, match="tensor_parallel_size 1"):
        EngineArgs(
            tensor_parallel_size=2, speculative_config={"model": str(other_draft_dir), "num_speculative_tokens": 2}
        )
    from fleetserve.replica.testing import make_tiny_llama

    other_vocab = make_tiny_llama(
        tmp_path / "v", vocab_size=300, num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1
    )
    with pytest.raises(ValueError, match="share the tokenizer"):
        LLM(
            str(tiny_model_dir),
            dtype="float32",
            num_gpu_blocks_override=64,
            speculative_config={"model": str(other_vocab), "num_speculative_tokens": 2},
        )


@pytest.mark.real_model
@pytest.mark.slow
def test_real_model_copy_prompts_greedy_identical_and_mostly_accepted():
    """SmolLM2-135M, float32: asked to quote a passage, n-gram drafts are mostly
    accepted, and the answer is token for token the plain engine's."""
    from fleetserve.replica.engine.tokenizer import apply_chat_template

    passage = (
        "The lighthouse stood at the end of a narrow spit of rock, and for ninety years its "
        "keepers climbed the same one hundred and twelve steps every evening to light the lamp."
    )
    chats = [
        [{"role": "user", "content": f"Repeat the following text exactly:\n\n{passage}"}],
        [{"role": "user", "content": f"Copy this text and add a title to it:\n\n{passage}"}],
    ]
    sp = SamplingParams(temperature=0.0, max_tokens=40)
    kw = dict(dtype="float32", num_gpu_blocks_override=64, max_num_batched_tokens=64)
    plain = LLM("smollm2-135m", **kw)
    ids = [plain.tokenizer.encode(apply_chat_template(plain.tokenizer, c), add_special_tokens=False) for c in chats]
    want = _tokens(plain, ids, sp)
    del plain
    llm = LLM(
        "smollm2-135m",
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 5,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
        },
        **kw,
    )
    assert _tokens(llm, ids, sp) == want
    stats = llm.core.scheduler.get_stats().spec_decoding
    assert stats.num_accepted_tokens > 0.5 * stats.num_draft_tokens
    _assert_idle(llm)
