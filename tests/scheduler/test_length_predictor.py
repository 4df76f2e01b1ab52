"""The output-length predictor (scheduler/length_predictor.py): it learns per bucket, shrinks
a sparse bucket toward its parent, never answers past max_tokens, stays within its memory
bounds, and beats the running mean on a structured long-tailed trace."""

from __future__ import annotations

import random

import pytest

from fleetserve.scheduler.length_predictor import (
    LengthFeatures,
    OutputLengthPredictor,
    RunningMean,
    length_bin,
)


def f(prompt=100, max_tokens=None, tenant="a", session=None, model=""):
    return LengthFeatures(prompt, max_tokens, tenant, model, session)


def test_learns_each_bucket_apart():
    p = OutputLengthPredictor()
    rng = random.Random(0)
    for _ in range(300):
        p.observe(f(tenant="short"), rng.randint(8, 12))
        p.observe(f(tenant="long"), rng.randint(900, 1100))
    assert 7 <= p.predict(f(tenant="short")) <= 13
    assert 850 <= p.predict(f(tenant="long")) <= 1150
    # Prompt length octaves are their own buckets under the tenant.
    for _ in range(300):
        p.observe(f(prompt=5000, tenant="short"), 400)
    assert 330 <= p.predict(f(prompt=5000, tenant="short")) <= 480
    assert p.predict(f(prompt=100, tenant="short")) <= 13


def test_a_sparse_bucket_shrinks_to_its_parent():
    p = OutputLengthPredictor(prior_strength=4.0)
    for _ in range(200):
        p.observe(f(tenant="t", prompt=100), 1000)
    # One observation in a new prompt octave: the parent's 1000 still dominates.
    p.observe(f(tenant="t", prompt=3000), 10)
    assert p.predict(f(tenant="t", prompt=3000)) >= 800
    # Many observations there: the bucket answers for itself.
    for _ in range(60):
        p.observe(f(tenant="t", prompt=3000), 10)
    assert p.predict(f(tenant="t", prompt=3000)) <= 12
    # An unseen tenant answers the model-wide distribution (mostly 1000 here).
    assert p.predict(f(tenant="new")) >= 800


def test_never_past_max_tokens_and_at_least_one():
    p = OutputLengthPredictor()
    assert 28 <= p.predict(f(max_tokens=64)) <= 36  # nothing learned: about half the cap
    assert p.predict(f()) == 1
    for _ in range(100):
        p.observe(f(), 3000)
    assert p.predict(f(max_tokens=50)) == 50
    assert p.predict(f(max_tokens=1)) == 1
    assert 2500 <= p.predict(f()) <= 3500


def test_session_turns_pull_the_prediction():
    p = OutputLengthPredictor()
    for _ in range(200):
        p.observe(f(), 100)
    for _ in range(3):
        p.observe(f(session="s1"), 800)
    assert p.predict(f(session="s1")) >= 500
    assert p.predict(f(session="other")) <= 120
    assert OutputLengthPredictor(use_session=False).predict(f(session="s1")) == 1


def test_memory_is_bounded():
    p = OutputLengthPredictor(max_buckets=50, max_sessions=20, window=64)
    for i in range(5000):
        p.observe(f(prompt=1 + i % 4000, tenant=f"t{i}", session=f"s{i}"), 1 + i % 700)
    assert p.num_buckets() <= 50
    assert p.num_sessions() <= 20
    assert all(h.total <= 64 for h in p._buckets.values())
    # The global bucket, used by every call, survives the LRU.
    assert () in p._buckets


def test_follows_a_drift():
    p = OutputLengthPredictor(window=200)
    for _ in range(1000):
        p.observe(f(), 50)
    for _ in range(1000):
        p.observe(f(), 500)
    assert 420 <= p.predict(f()) <= 580


def test_bins_and_bad_settings():
    assert length_bin(1) == 0 and length_bin(2) == 4 and length_bin(1 << 30) == length_bin(1 << 25)
    with pytest.raises(ValueError):
        OutputLengthPredictor(quantile=1.0)
    with pytest.raises(ValueError):
        OutputLengthPredictor(levels=0)


def test_beats_the_running_mean_on_a_structured_trace():
    from fleetserve.sim.generators import generate

    trace = generate("length_mix", num_requests=3000, rate=10.0, seed=3)
    ours, mean = OutputLengthPredictor(), RunningMean()
    err_ours = err_mean = 0
    for r in trace:
        x = LengthFeatures(r.num_prompt_tokens, r.max_tokens, r.tenant or "default", "", r.session)
        err_ours += abs(ours.predict(x) - r.output_tokens)
        err_mean += abs(mean.predict(x) - r.output_tokens)
        ours.observe(x, r.output_tokens)
        mean.observe(x, r.output_tokens)
    assert err_ours < 0.8 * err_mean
