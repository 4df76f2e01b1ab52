"""What /health reports (router.health.replica_health): every pool asked; with P/D a dead
prefill pool degrades the service but the decode pool decides healthy or not."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from ray.exceptions import RayTaskError

from fleetserve.router import health


class Actor:
    def __init__(self, failure: str | None = None, hang: bool = False) -> None:
        self.check_health = SimpleNamespace(remote=lambda: self._check(failure, hang))

    @staticmethod
    async def _check(failure, hang):
        if hang:
            await asyncio.sleep(60)
        if failure:
            raise RayTaskError("check_health", "tb", RuntimeError(failure))


class Router:
    def __init__(self, actors: dict) -> None:
        self._actors = actors

    def replica_actors(self) -> dict:
        return self._actors


def _pools(monkeypatch, pools: dict[str, dict]):
    routers = {name: Router(actors) for name, actors in pools.items()}
    monkeypatch.setattr(health, "get_router", lambda app, dep: routers[dep])
    handles = [SimpleNamespace(app_name="app", deployment_name=name) for name in pools]

    async def info():
        return {}

    return SimpleNamespace(handles=handles, info=info)


def test_colocated_report(monkeypatch):
    pools = _pools(monkeypatch, {"engine": {"a": Actor(), "b": Actor("engine core died")}})
    report = asyncio.run(health.replica_health(pools))
    assert report == {"healthy": ["a"], "unhealthy": {"b": "engine core died"}}


def test_pd_reports_the_prefill_pool_without_letting_it_decide(monkeypatch):
    pools = _pools(monkeypatch, {"decode": {"d1": Actor()}, "prefill": {"p1": Actor("wedged"), "p2": Actor(hang=True)}})
    report = asyncio.run(health.replica_health(pools, timeout_s=0.2))
    assert report["healthy"] == ["d1"] and report["unhealthy"] == {}
    assert report["prefill"]["healthy"] == []
    assert report["prefill"]["unhealthy"]["p1"] == "wedged"
    assert report["prefill"]["unhealthy"]["p2"].startswith("unreachable")
    dead_decode = _pools(monkeypatch, {"decode": {"d1": Actor("gone")}, "prefill": {"p1": Actor()}})
    report = asyncio.run(health.replica_health(dead_decode))
    assert report["healthy"] == [] and report["prefill"]["healthy"] == ["p1"]
