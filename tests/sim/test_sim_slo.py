"""SLO-aware admission in the simulator (the router's own router/routing/slo.py in SimRouter):
under 2x overload, refusing early what cannot meet its TTFT target serves more requests within
it than queueing everything; the run still conserves every request and KV block."""

from __future__ import annotations

import json
import random

from fleetserve.router.routing.slo import SloSettings, SloTarget
from fleetserve.sim.cluster import run_simulation
from fleetserve.sim.profile import load_profile
from fleetserve.sim.traces import TraceRequest

ENGINE = {"max_model_len": 8192, "max_num_seqs": 64, "kv_cache_memory_bytes": 60 * 2**30}
TTFT_S = 1.0


def trace(rate: float, seconds: float, seed: int = 0) -> list[TraceRequest]:
    rng = random.Random(seed)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t > seconds:
            return out
        out.append(TraceRequest(arrival_s=t, prompt_tokens=rng.randint(256, 3072), output_tokens=rng.randint(32, 512)))


def test_admission_raises_goodput_under_2x_overload():
    prof = load_profile("h100-llama-3.1-8b")
    # One H100 replica serves about 12 of these requests a second; 24/s is twice that.
    requests = trace(24.0, 20.0)
    results = {}
    for name, slo in (
        ("off", None),
        ("profile", SloSettings(default=SloTarget(ttft_s=TTFT_S), profile=json.loads(prof.to_json()))),
        ("online", SloSettings(default=SloTarget(ttft_s=TTFT_S))),
    ):
        results[name] = run_simulation(
            requests, prof.cost_model(), 1, "power_of_two", ENGINE, slo_ttft_s=TTFT_S, slo=slo
        )
    off, profile, online = results["off"], results["profile"], results["online"]
    assert off.refused == 0 and "slo_admission" not in off.config
    for r in (profile, online):
        assert r.refused > 0 and set(r.refused_reasons) == {"slo_ttft"}
        assert r.completed + r.refused == len(requests)
        assert r.slo["met"] >= 2 * off.slo["met"], (r.slo, off.slo)
        assert r.ttft_s["p90"] < off.ttft_s["p90"]
    assert profile.config["slo_admission"]["profile"] == "h100-llama-3.1-8b"
    assert online.config["slo_admission"]["profile"] is None


def test_admission_refuses_nothing_when_the_fleet_keeps_up():
    prof = load_profile("h100-llama-3.1-8b")
    requests = trace(4.0, 10.0)
    slo = SloSettings(default=SloTarget(ttft_s=TTFT_S), profile=json.loads(prof.to_json()))
    r = run_simulation(requests, prof.cost_model(), 1, "power_of_two", ENGINE, slo_ttft_s=TTFT_S, slo=slo)
    assert r.refused == 0 and r.slo["met"] == len(requests)
