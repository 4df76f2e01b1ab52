"""Sampling parameters of one request.

They live in `scheduler/` because the scheduler reads the stop fields
(`max_tokens`, `min_tokens`, `ignore_eos`, `stop_token_ids`); the model runner
reads the rest. Field names and defaults follow vLLM's `SamplingParams`, so
OpenAI-style requests map onto it one to one.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from fleetserve.scheduler.structured_outputs import StructuredOutputsParams


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    best_of: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # None: generate until EOS or max_model_len.
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    # OpenAI's logit_bias: token id -> value added to its logit before sampling.
    logit_bias: Optional[dict[int, float]] = None
    # Constrained decoding (vLLM's `structured_outputs`); the engine core compiles it.
    structured_outputs: Optional[StructuredOutputsParams] = None
    # Streaming: tokens per streamed output after the first (vLLM's `stream_interval`;
    # raises the engine's `--stream-interval` for this request, never lowers it).
    stream_interval: Optional[int] = None
    # vLLM's: only these token ids may be sampled.
    allowed_token_ids: Optional[list[int]] = None
    # vLLM's: words the output never contains. The engine's input processor fills
    # `bad_words_token_ids` (each word tokenized without and with a leading space); a token
    # that would complete one of them, after the output's last tokens, is never sampled.
    bad_words: Optional[list[str]] = None
    bad_words_token_ids: Optional[list[list[int]]] = None
    # vLLM's: keep only the prompt's last k tokens; -1: the last tokens that fit
    # (max_model_len minus max_tokens, or minus 1 when max_tokens is unset).
    truncate_prompt_tokens: Optional[int] = None
    # The prompt's last k tokens are output this request already produced elsewhere (a
    # migration continuation, router/migration.py): frequency and presence penalties, bad
    # words and a structured-output grammar count them as output, so the continuation goes
    # on exactly where the failed replica stopped. max_tokens and min_tokens do not.
    continued_output_tokens: int = 0
    # The output also carries the prompt's embedding: the final hidden state (after the last
    # norm) of its last token, L2-normalized (vLLM's LAST pooling with normalize=True); what
    # /v1/embeddings and `LLM.embed` ask for, with max_tokens=1.
    embed: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids)
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or not all(isinstance(w, str) for w in self.bad_words):
                raise ValueError(f"bad_words must be a list of strings, got {self.bad_words!r}")
            self.bad_words = list(self.bad_words)
            if any(not w.strip() for w in self.bad_words):
                raise ValueError("bad_words must be non-empty words")
        if self.bad_words_token_ids is not None:
            self.bad_words_token_ids = [_token_ids("bad_words_token_ids", w) for w in self.bad_words_token_ids]
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            # NaN passes every range check below (each comparison is False): a NaN temperature
            # sampled garbage from `LLM`/`fleetserve generate` (HTTP and gRPC refused it first).
            try:
                finite = math.isfinite(value)
            except TypeError:
                finite = False
            if not finite:
                raise bad(name, "must be a finite number")
        if self.n < 1:
            raise bad("n", "must be at least 1")
        if self.best_of is not None and self.best_of < self.n:
            raise bad("best_of", f"must be at least n={self.n}")
        if self.temperature < 0.0:
            raise bad("temperature", "must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < 0:
            raise bad("top_k", "must be -1 (disabled), 0 (disabled) or positive")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", "must be in (0, 2]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", "must be at least 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", "must be non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be at most max_tokens={self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", "must be in [0, 20]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise bad("prompt_logprobs", "must be in [0, 20]")
        if self.stream_interval is not None and (
            isinstance(self.stream_interval, bool)
            or not isinstance(self.stream_interval, int)
            or self.stream_interval < 1
        ):
            raise bad("stream_interval", "must be a positive integer")
        if self.truncate_prompt_tokens is not None and (
            isinstance(self.truncate_prompt_tokens, bool)
            or not isinstance(self.truncate_prompt_tokens, int)
            or not (self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1)
        ):
            raise bad("truncate_prompt_tokens", "must be -1 (as many as fit) or a positive integer")
        if (
            isinstance(self.continued_output_tokens, bool)
            or not isinstance(self.continued_output_tokens, int)
            or self.continued_output_tokens < 0
        ):
            raise bad("continued_output_tokens", "must be a non-negative integer")
        if self.embed and self.n != 1:
            raise ValueError(f"embed needs n=1, got {self.n}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def replace(self, **changes: Any) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


def _token_ids(name: str, value: object) -> list[int]:
    """A non-empty list of non-negative token ids (vLLM refuses an empty allowed_token_ids)."""
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):
        raise ValueError(f"{name} must be a list of token ids, got {value!r}")
    ids = list(value)
    if not ids:
        raise ValueError(f"{name} must not be empty")
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
        raise ValueError(f"{name} must be a list of non-negative token ids, got {ids!r}"[:200])
    return ids


def _logit_bias(bias: object) -> dict[int, float]:
    """OpenAI sends token ids as JSON object keys (strings); values lie in [-100, 100]."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
            value = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias must map token ids to numbers, got {key!r}: {value!r}") from None
        if token < 0:
            raise ValueError(f"logit_bias: token id {token} is negative")
        if not -100.0 <= value <= 100.0:
            raise ValueError(f"logit_bias: the bias of token {token} must be in [-100, 100], got {value}")
        out[token] = value
    return out


# Output tokens kept free by `truncate_prompt_tokens=-1` when a request sets no max_tokens
# (vLLM's default max_tokens of a completion).
TRUNCATE_DEFAULT_ROOM = 16


def truncate_prompt(
    token_ids: list[int], k: Optional[int], max_model_len: int, max_tokens: Optional[int] = None
) -> list[int]:
    """The prompt's last tokens as `truncate_prompt_tokens=k` asks (vLLM's left truncation):
    k >= 1 keeps the last k; -1 keeps the last ones that leave `max_tokens` (else
    `TRUNCATE_DEFAULT_ROOM`) tokens of the context for the output. ValueError naming the
    field when k cannot be honoured."""
    if k is None:
        return token_ids
    if isinstance(k, bool) or not isinstance(k, int) or not (k == -1 or k >= 1):
        raise ValueError(f"truncate_prompt_tokens must be -1 (as many as fit) or a positive integer, got {k!r}")
    if k == -1:
        room = max_tokens if max_tokens is not None else TRUNCATE_DEFAULT_ROOM
        keep = max_model_len - room
        if keep < 1:
            raise ValueError(
                f"truncate_prompt_tokens: max_tokens={room} leaves no room for a prompt in "
                f"this model's maximum context length of {max_model_len} tokens"
            )
    else:
        if k > max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens must be at most this model's maximum context length ({max_model_len}), got {k}"
            )
        keep = k
    return list(token_ids[-keep:]) if len(token_ids) > keep else token_ids
