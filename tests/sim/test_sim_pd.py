"""Prefill/decode disaggregation in the simulator (sim/cluster.py, `pd=(P, D)`): the real
scheduler and connector scheduler half on both pools, the router's own decision function,
conservation of requests and KV blocks, and the physics P/D exists for."""

from __future__ import annotations

import pytest

import fleetserve.sim.cluster as sim_cluster
from fleetserve.kv_transfer.scheduler_half import TransferScheduler
from fleetserve.router.routing import pd_decision
from fleetserve.scheduler import RequestStatus
from fleetserve.sim.cluster import Cluster, run_simulation
from fleetserve.sim.generators import Lengths, poisson, shared_prefix
from fleetserve.sim.shape import StepShape

BLOCK = 16


class PDCost:
    """A small stand-in cost model with the shape that matters here: a step costs a fixed
    overhead plus its prefill tokens plus its decode rows' context reads."""

    KV = 4096  # bytes per token

    def __init__(self) -> None:
        self.transfers: list[tuple[int, str]] = []

    def step_seconds(self, s: StepShape) -> float:
        return 0.004 + 6e-5 * s.prefill_tokens + 2e-8 * s.prefill_attn_tokens + 2e-7 * s.decode_context_tokens

    def kv_transfer_seconds(self, nbytes: int, connector: str) -> float:
        self.transfers.append((nbytes, connector))
        return 0.002 + nbytes / 10e9

    def kv_bytes_per_token(self) -> int:
        return self.KV


def _trace(n=80, rate=20.0, seed=3, prompt=600, out=30, lo=8):
    return poisson(
        num_requests=n,
        rate=rate,
        seed=seed,
        prompt=Lengths(median=prompt, sigma=1.0, lo=lo, hi=3000),
        output=Lengths(median=out, sigma=0.5, lo=2, hi=4 * out),
    )


ARGS = {"num_gpu_blocks_override": 1500, "max_model_len": 4096, "block_size": BLOCK}


def _run(trace, pd=(1, 2), **kw):
    cluster = Cluster(PDCost(), None, kw.pop("policy", "power_of_two"), ARGS, pd=pd, **kw)
    return cluster, cluster.run(trace)


def test_every_request_completes_and_no_block_leaks_on_either_pool():
    trace = _trace()
    cluster, result = _run(trace)
    assert result.completed == len(trace) and result.refused == 0
    assert sum(r.num_output for r in result.records) == sum(t.output_tokens for t in trace)
    for replica in cluster.replicas:
        s = replica.scheduler
        assert not s.has_unfinished_requests() and not s.sending and not replica.requests
        assert replica.leaked_blocks() == 0, replica.replica_id
    # The prefill replicas did hold blocks past their requests' ends (delay_free) ...
    prefill = [r for r in cluster.replicas if r.pool == "prefill"]
    assert [r.replica_id for r in prefill] == ["prefill-0"]
    assert isinstance(prefill[0].scheduler.connector, TransferScheduler)
    assert prefill[0].scheduler.connector.config.kv_role == "kv_producer"
    # ... and every record's tokens came from its decode replica.
    assert {r.replica for r in result.records} <= {"decode-0", "decode-1"}


