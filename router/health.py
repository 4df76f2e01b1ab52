"""What /health (HTTP) and Health (gRPC) report: every engine replica asked, all at once,
outside Serve's request path.

A replica counts as healthy only when its engine says so (`EngineReplica.check_health`: the
engine core process is alive, not wedged, and answered its ping), not merely because its
actor answers: a replica whose engine core was SIGKILLed, or is stuck, used to keep /health
green. The answer is 200 while at least one replica is healthy (the service serves;
`unhealthy` lists the others and why) and 503 when none is. Serve replaces the unhealthy
replicas on its own (its periodic `check_health` fails too).

How the replicas are asked: through each replica actor's `check_health` method, the very
control-plane call Serve's controller makes, not through the deployment handle. A handle call
is a request like any other: it waits in Serve's queue while the replica is at
`max_ongoing_requests`, so under overload /health took as long as a generation request
(p99 29 s in a soak). The actor method runs on the replica's event loop alongside the
requests, never behind them, and the replicas are asked concurrently (no Serve router, so no
shared internal request id to confuse it).
"""

from __future__ import annotations

import asyncio
from typing import Any

from ray.exceptions import RayTaskError

from fleetserve.router.routing.registry import get_router

# A replica that does not answer its health check within this is reported unhealthy
# ("unreachable"); a healthy replica answers in milliseconds even under overload.
REPLICA_TIMEOUT_S = 5.0


async def replica_health(pools: Any, timeout_s: float = REPLICA_TIMEOUT_S) -> dict:
    """{"healthy": [replica ids], "unhealthy": {replica id: reason}} of the engine pool (the
    decode pool with P/D: what answers requests), plus with P/D "prefill": the same for the
    prefill pool. A dead prefill pool degrades the service (the decode replicas recompute
    prompts) but does not stop it, so only the engine pool decides healthy or not.
    `pools`: the ingress's EnginePools (`handles`, the engine pool first, and `info()`)."""
    handles = list(pools.handles)
    routers = [get_router(h.app_name, h.deployment_name) for h in handles]
    if any(r is None for r in routers):  # a handle's router is built by its first call
        await pools.info()
        routers = [get_router(h.app_name, h.deployment_name) for h in handles]
    reports = await asyncio.gather(*(_pool_health(r, timeout_s) for r in routers))
    report = reports[0]
    if len(reports) > 1:
        report["prefill"] = reports[1]
    return report


async def _pool_health(router: Any, timeout_s: float) -> dict:
    actors = router.replica_actors() if router else {}
    results = await asyncio.gather(*(_ask(actor, timeout_s) for actor in actors.values()))
    healthy: list[str] = []
    unhealthy: dict[str, str] = {}
    for rid, reason in zip(actors, results):
        if reason is None:
            healthy.append(rid)
        else:
            unhealthy[rid] = reason[:500]
    return {"healthy": healthy, "unhealthy": unhealthy}


async def _ask(actor: Any, timeout_s: float):
    """None when the replica's health check passes, else why not."""
    try:
        await asyncio.wait_for(actor.check_health.remote(), timeout_s)
    except asyncio.TimeoutError:
        return f"unreachable: no answer to the health check within {timeout_s:g} s"
    except RayTaskError as e:  # the check ran and failed: the engine's own reason
        return str(e.cause)
    except Exception as e:  # noqa: BLE001 - the actor is gone or unreachable
        return f"unreachable: {type(e).__name__}: {e}"
    return None
