"""With tensor parallelism every rank moves its own KV heads: a transfer is done only when
every rank says so (vLLM's KVOutputAggregator)."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from fleetserve.scheduler import ModelRunnerOutput


class KVOutputAggregator:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._sending: dict[str, set[int]] = {}
        self._recving: dict[str, set[int]] = {}

    def _count(self, pending: dict[str, set[int]], rank: int, ids: set[str], done: set[str]) -> None:
        for rid in ids:
            ranks = pending.setdefault(rid, set())
            ranks.add(rank)  # a rank repeating itself still counts once
            if len(ranks) == self.world_size:
                del pending[rid]
                done.add(rid)

    def aggregate(self, outputs: list[ModelRunnerOutput]) -> ModelRunnerOutput:
        """Rank 0's output, carrying only the ids every rank has reported (over any number
        of steps) and the failed blocks of any rank."""
        sending: set[str] = set()
        recving: set[str] = set()
        invalid: set[int] = set()
        for rank, out in enumerate(outputs):
            self._count(self._sending, rank, out.finished_sending, sending)
            self._count(self._recving, rank, out.finished_recving, recving)
            invalid |= out.invalid_block_ids
        first = outputs[0]
        first.finished_sending, first.finished_recving, first.invalid_block_ids = sending, recving, invalid
        first.kv_connector_stats = merge_stats([o.kv_connector_stats for o in outputs])
        # Every rank saves its own heads of each save: in flight until the slowest is done.
        first.kv_saves_in_flight = max(o.kv_saves_in_flight for o in outputs)
        return first


def merge_stats(parts: Sequence[Optional[Mapping[str, Any]]]) -> Optional[dict[str, Any]]:
    """Ranks' transfer stats (base.TransferStats, as each rank sent them) as one: every rank's
    transfers observed (bytes add up across ranks), a failed or expired load counted once (the
    most any rank saw)."""
    given = [p for p in parts if p]
    if not given:
        return None
    out: dict[str, Any] = {}
    for p in given:
        for key, value in p.items():
            if isinstance(value, list):
                out.setdefault(key, []).extend(value)
            else:
                out[key] = max(out.get(key, 0), value)
    return out


def kv_part(out: ModelRunnerOutput) -> ModelRunnerOutput:
    """What a non-driver rank sends back: only its connector's report."""
    return ModelRunnerOutput(
        [],
        [],
        finished_sending=out.finished_sending,
        finished_recving=out.finished_recving,
        invalid_block_ids=out.invalid_block_ids,
        kv_connector_stats=out.kv_connector_stats,
        kv_saves_in_flight=out.kv_saves_in_flight,
    )
