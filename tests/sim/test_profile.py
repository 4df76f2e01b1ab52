"""Step-cost profiles (fleetserve/sim/profile.py): the schema and its errors, the linear fit,
the roofline's physics, KV transfer, the shipped files, and a simulation on a profile."""

from __future__ import annotations

import json
import random

import pytest

from fleetserve.sim import profile as P
from fleetserve.sim.cluster import run_simulation
from fleetserve.sim.generators import Lengths, poisson
from fleetserve.sim.profile import (
    LinearStep,
    Profile,
    ProfileError,
    analytic_profile,
    calibrated_profile,
    fit_linear,
    load_profile,
)
from fleetserve.sim.shape import StepCostModel, StepShape

SHAPE_8B = P.MODELS["llama-3.1-8b"][1]


def _prefill(n: int, context: int = 0, seqs: int = 1) -> StepShape:
    """`seqs` chunks of `n` tokens each against `context` computed tokens."""
    return StepShape(prefill_tokens=n * seqs, prefill_seqs=seqs, prefill_attn_tokens=seqs * n * (context + n / 2))


def _decode(seqs: int, context: int) -> StepShape:
    return StepShape(decode_seqs=seqs, decode_tokens=seqs, decode_context_tokens=seqs * context)


def _mixed(rng: random.Random) -> StepShape:
    p_seqs = rng.randint(0, 3)
    chunks = [(rng.randint(16, 2048), rng.randint(0, 4096)) for _ in range(p_seqs)]
    d_seqs = rng.randint(0 if p_seqs else 1, 64)
    ctx = sum(rng.randint(16, 4096) for _ in range(d_seqs))
    return StepShape(
        prefill_tokens=sum(n for n, _ in chunks),
        prefill_seqs=p_seqs,
        prefill_attn_tokens=sum(n * (c + n / 2) for n, c in chunks),
        decode_seqs=d_seqs,
        decode_tokens=d_seqs,
        decode_context_tokens=ctx,
    )


TRUE = LinearStep(
    overhead_s=2e-3,
    per_prefill_token_s=4e-5,
    per_prefill_attn_token_s=3e-9,
    per_prefill_seq_s=1e-4,
    per_decode_seq_s=3e-4,
    per_decode_context_token_s=2e-8,
)


def _samples(n=300, noise=0.0, seed=0):
    rng = random.Random(seed)
    cost = _calibrated(TRUE).cost_model()
    out = []
    for _ in range(n):
        s = _mixed(rng)
        out.append((s, cost.step_seconds(s) * (1.0 + rng.uniform(-noise, noise))))
    return out


def _calibrated(step: LinearStep) -> Profile:
    return Profile(
        name="test-cpu",
        kind="calibrated",
        hardware="AMD EPYC (AVX2), 1 thread",
        model="HuggingFaceTB/SmolLM2-135M",
        model_shape=SHAPE_8B,
        dtype="float32",
        threads=1,
        created="2026-12-02",
        source="synthetic",
        step=step,
        kv_transfer={"shared_storage": P.KVLink(bandwidth_bytes_s=1e9, latency_s=1e-3)},
    )


# --- schema -----------------------------------------------------------------------------------


def test_a_profile_round_trips_through_its_json(tmp_path):
    for prof in (analytic_profile("h100", "llama-3.1-70b", 4), _calibrated(TRUE)):
        path = prof.save(tmp_path / f"{prof.name}.json")
        back = load_profile(path)
        assert back == prof
        assert back.to_json() == prof.to_json() == path.read_text()
        assert isinstance(back.step, type(prof.step))


def _write(tmp_path, data) -> str:
    path = tmp_path / "bad.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data, indent=2))
    return str(path)


