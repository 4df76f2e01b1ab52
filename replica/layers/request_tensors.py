"""A request's logit_bias and allowed_token_ids as tensors, built once when the request is
added, and what a step does with them: gather them per row (O(rows), whatever the sizes of
the lists), and find the rows whose masks together leave no token to sample."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from fleetserve.scheduler.sampling_params import SamplingParams

Device = Union[torch.device, str]


def _long(values: Sequence[int], device: Device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _float(values: Sequence[float], device: Device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


@dataclass(slots=True)
class RequestSamplingTensors:
    """A request's `logit_bias` and `allowed_token_ids` as tensors on the sampling device,
    built once when the request is added (`build`), so that a step's setup only gathers
    them per row (O(rows), whatever the sizes of the lists); ids outside the vocabulary
    are dropped here (the input processor refuses them first)."""

    bias_tokens: Optional[torch.Tensor]  # [B] long, each token id once
    bias_values: Optional[torch.Tensor]  # [B] float32
    disallowed: Optional[torch.Tensor]  # [V] bool: True where the token may not be sampled

    @classmethod
    def build(cls, params: SamplingParams, vocab_size: int, device: Device) -> Optional["RequestSamplingTensors"]:
        """None when the request sets neither."""
        bias = {t: v for t, v in (params.logit_bias or {}).items() if 0 <= t < vocab_size}
        allowed = params.allowed_token_ids
        if not bias and not allowed:
            return None
        disallowed = None
        if allowed:
            disallowed = torch.ones(vocab_size, dtype=torch.bool, device=device)
            ids = _long([t for t in allowed if 0 <= t < vocab_size], device)
            disallowed.index_fill_(0, ids, False)
        return cls(
            _long(list(bias), device) if bias else None,
            _float(list(bias.values()), device) if bias else None,
            disallowed,
        )


def gather_logit_bias(
    tensors: Sequence[Optional[RequestSamplingTensors]], device: Device
) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(rows, token ids, values) of the rows with a logit_bias: one concatenation of the
    requests' own tensors, never a walk over their entries."""
    rows: list[int] = []
    tokens: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for i, t in enumerate(tensors):
        if t is not None and t.bias_tokens is not None and t.bias_values is not None:
            rows.append(i)
            tokens.append(t.bias_tokens)
            values.append(t.bias_values)
    if not rows:
        return None
    counts = _long([x.numel() for x in tokens], device)
    return torch.repeat_interleave(_long(rows, device), counts), torch.cat(tokens), torch.cat(values)


def gather_disallowed(
    tensors: Sequence[Optional[RequestSamplingTensors]], device: Device
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(rows, [rows, V] bool) of the rows with allowed_token_ids: their masks, stacked."""
    have = [(i, t.disallowed) for i, t in enumerate(tensors) if t is not None and t.disallowed is not None]
    if not have:
        return None
    masks = [m for _, m in have]
    return _long([i for i, _ in have], device), (masks[0].unsqueeze(0) if len(masks) == 1 else torch.stack(masks))


def fail_dead_rows(logits: torch.Tensor, masks: Sequence[Optional[tuple[torch.Tensor, torch.Tensor]]]) -> list[int]:
    """Rows whose masks left no finite logit, as a sorted list; their logits become 0 (any
    token, all in the vocabulary) so that sampling the batch stays well defined, and the
    caller must not use what they draw. `masks`: the step's -inf masks, each (rows, ...);
    only their rows are looked at (a bias is finite, and penalties and min-p keep a finite
    maximum finite). O(masked rows x V), as the masks themselves."""
    parts = [m[0].to(logits.device) for m in masks if m is not None]
    if not parts:
        return []
    rows = torch.unique(torch.cat(parts))
    alive = logits.index_select(0, rows).amax(-1) > float("-inf")  # False for -inf and NaN rows
    dead = rows[~alive]
    if not dead.numel():
        return []
    logits.index_fill_(0, dead, 0.0)
    return dead.tolist()
