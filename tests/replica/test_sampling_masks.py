"""logit_bias and allowed_token_ids as per-request tensors, and rows whose masks leave no
token: the sampler draws exactly what the dense definition says, a step's setup never walks
a request's lists, and a row with nothing left to sample fails alone (issue 51)."""

from __future__ import annotations

import pytest
import torch

from fleetserve.replica.layers.sampler import RequestSamplingTensors, Sampler, SamplingBatch, make_generator
from fleetserve.scheduler.sampling_params import SamplingParams

EOS = 2
V = 300


class _Untouchable(dict):
    """A logit_bias that fails the test if anything walks it."""

    def _fail(self, *_a, **_k):
        raise AssertionError("the step's setup walked a request's logit_bias")

    __iter__ = items = keys = values = __getitem__ = get = _fail  # type: ignore[assignment]


class _UntouchableList(list):
    def _fail(self, *_a, **_k):
        raise AssertionError("the step's setup walked a request's allowed_token_ids")

    __iter__ = __getitem__ = _fail  # type: ignore[assignment]


def batch_of(params, tensors=None, outputs=None, seeds=None, vocab=V):
    n = len(params)
    gens = [None if s is None else make_generator(s, "cpu") for s in (seeds or [None] * n)]
    return SamplingBatch.build(params, [[5, 6]] * n, outputs or [[]] * n, gens, EOS, vocab, "cpu", tensors)


def dense(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The definition: add each row's bias, then -inf outside its allowed ids."""
    out = logits.clone()
    for i, p in enumerate(params):
        for t, v in (p.logit_bias or {}).items():
            out[i, t] += v
        if p.allowed_token_ids:
            keep = torch.zeros(out.shape[1], dtype=torch.bool)
            keep[p.allowed_token_ids] = True
            out[i, ~keep] = float("-inf")
    return out


def stripped(p: SamplingParams) -> SamplingParams:
    return p.replace(logit_bias=None, allowed_token_ids=None)


MIXED = [
    SamplingParams(temperature=0.0, logit_bias={7: 30.0, 8: -100.0}),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, allowed_token_ids=[40, 41, 299]),
    SamplingParams(temperature=1.0, logit_bias={i: 4.0 for i in range(0, V, 3)}),
    SamplingParams(temperature=0.7, top_k=20, allowed_token_ids=list(range(100, 160)), logit_bias={150: 5.0}),
    SamplingParams(temperature=1.0, top_p=0.8, allowed_token_ids=list(range(0, V, 2))),
    SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.05, logit_bias={1: -3.0, 2: 2.0}),
    SamplingParams(temperature=1.0),
]


def test_bias_and_allowed_ids_draw_exactly_what_the_dense_definition_draws():
    """Seeded rows: the same uniforms, so the same token as sampling the densely biased and
    masked logits without those fields, position for position (greedy, plain, top-k, top-p,
    min-p); a request's tensors also serve its repeated (draft) positions."""
    torch.manual_seed(0)
    for trial in range(20):
        logits = torch.randn(len(MIXED), V) * 3
        seeds = [1000 * trial + i for i in range(len(MIXED))]
        got = Sampler()(logits.clone(), batch_of(MIXED, seeds=seeds))
        want = Sampler()(dense(logits, MIXED), batch_of([stripped(p) for p in MIXED], seeds=seeds))
        assert got.sampled_token_ids == want.sampled_token_ids
        assert got.failed_rows == []
        for i, p in enumerate(MIXED):
            if p.allowed_token_ids:
                assert got.sampled_token_ids[i] in p.allowed_token_ids
    # Prebuilt tensors shared by several rows (a request's draft positions) give the same draws.
    logits = torch.randn(3, V)
    p = MIXED[4]
    t = RequestSamplingTensors.build(p, V, "cpu")
    shared = Sampler()(logits.clone(), batch_of([p] * 3, tensors=[t] * 3, seeds=[1, 2, 3]))
    fresh = Sampler()(logits.clone(), batch_of([p] * 3, seeds=[1, 2, 3]))
    assert shared.sampled_token_ids == fresh.sampled_token_ids


