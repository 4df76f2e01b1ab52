"""The engine deployments behind the ingress, and how a request reaches one.

One pool (a Serve deployment of engine replicas), or with P/D a decode pool and a prefill
pool. `EnginePools` holds their handles and everything the ingress does with them:

* `info()`: what the engines report once (tokenizer, context length, block size, hash
  function, LoRA keys; `EngineReplica.get_info`), so the ingress never loads the model;
  it also builds this process's request router of each pool (the handle's first call),
  sets their prefix policies' hashing to the engines', and starts following the engines'
  KV events where a policy keeps a KV index;
* `open_stream(body)`: a request's stream and its first item, by the P/D flow, the
  prefix-reuse flow, or a plain call that migrates on a replica's failure, each call riding
  the per-step feed (router/feed.py) unless FLEETSERVE_STREAM_FEED=0;
* `replica_calls(op)`: a control call pinned to every replica (LoRA loads and unloads);
* `routers()`: the pools' request routers, for /metrics and /health;
* `reports`: the replicas' metrics reports /metrics answers from (router/metrics_hub.py:
  pushed by the replicas, so a scrape calls none of them).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
from typing import Any, Callable, Optional

from ray import serve
from ray.serve.exceptions import BackPressureError, RayServeException
from ray.serve.handle import DeploymentHandle

from fleetserve.router.api.errors import APIError, error_body, is_error
from fleetserve.router.api.limits import max_token_chars
from fleetserve.router.feed import FeedHub
from fleetserve.router.metrics import SloMetrics
from fleetserve.router.metrics_hub import ReplicaReports
from fleetserve.router.routing.kv_subscriber import KVEventSubscriber
from fleetserve.router.routing.migration import MigratingStream
from fleetserve.router.routing.pd import PDRouter
from fleetserve.router.routing.prefix_reuse import PrefixReuse
from fleetserve.router.routing.registry import get_router
from fleetserve.router.routing.request_router import TARGET_KWARG
from fleetserve.router.routing.slo import SLO_PICK_KEY, SloSettings
from fleetserve.router.settings import IngressSettings
from fleetserve.router.streams import ReplicaStream
from fleetserve.router.tracing import attach_to_body

logger = logging.getLogger("ray.serve")

# How long a request waits for the first engine replica to answer (the model may
# still be loading) before it gets a 503 instead of hanging.
INFO_TIMEOUT_S = 10.0


class EnginePools:
    """`engine`: the pool requests stream from; with P/D (`prefill` given and
    `settings.pd` set) the decode pool, and `prefill` the prefill pool. `on_info` is
    called with the engines' info once it has come."""

    def __init__(
        self,
        engine: DeploymentHandle,
        settings: IngressSettings,
        prefill: Optional[DeploymentHandle] = None,
        on_info: Optional[Callable[[dict], None]] = None,
    ) -> None:
        # Serve reads RAY_SERVE_USE_GRPC_BY_DEFAULT once, when ray.serve is imported, into the
        # default of every handle it builds. The engine handle was built in the driver, which
        # imports ray.serve before fleetserve exports the setting, so it arrives here set for
        # actor calls: ask for the direct gRPC channel explicitly when the setting is on here
        # (cluster.deploy puts it in this replica's runtime_env).
        if os.environ.get("RAY_SERVE_USE_GRPC_BY_DEFAULT") == "1":
            # (`_by_reference` is private: Ray 2.60's handle options have no public way to pick
            # the gRPC channel, only this option and the environment setting read at import.)
            engine = engine.options(_by_reference=False)
            prefill = prefill.options(_by_reference=False) if prefill is not None else None
        self.engine = engine
        self.handles = [engine] + ([prefill] if prefill is not None else [])
        self.pd: Optional[PDRouter] = None
        if prefill is not None and settings.pd is not None:
            self.pd = PDRouter(engine, prefill, settings.pd, max_migrations=settings.max_migrations)
        self.reuse: Optional[PrefixReuse] = None
        if settings.reuse is not None and self.pd is None:
            self.reuse = PrefixReuse(engine, settings.reuse, max_migrations=settings.max_migrations)
        self.stream = engine.options(stream=True)
        self._generate = self.stream.generate  # built once: each attribute access makes a new handle
        # One Serve stream per engine replica for all requests' deltas (router.feed);
        # FLEETSERVE_STREAM_FEED=0 streams each request on its own call only.
        self.feeds = FeedHub(self.stream) if os.environ.get("FLEETSERVE_STREAM_FEED", "1") != "0" else None
        self._max_migrations = settings.max_migrations
        self._on_info = on_info
        self._info: Optional[dict] = None
        self._info_lock = asyncio.Lock()
        self._kv_subscribers: dict[str, KVEventSubscriber] = {}
        self.reports = ReplicaReports(_app_name(), self.live_replicas)
        # SLO-aware admission (router/routing/slo.py): decided by the entry pool's request
        # router (`slo_decide`) before a request is sent; its counts and goodput here.
        self.slo = SloSettings.from_dict(settings.slo) if settings.slo else None
        self.slo_metrics = SloMetrics() if self.slo is not None else None

    def flows(self) -> list:
        """The P/D or reuse flow in use (its metrics are exported with the router's)."""
        return [flow for flow in (self.pd, self.reuse) if flow is not None]

    def slo_admit(self, body: dict) -> Optional[dict]:
        """SLO admission of a generate body: None to send it (to the replica the admission
        chose, where it chose one: `SLO_PICK_KEY`), or its 429 body (with `retry_after`).
        Before the pool's router exists (its handle's first call) every request goes."""
        if self.slo is None:
            return None
        router = get_router(self.engine.app_name, self.engine.deployment_name)
        decide = getattr(router, "slo_decide", None)
        decision = decide(body) if decide is not None else None
        if decision is None:
            return None
        if decision.refused:
            if self.slo_metrics is not None:
                self.slo_metrics.refused(decision.slo_class, str(decision.reason))
            refusal = error_body(decision.message, 429, code=f"slo_{decision.reason}_unattainable")
            refusal["retry_after"] = decision.retry_after_s
            return refusal
        if decision.replica_id is not None:
            body[SLO_PICK_KEY] = decision.replica_id
        return None

    def slo_observe(self, tenant: Optional[str], ttft_s: float, tpot_s: Optional[float]) -> None:
        """A finished request's TTFT and mean time per output token after the first, judged by
        its class's targets (requests of a class without targets are not counted)."""
        if self.slo is None or self.slo_metrics is None:
            return
        target = self.slo.target_for(tenant)
        if not target.active:
            return
        met = (target.ttft_s is None or ttft_s <= target.ttft_s) and (
            target.itl_s is None or tpot_s is None or tpot_s <= target.itl_s
        )
        cls = tenant if tenant is not None and tenant in self.slo.tenants else "default"
        self.slo_metrics.finished(cls, met)

    # -- the engines' info ---------------------------------------------------------

    def warm_up_soon(self) -> None:
        """Follow the engines' KV events from the start, not from the first request."""
        try:
            asyncio.get_running_loop().create_task(self._warm_up(), context=contextvars.Context())
        except RuntimeError:
            pass  # no loop yet: the first request starts it

    async def _warm_up(self) -> None:
        try:
            await self.info()
        except Exception as e:  # noqa: BLE001 - replicas not up yet: the first request retries
            logger.info("ingress warm-up: replicas not reachable yet: %r", e)

    async def info(self) -> dict:
        if self._info is None:
            async with self._info_lock:
                if self._info is None:
                    self._info = await self._fetch_info()
                    self._start_kv_subscribers()
        return self._info

    async def _fetch_info(self) -> dict:
        try:
            infos = [
                await asyncio.wait_for(pool.get_info.remote(), INFO_TIMEOUT_S) for pool in self.handles
            ]  # each builds this process's router
        except asyncio.TimeoutError:
            raise APIError(
                "the model is still loading (no engine replica has answered yet); retry shortly", 503
            ) from None
        for pool, pool_info in zip(self.handles, infos):
            self._set_pool_hashing(pool, pool_info)
        info = infos[0]
        for flow in self.flows():  # the decode (or only) pool's blocks
            if "block_size" in info:
                flow.block_size = int(info["block_size"])
        if info.get("tokenizer") is not None:  # every real engine has one
            info["max_token_chars"] = max_token_chars(info["tokenizer"])
        if self._on_info is not None:
            self._on_info(info)
        return info

    @property
    def tokenizer(self):
        """The engines' tokenizer, once `info()` has come (every request awaited it first)."""
        return self._info["tokenizer"]

    def _set_pool_hashing(self, pool, pool_info: dict) -> None:
        """Prefix routing hashes prompts as the pool's engines hash their KV blocks (block
        size and `prefix_caching_hash_algo` from their info, not from a second setting):
        any other hash never matches what their KV events report."""
        router = get_router(pool.app_name, pool.deployment_name)
        policy = getattr(router, "policy", None)
        if policy is not None and "block_size" in pool_info:
            policy.set_hashing(pool_info["block_size"], pool_info.get("hash_algo", "builtin"))

    def _start_kv_subscribers(self) -> None:
        """Feed each pool's routing policy's KV index (precise prefix routing) with its
        replicas' KV events, when the policy has one (router.routing.kv_subscriber)."""
        for pool in self.handles:
            router = get_router(pool.app_name, pool.deployment_name)
            index = getattr(getattr(router, "policy", None), "kv_index", None)
            if router is not None and index is not None and pool.deployment_name not in self._kv_subscribers:
                sub = KVEventSubscriber(pool, router.replica_ids, index)
                self._kv_subscribers[pool.deployment_name] = sub
                sub.start()

    def routers(self) -> list[tuple[str, Any]]:
        """(deployment name, request router) of each pool whose router exists (a handle's
        router is built by its first call)."""
        found = [(h.deployment_name, get_router(h.app_name, h.deployment_name)) for h in self.handles]
        return [(name, router) for name, router in found if router is not None]

    def live_replicas(self) -> dict[str, set[str]]:
        """Deployment name -> the replica ids its request router lists (pools whose router
        exists): a metrics report of a replica not listed is left out of /metrics."""
        return {name: set(router.replica_ids()) for name, router in self.routers()}

    # -- requests ------------------------------------------------------------------

    async def open_stream(self, body: dict):
        """Send to a replica; return (generator, first item). The first item may be an error."""
        attach_to_body(body)  # a traced request's engine spans hang from its request span
        refusal = self.slo_admit(body)
        if refusal is not None:
            return _NO_STREAM, refusal
        if self.pd is not None:
            await self.info()  # the pools' routers exist: the P/D flow picks from them
            return await self.pd.open_stream(body, self._open_call)
        if self.reuse is not None:
            await self.info()
            return await self.reuse.open_stream(body, self._open_call, self._open_plain)
        return await self._open_plain(body)

    def _open_call(self, generate, body: dict, **kwargs) -> ReplicaStream:
        """Call an engine pool's streaming `generate` (this ingress's pool handle, or the P/D
        and reuse flows' pinned ones: the same deployment) with the per-step feed."""
        return ReplicaStream.open(generate, body, self.feeds, **kwargs)

    async def _open_plain(self, body: dict):
        gen = MigratingStream(lambda b: self._open_call(self._generate, b), body, max_migrations=self._max_migrations)
        try:
            first = await gen.__anext__()
        except BackPressureError:  # Serve's bounded queue in front of the replicas is full
            first = error_body("the server is overloaded; retry later", 429)
        except BaseException:
            gen.cancel()
            raise
        if is_error(first):
            gen.cancel()
        return gen, first

    async def replica_calls(self, op: str, timeout_s: float = 10.0, **kwargs) -> dict[str, dict]:
        """`op` on every replica this ingress routes to: replica id -> result.

        One at a time on purpose: Serve gives every child call of one incoming
        request the same internal request id, and its router mixes up
        concurrent calls that share one (they hang).
        """
        await self.info()  # makes sure the handle's router exists and knows the replicas
        results = {}
        for pool in self.handles:  # the engine pool; with P/D, the prefill pool too
            router = get_router(pool.app_name, pool.deployment_name)
            for rid in router.replica_ids() if router else []:
                call = pool.control.remote(op, **kwargs, **{TARGET_KWARG: rid})
                r = await asyncio.wait_for(call, timeout_s)
                results[r["replica"]] = r
        return results


class _NoStream:
    """The stream of a request refused before it was sent: nothing to read or cancel."""

    def cancel(self) -> None:
        return None

    def __aiter__(self):
        return self

    async def __anext__(self):
        raise StopAsyncIteration


_NO_STREAM = _NoStream()


def _app_name() -> Optional[str]:
    """This ingress's Serve application (its replicas report to that app's metrics hub);
    None outside Serve (unit tests): no reports."""
    try:
        return serve.get_replica_context().app_name
    except RayServeException:
        return None
