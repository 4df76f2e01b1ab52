"""Which rows of a step run with which adapter, and the delta an adapted linear adds.

The model runner sets the step's `LoRABatch` around the forward (`active(batch)`); every
linear with adapter slots (`module.lora`, see adapter.attach) then adds, per adapter in the
batch, y[rows] += (x[rows] A^T) B^T for each of its targets. Rows of one request are
contiguous, and the model runner orders a step's requests by adapter, so each adapter's rows
are one slice (no gather); rows given in another order gather and scatter by index. Rows
of the base model are untouched: a batch that mixes adapters and the base model gives each
request what it would get alone.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Union

import torch

Rows = Union[slice, torch.Tensor]


class LoRABatch:
    """(lora_id, rows) for each adapter in the step; rows index the step's flattened tokens."""

    __slots__ = ("groups", "onehot")

    def __init__(self, groups: list[tuple[int, Rows]], onehot: Optional[torch.Tensor] = None) -> None:
        self.groups = groups
        # Instead of groups: each row's one-hot over the stacked slots ([rows, capacity]), for
        # steps whose kernels must not depend on the adapters they hold (CUDA graphs, stack.py).
        self.onehot = onehot

    @classmethod
    def stacked(cls, onehot: torch.Tensor) -> "LoRABatch":
        return cls([], onehot)

    @classmethod
    def build(cls, lora_ids: list[int], query_lens: list[int], device: torch.device) -> Optional["LoRABatch"]:
        """From each request's adapter id (0: none) and its number of rows in the step."""
        ranges: dict[int, list[tuple[int, int]]] = {}
        offset = 0
        for lid, n in zip(lora_ids, query_lens, strict=True):
            if lid and n:
                spans = ranges.setdefault(lid, [])
                if spans and spans[-1][1] == offset:
                    spans[-1] = (spans[-1][0], offset + n)
                else:
                    spans.append((offset, offset + n))
            offset += n
        if not ranges:
            return None
        groups: list[tuple[int, Rows]] = []
        for lid, spans in ranges.items():
            if len(spans) == 1:
                groups.append((lid, slice(*spans[0])))
            else:
                idx = torch.cat([torch.arange(a, b) for a, b in spans]).to(device)
                groups.append((lid, idx))
        return cls(groups)


_current: Optional[LoRABatch] = None


def current() -> Optional[LoRABatch]:
    """The step's adapters while a forward runs with some, else None."""
    return _current


@contextlib.contextmanager
def active(batch: Optional[LoRABatch]) -> Iterator[None]:
    global _current
    previous, _current = _current, batch
    try:
        yield
    finally:
        _current = previous


def add_lora(slots: Optional[dict], x: torch.Tensor, y: torch.Tensor, stack=None) -> torch.Tensor:
    """y (the base linear's output for x) plus each adapter's delta on its rows, in place.
    `stack`: the linear's stack.StackedLoRA, which a stacked batch (one-hot rows) reads."""
    batch = _current
    if batch is None:
        return y
    if batch.onehot is not None:
        if stack is None:
            return y
        n, k = x.shape[0], batch.onehot.shape[1]
        h = (x @ stack.a.t()).view(n, k, stack.rc) * batch.onehot[:, :, None]
        return y.addmm_(h.view(n, k * stack.rc), stack.b.t())
    for lid, rows in batch.groups:
        slot = slots.get(lid) if slots else None
        if slot is None:
            continue
        if isinstance(rows, slice):
            y[rows].addmm_(x[rows] @ slot.a.t(), slot.b.t())  # in place on the rows' view
        else:
            y.index_add_(0, rows, (x.index_select(0, rows) @ slot.a.t()) @ slot.b.t())
    return y


def touches(slots: Optional[dict], stack=None) -> bool:
    """Whether a linear with these slots (or this stack) adds anything in the current step."""
    batch = _current
    if batch is None:
        return False
    if batch.onehot is not None:
        return stack is not None
    if not slots:
        return False
    return any(lid in slots for lid, _ in batch.groups)


__all__ = ["LoRABatch", "active", "add_lora", "current", "touches"]