def test_allowed_ids_distribution_is_the_renormalized_softmax():
    """Unseeded random rows: chi-square against softmax(logits + bias) over the allowed ids."""
    from tests.replica.test_sampler import chi_square_ok

    row = torch.randn(V)
    p = SamplingParams(temperature=1.0, allowed_token_ids=[3, 9, 27, 81, 243], logit_bias={9: 1.5, 243: -1.0})
    rows = 6000
    t = RequestSamplingTensors.build(p, V, "cpu")
    torch.manual_seed(1)
    out = Sampler()(row.repeat(rows, 1), batch_of([p] * rows, tensors=[t] * rows))
    expected = dense(row.unsqueeze(0), [p])[0].softmax(-1)
    assert chi_square_ok(torch.tensor(out.sampled_token_ids), expected)


def test_a_steps_setup_never_walks_the_lists_once_the_tensors_are_built():
    """The regression this guards: a step rebuilt every row's bias and mask from the Python
    lists (O(sum of list sizes) per step and per draft position). With the request's tensors
    given, the lists themselves are never read."""
    params = [
        SamplingParams(temperature=0.0, logit_bias={i: 1.0 for i in range(300)}),
        SamplingParams(temperature=1.0, top_k=5, allowed_token_ids=list(range(0, 299, 7))),
    ]
    tensors = [RequestSamplingTensors.build(p, V, "cpu") for p in params]
    logits = torch.randn(2, V)
    before = Sampler()(logits.clone(), batch_of(params, tensors=tensors, seeds=[4, 5])).sampled_token_ids
    params[0].logit_bias = _Untouchable(params[0].logit_bias)
    params[1].allowed_token_ids = _UntouchableList(params[1].allowed_token_ids)
    for _ in range(50):  # many steps, each with the request's draft positions repeated
        batch = batch_of(params * 3, tensors=tensors * 3, seeds=[4, 5] * 3)
        assert Sampler()(logits.repeat(3, 1), batch).sampled_token_ids == before * 3


def test_tensors_are_deduplicated_and_drop_ids_outside_the_vocabulary():
    p = SamplingParams(allowed_token_ids=[4, 4, 9, V + 5], logit_bias={3: 1.0, V + 1: 2.0})
    t = RequestSamplingTensors.build(p, V, "cpu")
    assert t is not None and t.bias_tokens.tolist() == [3] and t.bias_values.tolist() == [1.0]
    assert t.disallowed is not None and (~t.disallowed).nonzero().squeeze(1).tolist() == [4, 9]
    assert RequestSamplingTensors.build(SamplingParams(), V, "cpu") is None


# ---- rows with no token left ------------------------------------------------------------


@pytest.mark.parametrize(
    "kind",
    [
        {"temperature": 0.0},
        {"temperature": 1.0},
        {"temperature": 1.0, "top_k": 5},
        {"temperature": 1.0, "top_p": 0.9},
        {"temperature": 1.0, "top_k": 50, "top_p": 0.5},
        {"temperature": 0.8, "min_p": 0.1},
    ],
    ids=["greedy", "random", "top_k", "top_p", "top_k_top_p", "min_p"],
)
def test_a_row_with_nothing_left_fails_alone_and_the_others_draw_as_without_it(kind):
    """`allowed_token_ids=[eos]` with min_tokens masks every token of that row. Before the
    fix: greedy drew token 0, random and min-p rows an id past the vocabulary (1023 of 300),
    and a top-k row raised for the whole batch."""
    bad = SamplingParams(allowed_token_ids=[EOS], min_tokens=4, max_tokens=8, seed=9, **kind)
    good = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=10, seed=3), SamplingParams(**kind)]
    for trial in range(5):
        logits = torch.randn(4, V)
        seeds = [None, 3, 11 + trial]
        with_bad = Sampler()(logits.clone(), batch_of([good[0], bad, good[1], good[2]], seeds=[None, 9, 3, seeds[2]]))
        alone = Sampler()(logits[[0, 2, 3]].clone(), batch_of(good, seeds=seeds))
        assert with_bad.failed_rows == [1]
        assert all(0 <= t < V for t in with_bad.sampled_token_ids)
        assert [with_bad.sampled_token_ids[i] for i in (0, 2, 3)] == alone.sampled_token_ids