def test_bad_profile_files_name_the_file_and_the_field(tmp_path):
    good = json.loads(analytic_profile("h100", "llama-3.1-8b").to_json())

    bad = json.loads(json.dumps(good))
    bad["step"]["mem_bandwidth_bytes_s"] = -1
    with pytest.raises(ProfileError, match=r"bad\.json: step\.roofline\.mem_bandwidth_bytes_s: .*greater than 0"):
        load_profile(_write(tmp_path, bad))

    bad = json.loads(json.dumps(good))
    bad["step"]["form"] = "cubic"
    with pytest.raises(ProfileError, match=r"bad\.json: step: .*'linear', 'roofline'"):
        load_profile(_write(tmp_path, bad))

    bad = json.loads(json.dumps(good))
    bad["model_shape"]["num_kv_head"] = 8  # a typo is an error, not ignored
    with pytest.raises(ProfileError, match=r"model_shape\.num_kv_head: Extra inputs"):
        load_profile(_write(tmp_path, bad))

    bad = json.loads(json.dumps(good))
    del bad["model_shape"]["head_dim"]
    with pytest.raises(ProfileError, match=r"model_shape\.head_dim: Field required"):
        load_profile(_write(tmp_path, bad))

    bad = json.loads(json.dumps(good))
    bad["dtype"] = "int3"
    with pytest.raises(ProfileError, match=r"unknown dtype 'int3'"):
        load_profile(_write(tmp_path, bad))

    bad = json.loads(json.dumps(good))
    bad["kind"] = "calibrated"
    with pytest.raises(ProfileError, match=r"calibrated profile's step has form 'linear'"):
        load_profile(_write(tmp_path, bad))

    text = analytic_profile("h100", "llama-3.1-8b").to_json().replace('"dtype": "bfloat16",', '"dtype": "bfloat16"', 1)
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if '"tensor_parallel_size"' in ln)
    with pytest.raises(ProfileError, match=rf"bad\.json: invalid JSON at line {line}, column 3"):
        load_profile(_write(tmp_path, text))

    with pytest.raises(ProfileError, match=r"nope\.json: cannot read"):
        load_profile(tmp_path / "nope.json")


def test_an_unknown_name_lists_the_shipped_profiles():
    with pytest.raises(ProfileError) as e:
        load_profile("tpu-v9-llama")
    for name in ("h100-llama-3.1-8b", "h100-llama-3.1-70b-tp8", "l4-llama-3.1-8b"):
        assert name in str(e.value)
    assert set(P.shipped_profiles()) >= {P.analytic_name(*t) for t in P.SHIPPED_ANALYTIC}


def test_kv_bytes_per_token_is_k_and_v_over_every_layer_and_kv_head():
    assert SHAPE_8B.kv_bytes_per_token("bfloat16") == 2 * 32 * 8 * 128 * 2 == 131072
    prof = analytic_profile("h100", "llama-3.1-70b", 8)
    assert prof.kv_bytes_per_token() == prof.cost_model().kv_bytes_per_token() == 2 * 80 * 8 * 128 * 2


# --- the fit ------------------------------------------------------------------------------------


def test_the_fit_recovers_known_coefficients_without_noise():
    samples = _samples()
    step, stats = fit_linear(samples)
    for k in P.LINEAR_TERMS:
        assert getattr(step, k) == pytest.approx(getattr(TRUE, k), rel=1e-6), k
    assert stats.samples == 300 and stats.max_rel_error < 1e-8
    assert stats.ranges["decode_seqs"][1] <= 64


def test_the_fit_with_small_noise_stays_close_and_its_error_stats_are_right():
    samples = _samples(noise=0.02, seed=3)
    step, stats = fit_linear(samples)
    for k in ("overhead_s", "per_prefill_token_s", "per_decode_seq_s", "per_decode_context_token_s"):
        assert getattr(step, k) == pytest.approx(getattr(TRUE, k), rel=0.1), k
    rel = sorted(P.relative_errors(step, samples))
    assert stats.median_rel_error == pytest.approx((rel[149] + rel[150]) / 2)
    assert stats.max_rel_error == pytest.approx(rel[-1])
    assert rel[int(0.85 * 300)] <= stats.p90_rel_error <= rel[int(0.95 * 300)]
    assert 0.002 < stats.median_rel_error < stats.p90_rel_error < stats.max_rel_error < 0.03


def test_the_fit_keeps_coefficients_non_negative():
    # Steps where more decode rows take *less* time: least squares would go negative.
    samples = [(_decode(n, 100), 0.01 - 1e-5 * n) for n in (1, 2, 4, 8, 16, 32)]
    step, _ = fit_linear(samples)
    assert all(getattr(step, k) >= 0 for k in P.LINEAR_TERMS)
    assert step.overhead_s > 0
    with pytest.raises(ProfileError, match="positive"):
        fit_linear([(_decode(1, 1), 0.0)])
    with pytest.raises(ProfileError, match="no samples"):
        fit_linear([])


