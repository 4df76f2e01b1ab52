"""The ingress class outside Serve: how it calls the engine deployment."""

from __future__ import annotations

import pytest

from fleetserve.router.ingress import Ingress
from fleetserve.router.settings import IngressSettings

SETTINGS = IngressSettings(served_model_name="m")


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
    ingress = Ingress(RecordingHandle(), SETTINGS)
    expected = {"stream": True, **({"_by_reference": False} if grpc == "1" else {})}
    assert ingress.pools.stream.options_used == expected
    assert ingress.pools.engine.options_used == {k: v for k, v in expected.items() if k != "stream"}


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

    from fleetserve.router import engine_pools
    from fleetserve.router.api.errors import APIError

    monkeypatch.setattr(engine_pools, "INFO_TIMEOUT_S", 0.2)

    async def scenario():
        engine = LoadingEngine()
        ingress = Ingress(engine, SETTINGS)
        with pytest.raises(APIError) as err:
            await asyncio.wait_for(ingress.info(), 5)
        assert err.value.status == 503 and "still loading" in str(err.value)
        engine.ready.set()  # the replicas are up: the next request is served
        assert (await ingress.info())["max_model_len"] == 64

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "field, value",
    [
        ("served_model_name", ""),
        ("max_body_bytes", 0),
        ("body_timeout_s", 0.0),
        ("max_migrations", -1),
        ("graceful_shutdown_timeout_s", -1.0),
    ],
)
def test_settings_refuse_bad_values_naming_the_field(field, value):
    kwargs = {"served_model_name": "m", field: value}
    with pytest.raises(ValueError, match=field):
        IngressSettings(**kwargs)


def test_deploy_builds_the_settings_from_the_app_config():
    """cluster/deploy.py's settings carry what the app config says (the ingress reads nothing
    else); P/D and reuse are added by build_app, one or the other."""
    from fleetserve.cluster.config import AppConfig
    from fleetserve.cluster.deploy import ingress_settings
    from fleetserve.router.routing.pd import PDSettings
    from fleetserve.router.routing.prefix_reuse import ReuseSettings

    config = AppConfig.model_validate(
        {
            "engine": {"model": "m", "served_model_name": ["a", "b"]},
            "api_key": "k",
            "api_key_open_paths": ["/health"],
            "http": {"host": "127.0.0.2", "max_body_bytes": 4096},
            "reliability": {"body_timeout_s": 3, "max_migrations": 1, "graceful_shutdown_timeout_s": 5},
            "reasoning_parser": "qwen3",
        }
    )
    s = ingress_settings(config, ("b",), ("m",))
    assert (s.served_model_name, s.listed_names, s.model_aliases) == ("a", ("b",), ("m",))
    assert s.served_names == {"a", "b", "m"}
    assert (s.api_key, s.open_paths, s.bind_host, s.max_body_bytes) == ("k", ("/health",), "127.0.0.2", 4096)
    assert (s.body_timeout_s, s.max_migrations, s.graceful_shutdown_timeout_s) == (3, 1, 5)
    assert s.reasoning_parser == "qwen3" and s.pd is None and s.reuse is None
    assert s.lora.app_name == config.name and len(s.lora.instance_id) == 16
    with pytest.raises(ValueError, match="exclude"):
        IngressSettings(served_model_name="m", pd=PDSettings(), reuse=ReuseSettings())
