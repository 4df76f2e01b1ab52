"""The connector contract: one class, two roles, and the per-step messages between them.

    scheduler half (EngineCore)                      worker half (where the KV lives)
    get_num_new_matched_tokens / update_state_after_alloc
    build_connector_meta(so) -> ConnectorMetadata ---> bind_connector_metadata(meta)
                                                       start_load_kv()   cancels, saves, new loads
                                                       [forward pass]
                                                       wait_for_save()
    update_connector_output(runner_output) <---------  get_finished(finished_ids)
                                                       get_block_ids_with_load_errors()
    request_finished(request, block_ids)               clear_connector_metadata()

Layer-wise hooks, as vLLM v1: when a connector asks for them
(`uses_layer_hooks`), the model calls `wait_for_layer_load(i)` before decoder
layer i reads its KV and `save_kv_layer(i, kv_cache, attn_metadata)` right
after that layer wrote it, and `run_connector_step` calls `wait_for_save()` when
the forward ends (so no block is reused mid-save). Without a connector, or with
one that does not ask, the model runs its plain loop: no per-layer call at all.
Our transfer connectors use `save_kv_layer` for a hand-off's layer-wise save
(`kv_connector_extra_config.layerwise_save`): a P/D producer's blocks are copied
out layer by layer during the very forward that computes the end of the prompt
(on a GPU, each copy overlaps the next layers' compute), exported when the
forward ends, and freed at once (no `delay_free`). `wait_for_layer_load` has
nothing to wait for in them: every load lands in the blocks of a request parked
in WAITING_FOR_REMOTE_KVS, never in the running batch.

Waking the engine: an engine core that idles on transfers alone (a load in
flight, an export still being written) waits a little between its empty steps.
It gives the worker half a callback (`set_wakeup`, when the worker lives in its
process: TP=1); the half calls `self.wakeup()` when a transfer ends on a thread
of its own, so the engine's next step comes at once. A `module:Class`
connector does the same; one that never calls it is just polled.

Saves in flight: `num_saves_in_flight()` (reported each step in
`ModelRunnerOutput.kv_saves_in_flight`) counts the saves handed to the worker
half whose export has not finished. The engine keeps stepping while it is
non-zero, so an engine that looks idle has nothing of its connector's pending.

A load is fetched in the background into a staging buffer and verified before
any of it is copied into its blocks (on its transfer thread for a CPU cache, in
`get_finished` for a GPU cache), under the load's lock. A load that is cancelled
or past its deadline is given up under that lock, so once the worker has seen a
cancel no write can land in those blocks any more (kv_transfer.loads).
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, TypedDict, Union

from fleetserve.kv_transfer.config import KVTransferConfig
from fleetserve.scheduler import ModelRunnerOutput, Request, SchedulerOutput
from fleetserve.scheduler.connector import KVConnectorScheduler

if TYPE_CHECKING:  # annotations only: the scheduler half (and the simulator) run without torch
    import torch


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass(frozen=True, slots=True)
class ConnectorContext:
    """What both halves know about the engine they serve."""

    engine_id: str
    fingerprint: str  # kv_transfer.keys.kv_fingerprint
    block_size: int
    num_layers: int
    num_kv_heads: int  # the whole model's
    head_dim: int
    tp_size: int = 1
    tp_rank: int = 0


@dataclass(slots=True)
class LoadSpec:
    """Fill `block_ids` with the blocks named `keys` (the consumer's own chain keys)."""

    req_id: str
    transfer_id: Optional[str]  # None: a lookup hit (shared storage), not a hand-off
    block_ids: list[int]
    keys: list[str]
    deadline: float  # time.time(): ranks may live in other processes
    source: dict[str, Any] = field(default_factory=dict)  # the producer's remote_* params
    # The prompt's block index of keys[0]: the blocks before it are cached here already. A
    # hand-off's batch holds the prompt from block 0, so its blocks are taken from here on.
    first_block: int = 0


@dataclass(slots=True)
class SaveSpec:
    """Copy `block_ids` (named `keys`) out of the cache and export them."""

    req_id: str
    transfer_id: Optional[str]
    block_ids: list[int]
    keys: list[str]
    lease_s: float
    # Copied out layer by layer during this step's forward (save_kv_layer), not after it.
    layerwise: bool = False


@dataclass(slots=True)
class ConnectorMetadata:
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # Requests finished while their load was in flight: drop the load, report
    # the id in finished_sending once no write can land in its blocks.
    cancels: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves or self.cancels)


