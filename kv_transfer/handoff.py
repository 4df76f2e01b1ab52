"""Ending a hand-off nobody will load: the router's side of a producer's lease.

A producer keeps an exported hand-off until its consumer confirms it (the consumer's worker
half does, once it has read it) or its lease ends (`kv_lease_s`). When the router knows the
consumer will never read it (the decode replica refused the request, failed before loading,
or the client went away), `release_unused(params)` ends it at once where the producer's
copy can be reached without its engine: the Ray object store's owner actor
(`remote_ray_owner`), which then drops every producer rank's object. P2P exports live in the
producing engine's outbox and shared-storage ones are a prefix cache: those are left to
their lease (P2P) or kept (shared storage), and this returns False.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

logger = logging.getLogger(__name__)

HOLD_WAIT_S = 5.0  # how long a release waits for the export to be held (it may be dropped)


def release_unused(params: Mapping[str, Any]) -> bool:
    """Release the hand-off `params` (a producer's kv_transfer_params) unread; True when its
    producer's copy was released, False when it is left to its lease. Blocking (a Ray
    lookup): call it off an event loop."""
    owner = params.get("remote_ray_owner")
    tid = params.get("transfer_id")
    if owner is None or tid is None:
        return False
    import ray

    if not ray.is_initialized():
        return False
    try:
        actor = ray.get_actor(str(owner), namespace=params.get("remote_ray_namespace"))
    except ValueError:  # no owner: nothing is held
        return False
    wait = getattr(actor, "wait_lookup", None)  # (an owner started by an older fleetserve lacks it)
    for rank in range(int(params.get("remote_tp_size", 1))):
        oid = f"{tid}/r{rank}"
        if wait is not None:
            # The producer answers before its export is held (it is saved after the request
            # finished): a release that came first would find nothing, and the export would
            # then wait for its lease.
            ray.get(wait.remote(oid, HOLD_WAIT_S), timeout=HOLD_WAIT_S + 5.0)
        # (one reader of one: the object goes now, whatever consumer ranks said before)
        actor.release.remote(oid, 0, 1)
    return True
