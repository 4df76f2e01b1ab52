"""The batched sampler: exact behaviour on fixed logits, distributions over many draws.

Statistical tests draw thousands of rows in one call (the same logits
repeated), with the global RNG seeded, and compare empirical frequencies with
the expected distribution by a chi-square test at a 1e-6 false-alarm level.
"""

from __future__ import annotations

import math

import pytest
import torch

from fleetserve.replica.layers.sampler import Sampler, SamplingBatch, compute_prompt_logprobs, make_generator
from fleetserve.scheduler.sampling_params import SamplingParams

EOS = 2


def run(
    logits: torch.Tensor, params: list[SamplingParams], prompts=None, outputs=None, generators=None, vocab_size=None
):
    n, v = logits.shape
    batch = SamplingBatch.build(
        params, prompts or [[]] * n, outputs or [[]] * n, generators or [None] * n, EOS, vocab_size or v, "cpu"
    )
    return Sampler()(logits.clone(), batch)


def draws(logits_row: torch.Tensor, params: SamplingParams, n: int = 6000, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    out: list[int] = []
    for start in range(0, n, 10000):
        rows = min(10000, n - start)
        out += run(logits_row.unsqueeze(0).repeat(rows, 1), [params] * rows).sampled_token_ids
    return torch.tensor(out)


def chi_square_ok(samples: torch.Tensor, expected_probs: torch.Tensor) -> bool:
    """Chi-square goodness of fit; cells expecting < 5 draws are pooled."""
    n = samples.numel()
    observed = torch.bincount(samples, minlength=expected_probs.numel()).double()
    expected = expected_probs.double() * n
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    # Nothing may be drawn where nothing is expected.
    if (obs[~keep] > 0).any():
        return False
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = max(obs.numel() - 1, 1)
    # Wilson-Hilferty upper quantile of chi2(df) at z = 4.75 (~1e-6).
    z = 4.75
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < critical


def nucleus(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Reference top-p: keep the largest probabilities while the mass before them is < p."""
    vals, idx = probs.sort(descending=True)
    before = vals.cumsum(0) - vals
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[idx[before < p]] = True
    out = torch.where(keep, probs, torch.zeros_like(probs))
    return out / out.sum()


@pytest.fixture
def logits_300():
    g = torch.Generator().manual_seed(1)
    # 300 columns: more than one block of the two-level inverse CDF.
    return torch.randn(300, generator=g) * 1.5


# ---- greedy -------------------------------------------------------------------------


def test_greedy_is_argmax():
    logits = torch.randn(16, 1000)
    out = run(logits, [SamplingParams(temperature=0.0)] * 16)
    assert out.sampled_token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 16


def test_mixed_batch_greedy_rows_stay_exact():
    logits = torch.randn(8, 500)
    params = [
        SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(temperature=1.0, top_p=0.9) for i in range(8)
    ]
    out = run(logits, params)
    for i in range(0, 8, 2):
        assert out.sampled_token_ids[i] == int(logits[i].argmax())
    assert all(0 <= t < 500 for t in out.sampled_token_ids)


def test_padded_logits_never_sample_padding():
    logits = torch.zeros(64, 512)
    logits[:, 500:] = 100.0  # padding columns of a wider LM head
    out = run(logits, [SamplingParams(temperature=1.0)] * 64, vocab_size=500)
    assert max(out.sampled_token_ids) < 500


# ---- distributions --------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_distribution(logits_300, temperature):
    samples = draws(logits_300, SamplingParams(temperature=temperature))
    assert chi_square_ok(samples, (logits_300 / temperature).softmax(-1))


def test_temperature_sharpens_and_flattens(logits_300):
    top = int(logits_300.argmax())
    share = {
        t: float((draws(logits_300, SamplingParams(temperature=t)) == top).double().mean()) for t in (0.3, 1.0, 3.0)
    }
    assert share[0.3] > share[1.0] > share[3.0]


@pytest.mark.parametrize("k", [1, 5, 40])
def test_top_k_never_leaves_the_top_k(logits_300, k):
    samples = draws(logits_300, SamplingParams(temperature=1.0, top_k=k))
    allowed = set(logits_300.topk(k).indices.tolist())
    assert set(samples.tolist()) <= allowed
    expected = torch.full_like(logits_300, float("-inf"))
    expected[list(allowed)] = logits_300[list(allowed)]
    assert chi_square_ok(samples, expected.softmax(-1))


@pytest.mark.parametrize("p", [0.3, 0.8, 0.95])
def test_top_p_matches_renormalized_nucleus(logits_300, p):
    samples = draws(logits_300, SamplingParams(temperature=1.0, top_p=p))
    expected = nucleus(logits_300.softmax(-1), p)
    assert set(samples.tolist()) <= set(expected.nonzero().squeeze(1).tolist())
    assert chi_square_ok(samples, expected)


def test_top_p_wider_than_first_candidates():
    # A nearly flat distribution over 1500 tokens (no exact ties): the nucleus
    # holds ~1350 of them, far more than the first 256 candidates.
    logits = -torch.arange(1500, dtype=torch.float32) * 1e-4
    samples = draws(logits, SamplingParams(temperature=1.0, top_p=0.9), n=4000)
    expected = nucleus(logits.softmax(-1), 0.9)
    assert set(samples.tolist()) <= set(expected.nonzero().squeeze(1).tolist())
    assert samples.unique().numel() > 1000 and samples.max() > 1250


def test_top_k_then_top_p(logits_300):
    samples = draws(logits_300, SamplingParams(temperature=1.0, top_k=20, top_p=0.7))
    masked = torch.full_like(logits_300, float("-inf"))
    top = logits_300.topk(20).indices
    masked[top] = logits_300[top]
    assert chi_square_ok(samples, nucleus(masked.softmax(-1), 0.7))


def test_min_p_excludes_unlikely_tokens(logits_300):
    min_p = 0.1
    samples = draws(logits_300, SamplingParams(temperature=1.0, min_p=min_p))
    probs = logits_300.softmax(-1)
    expected = torch.where(probs >= min_p * probs.max(), probs, torch.zeros_like(probs))
    assert set(samples.tolist()) <= set(expected.nonzero().squeeze(1).tolist())
    assert chi_square_ok(samples, expected / expected.sum())


def test_min_p_applies_to_tempered_distribution(logits_300):
    t, min_p = 2.0, 0.3
    samples = draws(logits_300, SamplingParams(temperature=t, min_p=min_p))
    probs = (logits_300 / t).softmax(-1)
    allowed = set((probs >= min_p * probs.max()).nonzero().squeeze(1).tolist())
    assert set(samples.tolist()) <= allowed


def test_few_live_tokens_across_blocks_exact_frequencies():
    # Few categories and many draws: a bias of a percent in any token is caught.
    live = [3, 255, 256, 299, 511, 599]
    probs = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.05, 0.2])
    logits = torch.full((600,), float("-inf"))
    logits[live] = probs.log()
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.999)):
        samples = draws(logits, params, n=100000)
        assert set(samples.tolist()) <= set(live)  # zero-probability tokens are never drawn
        expected = torch.zeros(600)
        expected[live] = probs
        assert chi_square_ok(samples, expected)


# ---- seeds -------------------------------------------------------------------------------


def test_seeded_rows_reproducible_in_any_batch(logits_300):
    sp = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)

    def sequence(batch_size: int, position: int, others: SamplingParams) -> list[int]:
        gen = make_generator(1234, "cpu")
        torch.manual_seed(batch_size)  # the unseeded rows' draws differ between runs
        tokens = []
        for _ in range(20):
            params = [others] * batch_size
            gens: list = [None] * batch_size
            params[position], gens[position] = sp, gen
            logits = logits_300.unsqueeze(0).repeat(batch_size, 1) * 0.5
            logits[position] = logits_300
            tokens.append(run(logits, params, generators=gens).sampled_token_ids[position])
        return tokens

    alone = sequence(1, 0, sp)
    assert sequence(1, 0, sp) == alone
    assert sequence(7, 3, SamplingParams(temperature=0.7)) == alone
    assert sequence(5, 4, SamplingParams(temperature=1.0, top_k=300)) == alone
    assert sequence(9, 0, SamplingParams(temperature=0.0)) == alone
    assert len(set(alone)) > 1  # it is really sampling


def test_different_seeds_differ(logits_300):
    def seq(seed):
        gen = make_generator(seed, "cpu")
        return [
            run(
                logits_300.unsqueeze(0), [SamplingParams(temperature=1.0, seed=seed)], generators=[gen]
            ).sampled_token_ids[0]
            for _ in range(20)
        ]

    assert seq(1) == seq(1)
    assert seq(1) != seq(2)


# ---- penalties ---------------------------------------------------------------------------


def reference_penalties(logits, prompt, output, sp):
    """Dense reference: HF repetition penalty, then OpenAI frequency and presence."""
    x = logits.clone()
    seen = torch.zeros_like(x, dtype=torch.bool)
    seen[list(prompt) + list(output)] = True
    x = torch.where(seen, torch.where(x > 0, x / sp.repetition_penalty, x * sp.repetition_penalty), x)
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=x.numel()).float()
    return x - sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0).float()


def test_penalties_match_dense_reference():
    g = torch.Generator().manual_seed(3)
    n, v = 48, 200
    logits = torch.randn(n, v, generator=g) * 2
    prompts = [
        torch.randint(0, v, (int(torch.randint(0, 30, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]
    outputs = [
        torch.randint(0, 40, (int(torch.randint(0, 30, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]
    params = [
        SamplingParams(
            temperature=0.0,
            repetition_penalty=[1.0, 1.3, 0.8][i % 3],
            frequency_penalty=[0.0, 0.4, -0.3, 1.5][i % 4],
            presence_penalty=[0.0, 0.7, -1.0][i % 3 - 1],
        )
        for i in range(n)
    ]
    out = run(logits, params, prompts, outputs)
    expected = [int(reference_penalties(logits[i], prompts[i], outputs[i], params[i]).argmax()) for i in range(n)]
    assert out.sampled_token_ids == expected


def greedy_one(logits, sp, prompt=(), output=()):
    sp = sp.replace(temperature=0.0)
    return run(torch.tensor([logits]), [sp], [list(prompt)], [list(output)]).sampled_token_ids[0]


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    # 2.0 / 1.5 = 1.33 < 1.5: the seen token loses.
    assert greedy_one([2.0, 1.5, -3.0], SamplingParams(repetition_penalty=1.5), prompt=[0]) == 1
    # -1.0 * 1.5 = -1.5 < -1.2: a negative seen logit becomes more negative.
    assert greedy_one([-1.0, -1.2, -3.0], SamplingParams(repetition_penalty=1.5), output=[0]) == 1
    assert greedy_one([-1.0, -1.2, -3.0], SamplingParams(repetition_penalty=1.1), output=[0]) == 0
    # Below 1 it encourages repetition.
    assert greedy_one([1.0, 1.5, -3.0], SamplingParams(repetition_penalty=0.5), prompt=[0]) == 0
    # Unseen tokens are untouched.
    assert greedy_one([2.0, 1.5, -3.0], SamplingParams(repetition_penalty=1.5), prompt=[2]) == 0


def test_frequency_penalty_scales_with_count_and_ignores_prompt():
    sp = SamplingParams(frequency_penalty=0.5)
    assert greedy_one([5.0, 3.6], sp, output=[0, 0, 0]) == 1  # 5 - 1.5 = 3.5
    assert greedy_one([5.0, 3.6], sp, output=[0, 0]) == 0  # 5 - 1.0 = 4.0
    assert greedy_one([5.0, 3.6], sp, prompt=[0, 0, 0, 0]) == 0


def test_presence_penalty_once_per_token():
    sp = SamplingParams(presence_penalty=1.0)
    assert greedy_one([5.0, 4.1], sp, output=[0]) == 1
    assert greedy_one([5.0, 3.9], sp, output=[0, 0, 0, 0]) == 0  # 5 - 1 = 4 > 3.9


# ---- min_tokens -------------------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = torch.tensor([[0.0, 0.0, 9.0, 8.0, 7.0, 1.0]])  # EOS (2) first, then stop id 3
    sp = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3])
    assert run(logits, [sp], outputs=[[5, 5]]).sampled_token_ids == [4]
    assert run(logits, [sp], outputs=[[5, 5, 5]]).sampled_token_ids == [2]
    # ignore_eos: EOS does not stop, so it is not masked; stop ids still are.
    sp2 = sp.replace(ignore_eos=True)
    assert run(logits, [sp2], outputs=[[5]]).sampled_token_ids == [2]


def test_min_tokens_with_sampling_never_draws_eos():
    logits = torch.zeros(2000, 8)
    logits[:, EOS] = 3.0
    sp = SamplingParams(temperature=1.0, min_tokens=2)
    out = run(logits, [sp] * 2000, outputs=[[1]] * 2000)
    assert EOS not in out.sampled_token_ids


# ---- allowed_token_ids, bad_words (vLLM's) -------------------------------------------------------


def test_allowed_token_ids_limit_greedy_and_random_rows_and_leave_other_rows_alone():
    logits = torch.tensor([[9.0, 1.0, 2.0, 3.0, 0.5, 8.0]] * 3)
    allow = SamplingParams(temperature=0.0, allowed_token_ids=[1, 4, 99])  # 99: beyond the vocab
    assert run(logits, [allow, SamplingParams(temperature=0.0), allow]).sampled_token_ids == [1, 0, 1]
    torch.manual_seed(0)
    rows = 3000
    sp = SamplingParams(temperature=1.0, allowed_token_ids=[3, 4])
    out = torch.tensor(run(logits[:1].repeat(rows, 1), [sp] * rows).sampled_token_ids)
    expected = torch.zeros(6)
    expected[[3, 4]] = torch.tensor([3.0, 0.5]).softmax(-1)
    assert set(out.tolist()) <= {3, 4} and chi_square_ok(out, expected)


def test_bad_words_ban_the_token_that_would_complete_a_word():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 9.0, 8.0, 7.0]])
    # Word [4]: always banned. Word [6, 5]: 5 banned only right after 6.
    sp = SamplingParams(temperature=0.0, bad_words=["x"], bad_words_token_ids=[[4], [6, 5]])
    assert run(logits, [sp], outputs=[[]]).sampled_token_ids == [5]
    assert run(logits, [sp], outputs=[[1, 6]]).sampled_token_ids == [6]
    assert run(logits, [sp], outputs=[[6, 1]]).sampled_token_ids == [5]
    # A three-token word: only its last token, only after the first two.
    sp3 = sp.replace(bad_words_token_ids=[[1, 2, 4]])
    assert run(logits, [sp3], outputs=[[1, 2]]).sampled_token_ids == [5]
    assert run(logits, [sp3], outputs=[[2, 2]]).sampled_token_ids == [4]
    # With a logit_bias pushing the banned token, the ban still wins; other rows untouched.
    pushed = sp.replace(logit_bias={4: 100})
    assert run(logits.repeat(2, 1), [pushed, SamplingParams(temperature=0.0)]).sampled_token_ids == [5, 4]


def test_sampling_params_check_the_vllm_extras():
    for bad in (
        {"allowed_token_ids": []},
        {"allowed_token_ids": [-1]},
        {"allowed_token_ids": "12"},
        {"bad_words": "word"},
        {"bad_words": [""]},
        {"bad_words": [3]},
        {"truncate_prompt_tokens": 0},
        {"truncate_prompt_tokens": -2},
        {"truncate_prompt_tokens": True},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    assert SamplingParams(allowed_token_ids=(3, 1)).allowed_token_ids == [3, 1]


# ---- logprobs ------------------------------------------------------------------------------------


def test_logprobs_are_raw_with_rank():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 100, generator=g)
    params = [
        SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=2.0),
        SamplingParams(temperature=0.5, top_k=10, logprobs=0),
        SamplingParams(temperature=0.0),
    ]
    out = run(logits, params, prompts=[list(range(50)), [], []])
    raw = logits.log_softmax(-1)
    ids, lps, rank = out.logprobs[0]
    tok = out.sampled_token_ids[0]
    assert len(ids) == len(lps) == 4 and ids[0] == tok
    assert ids[1:] == raw[0].topk(3).indices.tolist()
    assert lps == pytest.approx(raw[0, ids].tolist(), abs=1e-5)
    assert rank == int((raw[0] >= raw[0, tok]).sum())
    # The penalty changed the choice but not the reported logprobs.
    assert tok != int(logits[0].argmax()) and rank > 1
    ids1, lps1, rank1 = out.logprobs[1]
    assert ids1 == [out.sampled_token_ids[1]] and lps1 == pytest.approx([float(raw[1, ids1[0]])], abs=1e-5)
    assert 1 <= rank1 <= 10
    assert out.logprobs[2] is None


def test_prompt_logprobs():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 50, generator=g)
    targets = [3, 7, 0, 49, 3]
    entries = compute_prompt_logprobs(logits, torch.tensor(targets), 2)
    raw = logits.log_softmax(-1)
    assert len(entries) == 5
    for i, (ids, lps, rank) in enumerate(entries):
        assert ids[0] == targets[i] and ids[1:] == raw[i].topk(2).indices.tolist()
        assert lps == pytest.approx(raw[i, ids].tolist(), abs=1e-5)
        assert rank == int((raw[i] >= raw[i, targets[i]]).sum())
    assert [e[0] for e in compute_prompt_logprobs(logits, targets, 0)] == [[t] for t in targets]


def test_build_rejects_mismatched_lengths():
    with pytest.raises(ValueError):
        SamplingBatch.build([SamplingParams()], [[], []], [[]], [None], EOS, 10, "cpu")
