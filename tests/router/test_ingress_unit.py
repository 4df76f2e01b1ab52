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


class LoadingEngine:
    """An engine deployment whose replicas are still loading until `ready` is set."""

    def __init__(self) -> None:
        import asyncio

        self.ready = asyncio.Event()
        self.get_info = self

    def options(self, **kwargs) -> "LoadingEngine":
        return self

    def __getattr__(self, method: str):
        return self

    def remote(self):
        async def answer():
            await self.ready.wait()
            return {"max_model_len": 64, "tokenizer": None}
        return answer()


def test_a_request_while_the_model_loads_gets_503_not_silence(monkeypatch):
    """During start-up (or a deployment that never becomes ready) the ingress already
    listens: a request must be answered with 503 within a deadline, never hang."""
    import asyncio

    from fleetserve.router import ingress as ingress_module
    from fleetserve.router.api.errors import APIError

    monkeypatch.setattr(ingress_module, "INFO_TIMEOUT_S", 0.2)

    async def scenario():
        engine = LoadingEngine()
        ingress = Ingress(engine, served_model_name="m")
        with pytest.raises(APIError) as err:
            await asyncio.wait_for(ingress.info(), 5)
        assert err.value.status == 503 and "still loading" in str(err.value)
        engine.ready.set()  # the replicas are up: the next request is served
        assert (await ingress.info())["max_model_len"] == 64

    asyncio.run(scenario())
