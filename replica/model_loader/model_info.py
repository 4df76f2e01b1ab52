"""What a model is, read cheaply (no weights, no torch): its shape and its generation defaults.

`fleetserve serve` checks its arguments against these in about a second, before
starting Ray: a GGUF's header (metadata only, memory-mapped) or an HF folder's
config.json / generation_config.json.

Tensor parallelism splits the attention heads, the KV heads (or replicates them
when the size is a multiple of their count) and the MLP across ranks, so a size
must divide all three (`allowed_tp_sizes`).

Generation defaults follow `vllm serve --generation-config`: `auto` takes the
model's own (an HF folder's generation_config.json; a GGUF's `general.sampling.*`
keys; for a registry model without either, the settings its model card
recommends), `vllm` takes none, and a folder names a generation_config.json. A
request's own values always win over them.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetserve.replica.model_loader.registry import REGISTRY_GENERATION_DEFAULTS, ModelSource

# generation_config.json key -> SamplingParams field (vLLM's get_diff_sampling_param).
_HF_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# GGUF `general.sampling.*` (llama.cpp's recommended-sampling keys) -> SamplingParams field.
_GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


@dataclass(frozen=True)
class ModelShape:
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    num_hidden_layers: int = 0  # 0: unknown
    head_dim: int = 0  # 0: unknown
    num_experts: int = 0  # a mixture of experts (Mixtral, Qwen3-MoE); 0: a dense model
    expert_intermediate_size: int = 0  # each expert's

    def kv_bytes_per_block(self, block_size: int, element_size: int, tp: int = 1) -> int:
        """Bytes of one KV cache block on one rank (K and V, every layer), as the engine
        allocates it (replica.model_loader.weights.kv_cache_bytes_per_block); 0 if unknown."""
        local_kv_heads = max(1, self.num_key_value_heads // tp)
        return 2 * local_kv_heads * block_size * self.head_dim * self.num_hidden_layers * element_size


def read_model_shape(source: ModelSource) -> ModelShape:
    if source.kind == "gguf":
        meta = _gguf_metadata(source.path)
        arch = meta.get("general.architecture")
        heads = meta.get(f"{arch}.attention.head_count")
        if heads is None:
            raise ValueError(f"{source.path}: GGUF metadata lacks {arch}.attention.head_count")
        hidden = int(meta.get(f"{arch}.embedding_length", 0))
        return ModelShape(
            int(heads),
            int(meta.get(f"{arch}.attention.head_count_kv", heads)),
            int(meta.get(f"{arch}.feed_forward_length", 0)),
            int(meta.get(f"{arch}.context_length", 2048)),
            int(meta.get(f"{arch}.block_count", 0)),
            int(meta.get(f"{arch}.attention.key_length", 0)) or hidden // int(heads),
        )
    # The config as the engine reads it (ModelConfig: the family's defaults for absent keys),
    # so a context length or head count here is the engine's; ValueError naming the file if
    # unreadable or not a model our engine runs.
    from fleetserve.replica.model_loader.model_config import read_model_config

    cfg = read_model_config(source.path)
    intermediate = int(getattr(cfg, "intermediate_size", None) or 0)
    experts = int(getattr(cfg, "num_local_experts", None) or 0)
    expert_intermediate = 0
    if experts:
        from fleetserve.replica.model_loader.model_config import qwen3_moe_sparse_layer

        if cfg.model_type == "qwen3_moe":
            expert_intermediate = int(getattr(cfg, "moe_intermediate_size", 0) or 0)
            # intermediate_size is the dense layers' MLP: split only if there is one
            if all(qwen3_moe_sparse_layer(cfg, i) for i in range(cfg.num_hidden_layers)):
                intermediate = 0
        else:  # Mixtral: every layer's MLP is experts of intermediate_size
            expert_intermediate, intermediate = intermediate, 0
    return ModelShape(
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        intermediate,
        int(getattr(cfg, "max_position_embeddings", None) or 2048),
        int(cfg.num_hidden_layers),
        int(cfg.head_dim),
        experts,
        expert_intermediate,
    )


def tp_problems(shape: ModelShape, tp: int, expert_parallel: bool = False) -> list[str]:
    """What keeps `tp` ranks from splitting this model (empty: it splits); a mixture of
    experts splits each expert's intermediate size, or with `expert_parallel` the experts."""
    problems = []
    if shape.num_attention_heads % tp:
        problems.append(f"{shape.num_attention_heads} attention heads")
    kv = shape.num_key_value_heads
    if kv % tp and tp % kv:
        problems.append(f"{kv} kv heads (neither divisible by it nor dividing it)")
    if shape.intermediate_size and shape.intermediate_size % tp:
        problems.append(f"intermediate size {shape.intermediate_size}")
    if shape.num_experts and expert_parallel and shape.num_experts % tp:
        problems.append(f"{shape.num_experts} experts (--enable-expert-parallel places whole experts on each rank)")
    if shape.num_experts and not expert_parallel and shape.expert_intermediate_size % tp:
        problems.append(f"the experts' intermediate size {shape.expert_intermediate_size}")
    return problems


