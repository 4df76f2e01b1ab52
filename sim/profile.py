"""Step-cost profiles: how long one engine step takes on some hardware, as a JSON file.

A profile names the hardware, the model (its shape), the dtype and the tensor-parallel size,
and gives the simulator a `StepCostModel` (`shape.py`) through `Profile.cost_model()`: seconds
for a step of a given `StepShape`, seconds to move KV between replicas by a connector, and
the KV cache's bytes per token. Its `step` has one of two forms:

* ``linear`` (a *calibrated* profile): the step's seconds are a fixed overhead plus a
  non-negative coefficient for each count of the shape,

      t = overhead_s + per_prefill_token_s * (prefill_tokens + draft tokens)
          + per_prefill_attn_token_s * prefill_attn_tokens + per_prefill_seq_s * prefill_seqs
          + per_decode_seq_s * decode_seqs + per_decode_context_token_s * decode_context_tokens

  (draft tokens: `decode_tokens - decode_seqs`, computed as a prefill chunk computes its
  tokens). `fleetserve profile` runs the real engine over a grid of step shapes, times each
  step and fits the coefficients with `fit_linear` (non-negative least squares, relative
  error minimized); `calibrated_profile` wraps the fit, with its errors, into a profile.

* ``roofline`` (an *analytic* profile): the step is bound by compute or by memory traffic,
  whichever is slower, plus a fixed overhead and, for TP > 1, the all-reduces:

      t = overhead_s + max(FLOPs / (peak_flops * mfu), bytes / (mem_bandwidth_bytes_s * mbu))
          + all_reduces * (all_reduce_latency_s + 2 (tp - 1) / tp * T * hidden * dtype_bytes
                           / interconnect_bandwidth_bytes_s)

  per GPU (one TP rank), with T = prefill_tokens + decode_tokens and

      FLOPs = [2 * P_body * T + 2 * vocab * hidden * (decode_tokens + prefill_seqs)
               + 4 * layers * heads * head_dim * (prefill_attn_tokens + decode_attn)] / tp
      bytes = W / tp + kv_rank * (decode_context_tokens + prefill_kv_reads + T)

  where P_body is the parameters less the embedding and LM head (the matmuls every token
  runs through), the LM head runs for the sampled positions only (one per prefill chunk, every
  decode token), the attention term counts QK^T and PV (2 FLOPs per multiply-add each, per
  query token per key: `prefill_attn_tokens` already sums the keys each chunk's queries see,
  causal halving included), decode_attn is `decode_context_tokens` times the decode tokens
  per row (drafts attend too), W is the weights' bytes a step reads (everything but the input
  embedding table, of which a step gathers only its tokens' rows), kv_rank the KV bytes per
  token one rank holds, read for every decode row's context, written for every new token, and
  read for prefill contexts as a flash-attention kernel does, once per query tile:
  prefill_kv_reads = prefill_attn_tokens * max(prefill_seqs / prefill_tokens, 1 / 128) (a
  chunk's mean context, once per chunk or once per 128 queries, whichever is more).
  Activations are left out (small next to the weights). There are 2 all-reduces per layer
  (after attention's output projection and after the MLP's down projection), of T hidden
  vectors each, timed as a ring. `analytic_profile` builds one from tables of published GPU
  specs and model shapes (`GPUS`, `MODELS`); each number's source is in the profile's
  `source`.

A profile also carries `kv_transfer` (connector -> bandwidth and latency: seconds =
latency + bytes / bandwidth) and, where it knows the GPU's memory, the KV cache's bytes per
replica (`kv_cache_memory_bytes`, which the simulator uses when the engine args give none).

Shipped profiles live in `sim/profiles/*.json`: the analytic ones are written by
``python -m fleetserve.sim.profile regenerate`` (deterministic: a test checks the files equal
what it writes), calibrated ones by ``fleetserve profile``. `load_profile` takes a shipped
name or a path; a bad file raises `ProfileError` naming the file, the field and, for JSON
syntax, the line and column.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Sequence, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from fleetserve.scheduler.step_cost import (
    LinearStepCost,
    RooflineStepCost,
    StepShape,
    dtype_bytes,
)

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
SCHEMA_VERSION = 1

# Connector names as `--kv-connector` and the app config's `pd.connector` spell them, and the
# registered class names they stand for (kv_transfer/registry.py), so either finds a link.
CONNECTOR_SHORT_NAMES: dict[str, str] = {
    "SharedStorageConnector": "shared_storage",
    "RayObjectStoreConnector": "ray_object_store",
    "P2PConnector": "p2p",
}


class ProfileError(ValueError):
    """A profile that cannot be loaded or built: the message names the file and the field."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelShape(_Model):
    """The model's shape, as its HF config.json gives it."""

    num_layers: PositiveInt
    hidden_size: PositiveInt
    num_attention_heads: PositiveInt
    num_kv_heads: PositiveInt
    head_dim: PositiveInt
    intermediate_size: PositiveInt
    vocab_size: PositiveInt
    num_params: PositiveFloat  # all parameters, embedding and LM head included
    tie_word_embeddings: bool = False  # the LM head is the embedding table (not a second matrix)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def body_params(self) -> float:
        """Parameters every token's matmuls run through: all but the embedding and LM head."""
        return self.num_params - self.embedding_params * (1 if self.tie_word_embeddings else 2)

    def kv_bytes_per_token(self, dtype: str) -> int:
        """K and V of one token in every layer, all KV heads (the whole replica's)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * _dtype_bytes(dtype)


class LinearStep(_Model):
    """A fitted step cost (calibrated profiles); the formula is in the module docstring."""

    form: Literal["linear"] = "linear"
    overhead_s: NonNegativeFloat = 0.0
    per_prefill_token_s: NonNegativeFloat = 0.0
    per_prefill_attn_token_s: NonNegativeFloat = 0.0
    per_prefill_seq_s: NonNegativeFloat = 0.0
    per_decode_seq_s: NonNegativeFloat = 0.0
    per_decode_context_token_s: NonNegativeFloat = 0.0


class RooflineStep(_Model):
    """An analytic step cost from the hardware's peaks; the formula is in the module docstring.

    `mfu` and `mbu` are the fractions of the peaks a real engine reaches: large bf16 GEMMs
    reach about 60-70% of a GPU's dense tensor peak, and decode's weight-streaming GEMVs about
    80% of the memory bandwidth, hence the defaults 0.6 and 0.8."""

    form: Literal["roofline"] = "roofline"
    overhead_s: NonNegativeFloat  # per-step CPU work: scheduling, input prep, launches, sampling
    peak_flops: PositiveFloat  # dense, for the profile's dtype, one GPU
    mem_bandwidth_bytes_s: PositiveFloat  # one GPU
    mfu: Annotated[float, Field(gt=0, le=1)] = 0.6
    mbu: Annotated[float, Field(gt=0, le=1)] = 0.8
    interconnect_bandwidth_bytes_s: Optional[PositiveFloat] = None  # per direction, for TP > 1
    all_reduce_latency_s: NonNegativeFloat = 0.0  # per all-reduce, for TP > 1


Step = Annotated[Union[LinearStep, RooflineStep], Field(discriminator="form")]


class FitStats(_Model):
    """How well a linear fit matches the steps it was fitted to (relative errors)."""

    samples: PositiveInt
    median_rel_error: NonNegativeFloat
    p90_rel_error: NonNegativeFloat
    max_rel_error: NonNegativeFloat
    ranges: dict[str, list[float]] = Field(default_factory=dict)  # shape field -> [min, max] over the samples
    grid: Optional[dict[str, Any]] = None  # the measuring grid, as the caller describes it


class KVLink(_Model):
    """Moving KV by one connector: seconds = latency_s + bytes / bandwidth_bytes_s."""

    bandwidth_bytes_s: PositiveFloat
    latency_s: NonNegativeFloat = 0.0
    source: str = ""  # where the numbers come from (measured, or published and assumed)


class Profile(_Model):
    schema_version: Literal[1] = 1
    name: str = Field(min_length=1)
    kind: Literal["calibrated", "analytic"]
    hardware: str
    model: str
    model_shape: ModelShape
    dtype: str
    tensor_parallel_size: PositiveInt = 1
    threads: Optional[PositiveInt] = None
    created: str  # a date, YYYY-MM-DD
    source: str
    step: Step
    fit: Optional[FitStats] = None
    kv_transfer: dict[str, KVLink] = Field(default_factory=dict)
    kv_cache_memory_bytes: Optional[PositiveInt] = None  # the whole replica's KV cache

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        _dtype_bytes(v)
        return v

    @field_validator("kv_transfer")
    @classmethod
    def _short_connector_names(cls, v: dict[str, KVLink]) -> dict[str, KVLink]:
        for key in v:
            if key in CONNECTOR_SHORT_NAMES:
                raise ValueError(f"name the connector {key!r} as {CONNECTOR_SHORT_NAMES[key]!r}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "Profile":
        if self.kind == "calibrated" and self.step.form != "linear":
            raise ValueError("a calibrated profile's step has form 'linear'")
        if self.kind == "analytic" and self.step.form != "roofline":
            raise ValueError("an analytic profile's step has form 'roofline'")
        if self.fit is not None and self.kind != "calibrated":
            raise ValueError("only a calibrated profile has a fit")
        step = self.step
        if isinstance(step, RooflineStep) and self.tensor_parallel_size > 1:
            if step.interconnect_bandwidth_bytes_s is None:
                raise ValueError("a roofline step with tensor_parallel_size > 1 needs interconnect_bandwidth_bytes_s")
        return self

    def kv_bytes_per_token(self) -> int:
        return self.model_shape.kv_bytes_per_token(self.dtype)

    def cost_model(self) -> "ProfileCostModel":
        """The simulator's `StepCostModel` for this profile (coefficients precomputed)."""
        if isinstance(self.step, LinearStep):
            return LinearCostModel(self)
        return RooflineCostModel(self)

    def to_json(self) -> str:
        """The profile as its file holds it (stable: same profile, same bytes)."""
        return json.dumps(self.model_dump(mode="json", exclude_none=True), indent=2) + "\n"

    def save(self, path: Union[str, os.PathLike[str]]) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(self.to_json())
        return p


