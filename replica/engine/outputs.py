"""What the engine streams back to callers (vLLM's RequestOutput, in delta form).

Each item an `AsyncEngine.generate()` iterator yields carries only what is new
since the previous item: new text and token ids per completion index.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

# Per token: {token_id: logprob} for the sampled token and the top-N.
TokenLogprobs = dict[int, float]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str  # new text since the last yield
    token_ids: list[int]  # new token ids since the last yield
    logprobs: Optional[list[TokenLogprobs]] = None  # one entry per new token
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_generation_tokens: int = 0

    @property
    def queue_time(self) -> Optional[float]:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> Optional[float]:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def decode_tokens_per_s(self) -> Optional[float]:
        """Output tokens per second after the first token (None until there are two)."""
        if (
            self.first_token_time is None
            or self.last_token_time is None
            or self.last_token_time <= self.first_token_time
        ):
            return None
        return (self.num_generation_tokens - 1) / (self.last_token_time - self.first_token_time)

    @property
    def e2e(self) -> Optional[float]:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None
    # Per prompt position, the rank of the prompt's own token among the vocabulary (1: the
    # likeliest); its logprob is the first entry of that position's prompt_logprobs.
    prompt_logprob_ranks: Optional[list[Optional[int]]] = None
    metrics: Optional[RequestMetrics] = None
    kv_transfer_params: Optional[dict[str, Any]] = None
    # Of num_cached_tokens, the prompt tokens whose KV a KV connector loaded.
    num_remote_tokens: int = 0
    # Inter-token latencies (seconds) observed for this request, on the final item.
    itl: list[float] = field(default_factory=list)
    # SamplingParams.embed: the prompt's embedding (L2-normalized last-token hidden state).
    embedding: Optional[list[float]] = None
    # A traced request's engine-core scheduling events (scheduler.Request.events), on its
    # final item: router/tracing.py builds the replica's spans from them.
    events: Optional[list] = None


def merge_deltas(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive deltas of one request as one (`--stream-interval`, and `LLM` collecting
    whole outputs): per completion index the text, token ids and logprobs joined, the later
    finish; `first` is updated."""
    by_index = {c.index: c for c in first.outputs}
    for c in then.outputs:
        mine = by_index.get(c.index)
        if mine is None:  # a copy: later merges extend it, never the caller's delta
            mine = CompletionOutput(
                c.index,
                c.text,
                list(c.token_ids),
                None if c.logprobs is None else list(c.logprobs),
                c.finish_reason,
                c.stop_reason,
            )
            first.outputs.append(mine)
            by_index[c.index] = mine
            continue
        mine.text += c.text
        mine.token_ids = mine.token_ids + c.token_ids
        if c.logprobs is not None:
            mine.logprobs = (mine.logprobs or []) + c.logprobs
        mine.finish_reason, mine.stop_reason = c.finish_reason, c.stop_reason
    first.outputs.sort(key=lambda c: c.index)
    first.finished = then.finished
    first.num_cached_tokens = max(first.num_cached_tokens, then.num_cached_tokens)
    first.num_remote_tokens = max(first.num_remote_tokens, then.num_remote_tokens)
    if first.prompt_logprobs is None:
        first.prompt_logprobs = then.prompt_logprobs
        first.prompt_logprob_ranks = then.prompt_logprob_ranks
    first.metrics = then.metrics if then.metrics is not None else first.metrics
    first.kv_transfer_params = then.kv_transfer_params or first.kv_transfer_params
    first.itl = then.itl or first.itl
    first.embedding = first.embedding or then.embedding
    first.events = then.events or first.events
    return first


def num_new_tokens(out: RequestOutput) -> int:
    """The most new tokens any completion of a delta carries."""
    return max((len(c.token_ids) for c in out.outputs), default=0)
