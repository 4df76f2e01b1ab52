"""What one engine step costs: its shape (token counts) and the step-cost formulas.

Shared by the simulator (`sim/profile.py` wraps these formulas in its profiles' cost models,
`sim/shape.py` re-exports the shape) and by the router's SLO admission
(`router/routing/slo.py`), which predicts a request's time to first token on a replica from
the same formulas and a profile's JSON file; the router may import `scheduler`, never `sim`.
Pure Python on purpose: the simulator calls `step_seconds` once per simulated step.

The formulas (documented in full in `sim/profile.py`'s module docstring):

* linear (a calibrated profile): a fixed overhead plus a non-negative coefficient per count;
* roofline (an analytic profile): compute or memory traffic, whichever is slower, plus a
  fixed overhead and, for TP > 1, the all-reduces.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Union

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "fp8": 1,
    "float8_e4m3fn": 1,
}

# A flash-attention kernel's query tile: a prefill chunk's KV context is read once per tile.
ATTN_QUERY_TILE = 128


@dataclass(frozen=True, slots=True)
class StepShape:
    """One engine step as token counts.

    A prefill chunk of `n` new tokens for a request with `c` tokens already computed (or
    loaded from the prefix cache) adds `n` to `prefill_tokens` and `n * (c + n / 2)` to
    `prefill_attn_tokens` (the chunk's causal attention work against its context). A
    decode row with context `c` (its tokens so far) adds 1 to `decode_seqs`, 1 plus its
    draft tokens to `decode_tokens` and `c` to `decode_context_tokens`.
    """

    prefill_tokens: int = 0  # new tokens computed in prefill chunks
    prefill_seqs: int = 0  # requests with a prefill chunk in this step
    prefill_attn_tokens: float = 0.0  # sum over chunks of n * (c + n / 2)
    decode_seqs: int = 0  # requests decoding one token (plus drafts) this step
    decode_tokens: int = 0  # tokens computed for decode rows (1 each, + draft tokens)
    decode_context_tokens: int = 0  # sum of the decode rows' context lengths

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    @property
    def empty(self) -> bool:
        return self.num_tokens == 0


def step_shape(num_scheduled_tokens: Mapping[str, int], requests: Mapping[str, Any]) -> StepShape:
    """The shape of a step the scheduler just scheduled (`SchedulerOutput.num_scheduled_tokens`
    over `Scheduler.requests`), for the simulator and for `fleetserve profile` alike.

    `schedule()` has already advanced every scheduled request's `num_computed_tokens` by its
    tokens, so the context a chunk computes against is `num_computed_tokens - n` (prefix-cache
    hits included). A row is a decode when everything before the token(s) it computes is
    computed and the request has produced output; anything else (a prompt chunk, a recompute
    after a preemption, a prompt's last token after a full prefix hit) is a prefill chunk.
    Drafts are counted in `n` already."""
    p_tokens = p_seqs = d_seqs = d_tokens = d_ctx = 0
    p_attn = 0.0
    for rid, n in num_scheduled_tokens.items():
        r = requests[rid]
        num_tokens = r.num_tokens
        before = r.num_computed_tokens - n
        if before >= num_tokens - 1 and num_tokens > r.num_prompt_tokens:
            d_seqs += 1
            d_tokens += n
            d_ctx += num_tokens
        else:
            p_tokens += n
            p_seqs += 1
            p_attn += n * (before + n / 2)
    return StepShape(p_tokens, p_seqs, p_attn, d_seqs, d_tokens, d_ctx)


class StepCost(Protocol):
    def step_seconds(self, shape: StepShape) -> float: ...


class LinearStepCost:
    """t = overhead + per_prefill_token * (prefill tokens + drafts) + per_prefill_attn_token *
    prefill_attn_tokens + per_prefill_seq * prefill_seqs + per_decode_seq * decode_seqs +
    per_decode_context_token * decode_context_tokens (a calibrated profile's `step`)."""

    __slots__ = ("_c0", "_tok", "_attn", "_pseq", "_dseq", "_dctx")

    def __init__(
        self,
        overhead_s: float = 0.0,
        per_prefill_token_s: float = 0.0,
        per_prefill_attn_token_s: float = 0.0,
        per_prefill_seq_s: float = 0.0,
        per_decode_seq_s: float = 0.0,
        per_decode_context_token_s: float = 0.0,
    ) -> None:
        self._c0 = float(overhead_s)
        self._tok = float(per_prefill_token_s)
        self._attn = float(per_prefill_attn_token_s)
        self._pseq = float(per_prefill_seq_s)
        self._dseq = float(per_decode_seq_s)
        self._dctx = float(per_decode_context_token_s)

    def step_seconds(self, shape: StepShape) -> float:
        d_seqs = shape.decode_seqs
        return (
            self._c0
            + self._tok * (shape.prefill_tokens + shape.decode_tokens - d_seqs)
            + self._attn * shape.prefill_attn_tokens
            + self._pseq * shape.prefill_seqs
            + self._dseq * d_seqs
            + self._dctx * shape.decode_context_tokens
        )


class RooflineStepCost:
    """An analytic profile's step: overhead + max(FLOPs / (peak * mfu), bytes / (bandwidth *
    mbu)) + the TP all-reduces, per GPU (one TP rank); `sim/profile.py` derives the terms."""

    __slots__ = ("_c0", "_f_tok", "_f_head", "_f_attn", "_m_w", "_m_kv", "_ar_fixed", "_ar_tok")

    def __init__(self, step: Mapping[str, Any], model_shape: Mapping[str, Any], dtype: str, tp: int = 1) -> None:
        m = model_shape
        nbytes = dtype_bytes(dtype)
        flops_s = float(step["peak_flops"]) * float(step.get("mfu", 0.6))
        bytes_s = float(step["mem_bandwidth_bytes_s"]) * float(step.get("mbu", 0.8))
        layers, hidden = int(m["num_layers"]), int(m["hidden_size"])
        heads, kv_heads, head_dim = int(m["num_attention_heads"]), int(m["num_kv_heads"]), int(m["head_dim"])
        num_params = float(m["num_params"])
        embedding = int(m["vocab_size"]) * hidden
        tied = bool(m.get("tie_word_embeddings", False))
        body = num_params - embedding * (1 if tied else 2)
        self._c0 = float(step.get("overhead_s", 0.0))
        # seconds of compute per token, per sampled position, per attended key (one rank)
        self._f_tok = 2.0 * body / tp / flops_s
        self._f_head = 2.0 * embedding / tp / flops_s
        self._f_attn = 4.0 * layers * heads * head_dim / tp / flops_s
        # seconds of memory traffic per step (weights) and per token of KV (one rank's heads)
        weights = num_params - (0 if tied else embedding)
        self._m_w = weights * nbytes / tp / bytes_s
        kv_heads_rank = max(1.0, kv_heads / tp)  # heads are replicated when tp > kv heads
        self._m_kv = 2.0 * layers * kv_heads_rank * head_dim * nbytes / bytes_s
        if tp > 1:
            link = step.get("interconnect_bandwidth_bytes_s")
            if not link:
                raise ValueError("a roofline step with tensor_parallel_size > 1 needs interconnect_bandwidth_bytes_s")
            n_ar = 2 * layers
            self._ar_fixed = n_ar * float(step.get("all_reduce_latency_s", 0.0))
            self._ar_tok = n_ar * 2.0 * (tp - 1) / tp * hidden * nbytes / float(link)
        else:
            self._ar_fixed = self._ar_tok = 0.0

    def step_seconds(self, shape: StepShape) -> float:
        p_tok = shape.prefill_tokens
        d_tok = shape.decode_tokens
        d_seqs = shape.decode_seqs
        tokens = p_tok + d_tok
        p_attn = shape.prefill_attn_tokens
        d_ctx = shape.decode_context_tokens
        d_attn = d_ctx * d_tok / d_seqs if d_seqs else 0.0
        compute = self._f_tok * tokens + self._f_head * (d_tok + shape.prefill_seqs) + self._f_attn * (p_attn + d_attn)
        if p_tok:
            per_seq = shape.prefill_seqs / p_tok
            p_kv = p_attn * (per_seq if per_seq > 1.0 / ATTN_QUERY_TILE else 1.0 / ATTN_QUERY_TILE)
        else:
            p_kv = 0.0
        memory = self._m_w + self._m_kv * (d_ctx + p_kv + tokens)
        return self._c0 + (compute if compute > memory else memory) + self._ar_fixed + self._ar_tok * tokens


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPE_BYTES)}") from None


_LINEAR_FIELDS = (
    "overhead_s",
    "per_prefill_token_s",
    "per_prefill_attn_token_s",
    "per_prefill_seq_s",
    "per_decode_seq_s",
    "per_decode_context_token_s",
)
_ROOFLINE_REQUIRED = ("overhead_s", "peak_flops", "mem_bandwidth_bytes_s")
_SHAPE_REQUIRED = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
    "vocab_size",
    "num_params",
)


