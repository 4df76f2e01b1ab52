"""Old home of the gRPC service (now router/grpc/service.py), kept for one name only.

Serve deploy configs that an earlier `fleetserve build` wrote, and RayServices deployed from
them, name the servicer `fleetserve.router.grpc_service.add_servicer` in
`grpc_servicer_functions`; Serve's proxy imports that string. Nothing in this repository
imports this module.
"""

from fleetserve.router.grpc.service import add_servicer

__all__ = ["add_servicer"]
