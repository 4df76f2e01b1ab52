"""The replica deployment: one AsyncEngine per Ray Serve replica.

The ingress calls it with plain dicts (already tokenized, sampling params
already validated) so that the request router can read the prompt's token ids.
`generate` is an async generator of small dicts, one per engine delta. Errors the
user caused (bad input, full queue) come back as one `{"error": ...}` item rather
than an exception, so they keep their HTTP status across the Ray boundary.

Cancellation: when the caller drops the stream (client disconnect), Serve
cancels this generator's task; leaving the `async for` aborts the request in
the engine, whose blocks go back to the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
import uuid
from typing import Any, AsyncGenerator, AsyncIterator, Callable, Optional

from ray import serve
from ray.serve.exceptions import RayServeException

from fleetserve.replica.engine.engine_args import EngineArgs
from fleetserve.replica.engine.errors import EngineDeadError, QueueFullError
from fleetserve.replica.lora.paths import LoRANotLoadable
from fleetserve.router.api.errors import error_body
from fleetserve.router.feed import FEED_END_GRACE_S, FEED_FLAG, FEED_KEY, FeedChannel, FeedChannels
from fleetserve.router.metrics_hub import DEFAULT_INTERVAL_S, MetricsReporter
from fleetserve.router.routing.admission import RESERVATION_KEY, Reservations, admission_refusal
from fleetserve.router.routing.migration import ENGINE_DEAD, MIGRATED_KEY
from fleetserve.router.tracing import EXPORTS, PhaseHistograms, engine_timings, record_engine_spans
from fleetserve.router.tracing import carrier_of as trace_carrier_of
from fleetserve.router.tracing import setup as setup_tracing
from fleetserve.scheduler import SamplingParams, resolve_obj_by_qualname
from fleetserve.scheduler.structured_outputs import GRAMMAR_ERRORS, parse_grammar_error

logger = logging.getLogger("ray.serve")


class EngineReplica:
    """Deployment class; `router.app.build_app` wraps it with `serve.deployment`."""

    def __init__(
        self,
        engine_args: dict,
        engine_cls: str,
        reliability: Optional[dict] = None,
        tracing: Optional[dict] = None,
    ) -> None:
        args = EngineArgs.model_validate(engine_args)
        cls = resolve_obj_by_qualname(engine_cls)
        self.engine = cls(args)
        self._stall_timeout_s = (reliability or {}).get("engine_stall_timeout_s", 30.0)
        self._max_queued_kv_ratio = (reliability or {}).get("max_queued_kv_ratio", 4.0)
        self.block_size = args.block_size
        self.hash_algo = args.prefix_caching_hash_algo
        self._kv_wake = AppendWaiter()
        self._feeds = FeedChannels()
        self._reservations = Reservations()  # P/D decode slots held before their prefill runs
        self.metrics_reporter: Optional[MetricsReporter] = None
        self.kv_connector = getattr(args.kv_transfer_config, "kv_connector", None)
        self.tracing = setup_tracing(tracing, role="engine")
        self.role = "engine"  # the deployment's name in Serve: engine, prefill or decode
        self.phases = PhaseHistograms()
        # --enable-log-requests: one INFO line per request with its phase times
        self._log_phases = bool((tracing or {}).get("log_phases"))
        try:
            context = serve.get_replica_context()
        except RayServeException:  # outside Serve (unit tests): a random id, no reports
            self.replica_id = uuid.uuid4().hex[:8]
        else:
            self.replica_id = context.replica_id.unique_id
            self.role = context.deployment
            # Serve builds the replica on its event loop: the reports start now.
            interval_s = (reliability or {}).get("metrics_report_interval_s", DEFAULT_INTERVAL_S)
            self.report_metrics(context.app_name, context.deployment, interval_s)

    # -- generation ------------------------------------------------------------

    async def generate(self, body: dict, _fleetserve_target: Optional[str] = None) -> AsyncIterator[Any]:
        """Stream one request. `body["kv_transfer_params"]` (set by the router's P/D flow,
        never taken from a client) asks the engine to export or load the prompt's KV;
        `_fleetserve_target` pins the call to this replica (router.request_router).

        `body[FEED_KEY]` (the ingress's feed id and this request's key): once that feed is
        open here (checked at each item, so a burst that arrived before the feed opened
        moves onto it too), the item going out on this call is marked `"feed": True` and
        the later ones go over the feed (router.feed); this call then ends when the request
        does. If the feed closes, the rest comes on this call again, for good."""
        feed = body.get(FEED_KEY)
        channel: Optional[FeedChannel] = None  # the feed this request's items go over
        fell_back = False  # a feed closed under it: never bind again (order across streams)
        key = 0  # this request's key on `channel`, set when it binds
        try:
            async with contextlib.aclosing(self._items(body, batching=lambda: channel is None)) as items:
                async for item in items:
                    if channel is not None:
                        if channel.open:
                            channel.put(key, item)
                            continue
                        # The feed closed: what it never sent, then the rest, on this call.
                        for unsent in channel.reclaim(key):
                            yield unsent
                        channel.unbind()
                        channel, fell_back = None, True
                    elif feed is not None and not fell_back:
                        last = item[-1] if isinstance(item, list) else item
                        # Not on errors (no "finished") nor on a last item: nothing follows.
                        if last.get("finished", True) is False:
                            channel = self._feeds.get(feed[0])
                            if channel is not None:
                                key = feed[1]
                                last[FEED_FLAG] = True
                                channel.bound += 1
                    yield item
            if channel is not None:
                # The last items went in: end once the feed took them, or send them here if
                # it closes first (a feed that closes after this call ended would lose them).
                # A feed still open but unread past the deadline keeps them: the ingress
                # counts them lost after the same grace and migrates the request.
                if not await channel.drained(key, FEED_END_GRACE_S) and not channel.open:
                    for unsent in channel.reclaim(key):
                        yield unsent
        finally:
            if channel is not None:
                channel.unbind()

    async def _items(self, body: dict, batching: Callable[[], bool]) -> AsyncGenerator[Any, None]:
        """The request's items: dicts (and, while `batching()`, lists of the dicts that were
        ready together: `ready_batches`), or one error dict."""
        try:
            params = SamplingParams(**body["sampling_params"])
        except (TypeError, ValueError) as e:
            yield error_body(str(e), param=_param_of(str(e)))
            return
        prompt_len = len(body["prompt_token_ids"])
        # A migrated request's continuation was admitted once already, and a P/D request that
        # reserved its slot here before its prefill was too: never refuse them.
        admitted = bool(body.get(MIGRATED_KEY)) or (
            RESERVATION_KEY in body and self._reservations.take(str(body[RESERVATION_KEY]))
        )
        refusal = None if admitted else self._admission_refusal(prompt_len)
        if refusal is not None:
            yield error_body(refusal, status=429)
            return
        first = True
        kv_params = body.get("kv_transfer_params")
        prompt_logprobs_sent = False
        carrier = trace_carrier_of(body) if self.tracing is not None else None
        last = None  # the request's latest output: its metrics and, at the end, its events
        error: Optional[str] = None
        outputs = self.engine.generate(
            body["prompt_token_ids"],
            params,
            body["request_id"],
            priority=int(body.get("priority", 0)),
            cache_salt=body.get("cache_salt"),
            **_tenant_kwargs(body),
            **_length_kwargs(body),
            **({"admitted": True} if admitted else {}),
            # The adapter's folder too: a replica that lacks it (one loaded at run time before this
            # replica started, or evicted here by --max-cpu-loras) loads it first, as Ray Serve's
            # multiplexed models are.
            **({"lora_name": body["lora_name"], "lora_path": body.get("lora_path")} if body.get("lora_name") else {}),
            **({"kv_transfer_params": kv_params} if kv_params is not None else {}),
            **({"trace": True} if carrier is not None else {}),
        )
        try:
            async with contextlib.aclosing(ready_batches(outputs, batching)) as batches:
                async for batch in batches:
                    failure = _grammar_failure(batch[-1])
                    if failure is not None:  # its grammar never compiled: no token came before
                        yield failure
                        return
                    items = []
                    last = batch[-1]
                    for out in batch:
                        items.append(_encode(out, self.replica_id, prompt_len if first else None))
                        first = False
                        if out.prompt_logprobs is not None and not prompt_logprobs_sent:
                            items[-1]["prompt_logprobs"] = out.prompt_logprobs  # once (echo)
                            items[-1]["prompt_logprob_ranks"] = out.prompt_logprob_ranks
                            prompt_logprobs_sent = True
                        if out.embedding is not None:
                            items[-1]["embedding"] = out.embedding
                    yield items[0] if len(items) == 1 else items
        except QueueFullError as e:
            error = str(e)
            yield error_body(str(e) or "the replica's waiting queue is full; retry later", status=429)
        except LoRANotLoadable as e:  # its adapter unloaded (or its folder gone) since the body was built
            error = str(e)
            yield error_body(str(e), status=404, param="model", code="model_not_found")
        except ValueError as e:
            error = str(e)
            yield error_body(str(e), param=_param_of(str(e)), code=_code_of(str(e)))
        except EngineDeadError as e:
            error = str(e)
            # Named, so the ingress migrates the request and avoids this replica
            # (router/migration.py) until Serve replaces it.
            yield {**error_body(str(e), status=503, code=ENGINE_DEAD), "replica": self.replica_id}
        except BaseException:
            error = "cancelled"  # the caller went away (or the replica is stopping)
            raise
        finally:
            if last is not None:
                self._observe_phases(body, last, carrier, error)

    def _kv_bytes(self, tokens: int) -> int:
        """The KV bytes of `tokens` tokens as a hand-off moves them: whole blocks, every layer
        and TP rank (0 where the engine does not say)."""
        per_block = int(getattr(self.engine, "kv_bytes_per_block", 0) or 0)
        return -(-int(tokens) // self.block_size) * per_block

    def _observe_phases(self, body: dict, out: Any, carrier: Optional[dict], error: Optional[str]) -> None:
        """The request's phase times into the histograms and, when traced, its spans."""
        metrics = getattr(out, "metrics", None)
        if metrics is None:
            return
        try:
            end = metrics.finished_time or metrics.last_token_time or time.monotonic()
            timings = engine_timings(metrics, getattr(out, "events", None), end)
            phases = timings.phases()
            self.phases.observe(self.role, phases)
            if self._log_phases:
                logger.info(
                    "request %s on %s (%s): %s; %d prompt tokens (%d cached), %d output tokens",
                    body.get("request_id"),
                    self.replica_id,
                    self.role,
                    ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in phases.items()) or "no phase",
                    len(body["prompt_token_ids"]),
                    out.num_cached_tokens,
                    metrics.num_generation_tokens,
                )
            if carrier is None or self.tracing is None:
                return
            finish = [c.finish_reason for c in out.outputs if c.finish_reason]
            remote = getattr(out, "num_remote_tokens", 0)
            params = getattr(out, "kv_transfer_params", None) if out.finished else None
            attributes = {
                "fleetserve.role": self.role,
                "fleetserve.replica": self.replica_id,
                "fleetserve.request_id": body.get("request_id"),
                "gen_ai.request.model": getattr(self.engine, "model_name", None),
                "gen_ai.usage.input_tokens": len(body["prompt_token_ids"]),
                "gen_ai.usage.output_tokens": metrics.num_generation_tokens,
                "gen_ai.response.finish_reasons": finish or None,
                "fleetserve.cached_tokens": out.num_cached_tokens,
                "fleetserve.remote_tokens": remote,
                "fleetserve.remote_kv_bytes": self._kv_bytes(remote) if remote else None,
                "fleetserve.kv_connector": self.kv_connector,
                "fleetserve.preemptions": sum(1 for e in timings.events if e[0] == "preempted"),
                "fleetserve.lora": body.get("lora_name"),
                "fleetserve.tenant": body.get("tenant"),
                "fleetserve.migrated": bool(body.get(MIGRATED_KEY)) or None,
            }
            export = None
            if isinstance(params, dict) and params.get("do_remote_prefill"):  # this engine exported its KV
                export = {
                    "connector": params.get("remote_connector") or self.kv_connector,
                    "tokens": params.get("remote_num_tokens"),
                    "bytes": self._kv_bytes(params.get("remote_num_tokens") or 0) or None,
                    "transfer_id": params.get("transfer_id"),
                }
            record_engine_spans(self.tracing, carrier, timings, attributes, kv_export=export, error=error)
        except Exception as e:  # noqa: BLE001 - observability never fails a request
            logger.warning("could not record the trace of %s: %r", body.get("request_id"), e)

    def _admission_refusal(self, prompt_len: int, reserving: bool = False) -> Optional[str]:
        """Why a new request of `prompt_len` tokens (or, `reserving`, a decode slot for one) is
        refused here now (429), or None. The slots reserved here count as queued work and as
        waiting requests (router.routing.admission)."""
        load = self.engine.get_load()
        reserved = self._reservations.tokens()
        refusal = admission_refusal(load, prompt_len, self.block_size, self._max_queued_kv_ratio, reserved)
        limit = getattr(getattr(self.engine, "args", None), "max_waiting_requests", None)
        if refusal is None and (reserved or reserving) and isinstance(limit, int):
            if load.get("num_waiting", 0) + len(self._reservations) >= limit:
                refusal = "the replica's waiting queue is full (reserved decode slots included); retry later"
        return refusal

    def _reserve(self, owner: str, prompt_len: int, ttl_s: float) -> dict:
        """Admit a P/D request before its prefill runs: a slot held for `ttl_s` (its owner's
        request takes it, or the owner releases it), or the 429 it would get now."""
        refusal = self._admission_refusal(prompt_len, reserving=True)
        if refusal is not None:
            return {"replica": self.replica_id, "error": refusal, "status": 429}
        self._reservations.reserve(owner, prompt_len, ttl_s)
        return {"replica": self.replica_id, "reserved": owner}

    async def feed(
        self, feed_id: str, replica_id: Optional[str] = None, _fleetserve_target: Optional[str] = None
    ) -> AsyncIterator[list]:
        """One ingress's per-step feed (router.feed): lists of (request key, item) of the
        requests bound to it, until no request has been bound for `FEED_IDLE_S` or the
        caller goes away. A call meant for another replica (`replica_id`: Serve routes a
        call pinned to a replica that is gone anywhere) ends at once."""
        if replica_id is not None and replica_id != self.replica_id:
            return
        channel = self._feeds.open(feed_id)
        try:
            while True:
                batch = await channel.take()
                if batch is None:
                    return
                yield batch
        finally:
            self._feeds.close(feed_id, channel)

    # -- control ---------------------------------------------------------------

    async def control(self, op: str, _fleetserve_target: Optional[str] = None, **kwargs: Any) -> dict:
        """Calls the ingress pins to this replica (see router.request_router)."""
        if op == "load_lora":
            try:
                key = await self.engine.add_lora(
                    kwargs["name"], kwargs["path"], replace=bool(kwargs.get("replace", False))
                )
            except QueueFullError as e:  # every adapter it may hold is busy (--max-cpu-loras)
                return {"replica": self.replica_id, "error": str(e), "status": 429}
            except LoRANotLoadable as e:  # the path refused or unreadable: said the same way
                return {"replica": self.replica_id, "error": str(e), "status": 404}
            except ValueError as e:
                return {"replica": self.replica_id, "error": str(e), "status": 400}
            return {"replica": self.replica_id, "key": key}
        if op == "unload_lora":  # evict: drop the weights only (a request naming it loads it again)
            removed = await self.engine.remove_lora(kwargs["name"], evict=bool(kwargs.get("evict", False)))
            return {"replica": self.replica_id, "removed": removed}
        if op == "reserve":
            return self._reserve(str(kwargs["owner"]), int(kwargs["prompt_len"]), float(kwargs["ttl_s"]))
        if op == "release_reservation":
            return {"replica": self.replica_id, "released": self._reservations.release(str(kwargs["owner"]))}
        if op == "get_load":
            return {"replica": self.replica_id, "load": self.engine.get_load()}
        if op == "health":
            try:
                self.check_health()
            except Exception as e:  # noqa: BLE001 - reported to /health, which says why
                return {"replica": self.replica_id, "healthy": False, "reason": str(e)}
            return {
                "replica": self.replica_id,
                "healthy": True,
                "load": self.engine.get_load(),
                "core_pid": getattr(self.engine, "core_pid", None),
            }
        raise ValueError(f"unknown control op {op!r}")

    async def kv_events(
        self,
        since_seq: int = -1,
        instance: Optional[str] = None,
        wait_s: float = 1.0,
        _fleetserve_target: Optional[str] = None,
    ) -> dict:
        """The engine's KV events after `since_seq` of `instance` (a long poll: waits up to
        `wait_s` for the first new batch), or a snapshot when those batches are gone or the
        caller followed another engine. See `scheduler.kv_events.KVEventLog.read`."""
        log = getattr(self.engine, "kv_events", None)
        if log is None:
            return {"replica": self.replica_id, "disabled": True}
        reply = log.read(since_seq, instance)
        if not reply.get("batches") and "snapshot" not in reply and wait_s > 0:
            await self._kv_wake.wait_for_append(log, wait_s)
            reply = log.read(since_seq, instance)
        reply["replica"] = self.replica_id
        return reply

    def report_metrics(self, app: str, deployment: str, interval_s: float) -> None:
        """Report the engine's metrics to `app`'s metrics hub every `interval_s`, from a task
        on the running loop (router/metrics_hub.py: /metrics answers from the reports)."""
        self.metrics_reporter = MetricsReporter(app, deployment, self.replica_id, self.metrics_text, interval_s)
        if not self.metrics_reporter.start():
            logger.warning("no event loop: replica %s does not report its metrics", self.replica_id)

    def metrics_text(self) -> str:
        """The engine's metrics, then this replica's phase histograms (and its span exports
        when it traces): one exposition text, reported to the metrics hub."""
        return self.engine.metrics_text() + self.phases.text(self.role, EXPORTS if self.tracing is not None else None)

    def get_info(self) -> dict:
        """What the ingress needs to tokenize and validate on its own."""
        return {
            "replica": self.replica_id,
            "tokenizer": self.engine.tokenizer,
            "model_name": self.engine.model_name,
            "max_model_len": self.engine.max_model_len,
            "block_size": self.block_size,
            "hidden_size": getattr(self.engine, "hidden_size", None),
            "hash_algo": self.hash_algo,
            "generation_defaults": dict(getattr(self.engine, "generation_defaults", {})),
            "kv_events": getattr(self.engine, "kv_events", None) is not None,
            "lora_keys": dict(getattr(self.engine, "lora_keys", {})),
        }

    def record_routing_stats(self) -> dict[str, Any]:
        """Serve calls this every `request_routing_stats_period_s`; routers read it (with the
        LoRA adapters the engine holds: routers prefer a replica that has a request's)."""
        stats = dict(self.engine.get_load())
        stats["loras"] = sorted(getattr(self.engine, "lora_keys", None) or ())
        return stats

    def check_health(self) -> None:
        """Serve calls this periodically; a dead or wedged engine (work held, no steps, or
        no answer to a ping within the stall timeout) makes Serve replace the replica."""
        check = getattr(self.engine, "check_health", None)
        if check is None:
            return
        if "stall_timeout_s" in inspect.signature(check).parameters:
            check(stall_timeout_s=self._stall_timeout_s)
        else:
            check()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception as e:  # interpreter teardown: nothing left to do but say so
                logger.warning("engine shutdown failed: %s", e)


