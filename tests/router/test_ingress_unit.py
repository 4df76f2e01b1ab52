"""The ingress class outside Serve: how it calls the engine deployment."""

from __future__ import annotations

import pytest

from fleetserve.router.ingress import Ingress


class RecordingHandle:
    """Stands in for a DeploymentHandle: records the options it was derived with."""

    def __init__(self, options: dict | None = None) -> None:
        self.options_used = dict(options or {})

    def options(self, **kwargs) -> "RecordingHandle":
        return RecordingHandle({**self.options_used, **kwargs})

    def __getattr__(self, method: str) -> "RecordingHandle":  # handle.generate, handle.control
        return self


@pytest.mark.parametrize("grpc", ["1", "0", None])
def test_engine_calls_use_grpc_when_serve_is_set_to(monkeypatch, grpc):
    """The engine handle comes from the driver with actor calls as its default (the driver
    imported ray.serve before the gRPC setting was exported); the ingress must ask for the
    gRPC channel itself whenever the setting is on in its own process."""
    if grpc is None:
        monkeypatch.delenv("RAY_SERVE_USE_GRPC_BY_DEFAULT", raising=False)
    else:
        monkeypatch.setenv("RAY_SERVE_USE_GRPC_BY_DEFAULT", grpc)
    ingress = Ingress(RecordingHandle(), served_model_name="m")
    expected = {"stream": True, **({"_by_reference": False} if grpc == "1" else {})}
    assert ingress._stream.options_used == expected
    assert ingress._engine.options_used == {k: v for k, v in expected.items() if k != "stream"}
