"""Request migration: a stream whose replica (or its engine core) dies goes on elsewhere.

`MigratingStream` is what the ingress reads a replica's `generate` stream through (HTTP
streaming and not, gRPC). It remembers the token ids each choice has produced so far;
when the stream raises (the replica's actor died, its engine core was killed or failed a
step), it sends a continuation to another replica and keeps yielding from there:

    continuation prompt = original prompt ids + ids already generated
    max_tokens          = the remaining budget;  min_tokens likewise
    seed                = shifted so the draws continue where they stopped (below)
    everything else     = the same sampling settings, priority and cache_salt

so the client sees one stream with no token repeated and none missing. The replica
that failed is avoided (`AVOID_KEY`, read by the request router) when another exists.
The P/D and prefix-reuse flows read their pinned call (the one carrying
kv_transfer_params) through a MigratingStream too (`first`): its continuation is a plain
request on the same pool, so the next replica computes the prompt instead of loading it.
At most `max_migrations` continuations per request (then the error reaches the client
as before: an SSE error event, a gRPC status); what cannot be continued fails at once.

What is guaranteed:
- greedy requests: the same tokens as an uninterrupted run (up to the float rounding
  of recomputing the continuation's prompt as a prefill rather than decodes);
- seeded requests: the same random draws. The model runner reseeds a seeded request's
  generator before every sampled token from `seed * SEED_STRIDE + position` (mod 2**63;
  replica/worker/model_runner.py), so a continuation whose output restarts at position 0
  gets the seed `seed + k * SEED_STRIDE**-1` (mod 2**63) and draws what position k drew;
- the tokens made before the failure are prompt tokens of the continuation, marked as
  output already (`continued_output_tokens`): presence and frequency penalties and
  `bad_words` count them as output, and a structured-output grammar (JSON schema, regex,
  choice, EBNF) resumes after them, so the continuation is what the first replica would
  have produced (a bad word or a JSON object split by the failure stays whole);
- text: the new replica's detokenizer replays the continued tokens as the first one decoded
  them and takes what it handed out as sent (replica/engine/detokenizer.py), so text held
  back as the possible start of a stop string, or a character whose bytes the failure
  split, comes from the new replica, and a stop string that straddles the failure is
  matched (and cut) as without one;
- `n > 1` requests are not continued once any choice has produced tokens (their choices
  share one stream): they fail as before. One whose replica fails before its first token is
  sent again whole (nothing reached the client; the same seeds give the same draws).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Optional

from ray.serve.exceptions import BackPressureError

from fleetserve.router.api.errors import is_error
from fleetserve.router.metrics import MIGRATIONS
from fleetserve.router.tracing import TRACE_KEY
from fleetserve.router.tracing import carrier_of as trace_carrier_of
from fleetserve.router.tracing import current as current_tracing

logger = logging.getLogger("ray.serve")

AVOID_KEY = "_fleetserve_avoid_replicas"
# Set on a continuation: the replica admits it past its queue bounds (the cluster accepted
# the request already; a 429 now would fail a stream the client is reading).
MIGRATED_KEY = "_fleetserve_migrated"
ENGINE_DEAD = "engine_dead"  # error code of a replica whose engine died (router.replica)
SEED_STRIDE = 1_000_003  # the model runner's reseeding stride (see the module doc)
_SEED_MOD = 1 << 63
_SEED_STRIDE_INV = pow(SEED_STRIDE, -1, _SEED_MOD)


def continued_seed(seed: int, num_generated: int) -> int:
    """The seed whose draw at output position 0 is `seed`'s draw at `num_generated`."""
    return (seed + num_generated * _SEED_STRIDE_INV) % _SEED_MOD


def continuation_body(body: dict, generated: list[int], attempt: int, avoid: list[str]) -> dict:
    """The request that continues `body` after `generated` tokens (one choice)."""
    sp = dict(body["sampling_params"])
    done = len(generated)
    if sp.get("max_tokens") is not None:
        sp["max_tokens"] = sp["max_tokens"] - done
    sp["min_tokens"] = max(0, sp.get("min_tokens", 0) - done)
    if sp.get("seed") is not None:
        sp["seed"] = continued_seed(sp["seed"], done)
    if done:  # the prompt's logprobs came before its first token: not again, for a longer prompt
        sp["prompt_logprobs"] = None
    # Penalties, bad words and the grammar count the generated tokens as output, not prompt.
    sp["continued_output_tokens"] = sp.get("continued_output_tokens", 0) + done
    return {
        **body,
        "request_id": f"{body['request_id']}-m{attempt}",
        "prompt_token_ids": list(body["prompt_token_ids"]) + list(generated),
        "sampling_params": sp,
        AVOID_KEY: list(avoid),
        MIGRATED_KEY: attempt,
    }


