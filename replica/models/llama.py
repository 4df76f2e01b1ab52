"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM) on tensor-parallel layers and paged attention.

    input_ids [T] --embed--> [T, H] --(decoder layer x N)--> norm --> hidden [T, H]
    decoder layer:  x, residual = norm(x + residual); x = o_proj(attn(rope(qkv_proj(x))))
                    x, residual = norm(x + residual); x = down(silu(gate) * up)

Differences inside the family are config switches: GQA (num_key_value_heads),
rope scaling (config.rope_parameters), q/k/v biases (Qwen2, or Llama's
`attention_bias`, which also biases o_proj), `mlp_bias`, tied embeddings,
sliding windows: Mistral's `sliding_window` on every layer, Qwen2's (with
`use_sliding_window`) on the layers `config.layer_types` marks "sliding_attention"
(from `max_window_layers` on, as model_config derives it), as transformers applies
them (`layer_sliding_window`; PagedAttention reads only the keys inside a window).
When every layer slides, the scheduler gives back the blocks a window left behind
(scheduler/kv_cache_manager.py); with global layers among them the cache keeps every block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, NamedTuple, Optional, Union

import torch
from torch import nn

from fleetserve.replica.distributed.parallel import TPGroup, get_tp_group
from fleetserve.replica.kernels import ops_for
from fleetserve.replica.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
)
from fleetserve.replica.layers import linear as linear_module
from fleetserve.replica.layers.attention import AttentionMetadata, PagedAttention, kv_cache_layout
from fleetserve.replica.layers.linear import weight_loader_of
from fleetserve.replica.lora import layers as lora_layers
from fleetserve.replica.model_loader.model_config import layer_sliding_window

if TYPE_CHECKING:
    from fleetserve.kv_transfer.base import KVConnectorWorker

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

# What the layers rotate q and k with: the positions (the fused CPU kernel reads the cos|sin
# table itself), or (cos, sin) gathered once per forward.
Rope = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


def _rope_parameters(config: Any) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if "full_attention" in params:  # per layer type (Gemma 3): the full-attention layers' table
        params = params["full_attention"] or {}
    params = dict(params)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type")
    max_len, original = getattr(config, "max_position_embeddings", None), params.get("original_max_position_embeddings")
    if rope_type in ("longrope", "su") and "factor" not in params and max_len and original:
        # transformers derives LongRoPE's attention factor from the config's length: not from a
        # longer one served (RotaryEmbedding's max_position)
        params["factor"] = max_len / original
    return params


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, tp: TPGroup):
        super().__init__()
        head_dim = _head_dim(config)
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        is_qwen2 = getattr(config, "model_type", "") == "qwen2"
        llama_bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_attention_heads,
            num_kv_heads,
            bias=llama_bias or is_qwen2,
            tp_group=tp,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim, config.hidden_size, bias=llama_bias and not is_qwen2, tp_group=tp
        )
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.rotary_emb = rotary_emb
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, head_dim)

    def qk_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """q and k of the qkv output [T, (H + 2 KVH) d] as heads [T, H + KVH, d], ready for rope:
        a view of qkv (they are adjacent, so they are rotated in one go, in place). A family
        that normalizes q and k per head first (Qwen3) returns its own tensor."""
        heads = self.num_heads + self.num_kv_heads
        return qkv[:, : self.q_size + self.kv_size].view(qkv.shape[0], heads, self.head_dim)

    def apply_rope(self, qk: torch.Tensor, rope: Rope) -> torch.Tensor:
        """qk [T, heads, d] rotated: by the fused kernel in place when `rope` is the positions,
        else with (cos, sin). Partial rotary (the table narrower than a head): the first
        rotary_dim of each head only, through (cos, sin) (the kernel rotates whole heads)."""
        if isinstance(rope, torch.Tensor):  # positions: the fused kernel rotates qk in place
            if self.rotary_emb.rotary_dim == self.head_dim:
                ops = ops_for(qk)
                assert ops is not None, "positions come instead of (cos, sin) only where the kernels run"
                ops.rotary_embedding_(qk, self.rotary_emb.cos_sin_cache.float(), rope)
                return qk
            rope = self.rotary_emb.cos_sin(rope, qk.dtype)
        return RotaryEmbedding.rotate(qk, *rope)

    def forward(self, hidden: torch.Tensor, rope: Rope, kv_cache: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        T = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, (H + 2 KVH) d]
        qk = self.apply_rope(self.qk_heads(qkv), rope).view(T, -1)
        q, k = qk.split([self.q_size, self.kv_size], dim=-1)
        v = qkv[:, self.q_size + self.kv_size :]
        return self.o_proj(self.attn(q, k, v, kv_cache, md))


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, tp: TPGroup):
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.act_fn = self.activation(config)
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=bias, tp_group=tp
        )
        # silu(gate) * up straight from the gate|up kernel: for SiLU's MLP only
        self.gate_up_proj.fuse_silu = isinstance(self.act_fn, SiluAndMul)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias, tp_group=tp)

    def activation(self, config: Any) -> nn.Module:
        """The gated product act(gate) * up the config names (Llama's: SiLU; a family with
        another returns its own); ValueError for one this MLP does not run."""
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (the Llama family uses silu)")
        return SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = self.gate_up_proj.silu_and_mul(x)  # one fused kernel where it runs (SiLU only)
        if act is None:
            act = self.act_fn(self.gate_up_proj(x))
        return self.down_proj(act)