def test_calibrated_profile_carries_the_fit_and_loads_back(tmp_path):
    prof = calibrated_profile(
        _samples(60),
        name="epyc-smollm2",
        hardware="AMD EPYC (AVX2), 1 thread",
        model="HuggingFaceTB/SmolLM2-135M",
        model_shape=SHAPE_8B.model_dump(),
        dtype="float32",
        tensor_parallel_size=1,
        threads=1,
        source="fleetserve profile --model smollm2-135m",
        kv_transfer={"shared_storage": {"bandwidth_bytes_s": 1.2e9, "latency_s": 2e-3}},
        grid={"prefill_tokens": [16, 256, 2048]},
    )
    assert prof.kind == "calibrated" and prof.fit is not None and prof.fit.samples == 60
    assert prof.fit.grid == {"prefill_tokens": [16, 256, 2048]}
    assert load_profile(prof.save(tmp_path / "p.json")) == prof
    with pytest.raises(ProfileError, match=r"calibrated profile 'x': dtype"):
        calibrated_profile(
            _samples(10),
            name="x",
            hardware="h",
            model="m",
            model_shape=SHAPE_8B,
            dtype="fp4",
            tensor_parallel_size=1,
            threads=1,
            source="s",
            kv_transfer=None,
        )


# --- the roofline ---------------------------------------------------------------------------------


def test_one_decode_on_8b_h100_reads_the_weights_once():
    cost = load_profile("h100-llama-3.1-8b").cost_model()
    t = cost.step_seconds(_decode(1, 512))
    weights_s = (8.03e9 - 128256 * 4096) * 2 / 3.35e12
    assert 0.005 < t < 0.007
    assert weights_s < t < weights_s / 0.8 + 0.0012


def test_a_long_prefill_is_compute_bound_and_decode_grows_with_context():
    prof = analytic_profile("h100", "llama-3.1-8b")
    cost = prof.cost_model()
    t = cost.step_seconds(_prefill(4096))
    flops = 2 * SHAPE_8B.body_params * 4096 + 4 * 32 * 32 * 128 * 4096 * 2048 + 2 * 128256 * 4096
    assert t == pytest.approx(prof.step.overhead_s + flops / (989e12 * 0.6), rel=1e-9)
    # ... far above the memory bound
    assert t > 5 * cost.step_seconds(_decode(1, 1))
    times = [cost.step_seconds(_decode(64, c)) for c in (128, 1024, 4096, 16384)]
    assert times == sorted(times) and times[-1] > 2 * times[0]
    # drafts cost more than a plain decode of the same rows
    spec = StepShape(decode_seqs=64, decode_tokens=64 * 4, decode_context_tokens=64 * 1024)
    assert cost.step_seconds(spec) > cost.step_seconds(_decode(64, 1024))
    # H200's bandwidth makes decode faster, not the compute-bound prefill
    h200 = analytic_profile("h200", "llama-3.1-8b").cost_model()
    assert h200.step_seconds(_decode(1, 512)) < 0.8 * cost.step_seconds(_decode(1, 512))
    assert h200.step_seconds(_prefill(4096)) == pytest.approx(t)