def _dtype_bytes(dtype: str) -> int:
    return dtype_bytes(dtype)


# ---- cost models (the simulator's hot path: plain attributes, no pydantic) -----------------
class ProfileCostModel:
    """What both forms share: KV transfer by connector, KV bytes per token, KV memory."""

    __slots__ = ("profile_name", "_links", "_kv_bytes_per_token", "kv_cache_memory_bytes")

    def __init__(self, profile: Profile) -> None:
        self.profile_name = profile.name
        self._links = {k: (v.latency_s, v.bandwidth_bytes_s) for k, v in profile.kv_transfer.items()}
        self._kv_bytes_per_token = profile.kv_bytes_per_token()
        self.kv_cache_memory_bytes = profile.kv_cache_memory_bytes

    def step_seconds(self, shape: StepShape) -> float:
        raise NotImplementedError

    def kv_transfer_seconds(self, nbytes: int, connector: str) -> float:
        link = self._links.get(connector) or self._links.get(CONNECTOR_SHORT_NAMES.get(connector, ""))
        if link is None:
            known = ", ".join(sorted(self._links)) or "none"
            raise ProfileError(
                f"profile {self.profile_name!r} has no KV transfer figures for connector {connector!r}; "
                f"it knows: {known}"
            )
        return link[0] + nbytes / link[1]

    def kv_bytes_per_token(self) -> int:
        return self._kv_bytes_per_token


