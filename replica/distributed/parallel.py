"""The tensor-parallel group: who am I among the ranks that share one replica's model.

A `TPGroup` is what the layers talk to: `rank`, `world_size`, `all_reduce`,
`all_gather`. The default group is a world of one whose collectives return
their input, so TP=1 runs the same layer code with no torch.distributed at all.

For TP>1 every rank calls `init_tp_group(world_size, rank, init_method)` once
before building the model (the Ray executor does this in each actor, rank 0
choosing `init_method="tcp://host:port"`); the layers pick the group up with
`get_tp_group()` when they are built. Backend: NCCL when CUDA is available,
gloo otherwise.

gloo has no bfloat16/float16 reductions on every build, so half-precision
tensors are reduced in float32 on gloo (on CPU, TP is for correctness and
scale-out tests, not speed: see MEASURED.md).
"""

from __future__ import annotations

import datetime
import pickle
from typing import Any, Optional

import torch
import torch.distributed as dist

_HALF = (torch.bfloat16, torch.float16)


class TPGroup:
    """A tensor-parallel group; `TPGroup()` is the world of one."""

    def __init__(self, rank: int = 0, world_size: int = 1, group: Optional[Any] = None, backend: Optional[str] = None):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"invalid tensor-parallel rank {rank} for world size {world_size}")
        if world_size > 1 and group is None:
            raise ValueError("a tensor-parallel group of more than one rank needs a torch.distributed group")
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.backend = backend

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    def __repr__(self) -> str:
        return f"TPGroup(rank={self.rank}, world_size={self.world_size}, backend={self.backend})"

    def _needs_upcast(self, t: torch.Tensor) -> bool:
        return self.backend == "gloo" and t.dtype in _HALF

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks (in place when possible); returns the result."""
        if self.world_size == 1:
            return t
        if self._needs_upcast(t):
            buf = t.float()
            dist.all_reduce(buf, group=self.group)
            return t.copy_(buf)
        if not t.is_contiguous():
            t = t.contiguous()
        dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `t` along `dim`, in rank order."""
        if self.world_size == 1:
            return t
        src = t.float() if self._needs_upcast(t) else t.contiguous()
        parts = [torch.empty_like(src) for _ in range(self.world_size)]
        dist.all_gather(parts, src, group=self.group)
        return torch.cat(parts, dim=dim).to(t.dtype)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite `t` on every rank with rank `src`'s (in place)."""
        if self.world_size == 1:
            return t
        if self._needs_upcast(t):
            buf = t.float()
            dist.broadcast(buf, src=src, group=self.group)
            return t.copy_(buf)
        dist.broadcast(t, src=src, group=self.group)
        return t

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """Rank `src`'s picklable object, on every rank (for the step's input).

        One broadcast of the length, one of the pickled bytes: cheaper than
        `broadcast_object_list`'s per-object bookkeeping.
        """
        if self.world_size == 1:
            return obj
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        if self.rank == src:
            payload = torch.frombuffer(
                bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8
            )
            size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
            dist.broadcast(size, src=src, group=self.group)
            dist.broadcast(payload.to(device), src=src, group=self.group)
            return obj
        size = torch.empty(1, dtype=torch.int64, device=device)
        dist.broadcast(size, src=src, group=self.group)
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        dist.broadcast(payload, src=src, group=self.group)
        return pickle.loads(payload.cpu().numpy().tobytes())

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)


_TP_GROUP = TPGroup()


def get_tp_group() -> TPGroup:
    """The group layers shard over: the world of one unless `init_tp_group` ran."""
    return _TP_GROUP


def init_tp_group(
    world_size: int, rank: int, init_method: str, backend: Optional[str] = None, timeout_s: float = 300.0
) -> TPGroup:
    """Join (creating if needed) the default process group and make it this process's TP group."""
    global _TP_GROUP
    if world_size == 1:
        _TP_GROUP = TPGroup()
        return _TP_GROUP
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            init_method=init_method,
            world_size=world_size,
            rank=rank,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    elif dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise RuntimeError(
            f"torch.distributed is already initialized as rank {dist.get_rank()} of {dist.get_world_size()}, "
            f"not rank {rank} of {world_size}"
        )
    _TP_GROUP = TPGroup(rank, world_size, group=dist.group.WORLD, backend=backend)
    return _TP_GROUP


def destroy_tp_group() -> None:
    """Leave the process group (if any) and fall back to the world of one."""
    global _TP_GROUP
    if _TP_GROUP.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _TP_GROUP = TPGroup()