class TransferStats(TypedDict, total=False):
    """What a half moved since it was last asked (`take_stats`; kv_transfer.metrics reads it).
    Lists: one entry per transfer; counts add up over steps. TP ranks' stats are merged
    (kv_transfer.aggregate.merge_stats); the engine adds `blocks_held`."""

    bytes_sent: list[int]
    seconds_sent: list[float]
    bytes_recv: list[int]
    seconds_recv: list[float]
    failed_loads: int
    expired_loads: int
    dropped_saves: int
    staging_refused: int  # transfers refused by the staging pool's cap (kv_transfer.staging)
    blocks_held: int


class KVConnectorWorker(abc.ABC):
    """The worker half (vLLM v1's KVConnectorBase_V1, worker methods)."""

    # Whether the model must call wait_for_layer_load / save_kv_layer around each layer.
    uses_layer_hooks: bool = False
    # The engine's wake-up (set_wakeup); None: the engine polls.
    _wakeup: Optional[Callable[[], None]] = None
    # This step's metadata, between bind_connector_metadata and clear_connector_metadata.
    _metadata: Optional[ConnectorMetadata] = None

    def set_wakeup(self, callback: Optional[Callable[[], None]]) -> None:
        """The engine core's wake-up: call `self.wakeup()` when a transfer ends on a thread
        of this half (a load landed, a copy-out or export finished), so an engine idling on
        transfers steps at once instead of at its next poll. Any thread may call it."""
        self._wakeup = callback

    def wakeup(self) -> None:
        callback = self._wakeup
        if callback is not None:
            callback()

    def set_thread_initializer(self, initializer: Optional[Callable[[], None]]) -> None:
        """The engine's set-up for threads this half starts to copy blocks (the replica binds
        their torch ops to one core), called first on each; set before register_kv_caches.
        A half that starts no such thread ignores it."""
        return None

    def num_saves_in_flight(self) -> int:
        """Saves handed to this half (by bind_connector_metadata) that are not finished yet:
        being copied out or exported. The engine keeps stepping while any is."""
        return 0

    @abc.abstractmethod
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None: ...

    def bind_connector_metadata(self, metadata: Optional[ConnectorMetadata]) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    @abc.abstractmethod
    def start_load_kv(self) -> None: ...

    def wait_for_layer_load(self, layer: int) -> None:
        """Block until layer `layer`'s KV for this step's batch is in the cache."""
        return None

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, attn_metadata: object) -> None:
        """Layer `layer` just wrote this step's KV into `kv_layer` (its cache, [2, heads,
        num_blocks, block_size, head_dim]); `attn_metadata` is the model's, unused by ours."""
        return None

    def wait_for_save(self) -> None:
        return None

    @abc.abstractmethod
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(ids whose sending finished, ids whose receiving finished) since the last call."""

    @abc.abstractmethod
    def get_block_ids_with_load_errors(self) -> set[int]: ...

    def take_stats(self) -> Optional[TransferStats]:
        """What moved since the last call (kv_transfer.metrics), or None when nothing did."""
        return None

    def shutdown(self) -> None:
        return None


class KVConnectorBase(KVConnectorScheduler, KVConnectorWorker):
    """One connector class, built once per role; each role's calls go to its half.

    Subclasses build the half of a role in `build_half` (kv_transfer.transfer.TransferConnector:
    the shared halves over the subclass's transport)."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, ctx: ConnectorContext) -> None:
        self.config = config
        self.role = role
        self.ctx = ctx
        self.load_failure_policy_name = config.kv_load_failure_policy
        self._half = self.build_half(role)
        # A worker half's setting, fixed when it is built: whether the model calls the layer hooks.
        self.uses_layer_hooks = isinstance(self._half, KVConnectorWorker) and self._half.uses_layer_hooks

    @abc.abstractmethod
    def build_half(self, role: KVConnectorRole) -> Union[KVConnectorScheduler, KVConnectorWorker]:
        """The half that serves `role`, built from this connector's config and context."""

    @property
    def half(self) -> Union[KVConnectorScheduler, KVConnectorWorker]:
        return self._half

    @property
    def _scheduler(self) -> KVConnectorScheduler:
        half = self._half
        if not isinstance(half, KVConnectorScheduler):
            raise TypeError(f"{type(self).__name__} was built as its {self.role.value} half")
        return half

    @property
    def _worker(self) -> KVConnectorWorker:
        half = self._half
        if not isinstance(half, KVConnectorWorker):
            raise TypeError(f"{type(self).__name__} was built as its {self.role.value} half")
        return half

    # scheduler role
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Optional[ConnectorMetadata]:
        meta: Optional[ConnectorMetadata] = self._scheduler.build_connector_meta(scheduler_output)
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        return self._scheduler.request_finished(request, block_ids)

    def update_connector_output(self, runner_output: ModelRunnerOutput) -> None:
        self._scheduler.update_connector_output(runner_output)

    def load_failure_policy(self, request: Request) -> str:
        return self._scheduler.load_failure_policy(request)

    def has_pending_work(self) -> bool:
        half = self._half
        return isinstance(half, KVConnectorScheduler) and half.has_pending_work()

    def num_pending_saves(self) -> int:
        half = self._half
        return half.num_pending_saves() if isinstance(half, KVConnectorScheduler) else 0

    # worker role
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, metadata: Optional[ConnectorMetadata]) -> None:
        self._worker.bind_connector_metadata(metadata)

    def clear_connector_metadata(self) -> None:
        self._worker.clear_connector_metadata()

    def start_load_kv(self) -> None:
        self._worker.start_load_kv()

    def wait_for_layer_load(self, layer: int) -> None:
        self._worker.wait_for_layer_load(layer)

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, attn_metadata: object) -> None:
        self._worker.save_kv_layer(layer, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def set_wakeup(self, callback: Optional[Callable[[], None]]) -> None:
        half = self._half
        if isinstance(half, KVConnectorWorker):
            half.set_wakeup(callback)

    def wakeup(self) -> None:
        half = self._half
        if isinstance(half, KVConnectorWorker):
            half.wakeup()

    def set_thread_initializer(self, initializer: Optional[Callable[[], None]]) -> None:
        half = self._half
        if isinstance(half, KVConnectorWorker):
            half.set_thread_initializer(initializer)

    def num_saves_in_flight(self) -> int:
        half = self._half
        return half.num_saves_in_flight() if isinstance(half, KVConnectorWorker) else 0

    # both roles
    def take_stats(self) -> Optional[TransferStats]:
        """The half's stats (a scheduler half without `take_stats` has none)."""
        half = self._half
        if isinstance(half, KVConnectorWorker):
            return half.take_stats()
        take: Optional[Callable[[], Optional[TransferStats]]] = getattr(half, "take_stats", None)
        return take() if take is not None else None

    def shutdown(self) -> None:
        half = self._half
        if isinstance(half, KVConnectorWorker):
            half.shutdown()
            return
        stop: Optional[Callable[[], None]] = getattr(half, "shutdown", None)  # (not in the scheduler's contract)
        if stop is not None:
            stop()


def run_connector_step(
    connector: KVConnectorWorker,
    scheduler_output: SchedulerOutput,
    execute: Callable[[SchedulerOutput], ModelRunnerOutput],
) -> ModelRunnerOutput:
    """One worker step with the connector around it (also when no token is scheduled)."""
    connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
    try:
        connector.start_load_kv()
        out = execute(scheduler_output)
        connector.wait_for_save()
        # Counted before get_finished: a save that ends after the count is reported (its
        # stats, a failure) by this step or, counted as in flight, by one more step.
        saves_in_flight = connector.num_saves_in_flight()
        sending, recving = connector.get_finished(scheduler_output.finished_req_ids)
        invalid = connector.get_block_ids_with_load_errors()
        stats = connector.take_stats()
    finally:
        connector.clear_connector_metadata()
    if stats:
        out.kv_connector_stats = dict(stats)
    out.kv_saves_in_flight = saves_in_flight
    if sending or recving or invalid:  # (out is a fresh object every step)
        out.finished_sending |= sending
        out.finished_recving |= recving
        out.invalid_block_ids |= invalid
    return out
