"""Prefill/decode disaggregation through the router (the ingress calls `PDRouter.open_stream`).

    ingress ──▶ 1. pick the decode replica: its router's policy over load and the
                   prefix it caches (the KV index fed by KV events)
                2. uncached = prompt - decode's cached prefix; below min_prefill_tokens:
                   the decode replica computes it all itself (no prefill, no transfer)
                3. else reserve a slot on the decode replica (`control("reserve")`, an owner
                   id and a deadline: router.routing.admission.Reservations); a refusal is
                   the request's 429, and no prefill has run for it
                4. a prefill replica runs the prompt with max_tokens=1 and
                   kv_transfer_params={"do_remote_decode", transfer_id (minted here)}
                   and returns where its KV is (its final item's kv_transfer_params)
                5. the decode replica gets the request pinned, with those params and the
                   reservation (it is admitted on it): it loads (WAITING_FOR_REMOTE_KVS),
                   then streams the answer to the client

Failures, none of which reaches the client as garbage or a 5xx when it can be recovered:

* the prefill call fails (its replica died, refused, timed out): tried again up to
  `max_attempts` (Serve sends it to a live replica), then the decode replica computes
  the prompt itself (on its reservation);
* the decode replica's load fails or times out: by the engine's
  `kv_load_failure_policy`, it recomputes (the stream goes on), or it ends the request
  with finish_reason "error" before any token, and the router sends the request
  again without params (a recompute), within `max_attempts`;
* the decode replica dies, before its first token or mid-stream: the stream migrates
  (router.routing.migration): another decode replica computes the prompt and the tokens
  already sent and goes on, with no token repeated or lost;
* the client goes away or a call fails before the decode replica is streaming: the
  reservation is released at once (`control("release_reservation")`; otherwise its
  deadline ends it), and so is a hand-off the decode replica never read
  (kv_transfer.handoff: the Ray object store's owner drops it; a P2P export waits for
  its lease).

Silent fallbacks are counted: every decode-side final item carries
`num_remote_tokens` (prompt tokens loaded through the connector; the usage body's
`prompt_tokens_details.remote_tokens`), and Prometheus counts prompt tokens
loaded / found in the decode replica's own cache / recomputed, and which path
each request took, plus the time spent in the prefill call and in the hand-off.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from typing import Any, Optional

from fleetserve.kv_transfer.handoff import release_unused
from fleetserve.router.api.errors import error_body, is_error
from fleetserve.router.metrics import PDMetrics
from fleetserve.router.routing.admission import RESERVATION_KEY
from fleetserve.router.routing.migration import MIGRATED_KEY, MigratingStream
from fleetserve.router.routing.pd_decision import PDSettings, cached_prompt_tokens, wants_remote_prefill
from fleetserve.router.routing.policies import RouteRequest
from fleetserve.router.routing.registry import get_router
from fleetserve.router.routing.request_router import TARGET_KWARG
from fleetserve.router.tracing import annotate_request
from fleetserve.scheduler import prefix_salt

logger = logging.getLogger("ray.serve")

# A decode replica's answer to a reservation (or its release); a replica that has not answered
# by then (dead, or its loop stalled) reserves nothing and the request goes on as without one.
RESERVE_TIMEOUT_S = 3.0
# A reservation outlives the prefill calls it waits for by this much (then it is released).
RESERVATION_GRACE_S = 10.0


class PDRouter:
    def __init__(
        self, decode_handle, prefill_handle, settings: PDSettings, block_size: int = 16, max_migrations: int = 2
    ) -> None:
        # block_size: the decode engines' (the ingress sets it from their info).
        self._decode = decode_handle
        self._decode_generate = decode_handle.options(stream=True).generate
        self._prefill_generate = prefill_handle.options(stream=True).generate
        self.settings = settings
        self.block_size = block_size
        self.max_migrations = max_migrations
        self.metrics = PDMetrics()

    # -- the flow --------------------------------------------------------------

    async def open_stream(self, body: dict, open_call):
        """Like `Ingress.open_stream`: (stream, first item) from the decode replica.
        `open_call(generate, body, **kwargs)` makes the call and returns its stream (the
        ingress's `ReplicaStream.open`: the decode stream rides the per-step feed)."""
        if body["sampling_params"].get("embed"):
            return await self._embed(body)
        prompt = body["prompt_token_ids"]
        decode_id, cached = self._pick_decode(body)
        sp = body["sampling_params"]
        # n > 1 and prompt logprobs need the decode engine to run the prompt itself.
        wants_prefill = wants_remote_prefill(len(prompt), cached, sp, self.settings)
        owner = None
        if wants_prefill and decode_id is not None:
            # Admitted at the decode side first: a refusal there costs no prefill.
            owner, refusal = await self._reserve(decode_id, body)
            if refusal is not None:
                self.metrics.requests.labels("decode_refused").inc()
                return _Answered(), refusal
        params: Optional[dict] = None
        try:
            path, t_prefill_done = "decode_only", None
            if wants_prefill:
                params = await self._prefill(body)
                path = "pd" if params is not None else "prefill_failed"
                t_prefill_done = time.perf_counter()
            self.metrics.requests.labels(path).inc()
            annotate_request(
                {
                    "fleetserve.pd.path": path,
                    "fleetserve.pd.decode_replica": decode_id,
                    "fleetserve.pd.decode_cached_tokens": cached,
                }
            )
            stream, first, loaded = await self._open_decode(body, open_call, decode_id, params, owner, t_prefill_done)
        except BaseException:
            # The client went away or the decode call failed: the slot and the export go now.
            if owner is not None and decode_id is not None:
                soon(self._release_reservation(decode_id, owner))
            if params is not None:
                release_soon(body["request_id"], params)
            raise
        if params is not None and not loaded:
            release_soon(body["request_id"], params)  # the decode side never read it
        return stream, first

    async def _open_decode(
        self,
        body: dict,
        open_call,
        decode_id: Optional[str],
        params: Optional[dict],
        owner: Optional[str],
        t_prefill_done: Optional[float],
    ) -> tuple[Any, dict, bool]:
        """(stream, first item, whether the decode replica read the hand-off `params`). The
        stream migrates (router.routing.migration) when its decode replica fails, before its
        first item too: a continuation on another decode replica computes the prompt and the
        tokens already sent."""
        loaded = False
        for attempt in range(self.settings.max_attempts):
            d_body = dict(body, request_id=body["request_id"] + (f"-d{attempt}" if attempt else ""))
            if attempt:
                d_body[MIGRATED_KEY] = attempt  # admitted already (its reservation was taken)
            elif owner is not None:
                d_body[RESERVATION_KEY] = owner
            if params is not None:
                d_body["kv_transfer_params"] = params
            gen = MigratingStream(
                lambda b: open_call(self._decode_generate, b),
                body,
                self.max_migrations,
                first=open_call(self._decode_generate, d_body, **self._pin(decode_id)),
                replica=decode_id,
            )
            try:
                first = await gen.__anext__()
            except BaseException:
                gen.cancel()
                raise
            if t_prefill_done is not None:
                self.metrics.handoff_seconds.observe(time.perf_counter() - t_prefill_done)
                t_prefill_done = None
            loaded = params is not None and not gen.migrations and not is_error(first)
            if params is None or not failed_load(first) or attempt + 1 == self.settings.max_attempts:
                break
            # The load failed and the engine's policy is "fail": nothing was streamed yet,
            # so send it again as a plain request (the decode replica computes the prompt).
            logger.warning(
                "request %s: KV load failed on decode replica %s; recomputing there", body["request_id"], decode_id
            )
            gen.cancel()
            self.metrics.retries.labels("decode").inc()
            params = None
        stream = PDStream(gen, len(body["prompt_token_ids"]), self.metrics, loading=params is not None)
        if is_error(first):
            gen.cancel()
            return stream, first, loaded
        return stream, stream.observe(first), loaded

    async def _embed(self, body: dict):
        """An embedding is prompt work alone: the prefill pool answers it, and the decode
        pool's steps stay free of it (no KV to hand over)."""
        self.metrics.requests.labels("prefill_only").inc()
        try:
            final = await asyncio.wait_for(
                run_to_final(self._prefill_generate.remote(body)), self.settings.prefill_timeout_s
            )
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a dead or stuck prefill replica: the client is told
            final = error_body(f"the prefill pool failed the request: {type(e).__name__}: {e}", 503)
        return _Answered(), final

    async def _reserve(self, decode_id: str, body: dict) -> tuple[Optional[str], Optional[dict]]:
        """(the reservation's owner, None), or (None, the decode replica's 429). A replica
        that cannot answer the reservation reserves nothing: the request goes on as before
        (its decode call then meets that replica's admission, or its failure)."""
        owner = f"{body['request_id']}-{uuid.uuid4().hex[:8]}"
        ttl_s = self.settings.prefill_timeout_s * self.settings.max_attempts + RESERVATION_GRACE_S
        call = self._decode.control.remote(
            "reserve", owner=owner, prompt_len=len(body["prompt_token_ids"]), ttl_s=ttl_s, **self._pin(decode_id)
        )
        try:
            answer = await asyncio.wait_for(call, RESERVE_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a dead or stuck decode replica: no reservation
            logger.warning("request %s: decode slot not reserved on %s: %r", body["request_id"], decode_id, e)
            return None, None
        if answer.get("replica") != decode_id:  # Serve routed it elsewhere: that one is gone
            logger.warning(
                "request %s: decode slot not reserved: %s answered for %s",
                body["request_id"],
                answer.get("replica"),
                decode_id,
            )
            return None, None
        if "error" in answer:
            return None, error_body(answer["error"], int(answer.get("status", 429)))
        return owner, None

    async def _release_reservation(self, decode_id: str, owner: str) -> None:
        call = self._decode.control.remote("release_reservation", owner=owner, **self._pin(decode_id))
        await asyncio.wait_for(call, RESERVE_TIMEOUT_S)

    def _pick_decode(self, body: dict) -> tuple[Optional[str], int]:
        """The decode replica (policy order: load, then its cached prefix) and the prompt
        tokens it already caches; (None, 0) before its router exists (the handle routes)."""
        router = get_router(self._decode.app_name, self._decode.deployment_name)
        if router is None:
            return None, 0
        request = RouteRequest(
            str(body["request_id"]),
            body["prompt_token_ids"],
            prefix_salt(body.get("cache_salt"), body.get("lora_key")),
            body.get("lora_name") or None,
        )
        ranked = router.rank(request)
        if not ranked:
            return None, 0
        replica_id, blocks = ranked[0]
        return replica_id, cached_prompt_tokens(blocks, self.block_size, len(request.prompt_token_ids))

    async def _prefill(self, body: dict) -> Optional[dict]:
        """Run the prompt on a prefill replica; its kv_transfer_params, or None after
        `max_attempts` failures (the decode replica then computes the prompt)."""
        for attempt in range(self.settings.max_attempts):
            tid = f"{body['request_id']}-{uuid.uuid4().hex[:12]}"
            p_body = export_body(body, f"{body['request_id']}-p{attempt}", body["prompt_token_ids"], tid)
            t0 = time.perf_counter()
            call = asyncio.ensure_future(asyncio.wait_for(self._run_prefill(p_body), self.settings.prefill_timeout_s))
            try:
                final = await asyncio.shield(call)
            except asyncio.CancelledError:
                # The client went away: the prefill (one token) ends on its own, within its
                # timeout, and what it exported is released then, not left to its lease.
                soon(release_when_done(body["request_id"], call))
                raise
            except Exception as e:  # noqa: BLE001 - a dead or stuck prefill replica: try again
                final = {"error": {"message": f"{type(e).__name__}: {e}"}}
            self.metrics.prefill_seconds.observe(time.perf_counter() - t0)
            params = None if is_error(final) else final.get("kv_transfer_params")
            if params is not None:
                return params
            if not is_error(final):
                return None  # nothing to hand over (no full block): decode computes it
            logger.warning(
                "request %s: prefill attempt %d failed: %s",
                body["request_id"],
                attempt + 1,
                final["error"].get("message"),
            )
            if attempt + 1 < self.settings.max_attempts:
                self.metrics.retries.labels("prefill").inc()
        return None

    async def _run_prefill(self, p_body: dict) -> dict:
        return await run_to_final(self._prefill_generate.remote(p_body))

    @staticmethod
    def _pin(replica_id: Optional[str]) -> dict[str, Any]:
        return {TARGET_KWARG: replica_id} if replica_id is not None else {}


async def run_to_final(gen) -> dict:
    """Drain a replica's generate stream; its final item, or its first error item."""
    last: dict = {}
    try:
        async for item in gen:
            for one in item if isinstance(item, list) else [item]:
                last = one
                if is_error(one):
                    return one
    finally:
        gen.cancel()
    return last


_CLEANUPS: set[asyncio.Future] = set()  # clean-ups under way (kept from the GC)


def soon(coro) -> None:
    """Run clean-up `coro` on its own task: the request that asks may be being cancelled. (A
    context of its own: Serve's router keys calls by the request context's internal id, and a
    call sharing the id of the request that started it confuses it.)"""
    task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
    _CLEANUPS.add(task)
    task.add_done_callback(_cleaned)


def _cleaned(task: asyncio.Future) -> None:
    _CLEANUPS.discard(task)
    if not task.cancelled() and task.exception() is not None:
        logger.warning("P/D clean-up failed (its deadline or lease ends it): %r", task.exception())


def release_soon(request_id: str, params: dict) -> None:
    """Release hand-off `params`, which nobody will load, without waiting for it."""
    soon(release_export(request_id, params))


async def release_export(request_id: str, params: dict) -> None:
    """End hand-off `params` at once, unread (kv_transfer.handoff), off the event loop."""
    released = await asyncio.get_running_loop().run_in_executor(None, release_unused, params)
    logger.info(
        "request %s: its exported KV (transfer %s) was not loaded: %s",
        request_id,
        params.get("transfer_id"),
        "released" if released else "left to its lease",
    )


async def release_when_done(request_id: str, call: asyncio.Future) -> None:
    """Release what a prefill `call` nobody waits for any more exports (its final item's
    hand-off), once it ends."""
    try:
        final = await call
    except Exception:  # noqa: BLE001 - it failed or timed out: nothing was handed over
        return
    params = None if is_error(final) else final.get("kv_transfer_params")
    if params is not None:
        await release_export(request_id, params)


def export_body(body: dict, request_id: str, prompt: list[int], transfer_id: str) -> dict:
    """`body` as a one-token request that exports its prompt's KV under `transfer_id`."""
    sp = dict(
        body["sampling_params"], max_tokens=1, min_tokens=0, n=1, best_of=None, logprobs=None, prompt_logprobs=None
    )
    return dict(
        body,
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=sp,
        kv_transfer_params={"do_remote_decode": True, "transfer_id": transfer_id},
    )


def failed_load(item: dict) -> bool:
    """The decode engine gave up on the KV load before producing a token."""
    if is_error(item) or not item.get("finished"):
        return False
    outs = item.get("outputs") or []
    return any(o.get("finish_reason") == "error" for o in outs) and not any(o.get("token_ids") for o in outs)


class _Answered:
    """The stream of a request whose one (final) item came already."""

    def __aiter__(self):
        return self

    async def __anext__(self):
        raise StopAsyncIteration

    def cancel(self) -> None:
        pass


class PDStream:
    """The decode replica's stream, counting where its prompt's KV came from on the final
    item (and reporting `num_remote_tokens` there even when it is 0)."""

    def __init__(self, gen, prompt_len: int, metrics, loading: bool) -> None:
        self._gen = gen
        self._prompt_len = prompt_len
        self._metrics = metrics
        self._loading = loading

    def __aiter__(self):
        return self

    async def __anext__(self):
        return self.observe(await self._gen.__anext__())

    def observe(self, item: dict) -> dict:
        if is_error(item) or not item.get("finished"):
            return item
        loaded = item.get("num_remote_tokens", 0)
        item["num_remote_tokens"] = loaded
        cached = item.get("num_cached_tokens") or 0
        m = self._metrics.prompt_tokens
        m.labels("loaded").inc(loaded)
        m.labels("cached").inc(max(0, cached - loaded))
        m.labels("recomputed").inc(max(0, self._prompt_len - cached))
        return item

    def cancel(self) -> None:
        self._gen.cancel()
