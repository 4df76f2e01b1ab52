"""What one EngineCore step hands its caller (`EngineCore.step`, pickled from the core
process to the replica). Its own module, free of torch, so that the replica side, which
only receives steps, unpickles them without importing the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from fleetserve.scheduler import EngineCoreOutput, KVEventBatch


@dataclass(slots=True)
class StepResult:
    outputs: list[EngineCoreOutput]
    # Requests sent in full this step (new, or resumed after preemption).
    newly_scheduled: list[str] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    timestamp: float = 0.0
    # What the prefix cache gained and lost (scheduler.kv_events), when events are on.
    kv_events: Optional[KVEventBatch] = None
    # KV transfer: what moved this step, and blocks held for transfers (kv_transfer.metrics).
    kv_stats: Optional[dict] = None