def test_bitmask_against_allowed_ids_and_padded_logits_fail_only_that_row():
    """A grammar row whose bitmask allows nothing the request allows; logits wider than the
    vocabulary (a padded LM head) never lend it a padding column."""
    pytest.importorskip("xgrammar")
    vocab, padded = 70, 96
    params = [SamplingParams(temperature=1.0, allowed_token_ids=[5, 6]), SamplingParams(temperature=0.0)]
    batch = batch_of(params, vocab=vocab)
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    bitmask[0, 0] = 1 << 7  # only token 7
    batch.token_bitmask = (torch.tensor([0]), bitmask)
    logits = torch.randn(2, padded)
    out = Sampler()(logits, batch)
    assert out.failed_rows == [0]
    assert out.sampled_token_ids[1] == int(logits[1, :vocab].argmax())
    assert all(0 <= t < vocab for t in out.sampled_token_ids)


# ---- through the engine (tiny random model) -----------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPT = "The quick brown fox jumps over the lazy dog."


def assert_no_leak(llm) -> None:
    sched = llm.core.scheduler
    assert not sched.has_unfinished_requests() and not llm.core.structured.has_pending()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    sched.kv.check_invariants()


@pytest.fixture(scope="module")
def llms(tiny_model_dir):
    from fleetserve.replica.llm import LLM

    return {
        "plain": LLM(str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=128),
        "ngram": LLM(str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=128, speculative_config=NGRAM),
    }


