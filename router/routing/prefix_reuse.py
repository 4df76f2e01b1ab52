"""Cluster-wide prefix reuse: a replica that lacks a long prefix loads it from the replica
that caches it, instead of recomputing it (colocated apps; the ingress calls `open_stream`).

The precise prefix router sends a prompt to the replica caching its longest prefix unless
that replica is overloaded; then load wins and the request goes to a replica without the
prefix. Here, when the replica chosen (by the same policy, from the same KV index) caches
at least `min_tokens` fewer prompt tokens than the best holder:

    1. the holder runs only the prefix it caches (plus one token) as a one-token request
       with kv_transfer_params={"do_remote_decode", transfer_id}: all prefix-cache hits,
       so it computes one token, and exports the prefix's blocks through its connector;
    2. the chosen replica gets the request pinned, with the returned params: it loads
       those blocks (WAITING_FOR_REMOTE_KVS), computes the rest of the prompt, streams.

Every replica runs a `kv_both` connector (cluster.config.ClusterReuseOptions). With the
shared-storage connector every replica also finds any stored prefix on its own (a prefix
cache across replicas and restarts), with no export call at all.

Failures cost time, never tokens: an export that fails or times out sends the request
without params (the chosen replica computes the prefix); a load that fails ends the
request before its first token (policy "fail") and it is sent again without params.
Counted in Prometheus (`fleetserve:prefix_reuse_*`) and per request (usage
`prompt_tokens_details.remote_tokens`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

from fleetserve.router.api.errors import is_error
from fleetserve.router.metrics import ReuseMetrics
from fleetserve.router.routing.migration import MigratingStream
from fleetserve.router.routing.pd import PDStream, export_body, failed_load, release_soon, run_to_final
from fleetserve.router.routing.policies import RouteRequest
from fleetserve.router.routing.registry import get_router
from fleetserve.router.routing.request_router import TARGET_KWARG
from fleetserve.scheduler import prefix_salt

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class ReuseSettings:
    min_tokens: int = 256
    export_timeout_s: float = 30.0


class PrefixReuse:
    def __init__(self, engine_handle, settings: ReuseSettings, block_size: int = 16, max_migrations: int = 2) -> None:
        # block_size: the engines' (the ingress sets it from their info).
        self.max_migrations = max_migrations
        self._engine = engine_handle
        self._generate = engine_handle.options(stream=True).generate
        self.settings = settings
        self.block_size = block_size
        self.metrics = ReuseMetrics()

    def plan(self, body: dict) -> tuple[str, str, int] | None:
        """(chosen replica, holder, prefix tokens to export) when reuse pays, else None."""
        sp = body["sampling_params"]
        if sp.get("n", 1) != 1 or sp.get("prompt_logprobs") is not None:
            return None
        router = get_router(self._engine.app_name, self._engine.deployment_name)
        if router is None:
            return None
        prompt = body["prompt_token_ids"]
        ranked = router.rank(
            RouteRequest(
                str(body["request_id"]),
                prompt,
                prefix_salt(body.get("cache_salt"), body.get("lora_key")),
                body.get("lora_name") or None,
            )
        )
        if len(ranked) < 2:
            return None
        chosen, chosen_blocks = ranked[0]
        holder, holder_blocks = max(ranked, key=lambda r: r[1])
        # Whole blocks of the prompt, never its last token (computed for logits anyway).
        prefix = min(holder_blocks * self.block_size, (len(prompt) - 1) // self.block_size * self.block_size)
        if holder == chosen or prefix - chosen_blocks * self.block_size < self.settings.min_tokens:
            return None
        return chosen, holder, prefix

    async def open_stream(self, body: dict, open_call, plain):
        """(stream, first item); `plain(body)` opens an ordinary stream when reuse does not pay.
        `open_call(generate, body, **kwargs)` makes a call and returns its stream. The stream
        migrates as a plain one does (router.routing.migration) when the chosen replica fails,
        before its first item too; an export that will not be read is released at once."""
        plan = self.plan(body)
        if plan is None:
            return await plain(body)
        chosen, holder, prefix = plan
        params = await self._export(body, holder, prefix)
        self.metrics.requests.labels("exported" if params else "export_failed").inc()
        exported, loaded = params, False
        try:
            for attempt in range(2):
                r_body = dict(body, request_id=body["request_id"] + (f"-r{attempt}" if attempt else ""))
                if params is not None:
                    r_body["kv_transfer_params"] = params
                gen = MigratingStream(
                    lambda b: open_call(self._generate, b),
                    body,
                    self.max_migrations,
                    first=open_call(self._generate, r_body, **{TARGET_KWARG: chosen}),
                    replica=chosen,
                )
                try:
                    first = await gen.__anext__()
                except BaseException:
                    gen.cancel()
                    raise
                loaded = loaded or (params is not None and not gen.migrations and not is_error(first))
                if params is None or not failed_load(first):
                    break
                gen.cancel()
                self.metrics.requests.labels("load_failed").inc()
                params = None
        finally:
            if exported is not None and not loaded:
                release_soon(body["request_id"], exported)
        stream = PDStream(gen, len(body["prompt_token_ids"]), self.metrics, loading=params is not None)
        return stream, (first if is_error(first) else stream.observe(first))

    async def _export(self, body: dict, holder: str, prefix: int):
        """The holder exports the prompt's first `prefix` tokens (cached there: it computes
        one more token); its kv_transfer_params, or None if that failed."""
        tid = f"{body['request_id']}-x{uuid.uuid4().hex[:12]}"
        x_body = export_body(body, f"{body['request_id']}-x", body["prompt_token_ids"][: prefix + 1], tid)
        t0 = time.perf_counter()
        try:
            final = await asyncio.wait_for(
                run_to_final(self._generate.remote(x_body, **{TARGET_KWARG: holder})), self.settings.export_timeout_s
            )
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the holder died or is stuck: compute instead
            final = {"error": {"message": f"{type(e).__name__}: {e}"}}
        self.metrics.export_seconds.observe(time.perf_counter() - t0)
        if is_error(final) or final.get("replica") != holder:
            logger.warning(
                "request %s: prefix export from %s failed: %s",
                body["request_id"],
                holder,
                final.get("error") or f"answered by {final.get('replica')}",
            )
            return None
        return final.get("kv_transfer_params")
