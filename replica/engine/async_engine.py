"""AsyncEngine: the EngineCore stepping on its own, with asyncio streams in front.

    caller (asyncio)                          EngineCore (child process, or a thread)
    generate() --- add(requests) ----------->  drain commands
       ^                                       core.step()  (schedule/execute/update)
       |                                             |
       +-- RequestOutput deltas <-- on_step: detokenize, stop strings, metrics
                                    (a core process: read on the caller's loop;
                                    a thread: loop.call_soon_threadsafe)

By default the EngineCore runs in a process of its own (`replica.engine.core_client`:
vLLM v1's layout), so the model's steps never wait for this process's GIL; this
process keeps the tokenizer, the detokenizer and the streams. With TP > 1 (or
FLEETSERVE_ENGINE_CORE_PROCESS=0) it runs on a thread of this process instead.
A caller that stops iterating (or whose task is cancelled, e.g. an HTTP client
that disconnected) aborts its request, and its KV blocks return to the pool.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import sys
import threading
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional

from fleetserve.kv_transfer.params import validate_kv_transfer_params
from fleetserve.replica.engine.core_client import EngineCoreClient, use_core_process
from fleetserve.replica.engine.core_messages import EngineLoad
from fleetserve.replica.engine.engine_args import EngineArgs
from fleetserve.replica.engine.errors import EngineDeadError, LoRACapacityError, QueueFullError  # noqa: F401 (re-exported)
from fleetserve.replica.engine.metrics import EngineMetrics
from fleetserve.replica.engine.outputs import RequestOutput, merge_deltas, num_new_tokens
from fleetserve.replica.engine.process_client import ProcessCoreClient, SpawnedCore
from fleetserve.replica.engine.processor import InputProcessor, OutputProcessor, PromptType
from fleetserve.replica.engine.step_result import StepResult
from fleetserve.replica.engine.thread_client import ThreadCoreClient
from fleetserve.replica.engine.tokenizer import apply_chat_template, load_tokenizer
from fleetserve.replica.executor.base import ExecutorError
from fleetserve.replica.lora.manager import EngineLoRAs
from fleetserve.replica.lora.paths import LoRANotLoadable
from fleetserve.replica.model_loader.model_info import generation_defaults, read_model_shape
from fleetserve.replica.model_loader.registry import resolve_model
from fleetserve.scheduler import KVEventLog, SamplingParams

if TYPE_CHECKING:
    from fleetserve.replica.engine.engine_core import EngineCore

logger = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(
        self, args: Optional[EngineArgs] = None, *, core_process: Optional[bool] = None, **kwargs: Any
    ) -> None:
        self.args = args = args or EngineArgs(**kwargs)
        own_process = use_core_process(args, core_process)
        # The core process imports torch and the engine while this one loads the tokenizer.
        spawned = SpawnedCore() if own_process else None
        try:
            self._start(args, spawned)
        except BaseException:
            if spawned is not None:
                spawned.kill()
            raise

    def _start(self, args: EngineArgs, spawned: Optional[SpawnedCore]) -> None:
        source = resolve_model(args.model)
        self.tokenizer = load_tokenizer(source)
        if args.chat_template is not None:  # --chat-template: the ingress gets it with the tokenizer
            self.tokenizer.chat_template = args.chat_template
        self.model_name = args.served_name or source.name
        shape = read_model_shape(source)
        self.metrics = EngineMetrics(self.model_name, args.max_model_len or shape.max_position_embeddings)
        # Sampling defaults the model ships (`--generation-config`); the ingress applies them.
        self.generation_defaults = generation_defaults(source, args.generation_config)
        self.output_processor = OutputProcessor(self.tokenizer, self.metrics)
        # The output processor is used by the callers' loop (add, abort) and by the thread
        # that delivers the engine's steps: one lock, held for microseconds.
        self._lock = threading.Lock()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._dead: Optional[str] = None  # why the engine cannot serve any more
        # What the prefix cache gains and loses, for subscribers (the router's prefix index).
        self.kv_events: Optional[KVEventLog] = KVEventLog() if args.enable_kv_cache_events else None
        self._client: EngineCoreClient
        if spawned is not None:
            self._client = ProcessCoreClient(
                args, self.tokenizer.eos_token_id, self._on_step, self._on_failure, spawned=spawned
            )
        else:
            self._client = ThreadCoreClient(args, self.tokenizer.eos_token_id, self._on_step, self._on_failure)
        self.max_model_len = self._client.info.max_model_len
        self.hidden_size = self._client.info.hidden_size  # an embedding's width
        # one KV block over every TP rank: what a hand-off moves per block (tracing)
        self.kv_bytes_per_block = self._client.info.kv_bytes_per_block
        self.input_processor = InputProcessor(
            self.tokenizer, self.max_model_len, self._client.info.vocab_size, args.lora_table()
        )
        self.loras = EngineLoRAs(args, self._client, self.input_processor)
        self._refresh_stats()
        self.metrics.cache_config(args.block_size, self._client.stats().num_blocks, args.enable_prefix_caching)

    @property
    def core(self) -> Optional[EngineCore]:
        """The EngineCore object, when it runs in this process (thread mode)."""
        return self._client.core if isinstance(self._client, ThreadCoreClient) else None

    @property
    def core_pid(self) -> Optional[int]:
        """The engine core's process id, when it runs in a process of its own."""
        return self._client.pid if isinstance(self._client, ProcessCoreClient) else None

    # ---- public API ----------------------------------------------------------------
    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, chat_template_kwargs: Optional[dict] = None
    ) -> str:
        return apply_chat_template(self.tokenizer, messages, add_generation_prompt, chat_template_kwargs)

    def generate(
        self,
        prompt: PromptType,
        sampling_params: Optional[SamplingParams] = None,
        request_id: Optional[str] = None,
        *,
        priority: int = 0,
        kv_transfer_params: Optional[dict] = None,
        cache_salt: Optional[str] = None,
        admitted: bool = False,
        lora_name: Optional[str] = None,
        lora_path: Optional[str] = None,
        trace: bool = False,
        tenant: Optional[str] = None,
        tenant_weight: float = 1.0,
        session: Optional[str] = None,
        predicted_output_tokens: Optional[int] = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream `prompt`'s outputs (an async generator: nothing runs, and nothing is raised,
        until it is iterated). `admitted=True` skips the waiting-queue bound: for work the
        cluster accepted already (a migrated request's continuation), which refusing would
        turn into a failed stream rather than back-pressure on a new request. `lora_name`:
        the LoRA adapter to run with; with `lora_path`, one this engine does not hold (loaded
        at run time elsewhere, or evicted here by --max-cpu-loras) is loaded first. `tenant`
        and its `tenant_weight`: whose request it is (the scheduler's policy "fair"). `trace`:
        the engine core records the request's scheduling events, which come back on its final
        output (`RequestOutput.events`, for the replica's trace spans). `session` (the chat it
        continues) and `predicted_output_tokens` (a prediction made before it was sent): for
        output-length-aware scheduling (scheduler/length_aware.py)."""
        length: dict[str, Any] = {"session": session, "predicted_output_tokens": predicted_output_tokens}
        if lora_name is None:
            return self._stream(
                prompt,
                sampling_params,
                request_id,
                priority,
                kv_transfer_params,
                cache_salt,
                admitted,
                None,
                tenant,
                tenant_weight,
                trace,
                **length,
            )
        return self._lora_stream(
            prompt,
            sampling_params,
            request_id,
            priority,
            kv_transfer_params,
            cache_salt,
            admitted,
            lora_name,
            lora_path,
            tenant,
            tenant_weight,
            trace,
            **length,
        )

    async def _lora_stream(
        self,
        prompt,
        sp,
        request_id,
        priority,
        kv_transfer_params,
        cache_salt,
        admitted,
        lora_name: str,
        lora_path: Optional[str],
        tenant: Optional[str] = None,
        tenant_weight: float = 1.0,
        trace: bool = False,
        **length: Any,
    ) -> AsyncIterator[RequestOutput]:
        self.loras.begin_use(lora_name)
        try:
            if lora_path and lora_name not in self.input_processor.loras:
                await self.add_lora(lora_name, lora_path, lazy=True)
                if lora_name not in self.input_processor.loras:  # unloaded as its load ended
                    raise LoRANotLoadable(lora_name)
            async for item in self._stream(
                prompt,
                sp,
                request_id,
                priority,
                kv_transfer_params,
                cache_salt,
                admitted,
                lora_name,
                tenant,
                tenant_weight,
                trace,
                **length,
            ):
                yield item
        finally:
            self.loras.end_use(lora_name)

    async def _stream(
        self,
        prompt,
        sp: Optional[SamplingParams],
        request_id: Optional[str],
        priority: int,
        kv_transfer_params: Optional[dict],
        cache_salt: Optional[str],
        admitted: bool,
        lora_name: Optional[str],
        tenant: Optional[str] = None,
        tenant_weight: float = 1.0,
        trace: bool = False,
        session: Optional[str] = None,
        predicted_output_tokens: Optional[int] = None,
    ) -> AsyncIterator[RequestOutput]:
        if self._dead is not None:
            raise EngineDeadError(f"the engine is dead: {self._dead}")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        sp = sp or SamplingParams()
        kv_transfer_params = self._check_kv_transfer_params(kv_transfer_params)
        if sp.structured_outputs is not None and "xgrammar" not in sys.modules:
            # seconds of CPU, once: off this loop (health). Imported here, not at the top:
            # the backend module needs torch, which this process never loads otherwise.
            await asyncio.to_thread(importlib.import_module, "xgrammar")
        text, requests = self.input_processor.process(
            prompt,
            sp,
            request_id,
            priority=priority,
            cache_salt=cache_salt,
            kv_transfer_params=kv_transfer_params,
            lora_name=lora_name,
            tenant=tenant,
            tenant_weight=tenant_weight,
            session=session,
            predicted_output_tokens=predicted_output_tokens,
        )
        if trace:
            for r in requests:
                r.events = []
        load = self._client.load()
        if not admitted and load["num_waiting"] + self._client.num_pending_adds >= self.args.max_waiting_requests:
            raise QueueFullError(f"the waiting queue is full ({self.args.max_waiting_requests} requests); retry later")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, queue)
        with self._lock:
            self.output_processor.add(request_id, text, requests)
        try:
            self._client.add(requests)  # a core process's results are read on this loop
        except ExecutorError as e:
            self._forget(request_id)
            raise EngineDeadError(f"the engine is dead: {e}") from e
        finished = False
        # --stream-interval: after the first output, deltas are held and merged until they
        # carry that many tokens or the request finishes (vLLM's semantics).
        interval = max(self.args.stream_interval, sp.stream_interval or 1)
        held: Optional[RequestOutput] = None
        sent = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                if interval > 1:
                    held = item if held is None else merge_deltas(held, item)
                    if sent and not finished and num_new_tokens(held) < interval:
                        continue
                    item, held = held, None
                sent = True
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._abort(request_id)

    def _check_kv_transfer_params(self, params: Optional[dict]) -> Optional[dict]:
        """KV transfer params come only from this keyword (never from sampling params or a
        request body); refused unless this engine has a KV connector."""
        if params is None:
            return None
        if self.args.kv_transfer_config is None:
            raise ValueError("kv_transfer_params given, but this engine has no KV connector (--kv-transfer-config)")
        return validate_kv_transfer_params(params)

    async def abort(self, request_id: str) -> None:
        self._abort(request_id)

    # ---- LoRA adapters at run time (replica/lora/manager.py) ------------------------------
    async def add_lora(
        self, name: str, path: str, timeout_s: Optional[float] = None, replace: bool = False, lazy: bool = False
    ) -> str:
        """Load a PEFT adapter on every rank as `name` (vLLM's /v1/load_lora_adapter on one
        engine) and return its key (`name@digest`): off the engine's step loop, within
        --lora-load-timeout (`timeout_s`). Loading a name already held from the same folder
        is a no-op; LoRANotLoadable (a ValueError) when the path is refused or cannot be
        read; ValueError when the adapter does not fit, the name is taken by other weights
        (unless `replace`), or the deadline passed. `lazy`: a request's load on first use,
        refused for a name unloaded here."""
        return await self.loras.add(name, path, timeout_s, replace, lazy)

    async def remove_lora(self, name: str, evict: bool = False) -> bool:
        """Unload adapter `name`: new requests for it are refused at once (a load of it under
        way is discarded, and a request built before cannot load it back); its weights go
        when the requests running with it end. `evict`: drop the weights only, as
        --max-cpu-loras does (a request naming it with its path loads it again). False when
        no such adapter is loaded."""
        return self.loras.evict(name) if evict else self.loras.remove(name)

    @property
    def lora_keys(self) -> dict[str, str]:
        """The adapters requests may name: name -> the key their KV blocks are salted with."""
        return self.loras.keys()

    def get_load(self) -> EngineLoad:
        return self._client.load().copy()  # a core process's latest, read now if no loop reads it

    def metrics_text(self) -> str:
        self._refresh_stats()  # a core process reports aborts and finishes between steps too
        return self.metrics.text()

    def check_health(self, stall_timeout_s: Optional[float] = None) -> None:
        """EngineDeadError when the engine is dead, or (with `stall_timeout_s`) wedged: it
        holds work but makes no steps, or its core process answers no ping in time."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine is dead: {self._dead}")
        if not self._client.is_alive():
            raise EngineDeadError("the engine core has stopped")
        if stall_timeout_s is not None:
            reason = self._client.stall_reason(stall_timeout_s)
            if reason is not None:
                raise EngineDeadError(f"the engine is wedged: {reason}")

    def shutdown(self) -> None:
        """Stop the engine core. It carries out its pending KV saves first (up to
        kv_save_timeout_s); saves it drops are logged (by the core process, in its own log)
        and, with the core on a thread here, counted in vllm:kv_transfer_dropped_saves."""
        dropped = self._client.shutdown()
        if dropped:
            self.metrics.kv_transfer.observe_step({"dropped_saves": dropped})

    # ---- requests out, steps in -----------------------------------------------------------
    def _abort(self, request_id: str) -> None:
        with self._lock:
            child_ids = self.output_processor.abort(request_id)
        if child_ids and self._dead is None:
            try:
                self._client.abort(child_ids)
            except ExecutorError:
                pass  # the engine is gone, and the request with it

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        with self._lock:
            self.output_processor.abort(request_id)

    def _on_step(self, result: StepResult) -> None:
        """One step's outputs: on the engine thread, or wherever a core process's results are
        read (the callers' event loop, or a `get_load`/`metrics_text` caller between loops)."""
        if result.kv_events is not None and self.kv_events is not None:
            self.kv_events.append(result.kv_events)
        op = self.output_processor
        if result.num_scheduled_tokens:
            self.metrics.iteration_tokens.observe(result.num_scheduled_tokens)
        with self._lock:
            if result.newly_scheduled:
                op.mark_scheduled(result.newly_scheduled, result.timestamp)
            outputs, stopped = op.process(result.outputs)
            if result.kv_stats:
                self.metrics.kv_transfer.observe_step(result.kv_stats)
        if stopped:
            try:
                self._client.finish(stopped)
            except ExecutorError:
                pass  # the failure callback tells everyone
        # Stats before delivery: a caller that sees its last output must also see its
        # blocks back in the pool (stop strings: in thread mode; a core process frees them
        # a moment later, when it has the finish).
        self._refresh_stats()
        for ro in outputs:
            self._deliver(ro.request_id, ro)

    def _on_failure(self, message: str, dead: bool) -> None:
        """A step failed (the core has aborted everything in flight), or the engine died."""
        if dead:
            self._dead = message
            logger.error("engine failed, failing all requests: %s", message)
            failure: Exception = EngineDeadError(message)
        else:
            failure = RuntimeError(f"engine step failed: {message}")
        with self._lock:
            in_flight = list(self.output_processor.parents)
            for request_id in in_flight:
                self.output_processor.abort(request_id)
        for request_id in in_flight:
            self._deliver(request_id, failure)
        self._refresh_stats()

    def _refresh_stats(self) -> None:
        stats = self._client.stats()  # (a core process may deliver steps here: not under the lock)
        with self._lock:  # counters advance by deltas: one updater at a time
            self.metrics.update_scheduler_stats(stats)

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        loop, queue = stream
        # Always through the loop's ready queue, in delivery order. A core process's results
        # are read on the caller's loop or by a get_load/metrics_text caller on another
        # thread; a direct put here overtook an output that thread had scheduled a moment
        # before, and a stream's text came out with two pieces swapped (CI, under overload).
        if _running_loop() is loop:
            loop.call_soon(queue.put_nowait, item)
            return
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening
            pass


def _running_loop() -> Optional[asyncio.AbstractEventLoop]:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
