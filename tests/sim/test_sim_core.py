"""The simulator's core (fleetserve/sim replica.py, cluster.py, result.py): the real scheduler
and routing policies in virtual time, deterministic, conserving requests and KV blocks."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import fleetserve.sim
from fleetserve.router.routing.kv_index import KVIndex
from fleetserve.router.routing.policies import POLICIES, RoutingPolicy
from fleetserve.router.routing.policies.prefix_aware import PrefixAwarePolicy
from fleetserve.scheduler import Scheduler
from fleetserve.sim.cluster import Cluster, run_simulation
from fleetserve.sim.generators import Lengths, poisson, shared_prefix
from fleetserve.sim.replica import SimReplica
from fleetserve.sim.result import GapHistogram, quantile
from fleetserve.sim.shape import StepShape
from fleetserve.sim.traces import TraceRequest


class LinearCost:
    """A stand-in step-cost model: fixed overhead plus per-token and per-row terms."""

    def __init__(self, overhead_s: float = 0.002, prefill_s: float = 5e-5, decode_s: float = 2e-4) -> None:
        self.overhead_s, self.prefill_s, self.decode_s = overhead_s, prefill_s, decode_s
        self.shapes: list[StepShape] = []

    def step_seconds(self, shape: StepShape) -> float:
        self.shapes.append(shape)
        return self.overhead_s + self.prefill_s * shape.prefill_tokens + self.decode_s * shape.decode_seqs

    def kv_transfer_seconds(self, nbytes: int, connector: str) -> float:
        return 0.0

    def kv_bytes_per_token(self) -> int:
        return 1024


def _trace(n=200, rate=40.0, seed=5, prompt=300, out=60):
    return poisson(
        num_requests=n,
        rate=rate,
        seed=seed,
        prompt=Lengths(median=prompt, sigma=0.4, lo=16, hi=4 * prompt),
        output=Lengths(median=out, sigma=0.4, lo=4, hi=4 * out),
    )


def _args(num_blocks=2000, max_model_len=4096, **kw):
    return {"num_gpu_blocks_override": num_blocks, "max_model_len": max_model_len, **kw}


# --- the real code is what runs -----------------------------------------------------------


def test_replicas_run_the_real_scheduler_and_the_router_the_real_policy():
    cluster = Cluster(LinearCost(), 3, "prefix_aware", _args(), seed=0)
    for replica in cluster.replicas:
        assert type(replica.scheduler) is Scheduler
        assert type(replica.scheduler).__module__ == "fleetserve.scheduler.scheduler"
        # KV events are on by themselves with prefix_aware, as with `fleetserve serve`.
        assert replica.scheduler.kv.pool.events is not None
    assert type(cluster.policy) is PrefixAwarePolicy is POLICIES["prefix_aware"]
    assert type(cluster.policy).__module__ == "fleetserve.router.routing.policies.prefix_aware"
    assert type(cluster.kv_index) is KVIndex and cluster.policy.kv_index is cluster.kv_index
    # The policy's lingering hints expire in virtual time.
    assert cluster.policy.clock == cluster.clock
    result = cluster.run(_trace(60))
    assert result.completed == 60
    assert cluster.kv_index.replicas(), "the KV events reached the router's index"


def test_a_configured_scheduler_subclass_is_built(tmp_path):
    cluster = Cluster(LinearCost(), 1, "power_of_two", _args(scheduler_cls="fleetserve.scheduler.scheduler:Scheduler"))
    assert isinstance(cluster.replicas[0].scheduler, Scheduler)


def test_no_copy_of_scheduler_or_policy_code_in_the_simulator():
    """A scheduler or routing policy defined inside fleetserve.sim would be a fork."""
    for info in pkgutil.iter_modules(fleetserve.sim.__path__, "fleetserve.sim."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and obj.__module__ == module.__name__:
                assert not issubclass(obj, (Scheduler, RoutingPolicy)), f"{info.name}.{name} forks real code"
                assert not {"schedule", "update_from_output", "allocate_slots"} & set(vars(obj)), (
                    f"{info.name}.{name} reimplements the scheduler"
                )


# --- determinism --------------------------------------------------------------------------------


def test_same_seed_same_result_other_seed_other_result():
    trace = _trace(150, rate=60.0)

    def run(seed):
        return run_simulation(trace, LinearCost(), 4, "power_of_two", _args(), seed=seed, slo_ttft_s=0.5).to_json()

    a, b, c = run(1), run(1), run(2)
    assert a == b
    assert a != c
    assert json.loads(a)["requests"] == 150


_IN_A_PROCESS = """
import json, sys
sys.path.insert(0, {tests!r})
from sim.test_sim_core import LinearCost, _args
from fleetserve.sim.cluster import run_simulation
from fleetserve.sim.generators import Lengths, shared_prefix
trace = shared_prefix(num_requests=120, rate=30.0, seed=4, num_tenants=6, system_prompt_tokens=256,
                      user=Lengths(median=32, lo=8, hi=64), output=Lengths(median=8, lo=2, hi=16))
