"""AsyncEngine: the EngineCore on a background thread, with asyncio streams in front.

    caller (asyncio)                         engine thread
    generate() --- ("add", ...) ---------->  drain commands
       ^                                     core.step()  (schedule/execute/update)
       |                                     detokenize, stop strings
       +---- RequestOutput deltas <---------- loop.call_soon_threadsafe(queue.put)

The engine thread sleeps on an event when there is no work. torch releases the
GIL inside its kernels, so the asyncio side stays responsive while a step runs.
A caller that stops iterating (or whose task is cancelled, e.g. an HTTP client
that disconnected) aborts its request, and its KV blocks return to the pool.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import uuid
from typing import Any, AsyncIterator, Optional

from replica.engine_args import EngineArgs
from replica.engine_core import EngineCore, StepResult
from replica.executor import ExecutorError
from replica.metrics import EngineMetrics
from replica.model_registry import resolve_model
from replica.outputs import RequestOutput
from replica.processor import InputProcessor, OutputProcessor, PromptType
from replica.tokenizer import apply_chat_template, load_tokenizer
from scheduler import RequestStatus, SamplingParams

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The replica's bounded waiting queue is full; try again later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine hit an unrecoverable error (e.g. a worker died); restart the replica."""


class AsyncEngine:
    def __init__(self, args: Optional[EngineArgs] = None, **kwargs: Any) -> None:
        self.args = args = args or EngineArgs(**kwargs)
        source = resolve_model(args.model)
        self.tokenizer = load_tokenizer(source)
        self.core = EngineCore(args, self.tokenizer.eos_token_id)
        self.model_name = args.served_model_name or source.name
        self.max_model_len = self.core.max_model_len
        self.metrics = EngineMetrics(self.model_name)
        self.input_processor = InputProcessor(self.tokenizer, self.max_model_len,
                                              self.core.hf_config.vocab_size)
        self.output_processor = OutputProcessor(self.tokenizer, self.metrics)

        self._commands: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._num_pending_adds = 0  # adds submitted but not yet drained (both threads: locked)
        self._pending_lock = threading.Lock()
        self._dead: Optional[BaseException] = None
        self._stopping = False
        self._load = self.core.get_load()
        self._thread = threading.Thread(target=self._run, name="fleetserve-engine", daemon=True)
        self._thread.start()

    # ---- public API ----------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return apply_chat_template(self.tokenizer, messages, add_generation_prompt)

    async def generate(self, prompt: PromptType, sampling_params: Optional[SamplingParams] = None,
                       request_id: Optional[str] = None, *, priority: int = 0,
                       kv_transfer_params: Optional[dict] = None,
                       cache_salt: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        if self._dead is not None:
            raise EngineDeadError(f"the engine is dead: {self._dead}")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        sp = sampling_params or SamplingParams()
        text, requests = self.input_processor.process(
            prompt, sp, request_id, priority=priority, cache_salt=cache_salt,
            kv_transfer_params=kv_transfer_params)
        if self._load["num_waiting"] + self._num_pending_adds >= self.args.max_waiting_requests:
            raise QueueFullError(
                f"the waiting queue is full ({self.args.max_waiting_requests} requests); retry later")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        with self._pending_lock:
            self._num_pending_adds += 1
        self._submit(("add", request_id, text, requests))
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._submit(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def get_load(self) -> dict:
        return dict(self._load)

    def metrics_text(self) -> str:
        return self.metrics.text()

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine is dead: {self._dead}")
        if not self._thread.is_alive():
            raise EngineDeadError("the engine thread has stopped")

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)
        self.core.shutdown()

    # ---- the engine thread ------------------------------------------------------------
    def _submit(self, command: tuple) -> None:
        self._commands.append(command)
        self._wake.set()

    def _run(self) -> None:
        core = self.core
        while not self._stopping:
            self._drain_commands()
            if not core.has_work():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                result = core.step()
            except Exception as e:  # noqa: BLE001 - every in-flight request must hear of it
                self._fail_all(e)
                continue
            self._handle(result)

    def _drain_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            kind, request_id = command[0], command[1]
            if kind == "add":
                with self._pending_lock:
                    self._num_pending_adds -= 1
                _, _, text, requests = command
                if self._dead is not None:
                    self._deliver(request_id, EngineDeadError(f"the engine is dead: {self._dead}"))
                    continue
                self.output_processor.add(request_id, text, requests)
                for r in requests:
                    self.core.add_request(r)
            elif kind == "abort":
                self.core.abort_requests(self.output_processor.abort(request_id))
        self._load = self.core.get_load()

    def _handle(self, result: StepResult) -> None:
        op = self.output_processor
        if result.newly_scheduled:
            op.mark_scheduled(result.newly_scheduled, result.timestamp)
        outputs, stopped = op.process(result.outputs)
        if stopped:
            self.core.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        # Load and metrics first: a caller that sees its last output must also
        # see its blocks back in the pool.
        self._load = self.core.get_load()
        self.metrics.update_scheduler_stats(self.core.scheduler.get_stats())
        for ro in outputs:
            self._deliver(ro.request_id, ro)

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        loop, queue = stream
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening
            pass

    def _fail_all(self, error: Exception) -> None:
        if isinstance(error, ExecutorError):
            self._dead = error
            logger.error("engine failed, failing all requests: %s", error)
            failure: Exception = EngineDeadError(str(error))
        else:
            logger.exception("engine step failed; failing the in-flight requests")
            failure = RuntimeError(f"engine step failed: {type(error).__name__}: {error}")
        for request_id in list(self.output_processor.parents):
            self.core.abort_requests(self.output_processor.abort(request_id))
            self._deliver(request_id, failure)
        self._load = self.core.get_load()
