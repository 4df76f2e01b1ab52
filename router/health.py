"""What /health (HTTP) and Health (gRPC) report: every engine replica asked, one by one.

A replica counts as healthy only when its engine says so (`EngineReplica.control("health")`:
the engine core process is alive, not wedged, and answered its ping), not merely because
its actor answers: a replica whose engine core was SIGKILLed, or is stuck, used to keep
/health green. The answer is 200 while at least one replica is healthy (the service
serves; `unhealthy` lists the others and why) and 503 when none is. Serve replaces the
unhealthy replicas on its own (their `check_health` fails too).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fleetserve.router.registry import get_router
from fleetserve.router.request_router import TARGET_KWARG


async def replica_health(ingress: Any, timeout_s: float = 5.0) -> dict:
    """{"healthy": [replica ids], "unhealthy": {replica id: reason}}."""
    await ingress.info()  # the handle's router exists and knows the replicas
    router = get_router(ingress._engine.app_name, ingress._engine.deployment_name)
    healthy: list[str] = []
    unhealthy: dict[str, str] = {}
    # One call at a time: see Ingress.replica_calls (concurrent pinned calls sharing one
    # internal request id confuse Serve's router).
    for rid in (router.replica_ids() if router else []):
        try:
            r = await asyncio.wait_for(
                ingress._engine.control.remote("health", **{TARGET_KWARG: rid}), timeout_s)
        except Exception as e:  # noqa: BLE001 - an unreachable replica is an unhealthy one
            unhealthy[rid] = f"unreachable: {type(e).__name__}: {e}"[:500]
            continue
        if r.get("healthy"):
            healthy.append(r["replica"])
        else:
            unhealthy[r["replica"]] = str(r.get("reason"))[:500]
    return {"healthy": healthy, "unhealthy": unhealthy}
