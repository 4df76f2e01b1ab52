"""P/D and prefix reuse in one process, on real engine replicas and a real KV connector, without
Serve: `LocalPool` makes a deployment handle's calls (streaming `generate`, `control`) on
`EngineReplica`s of this process, as Serve's router would (a pinned call goes to its replica,
another to the first replica its body does not ask to avoid), and `ListRouter` is the
request router the flows rank replicas with (registered as Serve's would be)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any, Optional

from fleetserve.router.replica import EngineReplica
from fleetserve.router.routing import registry
from fleetserve.router.routing.migration import AVOID_KEY
from fleetserve.router.routing.request_router import TARGET_KWARG
from fleetserve.router.streams import ReplicaStream

APP = "local-pools"
ENGINE_CLS = "fleetserve.replica.engine.async_engine:AsyncEngine"


class _Call:
    """One streaming call, as Serve makes it: the replica's generator runs on a task of its
    own (ahead of the reader), and cancelling the call cancels that task."""

    def __init__(self, agen) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.ensure_future(self._pump(agen))

    async def _pump(self, agen) -> None:
        try:
            async for item in agen:
                self._queue.put_nowait(("item", item))
            self._queue.put_nowait(("end", None))
        except asyncio.CancelledError:
            self._queue.put_nowait(("error", RuntimeError("call cancelled")))
            raise
        except Exception as e:  # noqa: BLE001 - handed to the reader, as Serve does
            self._queue.put_nowait(("error", e))

    def __aiter__(self):
        return self

    async def __anext__(self):
        kind, value = await self._queue.get()
        if kind == "end":
            self._queue.put_nowait(("end", None))
            raise StopAsyncIteration
        if kind == "error":
            self._queue.put_nowait((kind, value))
            raise value
        return value

    def cancel(self) -> None:
        self._task.cancel()


class _Method:
    def __init__(self, pool: "LocalPool", name: str) -> None:
        self._pool, self._name = pool, name

    def remote(self, *args, **kwargs):
        replica = self._pool.route(kwargs.pop(TARGET_KWARG, None), args[0] if args else None)
        method = getattr(replica, self._name)
        if self._name == "generate":
            self._pool.calls.append(args[0])
            return _Call(method(*args, **kwargs))
        if self._name == "feed":
            return _Call(method(*args, **kwargs))
        return method(*args, **kwargs)  # control: a coroutine, awaited by the caller


class LocalPool:
    """A Serve deployment handle's stand-in over `replicas` (id -> EngineReplica)."""

    def __init__(self, name: str, replicas: dict[str, EngineReplica]) -> None:
        self.app_name, self.deployment_name = APP, name
        self.replicas = replicas
        self.calls: list[dict] = []  # the generate bodies sent, in order

    def options(self, **kwargs) -> "LocalPool":
        return self

    def __getattr__(self, name: str) -> _Method:
        if name in ("generate", "control", "feed"):
            return _Method(self, name)
        raise AttributeError(name)

    def route(self, target: Optional[str], body: Any) -> EngineReplica:
        if target is not None and target in self.replicas:
            return self.replicas[target]
        avoid = set(body.get(AVOID_KEY) or ()) if isinstance(body, dict) else set()
        live = [r for rid, r in self.replicas.items() if rid not in avoid]
        return live[0] if live else next(iter(self.replicas.values()))


class ListRouter:
    """The request router the flows rank with: replicas in the order given, each with the
    number of prompt blocks `blocks` says it caches."""

    def __init__(self, order: list[str], blocks: Optional[dict[str, int]] = None) -> None:
        self.order = order
        self.blocks = blocks or {}

    def rank(self, request) -> list[tuple[str, int]]:
        return [(rid, self.blocks.get(rid, 0)) for rid in self.order]

    def replica_ids(self) -> list[str]:
        return list(self.order)


def local_ray_session():
    """A local Ray for the connector's owner actor and object store (a fixture's body)."""
    import pytest

    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = not ray.is_initialized()
    if started:
        ray.init(
            address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1"
        )
    yield ray
    if started:
        ray.shutdown()


def register(pool: LocalPool, router: ListRouter) -> None:
    registry.register(pool.app_name, pool.deployment_name, router)


def open_call(generate, body: dict, **kwargs) -> ReplicaStream:
    """The ingress's open_call (router.engine_pools), without the per-step feed."""
    return ReplicaStream.open(generate, body, None, **kwargs)


def feed_open_call(hub):
    """The ingress's open_call with its per-step feed `hub` (router.feed)."""

    def call(generate, body: dict, **kwargs) -> ReplicaStream:
        return ReplicaStream.open(generate, body, hub, **kwargs)

    return call


def make_replica(model_dir, rid: str, kv: Optional[dict] = None, **engine) -> EngineReplica:
    args = {
        "model": str(model_dir),
        "dtype": "float32",
        "block_size": 4,
        "max_model_len": 256,
        "num_gpu_blocks_override": 96,
        "num_threads": 1,
        **({"kv_transfer_config": kv} if kv else {}),
        **engine,
    }
    r = EngineReplica(args, ENGINE_CLS, {"max_queued_kv_ratio": 4.0})
    r.replica_id = rid
    return r


def kill_core(replica: EngineReplica) -> None:
    """SIGKILL the replica's engine-core process (its engine fails every request: ENGINE_DEAD)."""
    os.kill(replica.engine.core_pid, signal.SIGKILL)


def wait_free(replica: EngineReplica, timeout_s: float = 20.0) -> dict:
    """Every KV block of `replica` back in its pool, nothing running, waiting or reserved."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = replica.engine.get_load()
        if (
            load["num_free_blocks"] == load["num_blocks"]
            and load["num_running"] == 0
            and load["num_waiting"] == 0
            and len(replica._reservations) == 0
        ):
            return load
        if time.monotonic() > deadline:
            raise AssertionError(
                f"replica {replica.replica_id} still holds: {load}, {len(replica._reservations)} reserved"
            )
        time.sleep(0.05)


async def read_all(stream, first: dict) -> tuple[list[int], list[dict]]:
    """Every token id of choice 0 from `first` on, and the items."""
    items, tokens = [], []
    item = first
    while True:
        items.append(item)
        if "error" in item:
            return tokens, items
        for out in item.get("outputs", ()):
            tokens.extend(out["token_ids"])
        if item.get("finished"):
            return tokens, items
        try:
            item = await stream.__anext__()
        except StopAsyncIteration:
            return tokens, items