def allowed_tp_sizes(shape: ModelShape, expert_parallel: bool = False) -> list[int]:
    return [t for t in range(1, shape.num_attention_heads + 1) if not tp_problems(shape, t, expert_parallel)]


def check_expert_parallel(source: ModelSource, enable_expert_parallel: bool) -> None:
    """ValueError when expert parallelism is asked of a model without experts."""
    if enable_expert_parallel and not read_model_shape(source).num_experts:
        raise ValueError(
            f"--enable-expert-parallel: {source.name!r} is not a mixture-of-experts model "
            "(supported: Mixtral, Qwen3-MoE); leave the flag off for a dense model"
        )


def check_model_files(source: ModelSource) -> None:
    """An HF folder's config.json is one our model reads and its weights are there: checked
    from the files alone (no torch, no transformers), so `fleetserve serve` refuses a broken
    folder at once instead of every replica failing to load it (a stack trace from each,
    and Serve giving up only after its retries). A GGUF's metadata is read by read_model_shape."""
    if source.kind != "hf":
        return
    read_model_shape(source)  # the config
    files = sorted(source.path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{source.path}: no *.safetensors files (only safetensors checkpoints are supported)")
    for f in files:
        _check_safetensors(f)


def _check_safetensors(path: Path) -> None:
    """The file is whole: its JSON header parses and its tensors end where the file does (what a
    truncated download or copy breaks). Reads the header only."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > size - 8:
                raise ValueError(f"a header of {n} bytes in a file of {size}")
            header = json.loads(fh.read(n))
        ends = [int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"]
    except (OSError, ValueError, struct.error, TypeError, KeyError, IndexError, AttributeError) as e:
        raise ValueError(f"corrupt or unreadable weight file {path}: {e}") from None
    if 8 + n + max(ends, default=0) != size:
        raise ValueError(
            f"corrupt or truncated weight file {path}: its tensors need "
            f"{8 + n + max(ends, default=0)} bytes, the file has {size}"
        )


def check_max_model_len(source: ModelSource, max_model_len: int | None) -> None:
    """ValueError when `max_model_len` is past the model's context (max_position_embeddings, as
    the engine reads it: engine_core.resolve_max_model_len refuses the same)."""
    if max_model_len is None:
        return
    model_max = read_model_shape(source).max_position_embeddings
    if max_model_len > model_max:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={model_max} (--max-model-len)"
        )


def check_tp_size(source: ModelSource, tp: int, expert_parallel: bool = False) -> None:
    """ValueError naming the sizes the model allows, when `tp` does not split it (or, with
    `expert_parallel`, when the model has no experts)."""
    check_expert_parallel(source, expert_parallel)
    shape = read_model_shape(source)
    problems = tp_problems(shape, tp, expert_parallel)
    if problems:
        sizes = ", ".join(map(str, allowed_tp_sizes(shape, expert_parallel)))
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide the model {source.name!r}: "
            f"{', '.join(problems)} are not divisible by {tp}; "
            f"the sizes this model allows are {sizes}"
        )


def generation_defaults(source: ModelSource, mode: str = "auto") -> dict[str, Any]:
    """SamplingParams defaults per `--generation-config` (`auto`, `vllm`, or a folder)."""
    if mode == "vllm":
        return {}
    if mode != "auto":
        folder = Path(mode).expanduser()
        if not (folder / "generation_config.json").is_file():
            raise ValueError(
                f"--generation-config {mode!r}: no generation_config.json there "
                "(give 'auto', 'vllm' or a folder holding one)"
            )
        return _pick(_read_json(folder / "generation_config.json"), _HF_KEYS)
    if source.kind == "hf":
        path = source.path / "generation_config.json"
        found = _pick(_read_json(path), _HF_KEYS) if path.is_file() else {}
    else:
        found = _pick(_gguf_metadata(source.path), _GGUF_KEYS)
    return found or dict(REGISTRY_GENERATION_DEFAULTS.get(source.name, {}))


def _pick(data: dict, keys: dict[str, str]) -> dict[str, Any]:
    return {field: data[key] for key, field in keys.items() if data.get(key) is not None}


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return data


def _gguf_metadata(path: Path) -> dict:
    from fleetserve.replica.model_loader.gguf_reader import GGUFFile

    f = GGUFFile(path)
    try:
        return f.metadata
    finally:
        f.close()
