"""Mixture-of-experts: top-k routing and the experts' SwiGLU MLPs as grouped matmuls (vLLM's FusedMoE).

    router_logits [T, E] --select_experts--> weights [T, k] (float32), expert ids [T, k]
    FusedMoE(x [T, H], weights, ids):
        the T*k (token, expert) pairs sorted by expert; per expert one gate|up
        matmul over all of its tokens, silu(gate) * up, one down matmul (grouped GEMMs);
        each row scaled by its routing weight and scatter-added (index_add_) into [T, H]

The expert matmuls are two grouped GEMMs over all experts (torch's `grouped_mm`, with the
groups' offsets on the device) where torch runs it for the rows: CPUs, and bfloat16 on
CUDA GPUs of compute capability 8.0 or newer; elsewhere one pair of matmuls per expert
that got tokens (a loop over at most E experts, never over tokens). The same torch ops
run on every device; a fused kernel (vLLM's fused_moe: routing, gather and both GEMMs
in one Triton kernel) is not written.

Routing (`select_experts`): softmax over all experts' logits (float32), the top k,
then, with `renormalize`, divided by their sum, which equals a softmax over the top k
logits (Mixtral always; Qwen3-MoE when `norm_topk_prob`).

Weights, stacked per expert as vLLM stores them: `w13_weight` [E_local, 2 I_local, H]
(gate rows, then up rows) and `w2_weight` [E_local, H, I_local]. Loading takes the
checkpoint's per-expert tensors (`weight_loader(param, tensor, (expert, shard))`,
shard 0 gate, 1 up, 2 down) and copies this rank's part.

Parallelism, in a TP group of `tp` ranks whose activations are replicated:

- tensor parallel (default): every rank holds every expert, each expert's
  intermediate dimension split in `tp` contiguous slices (like MergedColumnParallel
  for gate|up and RowParallel for down); the ranks' partial outputs are summed with
  the TP group's all-reduce.
- expert parallel (`enable_expert_parallel`): rank r holds whole experts
  [r E/tp, (r+1) E/tp) (E must be divisible by tp); every rank routes all the
  tokens (they are replicated), computes its own experts' weighted share and the
  all-reduce sums the shares. That is the all-gather + reduce pattern: tokens are
  not dispatched to the ranks holding their experts (no all-to-all), so each rank
  still reads every token, and the reduce moves T x H per layer as TP does.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from fleetserve.replica.distributed.parallel import TPGroup, get_tp_group
from fleetserve.replica.layers.linear import ReplicatedLinear, divide, env_on, set_weight_loader

logger = logging.getLogger(__name__)

GATE, UP, DOWN = 0, 1, 2


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64): the top k of
    softmax over all experts, divided by their sum when `renormalize`."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _grouped_mm_runs(x: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes these rows: on CPUs any float dtype; on CUDA
    bfloat16 on compute capability 8.0 or newer (its documented inputs)."""
    if not hasattr(F, "grouped_mm"):
        return False
    if x.device.type == "cpu":
        return True
    return (
        x.device.type == "cuda" and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    )


