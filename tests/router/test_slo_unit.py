"""SLO-aware admission (router/routing/slo.py): the shared step-cost formulas, the TTFT/ITL
predictor (profile and online) and the admission decision. Pure Python, no Ray, milliseconds."""

from __future__ import annotations

import json
import math

import pytest

from fleetserve.router.routing.slo import SloAdmission, SloSettings, SloTarget, TtftPredictor
from fleetserve.scheduler.step_cost import StepShape, read_profile_json, step_cost_from_profile
from fleetserve.sim.profile import load_profile, shipped_profiles

SHAPES = [
    StepShape(decode_seqs=1, decode_tokens=1, decode_context_tokens=1024),
    StepShape(decode_seqs=64, decode_tokens=80, decode_context_tokens=65536),
    StepShape(prefill_tokens=2048, prefill_seqs=3, prefill_attn_tokens=2048 * 1024.0),
    StepShape(1984, 1, 1984 * 992.0, 64, 64, 64 * 1500),
]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def h100() -> dict:
    return json.loads(load_profile("h100-llama-3.1-8b").to_json())


@pytest.mark.parametrize("name", shipped_profiles())
def test_router_evaluates_every_shipped_profile_as_the_simulator_does(name):
    prof = load_profile(name)
    sim_cost = prof.cost_model()
    shared = step_cost_from_profile(json.loads(prof.to_json()), name)
    for shape in SHAPES:
        assert shared.step_seconds(shape) == pytest.approx(sim_cost.step_seconds(shape), rel=1e-12)


def test_a_bad_profile_is_refused_naming_the_field(tmp_path):
    data = h100()
    del data["step"]["peak_flops"]
    with pytest.raises(ValueError, match=r"step\.peak_flops"):
        step_cost_from_profile(data, "x.json")
    data = h100()
    data["model_shape"]["num_layers"] = 0
    with pytest.raises(ValueError, match=r"model_shape\.num_layers"):
        step_cost_from_profile(data)
    p = tmp_path / "p.json"
    p.write_text("{not json")
    with pytest.raises(ValueError, match="line 1"):
        read_profile_json(p)
    p.write_text(json.dumps(h100()))
    assert read_profile_json(p)["name"] == "h100-llama-3.1-8b"


@pytest.mark.parametrize("name", shipped_profiles())
def test_a_shipped_profile_is_named_as_fleetserve_sim_names_it(name):
    """--slo-profile h100-llama-3.1-8b reads the shipped file, as `fleetserve sim --profile` does
    (the router reads the data file; it does not import the simulator)."""
    assert read_profile_json(name) == json.loads(load_profile(name).to_json())
    with pytest.raises(ValueError, match="no-such-profile"):
        read_profile_json("no-such-profile")


def report(q=0, running=0, waiting=0, kv=0.0, blocks=1000, steps=0, busy=0.0):
    return {
        "num_queued_tokens": q,
        "num_running": running,
        "num_waiting": waiting,
        "kv_cache_usage": kv,
        "num_blocks": blocks,
        "num_steps": steps,
        "busy_s": busy,
    }