def test_tp4_70b_is_faster_per_step_than_one_gpu_would_be():
    tp4 = load_profile("h100-llama-3.1-70b-tp4")
    tp8 = load_profile("h100-llama-3.1-70b-tp8")
    tp1 = tp4.model_copy(update={"tensor_parallel_size": 1})  # would not fit; priced anyway
    for shape in (_decode(1, 1024), _decode(64, 2048), _prefill(2048)):
        t1, t4, t8 = (p.cost_model().step_seconds(shape) for p in (tp1, tp4, tp8))
        assert t8 < t4 < t1 / 2.5, shape
    # 2 all-reduces per layer, each its latency plus a ring over T hidden vectors
    free = tp8.model_copy(
        update={
            "step": tp8.step.model_copy(update={"all_reduce_latency_s": 0.0, "interconnect_bandwidth_bytes_s": 1e30})
        }
    )
    shape = _decode(32, 1024)
    ar = 160 * (10e-6 + 2 * 7 / 8 * 32 * 8192 * 2 / 450e9)
    assert tp8.cost_model().step_seconds(shape) - free.cost_model().step_seconds(shape) == pytest.approx(ar)
    with pytest.raises(ProfileError, match="use a larger tensor_parallel_size"):
        analytic_profile("h100", "llama-3.1-70b", 1)
    with pytest.raises(ProfileError, match="known GPUs are h100, h200, l4, a10g"):
        analytic_profile("b300", "llama-3.1-8b")
    with pytest.raises(ProfileError, match="known models"):
        analytic_profile("h100", "mixtral-8x7b")


def test_kv_transfer_seconds_is_latency_plus_bytes_over_bandwidth():
    cost: StepCostModel = load_profile("h100-llama-3.1-8b").cost_model()
    nbytes = 1000 * cost.kv_bytes_per_token()
    assert cost.kv_transfer_seconds(nbytes, "p2p") == pytest.approx(10e-3 + nbytes / 50e9)
    # the registered class name finds the same link
    assert cost.kv_transfer_seconds(nbytes, "P2PConnector") == cost.kv_transfer_seconds(nbytes, "p2p")
    assert cost.kv_transfer_seconds(0, "shared_storage") == pytest.approx(3e-3)
    with pytest.raises(ProfileError, match="p2p, ray_object_store, shared_storage"):
        cost.kv_transfer_seconds(nbytes, "carrier_pigeon")


def test_analytic_profiles_know_their_kv_memory():
    prof = analytic_profile("l4", "llama-3.1-8b")
    tokens = prof.kv_cache_memory_bytes // prof.kv_bytes_per_token()
    assert 10_000 < tokens < 40_000  # 24 GB less 16 GB of weights
    assert prof.cost_model().kv_cache_memory_bytes == prof.kv_cache_memory_bytes


# --- shipped files and the simulator ---------------------------------------------------------------


def test_the_shipped_profiles_regenerate_identically(tmp_path):
    written = P.regenerate(tmp_path)
    assert {p.name for p in written} == {f"{P.analytic_name(*t)}.json" for t in P.SHIPPED_ANALYTIC}
    for path in written:
        shipped = P.PROFILES_DIR / path.name
        assert shipped.read_text() == path.read_text(), f"{path.name}: run python -m fleetserve.sim.profile regenerate"
    for name in P.shipped_profiles():  # every shipped file loads, calibrated ones too
        load_profile(name)


def test_a_simulation_runs_on_a_loaded_profile():
    trace = poisson(
        num_requests=60, rate=30.0, seed=1, prompt=Lengths(median=256, lo=16, hi=1024), output=Lengths(median=16)
    )
    cost = load_profile("h100-llama-3.1-8b").cost_model()
    # no KV size in the engine args: the profile's memory sizes the cache
    result = run_simulation(trace, cost, 2, "power_of_two", {"max_model_len": 4096}, seed=0)
    assert result.completed == 60
    assert 0.005 < result.itl_s["p50"] < 0.05


def test_the_fit_minimizes_relative_not_absolute_error():
    """Where no line fits (a convex cost), the 1/t weighting keeps short steps' errors small."""
    import numpy as np
    from scipy.optimize import nnls

    samples = [(_prefill(n), 1e-3 + 1e-9 * n**2) for n in (1, 2, 4, 8, 16, 64, 256, 1024, 4096, 8192)]
    step, stats = fit_linear(samples)
    a = np.array([P._linear_row(s) for s, _ in samples])
    t = np.array([t for _, t in samples])
    scale = np.where(a.max(axis=0) > 0, a.max(axis=0), 1.0)
    x, _ = nnls(a / scale, t)  # unweighted: absolute error
    plain = LinearStep.model_validate(dict(zip(P.LINEAR_TERMS, (x / scale).tolist())))
    plain_rel = P.relative_errors(plain, samples)
    assert stats.median_rel_error < 0.5 * float(np.median(plain_rel))
    assert stats.max_rel_error < max(plain_rel)