class MigratingStream:
    """A replica stream (ReplicaStream's interface) that survives its replica.

    `first`: the stream already opened for this request, when it is not `open_stream(body)`
    (the P/D and prefix-reuse flows' pinned call, carrying kv_transfer_params); `body` is then
    the request as the client sent it, what a continuation continues (no params: the next
    replica computes the prompt and the tokens sent so far). `replica`: the one `first` was
    pinned to (avoided by a continuation even when it failed before its first item)."""

    def __init__(
        self,
        open_stream: Callable[[dict], Any],
        body: dict,
        max_migrations: int,
        backoff_s: float = 0.25,
        first: Any = None,
        replica: Optional[str] = None,
    ) -> None:
        self._open = open_stream
        self._body = body
        self._stream = first if first is not None else open_stream(body)
        self._max = max_migrations
        self._backoff_s = backoff_s
        self.migrations = 0
        self._generated: dict[int, list[int]] = {}
        self._finished: set[int] = set()
        # Replicas that served this request, in order (a continuation avoids them).
        self._replicas: list[str] = [replica] if replica else []
        # A traced request's migration under way: (start, attributes) of its span.
        self._pending_span: Optional[tuple[int, dict]] = None

    def __aiter__(self):
        return self

    async def __anext__(self):
        while True:
            try:
                item = await self._stream.__anext__()
            except (StopAsyncIteration, asyncio.CancelledError):
                raise
            except Exception as e:  # noqa: BLE001 - the replica failed: continue elsewhere
                reason = self._why_not(e)
                if reason is not None:
                    if self._generated:  # tokens were sent: say why the stream stops here
                        MIGRATIONS.not_migrated += 1
                        logger.warning("request %s not migrated: %s", self._body["request_id"], reason)
                    raise
                await self._migrate(e)
                continue
            if is_error(item) and item["error"].get("code") == ENGINE_DEAD:
                # The replica answered, but its engine is dead: continue elsewhere, avoiding it.
                if item.get("replica") and item["replica"] not in self._replicas:
                    self._replicas.append(item["replica"])
                if self._why_not(RuntimeError(item["error"]["message"])) is None:
                    await self._migrate(RuntimeError(item["error"]["message"]))
                    continue
            if not is_error(item):
                self._observe(item)
            if self._pending_span is not None:
                self._record_migration(item)
            return item

    def cancel(self) -> None:
        self._stream.cancel()

    def _record_migration(self, item: dict) -> None:
        """The `migration` span of a traced request (router/tracing.py): from its replica's
        failure to the continuation's first item, under the request's span."""
        start_ns, attrs = self._pending_span or (0, {})
        self._pending_span = None
        tracing = current_tracing()
        carrier = trace_carrier_of(self._body)
        if tracing is None or carrier is None:
            return
        attrs = {**attrs, "fleetserve.migration.to_replica": item.get("replica")}
        error = item["error"].get("message") if is_error(item) else None
        tracing.record("migration", tracing.extract(carrier), start_ns, time.time_ns(), attrs, error=error)

    # -- internals ---------------------------------------------------------------

    def _observe(self, item: dict) -> None:
        if item.get("replica") and (not self._replicas or self._replicas[-1] != item["replica"]):
            self._replicas.append(item["replica"])
        if self.migrations:
            item.pop("prompt_tokens", None)  # the client's prompt is the original one
        for out in item.get("outputs", ()):
            self._generated.setdefault(out["index"], []).extend(out["token_ids"])
            if out.get("finish_reason"):
                self._finished.add(out["index"])

    def _why_not(self, error: BaseException) -> Optional[str]:
        if isinstance(error, BackPressureError):
            return "the cluster is overloaded (Serve's queue is full)"
        if self.migrations >= self._max:
            return f"already migrated {self.migrations} times ({error})"
        if self._body["sampling_params"].get("n", 1) != 1 and self._generated:
            return "requests with n > 1 are not migrated once they have produced tokens"
        if self._body.get("kv_transfer_params"):
            return "requests with KV transfer parameters are not migrated"
        if 0 in self._finished:
            return "the request had already finished"
        return None

    async def _migrate(self, error: BaseException) -> None:
        if TRACE_KEY in self._body and self._pending_span is None:
            self._pending_span = (
                time.time_ns(),
                {
                    "fleetserve.migration.from_replica": self._replicas[-1] if self._replicas else None,
                    "fleetserve.migration.attempt": self.migrations + 1,
                    "fleetserve.migration.tokens_carried": len(self._generated.get(0, [])),
                    "fleetserve.migration.error": f"{type(error).__name__}: {str(error)[:200]}",
                },
            )
        self.migrations += 1
        MIGRATIONS.migrated += 1
        self._stream.cancel()
        generated = self._generated.get(0, [])
        logger.warning(
            "request %s: replica %s failed after %d tokens (%s: %s); continuing on "
            "another replica (migration %d of at most %d)",
            self._body["request_id"],
            self._replicas[-1] if self._replicas else "?",
            len(generated),
            type(error).__name__,
            str(error)[:200],
            self.migrations,
            self._max,
        )
        await asyncio.sleep(self._backoff_s * self.migrations)  # let Serve notice the failure
        body = continuation_body(self._body, generated, self.migrations, self._replicas)
        self._stream = self._open(body)