def test_profile_prediction_is_the_steps_the_queue_takes():
    clock = Clock()
    settings = SloSettings(profile=h100(), max_num_batched_tokens=2048, block_size=16)
    pred = TtftPredictor(settings, clock)
    cost = step_cost_from_profile(h100())
    # no report yet: an idle replica, one step of the prompt alone
    assert pred.predict("a", 100).ttft_s == pytest.approx(cost.step_seconds(StepShape(100, 1, 100 * 100 / 2)))
    pred.report("a", report(q=10_000 + 8, running=8, waiting=3, kv=0.1, blocks=1000))
    ctx = int(0.1 * 1000 * 16 / 8)
    chunk = 2048 - 8
    step = cost.step_seconds(StepShape(chunk, 1, chunk * chunk / 2, 8, 8, 8 * ctx))
    p = pred.predict("a", 500)
    work = 10_008 + 500
    full, rest = work // chunk, work % chunk  # full chunks, then a step of the rest
    last = cost.step_seconds(StepShape(rest, 1, rest * rest / 2, 8, 8, 8 * ctx))
    assert p.ttft_s == pytest.approx(full * step + last)
    assert p.itl_s is not None and p.itl_s > step * 0.5  # a step with a prefill chunk in it
    # what was routed there since the report counts; time since the report drains it
    pred.routed("a", 20_000)
    assert pred.predict("a", 500).ttft_s > p.ttft_s
    clock.t = 100.0
    idle = pred.predict("a", 500).ttft_s
    # all of it computed by now: one step of its own 500 tokens beside the decodes
    assert idle == pytest.approx(cost.step_seconds(StepShape(500, 1, 500 * 500 / 2, 8, 8, 8 * ctx)))


def test_online_drain_rate_and_step_time_without_profile():
    clock = Clock()
    pred = TtftPredictor(SloSettings(max_num_batched_tokens=1000), clock)
    pred.report("a", report(q=5000, waiting=4, steps=10, busy=0.5))
    assert pred.predict("a", 100).ttft_s is None  # one report: no rate yet
    pred.routed("a", 3000)
    clock.t = 1.0
    pred.report("a", report(q=4000, waiting=4, steps=30, busy=1.5))  # drained 5000 + 3000 - 4000
    st = pred._replicas["a"]
    assert st.drain_tps == pytest.approx(4000.0)
    assert st.step_s == pytest.approx(1.0 / 20)
    p = pred.predict("a", 1000)
    assert p.ttft_s == pytest.approx((4000 + 1000) / 4000.0)
    assert p.itl_s == pytest.approx(0.05)
    # a queue under one step's budget at either end says nothing of capacity
    pred2 = TtftPredictor(SloSettings(max_num_batched_tokens=1000), clock)
    clock.t = 0.0
    pred2.report("b", report(q=500, waiting=1))
    clock.t = 1.0
    pred2.report("b", report(q=0, waiting=0))
    assert pred2._replicas["b"].drain_tps is None


def test_admission_takes_the_first_candidate_that_meets_and_refuses_when_none_does():
    clock = Clock()
    adm = SloAdmission(SloSettings(default=SloTarget(ttft_s=1.0), headroom=1.0, max_num_batched_tokens=1000), clock)
    for rid, q, rate in (("busy", 50_000, 1000), ("ok", 1500, 4000)):
        adm.report(rid, report(q=q + rate, waiting=5))  # (both ends over the 1000-token budget)
        clock.t = 1.0
        adm.report(rid, report(q=q, waiting=5))  # drains `rate` tokens/s
        clock.t = 0.0
    clock.t = 1.0
    d = adm.choose(["busy", "ok"], 10)
    assert d.replica_id == "ok" and not d.refused  # the policy's first pick misses: skipped
    assert adm.admitted == {"default": 1}
    d = adm.choose(["busy"], 10)
    assert d.refused and d.reason == "ttft" and d.replica_id is None
    assert d.retry_after_s == math.ceil((50_000 + 10) / 1000.0 - 1.0)
    assert "time-to-first-token SLO of 1000 ms" in d.message
    assert adm.refused == {("default", "ttft"): 1}
    # a replica with no report yet: idle, at the fleet's mean drain rate (2500 tokens/s)
    assert adm.choose(["new"], 2000).replica_id == "new"
    assert adm.choose(["new"], 3000).refused


