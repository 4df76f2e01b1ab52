"""The scheduler half of the KV connector contract (vLLM v1's KVConnectorBase_V1).

A connector lets a request start from KV computed elsewhere (another replica,
a storage tier) and lets a finished request's KV be shipped elsewhere. The
same class is instantiated twice, once per role; `kv_transfer/` implements
both halves. This module holds only the scheduler half, so that the scheduler
stays free of torch.

Scheduler role, in call order for one request:

1. ``get_num_new_matched_tokens(request, num_computed_tokens) -> (n, load_async)``
   when a waiting request is first considered: how many tokens *beyond* the
   local prefix-cache hits the connector can supply. ``load_async=True`` means
   the load happens in the background: the request's blocks are allocated, it
   moves to ``WAITING_FOR_REMOTE_KVS`` (using no token budget, blocking nobody)
   and returns to ``WAITING`` once a worker reports it in
   ``ModelRunnerOutput.finished_recving``. ``n=None`` means "ask me again in a
   later step" (the connector does not know yet).
2. ``update_state_after_alloc(request, block_ids, num_external_tokens)`` right
   after its blocks were allocated: the connector records where to load.
3. ``build_connector_meta(scheduler_output)`` once per step: the opaque
   metadata the worker half needs (what to load / save this step).
4. ``request_finished(request, block_ids) -> (delay_free, kv_transfer_params)``
   when it finishes: ``delay_free=True`` keeps its blocks until a worker reports
   the id in ``finished_sending``; the params go back to the client (P/D).

5. ``update_connector_output(runner_output)`` at the start of every
   ``update_from_output``: the connector sees what the workers reported (and
   may add ids it gave up on: a load past its deadline whose notice never came
   goes into ``finished_recving`` with its blocks in ``invalid_block_ids``).

Work a connector queues for "the next step" (a save queued by
``request_finished``, a cancel, a load) reaches its worker only through the
next ``build_connector_meta``. ``has_pending_work()`` says there is some: the
scheduler's ``has_requests()`` includes it, so an engine never goes idle while
it is True and a finished request's save is carried out at once, with or
without more requests. ``num_pending_saves()`` counts the saves among it (what
an engine shutting down reports as dropped if it cannot hand them over).

A failed load is reported as ``ModelRunnerOutput.invalid_block_ids``: the
scheduler rolls the affected requests back to the first bad block and
recomputes from there (``load_failure_policy(request) == "recompute"``), or
finishes them with ``finish_reason == "error"`` (``"fail"``). Slower or
refused, never lost, never wrong.

Worker role (in ``kv_transfer/``): ``register_kv_caches``, ``start_load_kv``,
``wait_for_layer_load``, ``save_kv_layer``, ``wait_for_save``, ``get_finished``.
"""

from __future__ import annotations

import abc
from typing import Any, Optional

from fleetserve.scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from fleetserve.scheduler.request import Request


class KVConnectorScheduler(abc.ABC):
    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[Optional[int], bool]: ...

    @abc.abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None: ...

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any: ...

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        return False, None

    def update_connector_output(self, runner_output: ModelRunnerOutput) -> None:
        return None

    def has_pending_work(self) -> bool:
        """Whether the next build_connector_meta would hand the worker anything (saves,
        loads, cancels) or the connector otherwise needs steps: the engine keeps stepping
        (steps with no tokens) while True, so queued work is never stranded by an idle
        engine. A connector that queues work outside request_finished must say so here."""
        return False

    def num_pending_saves(self) -> int:
        """Saves queued for the next step, not handed to a worker yet."""
        return 0

    def load_failure_policy(self, request: Request) -> str:
        """ "recompute" (from the first bad block) or "fail" (finish with an error)."""
        return "recompute"