class FusedMoE(nn.Module):
    """The experts of one MoE layer (see the module docstring): forward(x [T, H], topk_weights
    [T, k], topk_ids [T, k]) -> [T, H], summed over the TP group."""

    # The expert matmuls as two grouped GEMMs where torch has them for the rows' device and
    # dtype (FLEETSERVE_MOE_GROUPED_MM=0: never), else one pair of matmuls per active expert.
    grouped_mm: bool = env_on("FLEETSERVE_MOE_GROUPED_MM")

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        tp_group: Optional[TPGroup] = None,
        enable_expert_parallel: bool = False,
    ):
        super().__init__()
        tp = tp_group or get_tp_group()
        self.tp = tp
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.expert_parallel = enable_expert_parallel
        if enable_expert_parallel:
            if num_experts % tp.world_size:
                raise ValueError(
                    f"--enable-expert-parallel: the number of experts ({num_experts}) is not divisible by "
                    f"the tensor-parallel size ({tp.world_size}); use a size that divides it, or tensor "
                    "parallelism within each expert (without --enable-expert-parallel)"
                )
            self.num_local_experts = num_experts // tp.world_size
            self.expert_start = tp.rank * self.num_local_experts
            self.local_intermediate = intermediate_size
        else:
            self.num_local_experts = num_experts
            self.expert_start = 0
            self.local_intermediate = divide(intermediate_size, tp.world_size, "the experts' intermediate size")
        experts, inter = self.num_local_experts, self.local_intermediate
        self.w13_weight = nn.Parameter(torch.empty(experts, 2 * inter, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(experts, hidden_size, inter), requires_grad=False)
        set_weight_loader(self.w13_weight, self.weight_loader)
        set_weight_loader(self.w2_weight, self.weight_loader)

    def extra_repr(self) -> str:
        mode = "expert parallel" if self.expert_parallel else "tensor parallel"
        return (
            f"experts={self.num_local_experts}/{self.num_experts} from {self.expert_start}, "
            f"hidden={self.hidden_size}, intermediate={self.local_intermediate}/{self.intermediate_size}, {mode}"
        )

    # ------------------------------------------------------------------ loading

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int]) -> None:
        """Copy one expert's full checkpoint matrix (gate or up [I, H], down [H, I]) into this
        rank's part of `param`; an expert another rank holds (expert parallel) is skipped."""
        expert, shard = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range: this layer has {self.num_experts} experts")
        local = expert - self.expert_start
        if not 0 <= local < self.num_local_experts:
            return  # another rank's expert
        full, hidden = self.intermediate_size, self.hidden_size
        expected = (hidden, full) if shard == DOWN else (full, hidden)
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"shape mismatch loading expert {expert} ({('gate', 'up', 'down')[shard]}): "
                f"expected {expected}, got {tuple(loaded.shape)}"
            )
        n = self.local_intermediate
        start = 0 if self.expert_parallel else self.tp.rank * n
        if shard == DOWN:
            param.data[local].copy_(loaded.narrow(1, start, n))
        else:
            param.data[local, shard * n : (shard + 1) * n].copy_(loaded.narrow(0, start, n))

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        out = self.local_experts(x, topk_weights, topk_ids)
        return self.tp.all_reduce(out)

    def local_experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output [T, H] (before the all-reduce), in x's dtype."""
        tokens, weights, counts = self.dispatch(topk_weights, topk_ids)
        ys = self.run_experts(x[tokens], counts)
        return self.combine(ys, tokens, weights, x.shape[0]).to(x.dtype)

    def dispatch(
        self, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The (token, expert) pairs of this rank's experts, grouped by expert: the token of each
        pair [P], its routing weight [P] and how many pairs each local expert has [E_local]."""
        T, k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1)
        pair = torch.arange(T * k, device=topk_ids.device)  # pair p is token p // k's slot p % k
        if self.expert_parallel and self.tp.world_size > 1:
            local = (flat_ids >= self.expert_start) & (flat_ids < self.expert_start + self.num_local_experts)
            pair = pair[local]
        ids, order = torch.sort(flat_ids[pair] - self.expert_start, stable=True)
        pair = pair[order]
        counts = torch.bincount(ids, minlength=self.num_local_experts)
        return pair // k, topk_weights.reshape(-1)[pair], counts

    def run_experts(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """xs [P, H] grouped by expert (`counts` rows each) -> down(silu(gate) * up) [P, H]."""
        aligned = all(d * xs.element_size() % 16 == 0 for d in (self.hidden_size, self.local_intermediate))
        if self.grouped_mm and aligned and _grouped_mm_runs(xs):  # its rows' strides: multiples of 16 bytes
            try:
                return self._run_grouped(xs, counts)
            except RuntimeError as e:
                if xs.device.type == "cpu":
                    raise
                # A GPU build whose grouped GEMM refuses these inputs: the per-expert matmuls from now on.
                logger.warning(
                    "MoE: grouped_mm refused %s on %s (%s); using one matmul pair per expert", xs.dtype, xs.device, e
                )
                FusedMoE.grouped_mm = False
        return self._run_each(xs, counts.tolist())

    def _run_grouped(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Two grouped GEMMs over every expert at once (torch's grouped_mm, offsets on the device:
        no host sync and no loop)."""
        offs = torch.cumsum(counts, 0).to(torch.int32)
        n = self.local_intermediate
        h = F.grouped_mm(xs, self.w13_weight.transpose(1, 2), offs=offs)  # [P, 2I]
        return F.grouped_mm(F.silu(h[:, :n]) * h[:, n:], self.w2_weight.transpose(1, 2), offs=offs)

    def _run_each(self, xs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """One gate|up and one down matmul per expert with rows (where grouped_mm does not run)."""
        ys = torch.empty_like(xs)
        n = self.local_intermediate
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            end = start + count
            h = F.linear(xs[start:end], self.w13_weight[e])  # [count, 2I]
            ys[start:end] = F.linear(F.silu(h[:, :n]) * h[:, n:], self.w2_weight[e])
            start = end
        return ys

    def combine(self, ys: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Each expert output row times its routing weight, summed per token (float32) -> [T, H]."""
        out = torch.zeros(num_tokens, self.hidden_size, dtype=torch.float32, device=ys.device)
        out.index_add_(0, tokens, ys.float() * weights.float().unsqueeze(1))
        return out


class SparseMoeBlock(nn.Module):
    """Router + experts, as a decoder layer's MLP: `gate` (a replicated [E, H] linear: every rank
    routes every token the same way) and `experts` (FusedMoE)."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        tp_group: Optional[TPGroup] = None,
        enable_expert_parallel: bool = False,
        hidden_act: str = "silu",
    ):
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r} for the experts (supported: silu)")
        if not 0 < top_k <= num_experts:
            raise ValueError(
                f"num_experts_per_tok ({top_k}) must be between 1 and the number of experts ({num_experts})"
            )
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False, tp_group=tp_group)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, tp_group, enable_expert_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        return self.experts(x, weights, ids)


__all__ = ["FusedMoE", "SparseMoeBlock", "select_experts"]