class AppendWaiter:
    """Wakes `kv_events` long polls (on the replica's loop) when the engine appends a
    batch (on whatever thread steps it). One listener per log, registered lazily."""

    def __init__(self) -> None:
        self._waiters: set[asyncio.Future] = set()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._logs: set[int] = set()

    async def wait_for_append(self, log, timeout_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        if id(log) not in self._logs:
            self._logs.add(id(log))
            log.add_listener(self._appended)
        fut = self._loop.create_future()
        self._waiters.add(fut)
        try:
            await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            pass
        finally:
            self._waiters.discard(fut)

    def _appended(self) -> None:
        loop = self._loop
        if loop is None or not self._waiters:
            return
        try:
            loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop is closed: nobody waits
            pass

    def _wake(self) -> None:
        for fut in list(self._waiters):
            if not fut.done():
                fut.set_result(None)


async def ready_batches(
    outputs: AsyncGenerator[Any, None], batching: Callable[[], bool] = lambda: True
) -> AsyncGenerator[list[Any], None]:
    """The engine's outputs in batches: each output is sent as soon as it exists (no
    waiting for more), but outputs that are already there when the previous send is
    done go out together, as one stream item.

    Every stream item costs CPU between the replica, the ingress and the proxy, which
    on a busy host can exceed the step time, and then items queue up behind each other
    (docs/design/router.md, "Serve settings on the request path"). Batching
    what is already queued keeps the stream from falling behind, and costs nothing
    when it keeps up. While `batching()` is false (the request's items go over a per-step
    feed, which batches across requests: router.feed) each output goes out alone, with no
    extra loop turn. Closing this generator (the caller went away) closes `outputs`
    (the engine aborts the request).
    """
    pending: Optional[asyncio.Future] = None
    first = True  # the first output (TTFT) goes out without the extra loop turn
    try:
        while True:
            try:
                out = await (pending if pending is not None else outputs.__anext__())
            except StopAsyncIteration:
                return
            pending = None
            batch = [out]
            while not first and not getattr(out, "finished", False) and batching():
                pending = asyncio.ensure_future(outputs.__anext__())
                await asyncio.sleep(0)  # one loop turn: an already-queued output completes it
                if not pending.done():
                    break
                if pending.exception() is not None:
                    break  # send what came before; awaiting `pending` next raises it
                out, pending = pending.result(), None
                batch.append(out)
            first = False
            yield batch
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            try:
                await pending
            except (asyncio.CancelledError, Exception):  # incl. StopAsyncIteration
                pass
        elif pending is not None and not pending.cancelled():
            pending.exception()  # retrieved: no "never retrieved" warning when we bail out
        await outputs.aclose()


def _encode(out: Any, replica_id: str, prompt_len: Optional[int]) -> dict:
    item = {
        "replica": replica_id,
        "finished": out.finished,
        "num_cached_tokens": out.num_cached_tokens,
        "outputs": [
            {
                "index": c.index,
                "text": c.text,
                "token_ids": list(c.token_ids),
                "logprobs": c.logprobs,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in out.outputs
        ],
    }
    if prompt_len is not None:
        item["prompt_tokens"] = prompt_len
    if out.finished:
        # P/D: what a producer exported (to hand to the consumer), and how many prompt
        # tokens a consumer loaded instead of computing (kv_transfer's RequestOutput).
        params = getattr(out, "kv_transfer_params", None)
        if params is not None:
            item["kv_transfer_params"] = params
        if getattr(out, "num_remote_tokens", 0):
            item["num_remote_tokens"] = out.num_remote_tokens
    return item


def _grammar_failure(out) -> Optional[dict]:
    """The OpenAI error of a request that ended because its grammar did not compile (a
    `GRAMMAR_ERRORS` stop_reason: a deadline missed, or xgrammar failing), else None."""
    for c in out.outputs:
        parsed = parse_grammar_error(c.stop_reason) if c.finish_reason == "error" else None
        if parsed is not None:
            code, message = parsed
            return error_body(message, status=GRAMMAR_ERRORS[code], param=_param_of(message), code=code)
    return None


def _tenant_kwargs(body: dict) -> dict:
    """Whose request it is (router/tenants.py): the scheduler's policy "fair" shares by it."""
    if not body.get("tenant"):
        return {}
    return {"tenant": str(body["tenant"]), "tenant_weight": float(body.get("tenant_weight", 1.0))}


def _length_kwargs(body: dict) -> dict:
    """The engine body's `session` (the chat a request continues) and
    `predicted_output_tokens` (a prediction made before the request was sent), for the
    scheduler's output-length-aware policies (scheduler/length_aware.py); absent: the
    scheduler predicts by itself. A prediction that is not a positive integer is dropped."""
    out: dict = {}
    if body.get("session"):
        out["session"] = str(body["session"])
    pred = body.get("predicted_output_tokens")
    if isinstance(pred, int) and not isinstance(pred, bool) and pred >= 1:
        out["predicted_output_tokens"] = pred
    return out


def _param_of(message: str) -> Optional[str]:
    """SamplingParams and the engine start their messages with the field name."""
    word = message.split(" ", 1)[0].rstrip(":")  # "logit_bias: ...", "structured_outputs.json: ..."
    return word if word.replace(".", "_").isidentifier() and word.islower() else None


def _code_of(message: str) -> Optional[str]:
    lowered = message.lower()
    if "too long" in lowered or "maximum context length" in lowered or "max_model_len" in lowered:
        return "context_length_exceeded"
    return None
