"""Tensor-parallel layers (nano-vllm / vLLM style) and the small ops around them.

Sharding, for a TP group of `tp` ranks:

    VocabParallelEmbedding  vocab rows split in `tp` contiguous ranges; out-of-range ids -> 0, all-reduce
    ParallelLMHead          same rows; each rank computes its logits slice, all-gather along vocab
    ColumnParallelLinear    output features split: y_local = x @ W_local^T      (no communication)
    MergedColumnParallel    [gate; up]: each part split separately, stacked per rank
    QKVParallelLinear       [q; k; v] heads split per rank; kv heads replicated when tp > kv heads
    RowParallelLinear       input features split: y = all_reduce(x_local @ W_local^T) (+ bias once)

Every parameter carries `weight_loader(param, loaded_weight[, shard_id])` which
takes the full checkpoint tensor and copies in this rank's narrow slice, so the
model's `load_weights` is a name -> (param, shard) table. Parameters are made
with `torch.empty` (no random init: a 1B-parameter model would spend seconds
initializing what loading overwrites). With a world of one the layers are plain
`F.embedding` / `F.linear`.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from fleetserve.replica.distributed.parallel import TPGroup, get_tp_group
from fleetserve.replica.kernels import isa as kernels_isa
from fleetserve.replica.kernels import ops_for
from fleetserve.replica.lora.layers import add_lora
from fleetserve.replica.lora.layers import touches as lora_touches


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator


def _check_shape(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"shape mismatch loading {name}: expected {tuple(param.shape)}, got {tuple(loaded.shape)}")


def _check_full(loaded: torch.Tensor, param: torch.Tensor, dim: int, full_size: int, name: str) -> None:
    """The checkpoint tensor must be the unsharded one: `param`'s shape with `full_size` along `dim`."""
    expected = list(param.shape)
    expected[dim] = full_size
    if list(loaded.shape) != expected:
        raise ValueError(f"shape mismatch loading {name}: expected {tuple(expected)}, got {tuple(loaded.shape)}")


def _new_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


# (param, loaded_weight[, shard_id]): copies this rank's slice of a checkpoint tensor into `param`.
WeightLoader = Callable[..., None]


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    """Attach the loader the model's `load_weights` calls for `param` (vLLM's convention)."""
    param.weight_loader = loader  # type: ignore[attr-defined]  # torch's stubs declare no extra Parameter attributes


def weight_loader_of(param: nn.Parameter) -> WeightLoader:
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        raise ValueError(f"a parameter of shape {tuple(param.shape)} has no weight_loader")
    return loader


# --------------------------------------------------------------------------- packed CPU weights