def test_tenant_targets_itl_refusals_and_no_target():
    clock = Clock()
    settings = SloSettings(
        tenants={"gold": SloTarget(ttft_s=0.5, itl_s=0.01)}, headroom=1.0, max_num_batched_tokens=1000
    )
    assert settings.enabled
    adm = SloAdmission(settings, clock)
    adm.report("a", report(q=0, steps=0, busy=0.0))
    clock.t = 1.0
    adm.report("a", report(q=0, steps=10, busy=0.5))  # 50 ms steps
    d = adm.choose(["a"], 10, tenant="gold")
    assert d.refused and d.reason == "itl" and d.slo_class == "gold" and d.retry_after_s == 1
    # a tenant without targets (and no default) is admitted to the policy's pick, unpredicted
    d = adm.choose(["a"], 10, tenant="bronze")
    assert d.replica_id == "a" and d.prediction is None and d.slo_class == "default"
    assert adm.choose([], 10).replica_id is None


def test_settings_round_trip_and_checks():
    s = SloSettings(default=SloTarget(ttft_s=2.0), tenants={"t": SloTarget(itl_s=0.05)}, profile=h100())
    again = SloSettings.from_dict(json.loads(json.dumps(s.to_dict())))
    assert again == s
    assert not SloSettings().enabled
    with pytest.raises(ValueError, match="ttft_s"):
        SloTarget(ttft_s=0)
    with pytest.raises(ValueError, match="headroom"):
        SloSettings(headroom=0)
    with pytest.raises(ValueError, match="step"):
        SloSettings(profile={"name": "x"})


def test_goodput_metrics_count_met_missed_and_refused():
    from prometheus_client.parser import text_string_to_metric_families

    from fleetserve.router.metrics import SloMetrics

    clock = Clock()
    m = SloMetrics(window_s=10.0, clock=clock)
    m.finished("gold", True)
    m.finished("gold", True)
    m.finished("gold", False)
    m.refused("gold", "ttft")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(m.text())
        for s in fam.samples
    }
    assert samples[("fleetserve:slo_requests_total", (("outcome", "met"), ("slo_class", "gold")))] == 2
    assert samples[("fleetserve:slo_requests_total", (("outcome", "missed"), ("slo_class", "gold")))] == 1
    assert samples[("fleetserve:slo_refusals_total", (("reason", "ttft"), ("slo_class", "gold")))] == 1
    assert samples[("fleetserve:slo_goodput", (("slo_class", "gold"),))] == pytest.approx(0.2)
    clock.t = 11.0  # out of the window
    assert m.goodput() == {"gold": 0.0}


def test_a_replica_not_measured_yet_takes_the_fleets_drain_rate():
    """Without it a replica with no estimate would be predicted to meet every target, and the
    SLO pick would send it everything (seen on a real 2-replica app)."""
    clock = Clock()
    pred = TtftPredictor(SloSettings(max_num_batched_tokens=1000), clock)
    pred.report("a", report(q=6000, waiting=5))
    pred.report("b", report(q=30_000, waiting=0))  # one report: never measured
    clock.t = 1.0
    pred.report("a", report(q=4000, waiting=5))  # drains 2000 tokens/s
    # b's queue, less a second at that rate since its report
    assert pred.predict("b", 0).ttft_s == pytest.approx((30_000 - 2000) / 2000.0)
    assert pred.predict("unseen", 1000).ttft_s == pytest.approx(1000 / 2000.0)


def test_a_seat_bound_replica_is_measured_below_one_step_of_queue():
    """Every seat taken and requests waiting: the queue drains as seats free, however few
    tokens it holds (a real SmolLM2 replica with 16 seats was never measured before this)."""
    clock = Clock()
    pred = TtftPredictor(SloSettings(max_num_batched_tokens=2048, max_num_seqs=16), clock)
    pred.report("a", report(q=1500, running=16, waiting=6))
    clock.t = 2.0
    pred.report("a", report(q=1100, running=16, waiting=4))
    assert pred._replicas["a"].drain_tps == pytest.approx(200.0)
    # not seat-bound and under a step's work: arrivals-limited, not measured
    pred.report("b", report(q=1500, running=10, waiting=2))
    clock.t = 4.0
    pred.report("b", report(q=1100, running=10, waiting=1))
    assert pred._replicas["b"].drain_tps is None
