"""Old home of the generated gRPC modules (now router/grpc/proto/), kept for clients.

Client code outside this repository imports `from fleetserve.router.proto import
fleetserve_pb2, fleetserve_pb2_grpc` (the documented way). These names are the very modules
under router/grpc/proto, not copies: a second copy would register the same proto messages
twice in protobuf's default pool, which refuses that. Nothing in this repository imports
this package.
"""

import sys

from fleetserve.router.grpc.proto import fleetserve_pb2, fleetserve_pb2_grpc

sys.modules[f"{__name__}.fleetserve_pb2"] = fleetserve_pb2
sys.modules[f"{__name__}.fleetserve_pb2_grpc"] = fleetserve_pb2_grpc

__all__ = ["fleetserve_pb2", "fleetserve_pb2_grpc"]
