"""The trace's tenant reaches the real scheduler in the simulator, where policy "fair" runs
unchanged: a light tenant's TTFT behind a heavy tenant's backlog, fcfs vs fair."""

from __future__ import annotations

from fleetserve.sim.cluster import Cluster
from fleetserve.sim.traces import TraceRequest

from .test_sim_core import LinearCost, _args


def _trace() -> list[TraceRequest]:
    heavy = [TraceRequest(0.01 * i, 200, prompt_tokens=1000, tenant="heavy") for i in range(40)]
    light = [TraceRequest(0.5 + 0.5 * i, 10, prompt_tokens=100, tenant="light") for i in range(12)]
    return heavy + light


def _run(policy: str):
    cluster = Cluster(LinearCost(), 1, "power_of_two", _args(num_blocks=800, scheduling_policy=policy, max_num_seqs=8))
    seen: set[str] = set()
    scheduler = cluster.replicas[0].scheduler
    add = scheduler.add_request

    def spy(request):
        seen.add(request.tenant)
        add(request)

    scheduler.add_request = spy  # type: ignore[method-assign]
    return cluster.run(_trace()), seen, scheduler


def test_tenants_reach_the_scheduler_and_fair_shields_the_light_tenant():
    fcfs, seen, sched = _run("fcfs")
    assert seen == {"heavy", "light"} and sched.vtc is None
    fair, seen, sched = _run("fair")
    assert seen == {"heavy", "light"} and sched.vtc is not None
    assert fcfs.completed == fair.completed == 52
    light_fcfs, light_fair = fcfs.tenants["light"]["ttft_s"], fair.tenants["light"]["ttft_s"]
    # FCFS: the light requests queue behind the heavy backlog; fair: they go next.
    assert light_fair["p90"] * 5 < light_fcfs["p90"], (light_fair, light_fcfs)
    # The heavy tenant still gets the rest: the run ends about as late.
    assert fair.duration_s <= fcfs.duration_s * 1.05
    assert fair.to_dict()["tenants"]["heavy"]["completed"] == 40