def env_on(name: str) -> bool:
    """An on/off switch from the environment, on unless set to 0 / false / no / off."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def _can_pack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not env_on("FLEETSERVE_PACKED_LINEAR"):
        return False
    if weight.dtype == torch.bfloat16:
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            return False
    return weight.dtype == torch.float32


# Up to how many rows fleetserve's small-M linear beats oneDNN, per dtype and ISA (measured with
# benchmarks/decode_step.py --compare-small-m and the kernel's own sweep): bfloat16 up to 4096 rows,
# prefill chunks included; float32 with AVX-512 up to 128; float32 with AVX2 only up to 4096, so it
# takes prefill chunks too, as bf16 does: one code path, and a row's result never depends on its
# batch. Figures: docs/benchmarks/results/2026-11-25-cpu-kernels-epyc-avx512.md ("Prefill chunks on the small-M
# kernel") and docs/benchmarks/results/2026-11-27-avx2-zen3.md ("Small-M linears in 6-row passes").
_DEFAULT_ROWS = {
    ("bfloat16", "avx512_bf16"): 4096,
    ("float32", "avx512_bf16"): 128,
    ("float32", "avx512"): 128,
    ("float32", "avx2"): 4096,
}


def small_m_rows(dtype: torch.dtype = torch.bfloat16) -> int:
    """Up to how many rows a linear of `dtype` takes fleetserve's small-M kernel on this CPU's
    build (0: never). FLEETSERVE_SMALL_M_ROWS sets it for every dtype."""
    value = os.environ.get("FLEETSERVE_SMALL_M_ROWS", "").strip()
    if value:
        try:
            return max(0, int(value))
        except ValueError:
            raise ValueError("FLEETSERVE_SMALL_M_ROWS must be a whole number of rows") from None
    return _DEFAULT_ROWS.get((str(dtype).removeprefix("torch."), kernels_isa() or ""), 0)


def _can_pack_small_m(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32) or weight.dim() != 2:
        return False
    if not env_on("FLEETSERVE_SMALL_M_LINEAR") or ops_for(weight) is None:
        return False
    if (str(weight.dtype).removeprefix("torch."), kernels_isa() or "") not in _DEFAULT_ROWS:
        return False  # that build has no such path (linear_bf16 needs AVX-512 BF16; no scalar path)
    return small_m_rows(weight.dtype) > 0


class _SmallM(NamedTuple):
    """A weight packed for the small-M kernel, valid while the parameter is unchanged."""

    packed: torch.Tensor
    version: int
    data_ptr: int
    out_features: int
    run: Callable  # (x, packed, bias, n, float_out) -> y
    max_rows: int


def _current(packing: Optional[_SmallM], w: torch.Tensor) -> Optional[_SmallM]:
    """`packing` while it still matches parameter `w` (same storage and version), else None."""
    if packing is None or packing.version != w._version or packing.data_ptr != w.data_ptr():
        return None
    return packing


class PackedWeightMixin:
    """CPU linears with the weight packed once, for oneDNN and for fleetserve's small-M kernel.

    `F.linear` on CPU hands oneDNN a plain [out, in] weight, which it repacks on
    every call: at decode batch sizes (M = 1..64) that repacking is a large part of
    the matmul (figures: docs/deployment/cpu.md, "Figures behind the code"; bf16 results are
    bit-identical). `pack_weight()` (called by
    `pack_linear_weights(model)` after loading) keeps the packed copy beside the
    parameter; it is used only while the parameter is unchanged (same storage and
    version counter), so a reloaded or edited weight falls back to `F.linear`.
    The packed copy costs the weight's size again in memory.

    With fleetserve's CPU kernels the weight is also packed for their small-M
    linear (`linear_bf16` with AVX-512 BF16, `linear_f32` with AVX-512 or AVX2),
    which takes batches of up to `small_m_rows(dtype)` rows (read when the weight
    is packed): oneDNN streams the weights of a decode step at about half the
    memory bandwidth, that kernel at nearly all of it (docs/benchmarks/results/2026-11-25-cpu-kernels-epyc-avx512.md,
    "Small-M linears"); in bf16 it also takes prefill chunks. Each row's result is the same
    whatever else is in the batch. One more copy of the weights;
    FLEETSERVE_SMALL_M_LINEAR=0 goes without it (and without the kernel).
    """

    weight: nn.Parameter  # set by the layer the mixin is combined with
    _packed: Optional[tuple[torch.Tensor, int, int]] = None
    _small_m: Optional[_SmallM] = None

    def pack_weight(self) -> bool:
        w = self.weight
        self._packed = self._small_m = None
        ops = ops_for(w)
        if ops is not None and _can_pack_small_m(w):
            if w.dtype == torch.bfloat16:
                pack, run = ops.pack_linear_bf16, ops.linear_bf16
            else:  # float32 results already
                pack, run = ops.pack_linear_f32, lambda x, p, b, n, float_out: ops.linear_f32(x, p, b, n)
            self._small_m = _SmallM(pack(w.detach()), w._version, w.data_ptr(), w.shape[0], run, small_m_rows(w.dtype))
        if not _can_pack(w):
            return self._small_m is not None
        packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 64)  # layout tuned for M ~ 64
        self._packed = (packed, w._version, w.data_ptr())
        return True

    def current_small_m(self) -> Optional[_SmallM]:
        """The small-M packing while it matches the parameter, else None."""
        return _current(self._small_m, self.weight)

    def _linear(self, x: torch.Tensor, bias: Optional[torch.Tensor], float_out: bool = False) -> torch.Tensor:
        """x W^T + b; `float_out`: float32 results where the small-M kernel runs (unrounded
        accumulators; the other paths return the weight's dtype)."""
        w = self.weight
        small = _current(self._small_m, w)
        if (
            small is not None
            and x.dim() == 2
            and x.shape[0] <= small.max_rows
            and x.dtype == w.dtype
            and ops_for(x) is not None
        ):  # None on a GPU tensor or inside kernels.disabled()
            return small.run(x, small.packed, bias, small.out_features, float_out)
        packed = self._packed
        if packed is not None and x.device.type == "cpu" and packed[1] == w._version and packed[2] == w.data_ptr():
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed[0], bias, "none", [], "")
        return F.linear(x, w, bias)


