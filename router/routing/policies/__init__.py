"""Routing policies, chosen by name from the application config.

Each is a small class behind `RoutingPolicy.rank(replicas, request) -> tiers`;
`router.routing.request_router.FleetRequestRouter` plugs the chosen one into Ray Serve.
"""

from fleetserve.router.routing.policies.base import ReplicaLoad, RouteRequest, RoutingPolicy, prefer_adapter_holders
from fleetserve.router.routing.policies.least_loaded import LeastLoadedPolicy
from fleetserve.router.routing.policies.power_of_two import PowerOfTwoPolicy
from fleetserve.router.routing.policies.prefix_approx import ApproxPrefixPolicy
from fleetserve.router.routing.policies.prefix_aware import PrefixAwarePolicy

POLICIES: dict[str, type[RoutingPolicy]] = {
    "power_of_two": PowerOfTwoPolicy,
    "least_loaded": LeastLoadedPolicy,
    "prefix_aware": PrefixAwarePolicy,
    "prefix_aware_approx": ApproxPrefixPolicy,
}


def make_policy(name: str, **kwargs) -> RoutingPolicy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"routing_policy {name!r} is not one of {sorted(POLICIES)}") from None
    return cls(**kwargs)


__all__ = [
    "POLICIES",
    "ApproxPrefixPolicy",
    "LeastLoadedPolicy",
    "PowerOfTwoPolicy",
    "PrefixAwarePolicy",
    "ReplicaLoad",
    "RouteRequest",
    "RoutingPolicy",
    "make_policy",
    "prefer_adapter_holders",
]
