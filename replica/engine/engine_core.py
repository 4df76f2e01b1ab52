"""EngineCore: the heartbeat of a replica.

    step():  scheduler.schedule()                      -> SchedulerOutput
             executor.execute_model(scheduler_output)  -> ModelRunnerOutput
             scheduler.update_from_output(...)         -> EngineCoreOutputs

It is synchronous and single-threaded on purpose: the offline `LLM` drives it
directly, and `AsyncEngine` drives it from one background thread.

Idle means idle for the KV connector too: `has_work()` stays True while the
connector has work queued for the next step (a finished request's save) or
saves in flight on its workers, so a save is carried out right after the
request that queued it, with no later request needed. The offline `LLM` and a
shutdown, which stop stepping on their own, `flush_kv()` first: saves finish,
or past `kv_save_timeout_s` are reported (a warning naming how many; at
shutdown they are dropped and counted in `kv_saves_dropped`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from typing import Any, Callable, Iterable, Optional

from fleetserve.replica.engine.core_messages import Abort, Add, AddLoRA, CoreCommand, EngineLoad, Finish, RemoveLoRA
from fleetserve.replica.engine.engine_args import EngineArgs
from fleetserve.replica.engine.step_result import StepResult
from fleetserve.replica.executor import Executor, ExecutorError, make_executor
from fleetserve.replica.kv_connectors import make_scheduler_connector, name_kv_engine
from fleetserve.replica.lora.loader import LoRALoader
from fleetserve.replica.model_loader.model_config import model_sliding_window
from fleetserve.replica.structured_output.manager import StructuredOutputManager
from fleetserve.scheduler import EngineCoreOutput, Request, RequestStatus, create_scheduler

logger = logging.getLogger(__name__)

KV_IDLE_POLL_S = 0.002
STEP_TRACE_ENV = "FLEETSERVE_STEP_TRACE"


class StepTrace:
    """One JSON line per engine step, for finding where a served engine's time goes: with
    `FLEETSERVE_STEP_TRACE=<folder>` each engine core process appends to
    `<folder>/steps-<pid>.jsonl` (a served engine inherits the variable from `fleetserve
    serve`). Fields: `t` (wall clock at the step's end), `step_s` (schedule, model and
    update), `model_s` (the model alone), `cpu_s` (CPU time this process used in the step:
    below `step_s` x threads means its threads waited for a core), `tokens` (scheduled),
    `reqs` (scheduled requests), `waiting` (requests left waiting)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file = open(path, "a", buffering=1)

    @classmethod
    def from_env(cls) -> Optional["StepTrace"]:
        folder = os.environ.get(STEP_TRACE_ENV)
        if not folder:
            return None
        try:
            os.makedirs(folder, exist_ok=True)
            return cls(os.path.join(folder, f"steps-{os.getpid()}.jsonl"))
        except OSError as e:
            logger.warning("%s=%s: cannot write the step trace there: %s", STEP_TRACE_ENV, folder, e)
            return None

    def write(
        self, start: float, model_start: float, model_end: float, cpu_start: float, tokens: int, reqs: int, waiting: int
    ) -> None:
        end = time.monotonic()
        self._file.write(
            json.dumps(
                {
                    "t": round(time.time(), 6),
                    "step_s": round(end - start, 6),
                    "model_s": round(model_end - model_start, 6),
                    "cpu_s": round(time.process_time() - cpu_start, 6),
                    "tokens": tokens,
                    "reqs": reqs,
                    "waiting": waiting,
                }
            )
            + "\n"
        )

    def close(self) -> None:
        self._file.close()


def resolve_max_model_len(args: EngineArgs, hf_config) -> int:
    model_max = getattr(hf_config, "max_position_embeddings", None) or 2048
    if args.max_model_len is None:
        return int(model_max)
    if args.max_model_len > model_max:
        raise ValueError(f"max_model_len={args.max_model_len} exceeds the model's max_position_embeddings={model_max}")
    return args.max_model_len