def pack_linear_weights(model: nn.Module) -> int:
    """Pack every linear (and LM head) weight of `model` for CPU inference; returns how many."""
    return sum(1 for m in model.modules() if isinstance(m, PackedWeightMixin) and m.pack_weight())


# --------------------------------------------------------------------------- embeddings


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split across ranks (padded to a multiple of tp)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_group: Optional[TPGroup] = None):
        super().__init__()
        self.tp = tp_group or get_tp_group()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_per_partition = math.ceil(num_embeddings / self.tp.world_size)
        self.vocab_start = self.num_per_partition * self.tp.rank
        self.vocab_end = min(self.vocab_start + self.num_per_partition, num_embeddings)
        self.weight = _new_param(self.num_per_partition, embedding_dim)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if loaded_weight.shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"shape mismatch loading the embedding: expected "
                f"{(self.num_embeddings, self.embedding_dim)}, got {tuple(loaded_weight.shape)}"
            )
        shard = loaded_weight[self.vocab_start : self.vocab_end]
        param.data[: shard.shape[0]].copy_(shard)
        param.data[shard.shape[0] :].zero_()  # padding rows of the last rank

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_range, input_ids - self.vocab_start, 0)
        out = F.embedding(local_ids, self.weight) * in_range.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(PackedWeightMixin, VocabParallelEmbedding):
    """The output projection to the vocabulary; logits are gathered across ranks.

    Tied embeddings share the embedding's parameter (`tie_to(embedding)`); the
    sharding of both is the same vocab split, so no extra memory is used.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False, tp_group: Optional[TPGroup] = None):
        super().__init__(num_embeddings, embedding_dim, tp_group)
        if bias:
            self.bias = _new_param(self.num_per_partition)
            set_weight_loader(self.bias, self._bias_loader)
        else:
            self.register_parameter("bias", None)

    def _bias_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if tuple(loaded_weight.shape) != (self.num_embeddings,):
            raise ValueError(f"shape mismatch loading the lm_head bias: got {tuple(loaded_weight.shape)}")
        shard = loaded_weight[self.vocab_start : self.vocab_end]
        param.data[: shard.shape[0]].copy_(shard)
        param.data[shard.shape[0] :].zero_()

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # [S, vocab / tp]. float32 where the small-M kernel runs (every decode batch of up to
        # 128 rows): bf16 logits are ~0.1 apart at magnitudes of 16-32, so two candidates
        # often round to a tie that argmax then breaks by token id (SmolLM2 bf16 answered
        # "What is the capital of France?" with "L'Étoile, ..." from such a tie).
        logits = self._linear(hidden, self.bias, float_out=True)
        if self.tp.world_size > 1:
            logits = self.tp.all_gather(logits, dim=-1)
        return logits[..., : self.num_embeddings] if logits.shape[-1] != self.num_embeddings else logits


# --------------------------------------------------------------------------- linears


class LinearBase(PackedWeightMixin, nn.Module):
    """A linear layer whose weight is [output_size_per_partition, input_size_per_partition].

    `lora`: LoRA adapters' slots (lora_id -> replica.lora.adapter.LoRASlot), None without;
    column- and row-parallel linears add the step's adapters' deltas (replica.lora.layers).
    `lora_stack`: the same adapters in fixed buffers for CUDA graphs (replica.lora.stack)."""

    lora: Optional[dict] = None
    lora_stack: Optional[Any] = None

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_group: Optional[TPGroup]):
        super().__init__()
        self.tp = tp_group or get_tp_group()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = _new_param(output_size, input_size)
        set_weight_loader(self.weight, self._param_loader())
        if bias:
            self.bias = _new_param(output_size)
            set_weight_loader(self.bias, self._param_loader())
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} names its weight loader")

    def _param_loader(self) -> WeightLoader:
        """What loads this layer's parameters: `weight_loader`, or a loader by shard."""
        return self.weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_group: Optional[TPGroup] = None):
        super().__init__(input_size, output_size, bias, tp_group)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        _check_shape(param, loaded_weight, "a replicated linear")
        param.data.copy_(loaded_weight)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank returns its slice (or all of it with gather_output)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        gather_output: bool = False,
        tp_group: Optional[TPGroup] = None,
    ):
        tp = tp_group or get_tp_group()
        self.total_output_size = output_size
        super().__init__(input_size, divide(output_size, tp.world_size, "output size"), bias, tp)
        self.gather_output = gather_output

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        size = param.shape[0]
        _check_full(loaded_weight, param, 0, size * self.tp.world_size, "a column-parallel linear")
        param.data.copy_(loaded_weight.narrow(0, self.tp.rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._linear(x, self.bias)
        if self.lora is not None or self.lora_stack is not None:
            y = add_lora(self.lora, x, y, self.lora_stack)
        return self.tp.all_gather(y, dim=-1) if self.gather_output else y


def _no_plain_run(*args: Any) -> torch.Tensor:
    raise RuntimeError("a gate|up packing runs through silu_and_mul only")


def interleave_gate_up(w: torch.Tensor, d: int) -> torch.Tensor:
    """[gate; up] rows of a merged [2d, K] weight -> every 16 gate rows followed by the same 16
    up rows (zero rows pad d to a multiple of 16): the order `linear_bf16_silu_mul` reads."""
    dp = -(-d // 16) * 16
    K = w.shape[1]
    halves = w.new_zeros(2, dp, K)
    halves[0, :d] = w[:d]
    halves[1, :d] = w[d:]
    return halves.view(2, dp // 16, 16, K).transpose(0, 1).reshape(2 * dp, K)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up); shard_id indexes `output_sizes`.

    A gate|up pair in bf16 where the small-M kernel runs also gets `silu_and_mul(x)`: the
    MLP's silu(gate) * up straight from the accumulators of one kernel (`linear_bf16_silu_mul`),
    which never writes the [M, 2d] activations (docs/benchmarks/results/2026-11-27-cpu-kernels-zen5.md, "Gate|up
    with SiLU fused"), and is closer to a float64 reference, since gate and up are not rounded
    to bf16 first. Its packed weight replaces the
    plain small-M one (the oneDNN copy still takes larger batches), so memory stays the same.
    FLEETSERVE_FUSED_SILU_MUL=0 goes without it.
    """

    _gated: Optional[_SmallM] = None
    # The MLP's activation is SiLU (LlamaMLP sets it): only then the fused silu(gate) * up packing.
    fuse_silu = True

    def __init__(
        self, input_size: int, output_sizes: list[int], bias: bool = False, tp_group: Optional[TPGroup] = None
    ):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, tp_group=tp_group)

    def pack_weight(self) -> bool:
        packed = super().pack_weight()
        self._gated = None
        w, small = self.weight, self._small_m
        ops = ops_for(w)
        if (
            small is not None
            and ops is not None
            and w.dtype == torch.bfloat16
            and len(self.output_sizes) == 2
            and self.output_sizes[0] == self.output_sizes[1]
            and not self.gather_output
            and self.fuse_silu
            and env_on("FLEETSERVE_FUSED_SILU_MUL")
        ):
            d = w.shape[0] // 2
            # No `run`: silu_and_mul calls its own kernel on the packing.
            self._gated = _SmallM(
                ops.pack_linear_bf16(interleave_gate_up(w.detach(), d)),
                w._version,
                w.data_ptr(),
                d,
                _no_plain_run,
                small.max_rows,
            )
            self._small_m = None
        return packed

    def current_gated(self) -> Optional[_SmallM]:
        """The fused gate|up SiLU packing while it matches the parameter, else None."""
        return _current(self._gated, self.weight)

    def silu_and_mul(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """silu(x G^T) * (x U^T) from the fused kernel, or None where it does not run (then: the
        matmul and SiluAndMul)."""
        g = self.current_gated()
        if (self.lora is not None or self.lora_stack is not None) and lora_touches(self.lora, self.lora_stack):
            return None  # the adapters' deltas go on gate and up before the activation
        if g is None or x.dim() != 2 or x.shape[0] > g.max_rows or x.dtype != self.weight.dtype:
            return None
        ops = ops_for(x)  # None on a GPU tensor or inside kernels.disabled()
        return None if ops is None else ops.linear_bf16_silu_mul(x, g.packed, self.bias, g.out_features)

    def _param_loader(self) -> WeightLoader:
        return self.shard_loader

    def shard_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int) -> None:
        """Output `shard_id` (gate 0, up 1) of the merged weight."""
        tp = self.tp.world_size
        offset = sum(self.output_sizes[:shard_id]) // tp
        size = self.output_sizes[shard_id] // tp
        target = param.data.narrow(0, offset, size)
        _check_full(loaded_weight, target, 0, self.output_sizes[shard_id], f"shard {shard_id} of a merged linear")
        target.copy_(loaded_weight.narrow(0, self.tp.rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul, split by heads.

    Per rank: num_heads / tp query heads, and max(1, num_kv_heads / tp) kv
    heads; when tp > num_kv_heads each kv head is replicated on tp /
    num_kv_heads ranks (as vLLM does), which needs tp % num_kv_heads == 0.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        tp_group: Optional[TPGroup] = None,
    ):
        tp = tp_group or get_tp_group()
        self.head_dim = head_dim
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp.world_size, "number of attention heads")
        if tp.world_size >= total_num_kv_heads:
            if tp.world_size % total_num_kv_heads != 0:
                raise ValueError(
                    f"tensor-parallel size ({tp.world_size}) must be a multiple of the number of "
                    f"kv heads ({total_num_kv_heads}) when it exceeds it"
                )
            self.num_kv_heads = 1
            self.num_kv_head_replicas = tp.world_size // total_num_kv_heads
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp.world_size, "number of kv heads")
            self.num_kv_head_replicas = 1
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        out_total = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp.world_size
        super().__init__(hidden_size, out_total, bias, tp_group=tp)

    def _param_loader(self) -> WeightLoader:
        return self.shard_loader

    def shard_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str) -> None:
        """The "q", "k" or "v" projection's rows of this rank."""
        if shard_id == "q":
            offset, size, rank = 0, self.q_size, self.tp.rank
            full = self.total_num_heads * self.head_dim
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, rank = self.kv_size, self.tp.rank // self.num_kv_head_replicas
            full = self.total_num_kv_heads * self.head_dim
        else:
            raise ValueError(f"unknown qkv shard id {shard_id!r}")
        target = param.data.narrow(0, offset, size)
        _check_full(loaded_weight, target, 0, full, f"the {shard_id} projection")
        target.copy_(loaded_weight.narrow(0, rank * size, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial products summed with an all-reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_group: Optional[TPGroup] = None):
        tp = tp_group or get_tp_group()
        super().__init__(divide(input_size, tp.world_size, "input size"), output_size, bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if param.dim() == 1:  # the bias is not split: rank 0 adds it after the reduce
            _check_shape(param, loaded_weight, "a row-parallel bias")
            param.data.copy_(loaded_weight)
            return
        size = param.shape[1]
        _check_full(loaded_weight, param, 1, size * self.tp.world_size, "a row-parallel linear")
        param.data.copy_(loaded_weight.narrow(1, self.tp.rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp.rank == 0 else None
        y = self._linear(x, bias)
        if self.lora is not None or self.lora_stack is not None:
            # this rank's columns of A: the partial deltas add up in the reduce
            y = add_lora(self.lora, x, y, self.lora_stack)
        return self.tp.all_reduce(y)
