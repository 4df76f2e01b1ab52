"""Every adaptable linear's adapters in fixed buffers: LoRA inside CUDA graphs.

A captured graph replays fixed kernels on fixed addresses, so a decode step's adapters
cannot be a Python loop over the adapters the step holds (layers.add_lora's grouped path,
which the eager steps take). As vLLM's punica kernels do, every adaptable linear (q/k/v, o,
gate/up and down of every layer) holds slots for `capacity` adapters in two buffers
allocated once:

    A [capacity * Rc, in]   B [out, capacity * Rc]   Rc = --max-lora-rank x the linear's targets

(slot k: A's rows and B's columns k*Rc .. k*Rc + R, R the adapter's ranks in that linear, zeros
past them and in slots nobody holds). A step gives each row a one-hot over the slots (all
zeros for the base model), and every linear adds

    y += ((x A^T).view(n, capacity, Rc) * onehot[:, :, None]).view(n, -1) B^T

The same kernels whatever the mix of adapters: only the one-hot changes between replays.
The price is the shrink for every slot, capacity * Rc columns (a few hundred), and three
small kernels per linear (eager steps with several adapters take this path too on a GPU:
two kernels per adapter and linear otherwise). Loading an adapter writes its slot in place, which graphs
replayed afterwards read; past the capacity the buffers double (new addresses: the runner
captures its graphs again).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from fleetserve.replica.lora.adapter import decoder_linear, num_decoder_layers

logger = logging.getLogger(__name__)

# The adaptable linears of a decoder layer and how many targets each merges (adapter._MODULES).
_LINEARS = (("self_attn.qkv_proj", 3), ("self_attn.o_proj", 1), ("mlp.gate_up_proj", 2), ("mlp.down_proj", 1))


@dataclass
class StackedLoRA:
    """One linear's slots: A [capacity * rc, in], B [out, capacity * rc] (B scaled, as LoRASlot's)."""

    a: torch.Tensor
    b: torch.Tensor
    rc: int  # columns per slot


class LoRAStacks:
    """The stacked buffers of every adaptable linear of `model`, and which adapter holds which slot."""

    def __init__(
        self, model: nn.Module, capacity: int, max_rank: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self.linears = [
            (decoder_linear(model, i, attr), n) for i in range(num_decoder_layers(model)) for attr, n in _LINEARS
        ]
        self.slot_of: dict[int, int] = {}  # lora_id -> slot
        self.capacity = 0
        self._allocate(max(1, capacity))

    def _allocate(self, capacity: int) -> None:
        self.capacity = capacity
        self.stacks: list[StackedLoRA] = []  # the linears' `lora_stack`, in `linears` order
        for module, n in self.linears:
            rc = self.max_rank * n
            out, n_in = module.weight.shape
            module.lora_stack = stack = StackedLoRA(
                torch.zeros(capacity * rc, n_in, dtype=self.dtype, device=self.device),
                torch.zeros(out, capacity * rc, dtype=self.dtype, device=self.device),
                rc,
            )
            self.stacks.append(stack)
        for lora_id, slot in self.slot_of.items():
            self._write(lora_id, slot)

    def put(self, lora_id: int) -> bool:
        """Write adapter `lora_id` (attached: its LoRASlots are in the linears' `lora`) into a
        slot. True when the buffers had to grow: graphs captured before read the old ones."""
        slot = self.slot_of.get(lora_id)
        if slot is None:
            free = sorted(set(range(self.capacity)) - set(self.slot_of.values()))
            if not free:
                self.slot_of[lora_id] = self.capacity
                logger.info("LoRA slots for CUDA graphs: %d -> %d", self.capacity, 2 * self.capacity)
                self._allocate(2 * self.capacity)  # writes every adapter, this one too
                return True
            slot = self.slot_of[lora_id] = free[0]
        self._write(lora_id, slot)
        return False

    def drop(self, lora_id: int) -> None:
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            for st in self.stacks:
                st.a[slot * st.rc : (slot + 1) * st.rc].zero_()
                st.b[:, slot * st.rc : (slot + 1) * st.rc].zero_()

    def _write(self, lora_id: int, slot: int) -> None:
        for (module, _), st in zip(self.linears, self.stacks, strict=True):
            c0 = slot * st.rc
            st.a[c0 : c0 + st.rc].zero_()
            st.b[:, c0 : c0 + st.rc].zero_()
            part = (module.lora or {}).get(lora_id)
            if part is None:
                continue  # the adapter does not touch this linear
            r = part.a.shape[0]
            if r > st.rc:
                raise ValueError(
                    f"LoRA adapter id {lora_id}: {r} ranks in one linear, above the {st.rc} "
                    f"its slot holds (--max-lora-rank {self.max_rank})"
                )
            st.a[c0 : c0 + r].copy_(part.a)
            st.b[:, c0 : c0 + r].copy_(part.b)

    def onehot(self, lora_ids: list[int]) -> torch.Tensor:
        """[len(lora_ids), capacity] on the CPU: each row's slot (none for id 0, the base model)."""
        out = torch.zeros(len(lora_ids), self.capacity, dtype=self.dtype)
        for i, lid in enumerate(lora_ids):
            if lid:
                out[i, self.slot_of[lid]] = 1
        return out

    def holds(self, lora_ids: list[int]) -> bool:
        return all(not lid or lid in self.slot_of for lid in lora_ids)

    def release(self) -> None:
        """Take the buffers off the linears (no more graphs with adapters)."""
        for module, _ in self.linears:
            module.lora_stack = None
        self.stacks = []
        self.slot_of.clear()


__all__ = ["LoRAStacks", "StackedLoRA"]