class EngineCore:
    def __init__(self, args: EngineArgs, eos_token_id: Optional[int], executor: Optional[Executor] = None) -> None:
        self.args = args = name_kv_engine(args)
        self.executor = executor or make_executor(args, eos_token_id)
        self.hf_config = self.executor.hf_config
        self.max_model_len = resolve_max_model_len(args, self.hf_config)
        num_blocks = self.executor.determine_num_blocks()
        self.executor.initialize_kv_cache(num_blocks)
        # what moving one block of a request's KV moves (tracing's kv_transfer spans)
        self.kv_bytes_per_block = int(getattr(self.executor, "kv_bytes_per_block", 0))
        # The scheduler half of the KV connector (the worker half lives with the KV).
        self.kv_connector = make_scheduler_connector(args, self.hf_config)
        self.scheduler = create_scheduler(
            args.scheduler_config(self.max_model_len),
            args.cache_config(num_blocks, model_sliding_window(self.hf_config)),
            self.kv_connector,
        )
        # Set by the worker's connector half (its `wakeup()`) when a transfer ends on one of
        # its threads (TP=1: the worker is in this process); steps idling on transfers wait
        # on it. With the workers elsewhere (Ray TP) nothing sets it: those steps poll.
        self._kv_wake = threading.Event()
        if self.kv_connector is not None:
            self.executor.set_kv_wakeup(self._kv_wake.set)
        # Saves the workers reported unfinished at the last step (copy-outs, exports).
        self._kv_saves_in_flight = 0
        self.kv_saves_dropped = 0  # saves given up on at shutdown (past kv_save_timeout_s)
        self._closed = False
        # Steps that computed tokens, their model time (schedule to model output) and tokens.
        self.num_steps = 0
        self.busy_s = 0.0
        self.num_step_tokens = 0
        capacity = num_blocks * args.block_size
        window = self.scheduler.kv.sliding_window
        if window is not None:
            logger.info(
                "every layer attends within %d tokens: blocks a request's window left behind go back to the pool",
                window,
            )
        if capacity < self.max_model_len and not self.scheduler.window_fits_pool():
            logger.warning(
                "the KV cache holds %d tokens, fewer than max_model_len=%d: a request "
                "that alone outgrows the cache finishes with reason 'length'",
                capacity,
                self.max_model_len,
            )
        logger.info(
            "EngineCore ready: %d KV blocks of %d tokens, max_model_len %d",
            num_blocks,
            args.block_size,
            self.max_model_len,
        )
        self.structured = StructuredOutputManager(
            functools.partial(_grammar_backend, args.model, self.hf_config.vocab_size, eos_token_id),
            compile_timeout_s=args.structured_outputs_compile_timeout,
        )
        self._trace = StepTrace.from_env()
        # LoRA adapters unloaded while requests still ran with them: detached once none does.
        self._unloading_loras: set[int] = set()
        # Adapter loads at run time, off the step loop (replica/lora/loader.py).
        self.lora_loader = LoRALoader(self.executor, args.lora_load_timeout)

    # ---- commands (from either client layout: core_messages) -----------------------
    def apply(self, command: CoreCommand) -> None:
        """Carry out a client's command between steps. A LoRA command's answer (seq, the
        error's text or None) comes from `take_lora_answers`: a load's once it is installed."""
        match command:
            case Add(requests):
                for request in requests:
                    self.add_request(request)
            case Abort(request_ids):
                self.abort_requests(request_ids)
            case Finish(request_ids):
                self.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)
            case AddLoRA(seq, lora_id, name, path):
                self._unloading_loras.discard(lora_id)
                self.lora_loader.start(seq, lora_id, name, path)
            case RemoveLoRA(seq, lora_id):
                self.lora_loader.answer(seq, _error_text(self.remove_lora, lora_id))

    def take_lora_answers(self) -> list[tuple[int, Optional[str]]]:
        """The LoRA commands answered since the last call: (seq, error text or None)."""
        return self.lora_loader.take_answers()

    def fail_in_flight(self, error: Exception) -> tuple[str, bool]:
        """After a step raised (call it in the `except` block): abort everything in flight, log,
        and return (message, dead); dead when the executor cannot go on (a worker died)."""
        self.abort_requests(list(self.scheduler.requests) + self.structured.pending_ids())
        if isinstance(error, ExecutorError):
            logger.error("engine executor failed: %s", error)
            return str(error), True
        logger.exception("engine step failed; failing the in-flight requests")
        return f"{type(error).__name__}: {error}", False

    # ---- LoRA adapters at run time -------------------------------------------------
    def add_lora(self, lora_id: int, name: str, path: str) -> None:
        """Load an adapter on every rank now, within --lora-load-timeout (the offline LLM,
        which steps nothing meanwhile; a client's AddLoRA loads off the step loop)."""
        self._unloading_loras.discard(lora_id)
        self.lora_loader.load_now(lora_id, name, path)

    def remove_lora(self, lora_id: int) -> None:
        """A removed adapter stays attached until the requests running with it end (the caller
        already refuses new ones), so none of them switches weights midway. One still loading
        is never installed."""
        if self.lora_loader.cancel(lora_id):
            return
        self._unloading_loras.add(lora_id)
        self._detach_unused_loras()

    def _detach_unused_loras(self) -> None:
        if not self._unloading_loras:
            return
        in_use = {r.lora_id for r in self.scheduler.requests.values()}
        in_use.update(r.lora_id for r in self.structured.pending_requests())
        for lora_id in self._unloading_loras - in_use:
            self.executor.remove_lora(lora_id)
            self._unloading_loras.discard(lora_id)

    # ---- requests -----------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.sampling_params.structured_outputs is not None:
            self.structured.submit(request)  # the scheduler sees it once its grammar is ready
        else:
            self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        request_ids = list(request_ids)
        pending = [rid for rid in request_ids if self.structured.is_pending(rid)]
        self.structured.remove(request_ids)
        aborted = pending + self.scheduler.abort_requests(request_ids)
        self._detach_unused_loras()  # an unloaded adapter's last request may be one of them
        return aborted

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[str]:
        request_ids = list(request_ids)
        self.structured.remove(request_ids)
        finished = self.scheduler.finish_requests(request_ids, status)
        self._detach_unused_loras()
        return finished

    def has_work(self) -> bool:
        """Whether the loop must keep stepping: requests, grammars compiling (waited for or
        not: the reported state says when they stall), or KV connector
        work (the scheduler counts what its connector queued for the next step; saves the
        workers have in flight count here), so an idle engine has no save pending."""
        return (
            self.scheduler.has_requests()
            or self.structured.has_pending()
            or self.structured.compiling()
            or self._kv_saves_in_flight > 0
            or self.lora_loader.busy()
        )

    def kv_pending(self) -> bool:
        """The KV connector still has work: something queued for the next step, a finished
        request's blocks held until they are copied out, or saves in flight on the workers."""
        if self.kv_connector is None:
            return False
        return bool(self.kv_connector.has_pending_work() or self.scheduler.sending or self._kv_saves_in_flight > 0)

    @property
    def kv_save_timeout_s(self) -> float:
        """How long a flush waits for the KV connector's saves (0 without a connector)."""
        cfg = self.args.kv_transfer_config
        return 0.0 if cfg is None else cfg.kv_save_timeout_s

    def num_pending_kv_saves(self) -> int:
        """Saves not finished yet: queued for the next step, or in flight on the workers."""
        if self.kv_connector is None:
            return 0
        return self.kv_connector.num_pending_saves() + self._kv_saves_in_flight

    def flush_kv(
        self, timeout_s: Optional[float] = None, on_step: Optional[Callable[[StepResult], None]] = None
    ) -> int:
        """Step (steps with no tokens: call it once no request is unfinished) until the KV
        connector has nothing pending or `timeout_s` (default: kv_save_timeout_s) passes;
        each step's result goes to `on_step`. Returns how many saves are still unfinished."""
        if self.kv_connector is None:
            return 0
        if timeout_s is None:
            timeout_s = self.kv_save_timeout_s
        deadline = time.monotonic() + timeout_s
        while self.kv_pending() and time.monotonic() < deadline:
            result = self.step()
            if on_step is not None:
                on_step(result)
        return self.num_pending_kv_saves()

    # ---- the step ----------------------------------------------------------------
    def step(self) -> StepResult:
        self.lora_loader.poll()  # adapters that finished loading go in between steps
        # With nothing else to run, wait a little for a grammar (or an adapter) rather than spin.
        kv_busy = self._kv_saves_in_flight > 0  # a connector step polls the workers' saves
        ready, failed = self.structured.take_ready(
            wait_s=0.0 if kv_busy or self.scheduler.has_requests() else _GRAMMAR_WAIT_S
        )
        for request in ready:
            self.scheduler.add_request(request)
        if not (kv_busy or self.scheduler.has_requests()):  # only grammars or adapters loading: no step
            self.lora_loader.wait(_GRAMMAR_WAIT_S)
            return StepResult(failed, [], 0, time.monotonic())
        start, cpu_start = time.monotonic(), (time.process_time() if self._trace is not None else 0.0)
        scheduler_output = self.scheduler.schedule()
        scheduler_output.structured_output = self.structured.bitmask(self._sampling_req_ids(scheduler_output))
        now = time.monotonic()
        self._kv_saves_in_flight = 0  # (unknown after a step that raised: not kept busy by it)
        runner_output = self.executor.execute_model(scheduler_output)
        model_end = time.monotonic()
        if scheduler_output.total_num_scheduled_tokens:
            self.num_steps += 1
            self.busy_s += model_end - start
            self.num_step_tokens += scheduler_output.total_num_scheduled_tokens
        self._kv_saves_in_flight = getattr(runner_output, "kv_saves_in_flight", 0)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if runner_output.sampling_errors:
            self._fail_unsampleable(outputs, runner_output.sampling_errors)
        if self._trace is not None:
            self._trace.write(
                start,
                now,
                model_end,
                cpu_start,
                scheduler_output.total_num_scheduled_tokens,
                len(scheduler_output.num_scheduled_tokens),
                len(self.scheduler.waiting),
            )
        self._advance_grammars(outputs)
        outputs.extend(failed)
        self._detach_unused_loras()
        if (
            self.kv_connector is not None
            and not outputs
            and scheduler_output.is_empty
            and not (
                runner_output.finished_recving or runner_output.finished_sending or runner_output.invalid_block_ids
            )
        ):
            # Only transfers are pending (loads, saves, leases): poll them without spinning a
            # core, woken early when one ends on a transfer thread of this process (TP=1: the
            # connector's `wakeup()`). (Not after a step that finished some: a loaded request
            # is scheduled at once.)
            if self._kv_wake.wait(KV_IDLE_POLL_S):
                self._kv_wake.clear()  # before the next step's get_finished: no wake is lost
        # Resumed (preempted) requests are sent as new again; the output
        # processor keeps only the first schedule time of each request.
        scheduled = [n.req_id for n in scheduler_output.scheduled_new_reqs]
        kv_stats = None
        if self.kv_connector is not None:
            from fleetserve.kv_transfer.metrics import step_kv_stats

            kv_stats = step_kv_stats(self.scheduler, self.kv_connector, runner_output)
        return StepResult(
            outputs,
            scheduled,
            scheduler_output.total_num_scheduled_tokens,
            now,
            self.scheduler.take_kv_events(),
            kv_stats,
        )

    def take_kv_events(self) -> Optional[StepResult]:
        """KV events that commands (aborts, finishes) caused between steps, as an empty step's
        result, so they reach subscribers even when no step follows; None when there are none."""
        batch = self.scheduler.take_kv_events()
        return None if batch is None else StepResult([], kv_events=batch)

    def _sampling_req_ids(self, so) -> list[str]:
        """Scheduled requests that reach the end of their tokens (and so sample) this step;
        the scheduler already advanced their counters."""
        if not self.structured.has_matchers():
            return []
        reqs = self.scheduler.requests
        return [rid for rid in so.num_scheduled_tokens if reqs[rid].num_computed_tokens >= reqs[rid].num_tokens]

    def _fail_unsampleable(self, outputs: list[EngineCoreOutput], errors: dict[str, str]) -> None:
        """Finish with "error" the requests whose masks left no token to sample (the runner
        gave them only the tokens before that position); one that stopped on those tokens
        keeps its own finish. The rest of the batch went on as usual."""
        done = set(self.finish_requests(list(errors), RequestStatus.FINISHED_ERROR))
        for out in outputs:
            if out.request_id in done and not out.finished:
                out.finish_reason, out.stop_reason = "error", errors[out.request_id]
                done.discard(out.request_id)
        outputs.extend(EngineCoreOutput(rid, [], "error", errors[rid]) for rid in done)

    def _advance_grammars(self, outputs) -> None:
        """Feed sampled tokens to the matchers; a grammar that terminated without the
        request stopping (no EOS to sample: ignore_eos, or min_tokens) ends it as "stop"."""
        if not self.structured.has_matchers():
            return
        done = set(self.structured.accept(outputs))
        if done:
            self.scheduler.finish_requests(done, RequestStatus.FINISHED_STOPPED)
            for out in outputs:
                if out.request_id in done:
                    out.finish_reason = "stop"
        self.structured.remove([o.request_id for o in outputs if o.finished])

    def add_progress_hook(self, bump) -> bool:
        """Call `bump` as each decoder layer starts (replica.engine.progress); False when the
        executor runs no model in this process."""
        return self.executor.add_progress_hook(bump)

    def get_load(self) -> EngineLoad:
        s = self.scheduler
        queued = s.num_queued_tokens()
        stats = s.get_stats()
        return {
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting + stats.num_waiting_for_remote_kvs + self.structured.num_pending,
            "num_queued_tokens": queued,
            "kv_cache_usage": stats.kv_cache_usage,
            "num_free_blocks": stats.num_free_blocks,
            "num_blocks": stats.num_blocks,
            "grammar_stalled_since": self.structured.stalled_since(),
            # Cumulative step counters: the router's SLO predictor (router/routing/slo.py)
            # estimates this replica's step time and token rate from their change between reports.
            "num_steps": self.num_steps,
            "busy_s": self.busy_s,
            "num_step_tokens": self.num_step_tokens,
        }

    def shutdown(self) -> int:
        """Stop the engine: requests still unfinished are aborted (nobody will read them),
        finished ones' KV saves are carried out (up to kv_save_timeout_s). Returns how many
        saves were dropped (logged, and added to `kv_saves_dropped`)."""
        if self._closed:
            return 0
        self._closed = True
        dropped = self._flush_kv_at_shutdown() if self.kv_connector is not None else 0
        if self._trace is not None:
            self._trace.close()
            self._trace = None
        self.structured.shutdown()
        self.lora_loader.shutdown()
        self.executor.shutdown()
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        return dropped

    def _flush_kv_at_shutdown(self) -> int:
        timeout_s = self.kv_save_timeout_s
        try:
            self.abort_requests(list(self.scheduler.requests) + self.structured.pending_ids())
            left = self.flush_kv(timeout_s)
        except Exception as e:  # noqa: BLE001 - a dead executor: what is pending is lost
            logger.warning(
                "KV connector: carrying out the pending saves at shutdown failed: %s: %s", type(e).__name__, e
            )
            left = self.num_pending_kv_saves()
        if left:
            logger.warning(
                "KV connector: %d saves dropped at shutdown (not finished within "
                "kv_save_timeout_s=%g s); their blocks will be recomputed",
                left,
                timeout_s,
            )
            self.kv_saves_dropped += left
        return left


# How long an idle step waits for a grammar before returning (commands are read between steps).
_GRAMMAR_WAIT_S = 0.005


def _error_text(fn: Callable[..., None], *args: Any) -> Optional[str]:
    """Run `fn`; the text of what it raised (for the client to report: a 400 naming the
    problem), or None."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - reported to the caller, not lost
        return str(e) or type(e).__name__
    return None


def _grammar_backend(model: str, vocab_size: int, eos_token_id: Optional[int]):
    """The xgrammar backend for this model's tokenizer (built on first use, on a pool thread)."""
    from fleetserve.replica.engine.tokenizer import load_tokenizer
    from fleetserve.replica.model_loader.registry import resolve_model
    from fleetserve.replica.structured_output.backend import XgrammarBackend

    return XgrammarBackend(load_tokenizer(resolve_model(model)), vocab_size, eos_token_id)