def step_cost_from_profile(
    data: Mapping[str, Any], where: str = "<profile>"
) -> Union[LinearStepCost, RooflineStepCost]:
    """The step cost of a step-cost profile (the JSON of `sim/profiles/*.json` or `fleetserve
    profile`, as a dict); ValueError naming `where` and the field when one is missing or bad.
    (The simulator validates a profile in full with its pydantic schema; this checks what the
    formulas read.)"""

    def number(d: Mapping[str, Any], key: str, path: str, positive: bool = False) -> float:
        v = d.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{where}: {path}.{key}: expected a non-negative number, got {v!r}")
        if positive and v <= 0:
            raise ValueError(f"{where}: {path}.{key}: must be positive, got {v!r}")
        return float(v)

    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: a profile is a JSON object")
    step = data.get("step")
    if not isinstance(step, Mapping):
        raise ValueError(f"{where}: step: missing (a profile's step cost: form linear or roofline)")
    form = step.get("form")
    if form == "linear":
        return LinearStepCost(**{k: number(step, k, "step") for k in _LINEAR_FIELDS if k in step})
    if form != "roofline":
        raise ValueError(f"{where}: step.form: expected 'linear' or 'roofline', got {form!r}")
    for k in _ROOFLINE_REQUIRED:
        number(step, k, "step", positive=k != "overhead_s")
    shape = data.get("model_shape")
    if not isinstance(shape, Mapping):
        raise ValueError(f"{where}: model_shape: missing (a roofline profile needs the model's shape)")
    for k in _SHAPE_REQUIRED:
        number(shape, k, "model_shape", positive=True)
    dtype = data.get("dtype", "bfloat16")
    try:
        dtype_bytes(dtype)
    except ValueError as e:
        raise ValueError(f"{where}: dtype: {e}") from None
    tp = data.get("tensor_parallel_size", 1)
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"{where}: tensor_parallel_size: expected a positive integer, got {tp!r}")
    try:
        return RooflineStepCost(step, shape, dtype, tp)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


# The profiles the package ships (data files beside the simulator's code; read, not imported).
SHIPPED_PROFILES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sim", "profiles")


def resolve_profile(name_or_path: Union[str, os.PathLike[str]]) -> str:
    """The file of a profile named as `fleetserve sim --profile` names one: a shipped profile's
    name (e.g. `h100-llama-3.1-8b`) or a path (`~` expanded)."""
    s = os.path.expanduser(os.fspath(name_or_path))
    shipped = os.path.join(SHIPPED_PROFILES_DIR, f"{s}.json")
    if os.sep not in s and not s.endswith(".json") and not os.path.exists(s) and os.path.isfile(shipped):
        return shipped
    return s


def read_profile_json(path: Union[str, os.PathLike[str]]) -> dict[str, Any]:
    """A profile's JSON (a shipped profile's name or a file: `resolve_profile`), checked by
    `step_cost_from_profile`; ValueError naming the file."""
    p = resolve_profile(path)
    try:
        with open(p) as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"{p}: cannot read the profile: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    step_cost_from_profile(data, p)
    out: dict[str, Any] = data
    return out
