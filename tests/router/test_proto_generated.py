"""The checked-in gRPC modules are what router/grpc/proto/generate.py makes of fleetserve.proto now
(protoc from grpcio-tools, import paths for the `fleetserve` package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

GENERATE = Path(__file__).resolve().parents[2] / "router" / "grpc" / "proto" / "generate.py"


def test_generated_modules_are_current():
    spec = importlib.util.spec_from_file_location("fleetserve_proto_generate", GENERATE)
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    assert generate.stale() == [], "run: python router/grpc/proto/generate.py"


def test_messages_belong_to_the_package():
    from fleetserve.router.grpc.proto import fleetserve_pb2 as pb

    assert pb.ChatRequest.__module__ == "fleetserve.router.grpc.proto.fleetserve_pb2"
    assert [m.name for m in pb.DESCRIPTOR.services_by_name["FleetServe"].methods] == [
        "Generate",
        "Chat",
        "Embed",
        "Health",
        "ListModels",
    ]


def test_the_old_import_paths_name_the_same_objects():
    """Client code imports `fleetserve.router.proto`, and Serve configs written by an earlier
    `fleetserve build` name `fleetserve.router.grpc_service.add_servicer`: both still resolve,
    to the very objects under router/grpc/ (not copies)."""
    from ray.serve._private.utils import import_attr

    import fleetserve.router.proto.fleetserve_pb2_grpc as old_stubs
    from fleetserve.router.grpc import service
    from fleetserve.router.grpc.proto import fleetserve_pb2, fleetserve_pb2_grpc
    from fleetserve.router.proto import fleetserve_pb2 as old_pb

    assert old_pb is fleetserve_pb2 and old_stubs is fleetserve_pb2_grpc
    assert import_attr("fleetserve.router.grpc_service.add_servicer") is service.add_servicer
