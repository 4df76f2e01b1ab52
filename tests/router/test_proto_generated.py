"""The checked-in gRPC modules are what router/proto/generate.py makes of fleetserve.proto now
(protoc from grpcio-tools, import paths for the `fleetserve` package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

GENERATE = Path(__file__).resolve().parents[2] / "router" / "proto" / "generate.py"


def test_generated_modules_are_current():
    spec = importlib.util.spec_from_file_location("fleetserve_proto_generate", GENERATE)
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    assert generate.stale() == [], "run: python router/proto/generate.py"


def test_messages_belong_to_the_package():
    from fleetserve.router.proto import fleetserve_pb2 as pb

    assert pb.ChatRequest.__module__ == "fleetserve.router.proto.fleetserve_pb2"
    assert [m.name for m in pb.DESCRIPTOR.services_by_name["FleetServe"].methods] == [
        "Generate", "Chat", "Embed", "Health", "ListModels"]
