"""What a cost model sees of one engine step, and what it answers.

The simulator turns a real `SchedulerOutput` into a `StepShape` (token counts only) and
asks a `StepCostModel` how long the step takes on the profiled hardware. The profile
module implements the model (fitted or analytic); the simulator only needs this
protocol, so the two are built and tested apart. `StepShape` and `step_shape` live in
`scheduler/step_cost.py` (with the formulas), where the router's SLO admission reads them too.
"""

from __future__ import annotations

from typing import Protocol

from fleetserve.scheduler.step_cost import StepShape, step_shape


class StepCostModel(Protocol):
    """Seconds for one step on the profiled hardware, and for moving KV between replicas."""

    def step_seconds(self, shape: StepShape) -> float: ...

    def kv_transfer_seconds(self, nbytes: int, connector: str) -> float: ...

    def kv_bytes_per_token(self) -> int: ...


__all__ = ["StepCostModel", "StepShape", "step_shape"]