class LlamaDecoderLayer(nn.Module):
    # A family that differs only inside attention or the MLP names its own classes here.
    attention_cls: type[nn.Module] = LlamaAttention
    mlp_cls: type[nn.Module] = LlamaMLP
    norm_cls: type[RMSNorm] = RMSNorm

    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, tp: TPGroup, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = self.attention_cls(config, rotary_emb, tp)
        attn = getattr(self.self_attn, "attn", None)
        if isinstance(attn, PagedAttention):  # any family's attention: its layer's window
            attn.sliding_window = layer_sliding_window(config, layer_idx)
        self.mlp = self.mlp_cls(config, tp)
        self.input_layernorm = self.norm_cls(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = self.norm_cls(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: Optional[torch.Tensor],
        rope: Rope,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope, kv_cache, md)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class _KernelPlan(NamedTuple):
    """What the `llama_layers` kernel needs of every layer (replica/kernels/cpu_ops.cpp), taken from
    the modules once: per layer 6 weights (input norm, qkv, o, post norm, gate|up, down; the
    linears' packed copies), 4 biases and 4 out features (qkv, o, gate|up, down), 2 norm eps."""

    weights: list[torch.Tensor]
    biases: list[Optional[torch.Tensor]]
    sizes: list[int]
    eps: list[float]
    fused: bool  # gate|up through linear_bf16_silu_mul
    # (a module's __dict__, packing attribute or None, packing, weight, bias): the plan holds
    # while every module keeps those parameters and every packing is still its linear's and
    # matches the weight (a repack, a set-aside, an edit or a new Parameter: not); _plan_holds
    checks: list[tuple]
    max_rows: int  # the fewest rows any of the packed linears takes
    dtype: torch.dtype
    block_size: int
    cos_sin: torch.Tensor
    dims: tuple[int, int, int]  # heads, kv heads, head_dim
    scale: float
    k_tiled: bool
    windows: list[int]  # per layer: its sliding window, 0 for none (empty: no layer has one)


def _plan_holds(plan: _KernelPlan) -> bool:
    for state, attr, packing, w, b in plan.checks:
        params = state["_parameters"]
        if params["weight"] is not w or params.get("bias") is not b:
            return False
        if attr is not None and (
            state.get(attr) is not packing or w._version != packing.version or w.data_ptr() != packing.data_ptr
        ):
            return False
    return True


# A step of at least this many tokens runs the layers kernel one layer per call when someone
# follows progress (replica.engine.progress): a full-context prefill is one long call otherwise.
PROGRESS_SPLIT_ROWS = 256


class LlamaModel(nn.Module):
    # Called as each decoder layer starts, when set (replica.engine.progress.hook_layers).
    progress: Optional[Callable[[], None]] = None
    decoder_layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    norm_cls: type[RMSNorm] = RMSNorm  # the final norm's

    def __init__(self, config: Any, tp: TPGroup, max_position: int):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_group=tp)
        self.rotary_emb = RotaryEmbedding(_head_dim(config), max_position, _rope_parameters(config))
        self.layers = nn.ModuleList(
            self.decoder_layer_cls(config, self.rotary_emb, tp, i) for i in range(config.num_hidden_layers)
        )
        self.norm = self.norm_cls(config.hidden_size, config.rms_norm_eps)
        # (key, plan or None, and with None the packings it was refused with): see _kernel_plan
        self._plan: tuple[Optional[tuple], Optional[_KernelPlan], list] = (None, None, [])
        self._linear_states: Optional[list[dict]] = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden]: the embedding rows (a family that scales them, Gemma, says so here)."""
        return self.embed_tokens(input_ids)

    def rope_inputs(self, positions: torch.Tensor, dtype: torch.dtype, kernels: bool) -> Rope:
        """What every layer rotates q and k with: the positions where the fused kernel rotates
        (it reads the layer's own table), else (cos, sin) of this model's table, gathered once
        per forward. A family whose layers rotate with tables of their own (Gemma 3's local and
        global ones) passes the positions, and its attention gathers."""
        return positions if kernels else self.rotary_emb.cos_sin(positions, dtype)

    def decoder_layers(self) -> Iterator[LlamaDecoderLayer]:
        """`layers`, typed (an nn.ModuleList yields plain Modules)."""
        for layer in self.layers:
            assert isinstance(layer, LlamaDecoderLayer)
            yield layer

    def _kernel_plan(self, hidden: torch.Tensor, kv_caches: list[torch.Tensor]) -> Optional[_KernelPlan]:
        """What the `llama_layers` kernel needs to run every decoder layer in one call, where
        each layer's work is fleetserve's CPU kernels (one rank, every linear packed for the
        small-M kernel, the attention kernel on); else None and the modules run.

        The kernel calls the same kernels in the same order on the same tensors as the
        modules do (bit-identical results), from a C++ loop rather than through nine
        modules per layer with their views, checks and dispatches, whose Python cost is
        a good part of a small decode step (docs/benchmarks/results/2026-11-27-cpu-kernels-zen5.md,
        "Layers in one kernel call")."""
        if not linear_module.env_on("FLEETSERVE_KERNEL_LAYERS") or not PagedAttention.use_attention_kernel:
            return None
        key = (hidden.dtype, kv_caches[0].shape[3])
        cached_key, plan, packings = self._plan
        if cached_key == key:
            if plan is None:
                if all(a is b for a, b in zip(self._packings(), packings, strict=True)):
                    return None  # none repacked, set aside or put back since
            elif _plan_holds(plan):
                return plan
        plan = self._build_kernel_plan(*key)
        self._plan = (key, plan, self._packings() if plan is None else [])
        return plan

    def _packings(self) -> list:
        if self._linear_states is None:
            self._linear_states = [
                vars(m)
                for layer in self.decoder_layers()
                for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            ]
        return [state.get(attr) for state in self._linear_states for attr in ("_small_m", "_gated")]

    def _build_kernel_plan(self, dtype: torch.dtype, block_size: int) -> Optional[_KernelPlan]:
        ops = ops_for(torch.empty(0, dtype=dtype))
        if ops is None or not hasattr(ops, "llama_layers"):
            return None
        weights: list[torch.Tensor] = []
        biases: list[Optional[torch.Tensor]] = []
        sizes: list[int] = []
        eps: list[float] = []
        fused: set[bool] = set()
        checks: list[tuple] = []
        rows: list[int] = []
        windows: list[int] = []
        layers = list(self.decoder_layers())
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            # The kernel is Llama's layer exactly: a family's own norms, experts or windows run as modules.
            if (type(layer), type(attn), type(mlp)) != (LlamaDecoderLayer, LlamaAttention, LlamaMLP):
                return None
            assert isinstance(attn, LlamaAttention) and isinstance(mlp, LlamaMLP)
            if attn.o_proj.tp.world_size != 1 or attn.qkv_proj.gather_output or mlp.gate_up_proj.gather_output:
                return None
            qkv, o, down = (m.current_small_m() for m in (attn.qkv_proj, attn.o_proj, mlp.down_proj))
            gated = mlp.gate_up_proj.current_gated()
            gate_up = gated or mlp.gate_up_proj.current_small_m()
            if qkv is None or o is None or down is None or gate_up is None:
                return None
            norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
            weights += [norm1.weight, qkv.packed, o.packed, norm2.weight, gate_up.packed, down.packed]
            biases += [attn.qkv_proj.bias, attn.o_proj.bias, mlp.gate_up_proj.bias, mlp.down_proj.bias]
            sizes += [qkv.out_features, o.out_features, gate_up.out_features, down.out_features]
            eps += [norm1.eps, norm2.eps]
            fused.add(gated is not None)
            checks += [
                (vars(m), attr, packing, m.weight, getattr(m, "bias", None))
                for m, attr, packing in (
                    (attn.qkv_proj, "_small_m", qkv),
                    (attn.o_proj, "_small_m", o),
                    (mlp.gate_up_proj, "_small_m" if gated is None else "_gated", gate_up),
                    (mlp.down_proj, "_small_m", down),
                    (norm1, None, None),
                    (norm2, None, None),
                )
            ]
            rows += [qkv.max_rows, o.max_rows, gate_up.max_rows, down.max_rows]
            if attn.attn.logit_softcap is not None:
                return None
            windows.append(attn.attn.sliding_window or 0)
        if not rows or len(fused) != 1 or any(w.dtype != dtype for w in weights):
            return None
        first = layers[0].self_attn
        assert isinstance(first, LlamaAttention)
        D = first.head_dim
        if self.rotary_emb.rotary_dim != D:  # the kernel rotates whole heads
            return None
        return _KernelPlan(
            weights,
            biases,
            sizes,
            eps,
            fused.pop(),
            checks,
            min(rows),
            dtype,
            block_size,
            self.rotary_emb.cos_sin_cache.float().contiguous(),
            (first.num_heads, first.num_kv_heads, D),
            first.attn.scale,
            kv_cache_layout(dtype, block_size, D) == "k_tiled",
            windows if any(windows) else [],
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        md: AttentionMetadata,
        kv_hooks: Optional[KVConnectorWorker] = None,
    ) -> torch.Tensor:
        hidden = self.embed(input_ids)
        ops = ops_for(hidden)
        rope = self.rope_inputs(positions, hidden.dtype, ops is not None)
        plan = None
        if ops is not None and kv_hooks is None and hidden.shape[0] and lora_layers.current() is None:
            plan = self._kernel_plan(hidden, kv_caches)
            if plan is not None and hidden.shape[0] > plan.max_rows:
                plan = None
        progress = self.progress
        residual: Optional[torch.Tensor] = None
        if ops is not None and plan is not None:
            hidden, residual = self._run_kernel(ops, plan, hidden, positions, kv_caches, md, progress)
        elif kv_hooks is None:
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                if progress is not None:
                    progress()
                hidden, residual = layer(hidden, residual, rope, kv_cache, md)
        else:  # a KV connector moves KV layer by layer (kv_transfer.base: layer-wise hooks)
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
                kv_hooks.wait_for_layer_load(i)
                if progress is not None:
                    progress()
                hidden, residual = layer(hidden, residual, rope, kv_cache, md)
                kv_hooks.save_kv_layer(i, kv_cache, md)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    @staticmethod
    def _run_kernel(
        ops: Any,
        plan: _KernelPlan,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        md: AttentionMetadata,
        progress: Optional[Callable[[], None]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers through the `llama_layers` kernel (_kernel_plan): in one call, or,
        for a long step someone follows, one layer per call with progress between."""

        def layers(x: torch.Tensor, caches: list[torch.Tensor], first: int, count: int) -> tuple:
            return ops.llama_layers(
                x,
                positions,
                plan.cos_sin,
                caches,
                md.slot_mapping,
                md.block_table,
                md.token_seq_lens,
                md.token_req,
                plan.weights[6 * first : 6 * (first + count)],
                plan.biases[4 * first : 4 * (first + count)],
                plan.sizes[4 * first : 4 * (first + count)],
                plan.eps[2 * first : 2 * (first + count)],
                *plan.dims,
                plan.scale,
                plan.k_tiled,
                plan.fused,
                plan.windows[first : first + count],
            )

        if progress is None or hidden.shape[0] < PROGRESS_SPLIT_ROWS:
            if progress is not None:
                progress()
            out, residual = layers(hidden, kv_caches, 0, len(kv_caches))
            return out, residual
        residual = None
        for i, kv_cache in enumerate(kv_caches):
            progress()
            x = hidden if residual is None else hidden + residual  # the layer's input stream
            hidden, residual = layers(x, [kv_cache], i, 1)
        assert residual is not None, "a model has at least one layer"
        return hidden, residual


class LlamaForCausalLM(nn.Module):
    # The HF architectures this class loads (replica.models.MODELS maps them here).
    architectures: tuple[str, ...] = SUPPORTED_ARCHITECTURES
    model_cls: type[LlamaModel] = LlamaModel
    # checkpoint name piece -> (our parameter name piece, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # checkpoint entries that carry no weights of ours
    ignored_suffixes = ("rotary_emb.inv_freq",)

    def __init__(self, config: Any, tp_group: Optional[TPGroup] = None, max_position: Optional[int] = None):
        super().__init__()
        archs = getattr(config, "architectures", None) or [self.architectures[0]]
        if not any(a in self.architectures for a in archs):
            raise ValueError(f"unsupported architecture {archs}; supported: {', '.join(self.architectures)}")
        tp = tp_group or get_tp_group()
        self.config = config
        self.tp = tp
        max_position = max(max_position or 0, getattr(config, "max_position_embeddings", 0) or 0, 1)
        self.model = self.model_cls(config, tp, max_position)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_group=tp)
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    @property
    def max_position(self) -> int:
        return self.model.rotary_emb.max_position

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        kv_hooks: Optional[KVConnectorWorker] = None,
    ) -> torch.Tensor:
        """input_ids [T], positions [T] -> final hidden states [T, hidden]. `kv_hooks`: a KV
        connector worker whose wait_for_layer_load / save_kv_layer run around each layer."""
        return self.model(input_ids, positions, kv_caches, attn_metadata, kv_hooks)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] (the rows to sample from) -> logits [S, vocab], float32, full vocab on every rank."""
        return self.lm_head(hidden).float()

    # ----------------------------------------------------------------------- weights

    def _target(self, hf_name: str) -> tuple[str, Any]:
        for ckpt_piece, (ours, shard_id) in self.packed_modules_mapping.items():
            if f".{ckpt_piece}." in hf_name:
                return hf_name.replace(f".{ckpt_piece}.", f".{ours}."), shard_id
        return hf_name, None

    def expected_weight_names(self) -> set[str]:
        """The checkpoint (HF) names a complete checkpoint must provide."""
        inverse: dict[str, list[str]] = {}
        for ckpt_piece, (ours, _) in self.packed_modules_mapping.items():
            inverse.setdefault(ours, []).append(ckpt_piece)
        names = set()
        for name, _ in self.named_parameters(remove_duplicate=True):
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            pieces = [p for ours, ps in inverse.items() if f".{ours}." in name for p in ps]
            if not pieces:
                names.add(name)
                continue
            ours = next(o for o in inverse if f".{o}." in name)
            names.update(name.replace(f".{ours}.", f".{p}.") for p in pieces)
        return names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint") -> set[str]:
        """Copy (hf_name, tensor) pairs into this rank's shards; raises ValueError on unknown or missing names."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        with torch.no_grad():
            for hf_name, tensor in weights:
                if hf_name.endswith(self.ignored_suffixes):
                    continue
                if hf_name == "lm_head.weight" and self.tie_word_embeddings:
                    continue  # some tied checkpoints store a copy; the embedding is the source of truth
                name, shard_id = self._target(hf_name)
                param = params.get(name)
                if param is None:
                    raise ValueError(
                        f"{source}: unexpected weight {hf_name!r} (not part of {type(self).__name__} for this config)"
                    )
                loader = weight_loader_of(param)
                tensor = tensor.to(param.dtype)
                if shard_id is None:
                    loader(param, tensor)
                else:
                    loader(param, tensor, shard_id)
                loaded.add(hf_name)
        self.check_complete(loaded, source)
        return loaded

    def check_complete(self, loaded: set[str], source: str = "checkpoint") -> None:
        """ValueError naming what `expected_weight_names` has and `loaded` (checkpoint names) lacks."""
        missing = self.expected_weight_names() - loaded
        if missing:
            shown = ", ".join(sorted(missing)[:8])
            raise ValueError(f"{source}: {len(missing)} weight(s) missing, e.g. {shown}")