print(run_simulation(trace, LinearCost(), 3, "prefix_aware", _args(num_blocks=60), seed=7).to_json())
"""


def test_a_run_repeats_across_processes_whatever_the_hash_seed():
    """Set iteration over replica ids follows PYTHONHASHSEED; no result may depend on it."""
    root = Path(__file__).resolve().parents[2]
    code = _IN_A_PROCESS.format(tests=str(root / "tests"))
    outs = []
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs.append(proc.stdout)
    assert outs[0] == outs[1]
    assert json.loads(outs[0])["prefix_hit_rate"] > 0


# --- conservation ----------------------------------------------------------------------------------


def test_conservation_under_preemption_from_a_small_kv_cache():
    trace = _trace(120, rate=40.0, prompt=200, out=150)
    cluster = Cluster(LinearCost(), 2, "least_loaded", _args(num_blocks=64, max_model_len=2048), seed=1)
    result = cluster.run(trace)
    assert result.preemptions > 0
    assert result.completed == result.requests == 120 and result.refused == 0
    assert sum(r.num_preemptions for r in result.records) == result.preemptions
    for replica in cluster.replicas:
        kv = replica.scheduler.kv
        kv.check_invariants()
        assert not kv.req_to_blocks
        assert kv.num_free_blocks == kv.num_blocks  # cached blocks included: none referenced
        assert replica.leaked_blocks() == 0
        assert not replica.scheduler.requests and not replica.requests
    # Every request produced exactly the tokens the trace asked for, in order of time.
    for rec, tr in zip(result.records, trace):
        assert rec.num_output == tr.output_tokens
        assert rec.arrival_s <= rec.first_token_s <= rec.last_token_s == rec.finish_s


def test_a_prompt_longer_than_max_model_len_is_refused_not_lost():
    trace = _trace(20, rate=20.0) + [
        TraceRequest(arrival_s=0.3, prompt_tokens=5000, output_tokens=8, request_id="long"),
        TraceRequest(arrival_s=0.4, prompt_tokens=4096, output_tokens=8, request_id="exact"),
    ]
    result = run_simulation(trace, LinearCost(), 2, "power_of_two", _args(max_model_len=4096))
    assert result.requests == 22 and result.completed == 20 and result.refused == 2
    assert result.refused_reasons == {"prompt_too_long": 2}
    refused = {r.trace_id: r.refused for r in result.records if r.refused}
    assert set(refused) == {"long", "exact"} and "max_model_len 4096" in refused["long"]
    assert result.to_dict()["refused"] == 2


def test_a_prompt_longer_than_the_kv_cache_is_refused():
    trace = [TraceRequest(arrival_s=0.0, prompt_tokens=1000, output_tokens=4)]
    result = run_simulation(trace, LinearCost(), 1, "power_of_two", _args(num_blocks=32))
    assert result.refused_reasons == {"prompt_exceeds_kv_cache": 1}


def test_output_is_capped_by_max_model_len_as_the_engine_does():
    trace = [TraceRequest(arrival_s=0.0, prompt_tokens=1000, output_tokens=100)]
    result = run_simulation(trace, LinearCost(), 1, "power_of_two", _args(max_model_len=1024))
    (rec,) = result.records
    assert rec.finish_reason == "length" and rec.num_output == 24
    assert result.completed == 1 and result.truncated == 1


def test_requests_wait_at_the_router_when_every_replica_is_full():
    trace = _trace(40, rate=200.0)
    result = run_simulation(trace, LinearCost(), 2, "power_of_two", _args(), max_ongoing_requests=3)
    assert result.config["router_held"] > 0
    assert result.completed == 40
    assert max(r.num_preemptions for r in result.records) == 0


# --- what the metrics show -------------------------------------------------------------------------


def test_ttft_grows_when_load_exceeds_capacity():
    kw = {"prompt": 300, "out": 50}
    light = run_simulation(_trace(200, rate=5.0, **kw), LinearCost(), 2, "power_of_two", _args())
    heavy = run_simulation(_trace(200, rate=400.0, **kw), LinearCost(), 2, "power_of_two", _args())
    assert heavy.ttft_s["p50"] > 10 * light.ttft_s["p50"]
    assert min(heavy.utilization) > 0.9 > max(light.utilization)
    assert heavy.output_tokens_per_s > light.output_tokens_per_s


def test_prefix_aware_routing_beats_power_of_two_on_shared_system_prompts():
    trace = shared_prefix(
        num_requests=300,
        rate=20.0,
        seed=3,
        num_tenants=8,
        system_prompt_tokens=1024,
        user=Lengths(median=64, sigma=0.5, lo=16, hi=256),
        output=Lengths(median=16, sigma=0.5, lo=4, hi=64),
    )
    args = _args(num_blocks=200)  # a replica caches about 3 of the 8 system prompts
    p2 = run_simulation(trace, LinearCost(), 4, "power_of_two", args)
    precise = run_simulation(trace, LinearCost(), 4, "prefix_aware", args)
    approx = run_simulation(trace, LinearCost(), 4, "prefix_aware_approx", args)
    assert precise.prefix_hit_rate > p2.prefix_hit_rate + 0.3
    assert approx.prefix_hit_rate > p2.prefix_hit_rate + 0.3
    assert precise.ttft_s["p50"] < p2.ttft_s["p50"]


def test_step_shapes_carry_prefill_context_and_decode_rows():
    cost = LinearCost()
    trace = [TraceRequest(arrival_s=0.0, prompt_tokens=100, output_tokens=3)]
    run_simulation(trace, cost, 1, "power_of_two", _args(max_num_batched_tokens=64), network_latency_s=0.0)
    first, second = cost.shapes[:2]  # the prompt in two chunks of a 64-token budget
    assert (first.prefill_tokens, first.prefill_seqs, first.decode_seqs) == (64, 1, 0)
    assert first.prefill_attn_tokens == 64 * 32
    assert second.prefill_tokens == 36 and second.prefill_attn_tokens == 36 * (64 + 18)
    decodes = cost.shapes[2:]
    assert [(s.decode_seqs, s.decode_tokens, s.decode_context_tokens) for s in decodes] == [(1, 1, 101), (1, 1, 102)]


def test_result_json_has_the_fields_and_goodput():
    trace = _trace(80, rate=40.0)
    result = run_simulation(trace, LinearCost(), 2, "least_loaded", _args(), slo_ttft_s=10.0, slo_itl_s=10.0)
    d = json.loads(result.to_json())
    for key in (
        "requests",
        "completed",
        "refused",
        "duration_s",
        "output_tokens_per_s",
        "ttft_s",
        "itl_s",
        "e2e_s",
        "prefix_hit_rate",
        "preemptions",
        "kv_bytes_moved",
        "utilization",
        "goodput",
    ):
        assert key in d, key
    for key in ("ttft_s", "itl_s", "e2e_s"):
        assert set(d[key]) == {"p50", "p90", "p99"} and d[key]["p50"] <= d[key]["p90"] <= d[key]["p99"]
    assert d["kv_bytes_moved"] == 0 and len(d["utilization"]) == 2
    assert d["goodput"] == pytest.approx(80 / d["duration_s"])  # generous SLOs: all meet them
    strict = run_simulation(trace, LinearCost(), 2, "least_loaded", _args(), slo_ttft_s=1e-6)
    assert strict.to_dict()["goodput"] == 0.0
    assert "goodput" not in run_simulation(trace, LinearCost(), 2, "least_loaded", _args()).to_dict()


def test_gap_histogram_matches_exact_quantiles():
    values = [0.01 * (i % 37) + 0.001 * (i % 5) for i in range(1000)]
    h = GapHistogram()
    for v in values:
        h.add(v)
    s = sorted(values)
    assert h.quantiles((0.5, 0.9, 0.99)) == pytest.approx([quantile(s, q) for q in (0.5, 0.9, 0.99)])
    h.max_keys = 10
    h.maybe_fold()
    assert h.approximate and h.count == 1000
    assert h.quantiles((0.9,))[0] == pytest.approx(quantile(s, 0.9), rel=0.02)


def test_the_kv_cache_size_comes_from_the_memory_budget():
    cluster = Cluster(LinearCost(), 1, "power_of_two", {"kv_cache_memory_bytes": 1024 * 16 * 50, "max_model_len": 512})
    assert cluster.num_blocks == 50
    with pytest.raises(ValueError, match="KV cache size is unknown"):
        Cluster(LinearCost(), 1, "power_of_two", {"max_model_len": 512})


def test_sim_replica_alone():
    from fleetserve.replica.engine.engine_args import EngineArgs

    args = EngineArgs(max_model_len=512)
    replica = SimReplica("r", args.scheduler_config(512), args.cache_config(64), LinearCost())
    replica.add_request("a", list(range(1, 41)), 2, 0.0)
    step = replica.start_step()
    assert step is not None and step.shape.prefill_tokens == 40 and step.seconds > 0
    outputs, _ = replica.finish_step(step)
    assert [len(o.new_token_ids) for o in outputs] == [1]
