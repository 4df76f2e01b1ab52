"""Process-local registry of this process's request routers, by deployment.

Serve pickles the request router class *by value* when it ships the deployment
config, so module globals of `router/routing/request_router.py` are copies inside the
handle's process. The registry therefore lives here, in a module imported by
reference: the router registers itself, the ingress looks it up.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

_ROUTERS: dict[tuple[str, str], Any] = {}
_LOCK = threading.Lock()


def register(app_name: str, deployment_name: str, router: Any) -> None:
    with _LOCK:
        _ROUTERS[(app_name, deployment_name)] = router


def get_router(app_name: str, deployment_name: str) -> Optional[Any]:
    """The `FleetRequestRouter` of this process's handle to that deployment, if any."""
    with _LOCK:
        return _ROUTERS.get((app_name, deployment_name))


def release_request(internal_request_id: str) -> None:
    """The ingress's call for `internal_request_id` has ended (finished, failed or abandoned by
    its client): every router of this process stops counting it. Serve reports completion
    only for requests it dispatched; a caller that went away while its request was being
    routed or dispatched would otherwise stay counted on a replica for good."""
    with _LOCK:
        routers = list(_ROUTERS.values())
    for router in routers:
        release = getattr(router, "release_request", None)
        if release is not None:
            release(internal_request_id)