@pytest.mark.parametrize("kind", ["plain", "ngram"])
def test_each_requests_tensors_are_built_once_across_all_its_steps(llms, kind, monkeypatch):
    """Many decode steps (and, with n-gram drafts, several positions per step) build each
    request's logit_bias / allowed_token_ids tensors once: when the runner first sees it."""
    llm = llms[kind]
    built: list[SamplingParams] = []
    real = RequestSamplingTensors.build.__func__  # type: ignore[attr-defined]

    def counting(cls, params, vocab_size, device):
        out = real(cls, params, vocab_size, device)
        if out is not None:
            built.append(params)
        return out

    monkeypatch.setattr(RequestSamplingTensors, "build", classmethod(counting))
    ids = llm.tokenizer.encode(PROMPT)
    allowed = sorted(set(ids))
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logit_bias={ids[3]: 5.0, ids[4]: -5.0}),
        SamplingParams(temperature=1.0, seed=1, max_tokens=24, ignore_eos=True, allowed_token_ids=allowed),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    ]
    outs = llm.generate([PROMPT] * 3, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [24, 24, 24]
    assert set(outs[1].outputs[0].token_ids) <= set(allowed)
    assert len(built) == 2  # one per request that has either, not one per step or position
    assert_no_leak(llm)


@pytest.mark.parametrize("kind", ["plain", "ngram"])
def test_a_request_the_grammar_leaves_no_token_ends_with_error_and_its_batch_goes_on(llms, kind):
    """allowed_token_ids that its grammar forbids (only sampling can see it): that request
    ends with finish_reason "error" and no token; the normal request beside it produces
    exactly what it produces alone; no block is leaked and the engine serves afterwards."""
    from fleetserve.scheduler import StructuredOutputsParams

    llm = llms[kind]
    normal = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    (alone,) = llm.generate([PROMPT], normal, use_tqdm=False)
    letter = llm.tokenizer.encode("a")[-1]
    bad = SamplingParams(
        temperature=1.0,
        max_tokens=8,
        allowed_token_ids=[letter],
        structured_outputs=StructuredOutputsParams(regex="[0-9]+"),
    )
    outs = llm.generate([PROMPT, "Answer:", PROMPT], [normal, bad, normal], use_tqdm=False)
    assert outs[1].outputs[0].finish_reason == "error" and outs[1].outputs[0].token_ids == []
    assert "no token can be sampled" in str(outs[1].outputs[0].stop_reason)
    for o in (outs[0], outs[2]):
        assert o.outputs[0].token_ids == alone.outputs[0].token_ids and o.outputs[0].finish_reason == "length"
    assert_no_leak(llm)
    (again,) = llm.generate([PROMPT], normal, use_tqdm=False)
    assert again.outputs[0].token_ids == alone.outputs[0].token_ids


@pytest.mark.parametrize("kind", ["plain", "ngram"])
def test_a_mask_that_empties_mid_output_keeps_the_tokens_before_it(llms, kind):
    """allowed_token_ids=[x] with a bad word [x, x]: the first token is x, the second has
    nothing left. The request ends with "error" after that one token (n-gram drafts of x
    included: the verification stops where plain decoding would)."""
    llm = llms[kind]
    x = llm.tokenizer.encode(" fox")[-1]
    bad = SamplingParams(
        temperature=0.0,
        max_tokens=8,
        ignore_eos=True,
        allowed_token_ids=[x],
        bad_words=["w"],
        bad_words_token_ids=[[x, x]],
    )
    normal = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    (alone,) = llm.generate([PROMPT], normal, use_tqdm=False)
    outs = llm.generate([PROMPT + " fox fox fox fox", PROMPT], [bad, normal], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == [x] and outs[0].outputs[0].finish_reason == "error"
    assert outs[1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert_no_leak(llm)


def test_validation_refuses_what_it_can_see_naming_the_field(llms):
    """Contradictions the input processor can see, and the size bounds, are ValueErrors that
    start with the field's name (the HTTP layer's 400 names it); the caller's params are
    left as they were and allowed ids are deduplicated."""
    from fleetserve.replica.engine.processor import MAX_ALLOWED_TOKEN_IDS, MAX_LOGIT_BIAS

    llm = llms["plain"]
    eos = llm.tokenizer.eos_token_id
    for params, field in (
        (SamplingParams(allowed_token_ids=[eos], min_tokens=4), "allowed_token_ids"),
        (SamplingParams(allowed_token_ids=[eos, 7], stop_token_ids=[7], min_tokens=1), "allowed_token_ids"),
        (SamplingParams(allowed_token_ids=[9], bad_words=["w"], bad_words_token_ids=[[9]]), "allowed_token_ids"),
        (SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}), "logit_bias"),
        (SamplingParams(allowed_token_ids=[5] * (MAX_ALLOWED_TOKEN_IDS + 1)), "allowed_token_ids"),
    ):
        with pytest.raises(ValueError, match=f"^{field}"):
            llm.generate([PROMPT], params, use_tqdm=False)
    # Not contradictions: EOS allowed with ignore_eos, or beside another token, or min_tokens=0.
    ok = [
        SamplingParams(allowed_token_ids=[eos], min_tokens=2, ignore_eos=True, max_tokens=3),
        SamplingParams(allowed_token_ids=[eos, 9], min_tokens=2, max_tokens=3),
        SamplingParams(allowed_token_ids=[eos], max_tokens=3),
    ]
    outs = llm.generate([PROMPT] * 3, ok, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == [eos] * 3 and outs[2].outputs[0].token_ids == [eos]
    assert outs[1].outputs[0].token_ids[:2] == [9, 9]
    dup = SamplingParams(allowed_token_ids=[9, 9, 4, 9], max_tokens=2, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate([PROMPT], dup, use_tqdm=False)
    assert set(out.outputs[0].token_ids) <= {4, 9} and dup.allowed_token_ids == [9, 9, 4, 9]
    assert_no_leak(llm)