class LinearCostModel(ProfileCostModel):
    """A calibrated profile's step cost: `scheduler.step_cost.LinearStepCost` (the formula the
    router's SLO admission evaluates too)."""

    __slots__ = ("_step",)

    def __init__(self, profile: Profile) -> None:
        super().__init__(profile)
        s = profile.step
        assert isinstance(s, LinearStep)
        self._step = LinearStepCost(**s.model_dump(exclude={"form"}))

    def step_seconds(self, shape: StepShape) -> float:
        return self._step.step_seconds(shape)


class RooflineCostModel(ProfileCostModel):
    """An analytic profile's step cost: `scheduler.step_cost.RooflineStepCost`."""

    __slots__ = ("_step",)

    def __init__(self, profile: Profile) -> None:
        super().__init__(profile)
        s = profile.step
        assert isinstance(s, RooflineStep)
        self._step = RooflineStepCost(
            s.model_dump(), profile.model_shape.model_dump(), profile.dtype, profile.tensor_parallel_size
        )

    def step_seconds(self, shape: StepShape) -> float:
        return self._step.step_seconds(shape)


# ---- loading ---------------------------------------------------------------------------------
def shipped_profiles() -> list[str]:
    """The names of the profiles in sim/profiles/ (whatever JSON is there)."""
    if not PROFILES_DIR.is_dir():
        return []
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def _format_validation(where: str, e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
        lines.append(f"{where}: {loc}: {err['msg']}")
    return "\n".join(lines)


def parse_profile(text: str, where: str = "<profile>") -> Profile:
    """A profile from its JSON text; ProfileError naming `where`, the field or the line."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"{where}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    try:
        return Profile.model_validate(data)
    except ValidationError as e:
        raise ProfileError(_format_validation(where, e)) from None


def load_profile(name_or_path: Union[str, os.PathLike[str]]) -> Profile:
    """A shipped profile by name (`shipped_profiles()`), or a profile JSON file by path."""
    s = os.fspath(name_or_path)
    is_path = isinstance(name_or_path, os.PathLike) or s.endswith(".json") or os.sep in s or "/" in s
    if not is_path and (PROFILES_DIR / f"{s}.json").is_file():
        path = PROFILES_DIR / f"{s}.json"
    elif is_path or os.path.isfile(s):
        path = Path(s)
    else:
        names = ", ".join(shipped_profiles()) or "none"
        raise ProfileError(f"unknown profile {s!r}: shipped profiles are {names}; or give the path of a JSON file")
    try:
        text = path.read_text()
    except OSError as e:
        raise ProfileError(f"{path}: cannot read the profile: {e.strerror or e}") from None
    return parse_profile(text, str(path))


# ---- fitting ---------------------------------------------------------------------------------
LINEAR_TERMS = (
    "overhead_s",
    "per_prefill_token_s",
    "per_prefill_attn_token_s",
    "per_prefill_seq_s",
    "per_decode_seq_s",
    "per_decode_context_token_s",
)
_SHAPE_FIELDS = (
    "prefill_tokens",
    "prefill_seqs",
    "prefill_attn_tokens",
    "decode_seqs",
    "decode_tokens",
    "decode_context_tokens",
)


def _linear_row(s: StepShape) -> list[float]:
    """The linear form's regressors for one shape, in LINEAR_TERMS order."""
    return [
        1.0,
        float(s.prefill_tokens + s.decode_tokens - s.decode_seqs),
        float(s.prefill_attn_tokens),
        float(s.prefill_seqs),
        float(s.decode_seqs),
        float(s.decode_context_tokens),
    ]


def relative_errors(step: LinearStep, samples: Sequence[tuple[StepShape, float]]) -> list[float]:
    coef = [getattr(step, k) for k in LINEAR_TERMS]
    out = []
    for shape, t in samples:
        pred = sum(c * x for c, x in zip(coef, _linear_row(shape)))
        out.append(abs(pred - t) / t)
    return out


def fit_linear(samples: Sequence[tuple[StepShape, float]]) -> tuple[LinearStep, FitStats]:
    """Fit the linear form to measured (shape, seconds) steps by non-negative least squares,
    each row weighted by 1 / seconds (so the relative error is what is minimized), and the
    fit's median, 90th-percentile and largest relative error on those samples."""
    import numpy as np

    try:
        from scipy.optimize import nnls
    except ImportError as e:  # scipy is a test dependency, not a runtime one
        raise ProfileError("fitting a profile needs scipy (pip install scipy)") from e

    if not samples:
        raise ProfileError("fit_linear: no samples")
    times = np.array([float(t) for _, t in samples])
    if not np.all(np.isfinite(times)) or np.any(times <= 0):
        raise ProfileError("fit_linear: every sample's seconds must be positive and finite")
    a = np.array([_linear_row(s) for s, _ in samples]) / times[:, None]
    b = np.ones(len(samples))
    # Columns differ by orders of magnitude (a constant against token counts in the
    # thousands): scale each to unit norm, which keeps the signs, so NNLS is well conditioned.
    norms = np.linalg.norm(a, axis=0)
    used = norms > 0
    x = np.zeros(a.shape[1])
    if used.any():
        sol, _ = nnls(a[:, used] / norms[used], b)
        x[used] = sol / norms[used]
    step = LinearStep.model_validate({k: float(max(v, 0.0)) for k, v in zip(LINEAR_TERMS, x)})
    rel = np.array(relative_errors(step, samples))
    ranges = {}
    for f in _SHAPE_FIELDS:
        vals = [float(getattr(s, f)) for s, _ in samples]
        ranges[f] = [min(vals), max(vals)]
    stats = FitStats(
        samples=len(samples),
        median_rel_error=float(np.median(rel)),
        p90_rel_error=float(np.percentile(rel, 90)),
        max_rel_error=float(rel.max()),
        ranges=ranges,
    )
    return step, stats


def calibrated_profile(
    samples: Sequence[tuple[StepShape, float]],
    *,
    name: str,
    hardware: str,
    model: str,
    model_shape: Union[ModelShape, dict[str, Any]],
    dtype: str,
    tensor_parallel_size: int,
    threads: Optional[int],
    source: str,
    kv_transfer: Optional[dict[str, Any]] = None,
    grid: Optional[dict[str, Any]] = None,
    created: Optional[str] = None,
    kv_cache_memory_bytes: Optional[int] = None,
) -> Profile:
    """A calibrated profile: `fit_linear` over measured steps, with the fit's errors.
    `created` defaults to today's date (UTC)."""
    step, stats = fit_linear(samples)
    if grid is not None:
        stats = stats.model_copy(update={"grid": grid})
    if created is None:
        import datetime

        created = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    data = {
        "name": name,
        "kind": "calibrated",
        "hardware": hardware,
        "model": model,
        "model_shape": model_shape.model_dump() if isinstance(model_shape, ModelShape) else model_shape,
        "dtype": dtype,
        "tensor_parallel_size": tensor_parallel_size,
        "threads": threads,
        "created": created,
        "source": source,
        "step": step.model_dump(),
        "fit": stats.model_dump(),
        "kv_transfer": {k: (v.model_dump() if isinstance(v, KVLink) else v) for k, v in (kv_transfer or {}).items()},
        "kv_cache_memory_bytes": kv_cache_memory_bytes,
    }
    try:
        return Profile.model_validate(data)
    except ValidationError as e:
        raise ProfileError(_format_validation(f"calibrated profile {name!r}", e)) from None


# ---- analytic profiles from published specs ---------------------------------------------------
# The date the tables below were written: analytic profiles carry it, so regenerating them
# writes the same bytes.
SPECS_DATE = "2026-12-02"

# Per-step CPU overhead of a GPU engine (scheduling, input preparation, kernel launches with
# CUDA graphs, sampling): an estimate, not a measurement.
GPU_STEP_OVERHEAD_S = 1e-3
# KV transfer by the shared-storage connector, measured between two H200 GPU caches
# (docs/benchmarks/results/2026-11-27-kv-transfer-h200.md: export + load of 11-360 MiB);
# bound by the per-block files, not the GPU, so used for every GPU.
SHARED_STORAGE_LINK = (
    0.72e9,
    3e-3,
    "measured: shared-storage export + load between H200 GPU caches, 11-360 MiB "
    "(docs/benchmarks/results/2026-11-27-kv-transfer-h200.md), a line through its "
    "export/load times: 0.72 GB/s, 3 ms",
)
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of GPU memory for weights + KV cache
GPU_ACTIVATION_RESERVE_BYTES = 2 * 2**30  # activations, CUDA graphs, NCCL buffers per GPU (estimate)


class GPUSpec(_Model):
    hardware: str
    peak_flops_bf16: float  # dense
    mem_bandwidth_bytes_s: float
    memory_bytes: int  # as nvidia-smi reports it
    interconnect_bandwidth_bytes_s: float  # per direction, between the GPUs of one TP group
    all_reduce_latency_s: float
    network_bytes_s: float  # cross-node, per GPU
    host_network_bytes_s: float  # the host's TCP network (Ray's object transfers)
    source: str


_NETWORK_NOTE = (
    "ray_object_store: Ray moves objects between nodes over TCP on the host network; "
    "latency 2 ms for the owner actor's lookup and ray.get (estimate). p2p: NCCL pulls "
    "GPU to GPU; latency 10 ms for the pull's store round trips and its two-rank group "
    "(estimate: the NCCL path has not run yet)."
)

GPUS: dict[str, GPUSpec] = {
    "h100": GPUSpec(
        hardware="NVIDIA H100 SXM5 80GB",
        peak_flops_bf16=989e12,
        mem_bandwidth_bytes_s=3.35e12,
        memory_bytes=81559 * 2**20,
        interconnect_bandwidth_bytes_s=450e9,
        all_reduce_latency_s=10e-6,
        network_bytes_s=50e9,
        host_network_bytes_s=12.5e9,
        source=(
            "NVIDIA H100 datasheet (SXM5): 989 TFLOP/s dense BF16 (1979 with sparsity), "
            "3.35 TB/s HBM3, 80 GB (81559 MiB as nvidia-smi reports), NVLink 4 900 GB/s "
            "(450 GB/s per direction, used for the ring all-reduce); 10 us per small all-reduce "
            "(estimate: one-shot all-reduce over NVLink). Network: 400 Gb/s RDMA per GPU "
            "(ConnectX-7 NDR, as in DGX/HGX H100) = 50 GB/s for p2p; host TCP 100 Gb/s "
            "(assumed) = 12.5 GB/s for ray_object_store."
        ),
    ),
    "h200": GPUSpec(
        hardware="NVIDIA H200 SXM 141GB",
        peak_flops_bf16=989e12,
        mem_bandwidth_bytes_s=4.8e12,
        memory_bytes=143771 * 2**20,
        interconnect_bandwidth_bytes_s=450e9,
        all_reduce_latency_s=10e-6,
        network_bytes_s=50e9,
        host_network_bytes_s=12.5e9,
        source=(
            "NVIDIA H200 datasheet (SXM): 989 TFLOP/s dense BF16, 4.8 TB/s HBM3e, 141 GB "
            "(143771 MiB as nvidia-smi reports), NVLink 4 900 GB/s (450 GB/s per direction); "
            "10 us per small all-reduce (estimate). Network: 400 Gb/s RDMA per GPU "
            "(ConnectX-7 NDR) = 50 GB/s for p2p; host TCP 100 Gb/s (assumed) = 12.5 GB/s."
        ),
    ),
    "l4": GPUSpec(
        hardware="NVIDIA L4 24GB (PCIe)",
        peak_flops_bf16=121e12,
        mem_bandwidth_bytes_s=300e9,
        memory_bytes=23034 * 2**20,
        interconnect_bandwidth_bytes_s=32e9,
        all_reduce_latency_s=30e-6,
        network_bytes_s=3.125e9,
        host_network_bytes_s=3.125e9,
        source=(
            "NVIDIA L4 datasheet: 242 TFLOP/s BF16 with sparsity = 121 dense, 300 GB/s GDDR6, "
            "24 GB (23034 MiB as nvidia-smi reports), PCIe Gen4 x16 (32 GB/s per direction, "
            "no NVLink: TP all-reduces cross PCIe; 30 us each, estimate). Network: 25 Gb/s "
            "(AWS g6 mid-size instances, assumed) = 3.125 GB/s, TCP."
        ),
    ),
    "a10g": GPUSpec(
        hardware="NVIDIA A10G 24GB (AWS, PCIe)",
        peak_flops_bf16=70e12,
        mem_bandwidth_bytes_s=600e9,
        memory_bytes=23028 * 2**20,
        interconnect_bandwidth_bytes_s=32e9,
        all_reduce_latency_s=30e-6,
        network_bytes_s=3.125e9,
        host_network_bytes_s=3.125e9,
        source=(
            "A10G (AWS G5's variant of the A10): 70 TFLOP/s dense BF16/FP16 tensor, as published "
            "for the A10G (e.g. Baseten, 'NVIDIA A10 vs A10G for ML model inference'); NVIDIA's "
            "A10 datasheet gives 125 dense, but AWS's part trades tensor throughput for CUDA-core "
            "clocks, so 70 is used. 600 GB/s GDDR6, 24 GB (23028 MiB as nvidia-smi reports), "
            "PCIe Gen4 x16 (32 GB/s per direction; 30 us per all-reduce, estimate). Network: "
            "25 Gb/s (AWS g5 mid-size instances, assumed) = 3.125 GB/s, TCP."
        ),
    ),
}

MODELS: dict[str, tuple[str, ModelShape, str]] = {
    "llama-3.1-8b": (
        "meta-llama/Llama-3.1-8B",
        ModelShape(
            num_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=14336,
            vocab_size=128256,
            num_params=8.03e9,
        ),
        "meta-llama/Llama-3.1-8B config.json: 32 layers, hidden 4096, 32 heads, 8 KV heads, "
        "head_dim 128, intermediate 14336, vocab 128256, untied LM head; 8.03e9 parameters",
    ),
    "llama-3.1-70b": (
        "meta-llama/Llama-3.1-70B",
        ModelShape(
            num_layers=80,
            hidden_size=8192,
            num_attention_heads=64,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=28672,
            vocab_size=128256,
            num_params=70.6e9,
        ),
        "meta-llama/Llama-3.1-70B config.json: 80 layers, hidden 8192, 64 heads, 8 KV heads, "
        "head_dim 128, intermediate 28672, vocab 128256, untied LM head; 70.6e9 parameters",
    ),
}

# The analytic profiles shipped in sim/profiles/: (gpu, model, tensor_parallel_size).
SHIPPED_ANALYTIC: tuple[tuple[str, str, int], ...] = (
    ("h100", "llama-3.1-8b", 1),
    ("h200", "llama-3.1-8b", 1),
    ("l4", "llama-3.1-8b", 1),
    ("a10g", "llama-3.1-8b", 1),
    ("h100", "llama-3.1-70b", 4),
    ("h100", "llama-3.1-70b", 8),
)


def analytic_name(gpu: str, model: str, tensor_parallel_size: int = 1) -> str:
    return f"{gpu}-{model}" + (f"-tp{tensor_parallel_size}" if tensor_parallel_size > 1 else "")


def _model_key(model: str) -> str:
    key = model.lower().rsplit("/", 1)[-1].removesuffix("-instruct").replace("meta-", "")
    if key not in MODELS:
        raise ProfileError(f"no model shape for {model!r}: known models are {', '.join(MODELS)}")
    return key


def analytic_profile(gpu: str, model: str, tensor_parallel_size: int = 1, dtype: str = "bfloat16") -> Profile:
    """A roofline profile of `model` on `tensor_parallel_size` GPUs of kind `gpu` (`GPUS`),
    from published specs; ProfileError when the weights do not fit the GPUs' memory."""
    spec = GPUS.get(gpu.lower())
    if spec is None:
        raise ProfileError(f"no specs for GPU {gpu!r}: known GPUs are {', '.join(GPUS)}")
    key = _model_key(model)
    model_name, shape, shape_source = MODELS[key]
    if dtype not in ("bfloat16", "float16"):
        raise ProfileError(f"analytic profiles know the GPUs' 16-bit peaks only, not {dtype!r}")
    tp = int(tensor_parallel_size)
    if tp < 1:
        raise ProfileError(f"tensor_parallel_size must be at least 1, got {tp}")
    nbytes = _dtype_bytes(dtype)
    weights_per_gpu = shape.num_params * nbytes / tp
    free_per_gpu = spec.memory_bytes * GPU_MEMORY_UTILIZATION - weights_per_gpu - GPU_ACTIVATION_RESERVE_BYTES
    if free_per_gpu <= 0:
        raise ProfileError(
            f"{model_name} in {dtype} needs {weights_per_gpu / 1e9:.1f} GB of weights per GPU at TP={tp}; "
            f"a {spec.hardware} has {spec.memory_bytes / 1e9:.1f} GB: use a larger tensor_parallel_size"
        )
    kv_memory = int(free_per_gpu) * tp
    step = RooflineStep(
        overhead_s=GPU_STEP_OVERHEAD_S,
        peak_flops=spec.peak_flops_bf16,
        mem_bandwidth_bytes_s=spec.mem_bandwidth_bytes_s,
        interconnect_bandwidth_bytes_s=spec.interconnect_bandwidth_bytes_s if tp > 1 else None,
        all_reduce_latency_s=spec.all_reduce_latency_s if tp > 1 else 0.0,
    )
    source = (
        f"analytic roofline, python -m fleetserve.sim.profile regenerate. GPU: {spec.source} "
        f"Model: {shape_source}. mfu 0.6 (large bf16 GEMMs reach ~60-70% of the dense peak), "
        f"mbu 0.8 (weight-streaming decode reaches ~80% of HBM bandwidth); step overhead "
        f"{GPU_STEP_OVERHEAD_S * 1e3:g} ms (estimate). KV cache: {GPU_MEMORY_UTILIZATION} of each "
        f"GPU's memory less its weights and {GPU_ACTIVATION_RESERVE_BYTES // 2**30} GiB for "
        f"activations (estimate). KV transfer: {_NETWORK_NOTE}"
    )
    links = {
        "p2p": KVLink(bandwidth_bytes_s=spec.network_bytes_s, latency_s=10e-3, source="analytic: published NIC rate"),
        "ray_object_store": KVLink(
            bandwidth_bytes_s=spec.host_network_bytes_s, latency_s=2e-3, source="analytic: assumed host network"
        ),
        "shared_storage": KVLink(
            bandwidth_bytes_s=SHARED_STORAGE_LINK[0], latency_s=SHARED_STORAGE_LINK[1], source=SHARED_STORAGE_LINK[2]
        ),
    }
    return Profile(
        name=analytic_name(gpu.lower(), key, tp),
        kind="analytic",
        hardware=spec.hardware + (f" x{tp}" if tp > 1 else ""),
        model=model_name,
        model_shape=shape,
        dtype=dtype,
        tensor_parallel_size=tp,
        threads=None,
        created=SPECS_DATE,
        source=source,
        step=step,
        kv_transfer=links,
        kv_cache_memory_bytes=kv_memory,
    )


def regenerate(directory: Union[str, os.PathLike[str]] = PROFILES_DIR) -> list[Path]:
    """Write the shipped analytic profiles (SHIPPED_ANALYTIC) into `directory`; other files
    there (calibrated profiles) are left alone."""
    out = []
    for gpu, model, tp in SHIPPED_ANALYTIC:
        p = analytic_profile(gpu, model, tp)
        out.append(p.save(Path(directory) / f"{p.name}.json"))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fleetserve.sim.profile", description="Step-cost profiles.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("regenerate", help="write the shipped analytic profiles into sim/profiles/")
    r.add_argument("--dir", default=str(PROFILES_DIR))
    sub.add_parser("list", help="the shipped profiles")
    s = sub.add_parser("show", help="check a profile and print a few step times")
    s.add_argument("profile", help="a shipped name or a JSON path")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "regenerate":
            for p in regenerate(args.dir):
                print(p)
        elif args.cmd == "list":
            for name in shipped_profiles():
                print(name)
        else:
            prof = load_profile(args.profile)
            cost = prof.cost_model()
            print(f"{prof.name}: {prof.kind}, {prof.hardware}, {prof.model}, TP={prof.tensor_parallel_size}")
            for label, shape in (
                ("decode 1 seq, 1k context", StepShape(decode_seqs=1, decode_tokens=1, decode_context_tokens=1024)),
                (
                    "decode 64 seqs, 1k context",
                    StepShape(decode_seqs=64, decode_tokens=64, decode_context_tokens=65536),
                ),
                (
                    "prefill 2048 tokens",
                    StepShape(prefill_tokens=2048, prefill_seqs=1, prefill_attn_tokens=2048 * 1024),
                ),
            ):
                print(f"  {label}: {cost.step_seconds(shape) * 1e3:.2f} ms")
    except ProfileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