def test_decode_replicas_load_through_waiting_for_remote_kvs():
    trace = _trace()
    cluster = Cluster(PDCost(), None, "power_of_two", ARGS, pd=(1, 2))
    seen: set[str] = set()
    for replica in cluster.replicas:
        if replica.pool != "decode":
            continue
        sched = replica.scheduler
        assert sched.connector.config.kv_role == "kv_consumer"
        schedule = sched.schedule

        def watch(sched=sched, schedule=schedule):
            out = schedule()
            for request in sched.waiting_for_remote_kvs.values():
                assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
                seen.add(request.request_id)
            return out

        sched.schedule = watch
    result = cluster.run(trace)
    pd_ids = {r.request_id for r in result.records if r.path == "pd"}
    assert pd_ids and seen == pd_ids
    for r in result.records:
        if r.path == "pd":  # loaded: every full prompt block but the one holding the last token
            assert r.num_remote_tokens == min(r.prompt_tokens // BLOCK * BLOCK, r.prompt_tokens - 1)
        else:
            assert r.num_remote_tokens == 0


def test_short_prompts_stay_on_the_decode_pool_and_bytes_moved_are_the_loaded_blocks():
    cost = PDCost()
    trace = _trace(lo=8, prompt=120)
    cluster = Cluster(cost, None, "power_of_two", ARGS, pd=(1, 2), pd_min_prefill_tokens=64)
    result = cluster.run(trace)
    paths = {r.request_id: r.path for r in result.records}
    # power_of_two knows no cached prefix: the prompt's length alone decides.
    for r in result.records:
        assert paths[r.request_id] == ("pd" if r.prompt_tokens >= 64 else "decode_only")
    counts = result.pd["paths"]
    assert counts["decode_only"] > 5 and counts["pd"] > 5 and counts["prefill_failed"] == 0
    assert counts["pd"] + counts["decode_only"] == len(trace)
    # Whole blocks move: floor(prompt / block) blocks per P/D request (none shared here).
    expected = sum(r.prompt_tokens // BLOCK * BLOCK for r in result.records if r.path == "pd") * PDCost.KV
    assert result.kv_bytes_moved == expected == result.pd["kv_bytes_moved"] == sum(b for b, _ in cost.transfers)
    assert {c for _, c in cost.transfers} == {"p2p"}
    d = result.to_dict()
    assert d["kv_bytes_moved"] == expected and d["pd"]["paths"] == counts
    pools = d["pd"]["pools"]
    assert pools["prefill"]["replicas"] == 1 and pools["decode"]["replicas"] == 2
    assert 0 < pools["prefill"]["utilization"] <= 1 and 0 < pools["decode"]["utilization"] <= 1
    assert [x["pool"] for x in d["replicas"]] == ["prefill", "decode", "decode"]
    assert d["config"]["pd"] == [1, 2] and d["config"]["num_replicas"] == 3


def test_a_prefix_the_decode_replica_caches_is_not_prefilled_again():
    """prefix_aware: the decode pool's KV index knows what each decode replica holds (loaded
    blocks are cached there too), so a request whose uncached part is short stays there."""
    trace = shared_prefix(
        num_requests=60,
        rate=10.0,
        seed=2,
        num_tenants=2,
        system_prompt_tokens=1024,
        user=Lengths(median=24, sigma=0.3, lo=8, hi=40),
        output=Lengths(median=8, sigma=0.3, lo=2, hi=16),
    )
    cluster, result = _run(trace, policy="prefix_aware")
    counts = result.pd["paths"]
    assert counts["pd"] >= 2 and counts["decode_only"] > counts["pd"], counts
    assert cluster.decode_pool.kv_index is not cluster.prefill_pool.kv_index
    assert cluster.decode_pool.policy is not cluster.prefill_pool.policy
    assert result.completed == len(trace)
    # power_of_two knows no prefix: every prompt is prefilled, the decode replica loads only
    # what its own cache lacks, and an export it never loads (its cache held all of it) is
    # released at its first token: no prefill block is left held (the run checks it).
    cluster, result = _run(trace, policy="power_of_two")
    assert result.pd["paths"]["pd"] == len(trace)
    unloaded = [r for r in result.records if r.num_remote_tokens == 0]
    assert unloaded and all(r.num_cached_tokens > 0 for r in unloaded)
    assert all(r.leaked_blocks() == 0 and not r.scheduler.sending for r in cluster.replicas)


def test_same_seed_same_run():
    a = run_simulation(_trace(), PDCost(), None, "power_of_two", ARGS, seed=7, pd=(1, 2))
    b = run_simulation(_trace(), PDCost(), None, "power_of_two", ARGS, seed=7, pd=(1, 2))
    assert a.to_json() == b.to_json()
    assert [r.to_dict() for r in a.records] == [r.to_dict() for r in b.records]


def test_the_simulator_decides_with_the_routers_own_function(monkeypatch):
    from fleetserve.router.routing import pd

    assert sim_cluster.wants_remote_prefill is pd.wants_remote_prefill is pd_decision.wants_remote_prefill
    assert sim_cluster.cached_prompt_tokens is pd.cached_prompt_tokens
    assert sim_cluster.PDSettings is pd.PDSettings
    assert "wants_remote_prefill" in pd.PDRouter.open_stream.__code__.co_names
    assert "cached_prompt_tokens" in pd.PDRouter._pick_decode.__code__.co_names
    # ... and the simulator does call it: refusing every prefill keeps every request on decode.
    calls = []

    def never(prompt_len, cached, sp, settings):
        calls.append((prompt_len, cached, settings.min_prefill_tokens))
        return False

    monkeypatch.setattr(sim_cluster, "wants_remote_prefill", never)
    trace = _trace(n=30)
    _, result = _run(trace, pd_min_prefill_tokens=32)
    assert result.pd["paths"]["decode_only"] == 30 and result.kv_bytes_moved == 0
    assert len(calls) == 30 and {c[2] for c in calls} == {32}


def test_decision_function():
    s = pd_decision.PDSettings(min_prefill_tokens=64)
    assert pd_decision.wants_remote_prefill(100, 36, {}, s)
    assert not pd_decision.wants_remote_prefill(100, 37, {}, s)
    assert not pd_decision.wants_remote_prefill(500, 0, {"n": 2}, s)
    assert not pd_decision.wants_remote_prefill(500, 0, {"prompt_logprobs": 1}, s)
    assert pd_decision.wants_remote_prefill(1, 0, {}, pd_decision.PDSettings(min_prefill_tokens=0))
    assert pd_decision.cached_prompt_tokens(10, 16, 100) == 99
    assert pd_decision.cached_prompt_tokens(2, 16, 100) == 32


def test_bad_pd_settings_are_refused():
    with pytest.raises(ValueError, match="makes 3"):
        Cluster(PDCost(), 4, "power_of_two", ARGS, pd=(1, 2))
    with pytest.raises(ValueError, match="at least one"):
        Cluster(PDCost(), None, "power_of_two", ARGS, pd=(0, 2))
    with pytest.raises(ValueError, match="not simulated"):
        Cluster(PDCost(), None, "power_of_two", ARGS, pd=(1, 2), kv_connector="shared_storage")
    # The app config's default connector is simulated too.
    Cluster(PDCost(), 3, "power_of_two", ARGS, pd=(1, 2), kv_connector="ray_object_store")


def test_pd_decode_itl_p99_beats_colocated_on_long_prompts():
    """Long prompts, long answers, 4 replicas either way: colocated decodes share steps with
    prompt chunks, P/D's decode steps carry only decodes (and each prompt's last token)."""
    from fleetserve.sim.profile import load_profile

    cost = load_profile("h100-llama-3.1-8b").cost_model()
    trace = poisson(
        num_requests=120,
        rate=6.0,
        seed=11,
        prompt=Lengths(median=3000, sigma=0.2, lo=1500, hi=6000),
        output=Lengths(median=150, sigma=0.3, lo=50, hi=400),
    )
    args = {"num_gpu_blocks_override": 6000, "max_model_len": 8192, "max_num_batched_tokens": 2048}
    colocated = run_simulation(trace, cost, 4, "power_of_two", args, seed=0)
    disagg = run_simulation(trace, cost, 4, "power_of_two", args, seed=0, pd=(1, 3))
    assert colocated.completed == disagg.completed == len(trace)
    assert disagg.pd["paths"]["pd"] == len(trace)
    assert disagg.itl_s["p99"] < 0.5 * colocated.itl_s["p99"], (disagg.itl_s, colocated.itl_s)
