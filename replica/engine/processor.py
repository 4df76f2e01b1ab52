"""Between users and the EngineCore: prompts in, text out.

`InputProcessor` turns a prompt (text or token ids) and sampling params into
scheduler `Request`s, rejecting bad input with a `ValueError` that says what
is wrong. A request with `n > 1` becomes n child requests that share the
prompt (and so its prefix-cache blocks), as vLLM v1 does.

`OutputProcessor` turns `EngineCoreOutput`s into `RequestOutput` deltas: it
detokenizes incrementally, applies stop strings (asking the core to finish
the request), and records per-request latency metrics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from fleetserve.replica.engine.detokenizer import IncrementalDetokenizer
from fleetserve.replica.engine.metrics import EngineMetrics
from fleetserve.replica.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from fleetserve.scheduler import EngineCoreOutput, Request, SamplingParams
from fleetserve.scheduler.sampling_params import truncate_prompt

# vLLM's prompt forms: a string, token ids, {"prompt": str} (TextPrompt) or
# {"prompt_token_ids": [...]} (TokensPrompt; a "prompt" beside it is only its text).
PromptType = Union[str, list[int], dict[str, Any]]
_PROMPT_KEYS = {"prompt", "prompt_token_ids"}


class InputProcessor:
    def __init__(
        self, tokenizer, max_model_len: int, vocab_size: int, loras: Optional[dict[str, tuple[int, str]]] = None
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_id = tokenizer.eos_token_id
        # The LoRA adapters requests may name: name -> (engine id, `name@digest`, the key
        # their KV blocks are salted with); the engine adds and removes them.
        self.loras: dict[str, tuple[int, str]] = dict(loras or {})

    def tokenize(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, dict):
            return self._tokenize_dict(prompt)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise ValueError("the prompt must be a string or a list of token ids")
        return None, list(prompt)

    def _tokenize_dict(self, prompt: dict) -> tuple[Optional[str], list[int]]:
        unknown = set(prompt) - _PROMPT_KEYS
        if unknown:
            raise ValueError(
                f"prompt dict: unsupported keys {sorted(unknown)}; use 'prompt' (text) or 'prompt_token_ids'"
            )
        if "prompt_token_ids" in prompt:
            _, ids = self.tokenize(prompt["prompt_token_ids"])
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise ValueError("prompt dict: 'prompt' must be a string")
            return text, ids
        if not isinstance(prompt.get("prompt"), str):
            raise ValueError("prompt dict: needs 'prompt' (a string) or 'prompt_token_ids'")
        return self.tokenize(prompt["prompt"])

    def process(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        arrival_time: Optional[float] = None,
        cache_salt: Optional[str] = None,
        kv_transfer_params: Optional[dict[str, Any]] = None,
        lora_name: Optional[str] = None,
        tenant: Optional[str] = None,
        tenant_weight: float = 1.0,
        session: Optional[str] = None,
        predicted_output_tokens: Optional[int] = None,
    ) -> tuple[Optional[str], list[Request]]:
        lora_id, lora_key = self._lora(lora_name)
        text, token_ids = self.tokenize(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        if sampling_params.truncate_prompt_tokens is not None:
            kept = truncate_prompt(
                token_ids, sampling_params.truncate_prompt_tokens, self.max_model_len, sampling_params.max_tokens
            )
            if len(kept) < len(token_ids):
                text = None  # the text no longer matches the tokens
            token_ids = kept
        sampling_params = bounded_token_lists(sampling_params)
        self._check_ids(token_ids, sampling_params)
        if sampling_params.bad_words and sampling_params.bad_words_token_ids is None:
            sampling_params = sampling_params.replace(
                bad_words_token_ids=bad_words_token_ids(self.tokenizer, sampling_params.bad_words)
            )
        check_satisfiable(sampling_params, self.eos_token_id)
        if sampling_params.structured_outputs is not None:
            from fleetserve.replica.structured_output.backend import check

            check(sampling_params.structured_outputs)  # a bad schema/regex/grammar: ValueError
        if sampling_params.best_of is not None and sampling_params.best_of != sampling_params.n:
            raise ValueError("best_of different from n is not supported; use n")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        n = sampling_params.n
        requests = []
        for i in range(n):
            sp = sampling_params
            if n > 1:
                seed = None if sp.seed is None else sp.seed + i
                sp = sp.replace(n=1, best_of=None, seed=seed)
            rid = request_id if n == 1 else f"{request_id}#{i}"
            requests.append(
                Request(
                    rid,
                    token_ids,
                    sp,
                    self.eos_token_id,
                    arrival,
                    priority,
                    cache_salt,
                    kv_transfer_params,
                    lora_name,
                    lora_id,
                    lora_key,
                    tenant,
                    tenant_weight,
                    session=session,
                    predicted_output_tokens=predicted_output_tokens,
                )
            )
        return text, requests

    def _lora(self, lora_name: Optional[str]) -> tuple[int, Optional[str]]:
        """(adapter id, key) of `lora_name`; (0, None) for the base model."""
        if lora_name is None:
            return 0, None
        if lora_name not in self.loras:
            held = ", ".join(map(repr, self.loras)) or "none (start it with --lora-modules)"
            raise ValueError(f"LoRA adapter {lora_name!r} is not loaded; adapters: {held}")
        return self.loras[lora_name]

    def _check_ids(self, token_ids: list[int], sampling_params: SamplingParams) -> None:
        """The prompt fits the context and every token id (prompt, stop, bias, allowed) the
        vocabulary; ValueError naming which otherwise."""
        if sampling_params.continued_output_tokens >= len(token_ids):
            raise ValueError(
                f"continued_output_tokens ({sampling_params.continued_output_tokens}) must be "
                f"smaller than the prompt ({len(token_ids)} tokens)"
            )
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, but this model's maximum context length "
                f"is {self.max_model_len} tokens (prompt plus at least one output token)"
            )
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is out of the vocabulary (size {self.vocab_size})")
        bad = next((t for t in sampling_params.stop_token_ids if t >= self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids: {bad} is out of the vocabulary (size {self.vocab_size})")
        bad = next((t for t in (sampling_params.logit_bias or {}) if t >= self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"logit_bias: token id {bad} is out of the vocabulary (size {self.vocab_size})")
        for name in ("allowed_token_ids",):
            bad = next((t for t in (getattr(sampling_params, name) or ()) if t >= self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"{name}: token id {bad} is out of the vocabulary (size {self.vocab_size})")


# Bounds on the per-token maps of one request (every path: HTTP, gRPC, `LLM`). A request's
# lists become tensors once, when it is added, so a step's cost does not grow with them;
# the bounds cap what validation, transfer and that one build cost.
# OpenAI's API refuses a logit_bias of more than 300 entries (each in [-100, 100]).
MAX_LOGIT_BIAS = 300
# vLLM bounds allowed_token_ids by the vocabulary only; this is as many ids as half of the
# largest vocabularies hold (duplicates are counted as sent, then dropped).
MAX_ALLOWED_TOKEN_IDS = 1 << 17


def bounded_token_lists(sampling_params: SamplingParams) -> SamplingParams:
    """`sampling_params` with allowed_token_ids deduplicated (first occurrence kept; a new
    object, the caller's is untouched); ValueError naming the field past the bounds above.
    (logit_bias is a dict: its token ids are unique already.)"""
    bias, allowed = sampling_params.logit_bias, sampling_params.allowed_token_ids
    if bias is not None and len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
    if allowed is None:
        return sampling_params
    if len(allowed) > MAX_ALLOWED_TOKEN_IDS:
        raise ValueError(f"allowed_token_ids may hold at most {MAX_ALLOWED_TOKEN_IDS} ids, got {len(allowed)}")
    unique = list(dict.fromkeys(allowed))
    return sampling_params if len(unique) == len(allowed) else sampling_params.replace(allowed_token_ids=unique)


def check_satisfiable(sampling_params: SamplingParams, eos_token_id: Optional[int]) -> None:
    """ValueError naming allowed_token_ids when the request's own masks, as validation sees
    them, leave no token for its first output position: every allowed token is a one-token
    bad word, or a stop token (EOS unless ignore_eos, stop_token_ids) while min_tokens keeps
    those masked. (What only sampling can see, e.g. a grammar that forbids every allowed
    token, ends that request with finish_reason "error".)"""
    allowed = sampling_params.allowed_token_ids
    if not allowed:
        return
    banned = {w[0] for w in sampling_params.bad_words_token_ids or () if len(w) == 1}
    why = "bad_words ban" if banned else ""
    if sampling_params.min_tokens > 0:
        stops = set(sampling_params.stop_token_ids)
        if eos_token_id is not None and not sampling_params.ignore_eos:
            stops.add(eos_token_id)
        banned |= stops
        why = f"{why} or " if why else ""
        why += f"min_tokens={sampling_params.min_tokens} masks (EOS and stop_token_ids until then)"
    if banned and banned.issuperset(allowed):
        raise ValueError(
            f"allowed_token_ids: every allowed token is one that {why}, so no token could be sampled; "
            "allow another token or relax the other constraint"
        )


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's: each bad word as token ids, as it would start the text and, when a leading space
    makes it other tokens of the same count, as it would follow a word."""
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            continue
        out.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out


@dataclass
class _ChildState:
    parent: "_ParentState"
    index: int
    detok: IncrementalDetokenizer
    num_logprobs: Optional[int]
    finished: bool = False


@dataclass
class _ParentState:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    num_children: int
    num_finished: int = 0
    prompt_logprobs: Optional[list] = None
    prompt_logprob_ranks: Optional[list] = None
    prompt_logprobs_sent: bool = False
    itl: list[float] = field(default_factory=list)
    child_ids: list[str] = field(default_factory=list)
    max_tokens: int = 0


class OutputProcessor:
    def __init__(self, tokenizer, metrics: Optional[EngineMetrics] = None) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.children: dict[str, _ChildState] = {}
        self.parents: dict[str, _ParentState] = {}

    def add(self, request_id: str, prompt: Optional[str], requests: list[Request]) -> None:
        first = requests[0]
        parent = _ParentState(
            request_id,
            prompt,
            first.prompt_token_ids,
            RequestMetrics(first.arrival_time),
            len(requests),
            max_tokens=first.max_tokens,
        )
        if first.sampling_params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
            parent.prompt_logprob_ranks = [None]
        self.parents[request_id] = parent
        for i, r in enumerate(requests):
            detok = IncrementalDetokenizer(self.tokenizer, r.prompt_token_ids, r.sampling_params)
            self.children[r.request_id] = _ChildState(parent, i, detok, r.sampling_params.logprobs)
            parent.child_ids.append(r.request_id)

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return list(parent.child_ids) if parent is not None else []

    def has_unfinished(self) -> bool:
        return bool(self.parents)

    def mark_scheduled(self, child_ids: list[str], when: float) -> None:
        for cid in child_ids:
            child = self.children.get(cid)
            if child is not None and child.parent.metrics.first_scheduled_time is None:
                child.parent.metrics.first_scheduled_time = when

    def process(
        self, outputs: list[EngineCoreOutput], now: Optional[float] = None
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the RequestOutput deltas and the child ids a stop string finished."""
        now = time.monotonic() if now is None else now
        by_parent: dict[str, list[CompletionOutput]] = {}
        stopped: list[str] = []
        extra: dict[str, dict] = {}
        for out in outputs:
            child = self.children.get(out.request_id)
            if child is None:
                continue
            parent = child.parent
            # Every child of an n > 1 request computes the prompt's logprobs: keep the first's.
            if (
                out.new_prompt_logprobs
                and parent.prompt_logprobs is not None
                and parent.prompt_logprob_ranks is not None
                and child.index == 0
            ):
                parent.prompt_logprobs.extend(_to_dicts(out.new_prompt_logprobs))
                parent.prompt_logprob_ranks.extend(rank for _ids, _lps, rank in out.new_prompt_logprobs)
            completion = self._completion(child, out, stopped)
            if completion is None:
                continue
            self._observe(parent, len(out.new_token_ids), now)
            by_parent.setdefault(parent.request_id, []).append(completion)
            if (
                out.kv_transfer_params is not None
                or out.num_cached_tokens
                or out.embedding is not None
                or out.events is not None
            ):
                extra[parent.request_id] = {
                    "kv": out.kv_transfer_params,
                    "cached": out.num_cached_tokens,
                    "remote": out.num_remote_tokens,
                    "embedding": out.embedding,
                    "events": out.events,
                }
        results = []
        for rid, completions in by_parent.items():
            parent = self.parents[rid]
            finished = parent.num_finished == parent.num_children
            info = extra.get(rid, {})
            ro = RequestOutput(
                rid,
                parent.prompt,
                parent.prompt_token_ids,
                completions,
                finished,
                num_cached_tokens=info.get("cached", 0),
                metrics=parent.metrics,
                kv_transfer_params=info.get("kv"),
                num_remote_tokens=info.get("remote", 0),
                embedding=info.get("embedding"),
                events=info.get("events"),
            )
            if (
                parent.prompt_logprobs is not None
                and not parent.prompt_logprobs_sent
                and len(parent.prompt_logprobs) >= len(parent.prompt_token_ids)
            ):
                # Complete once the prompt is: streams can show them (echo) before the end.
                ro.prompt_logprobs = parent.prompt_logprobs
                ro.prompt_logprob_ranks = parent.prompt_logprob_ranks
                parent.prompt_logprobs_sent = True
            if finished:
                parent.metrics.finished_time = now
                if self.metrics is not None:
                    self.metrics.kv_transfer.observe_request(
                        len(parent.prompt_token_ids), info.get("cached", 0), info.get("remote", 0)
                    )
                ro.prompt_logprobs = parent.prompt_logprobs
                ro.prompt_logprob_ranks = parent.prompt_logprob_ranks
                ro.itl = parent.itl
                self._finish_parent(parent, completions)
            results.append(ro)
        return results, stopped

    def _completion(self, child: _ChildState, out: EngineCoreOutput, stopped: list[str]) -> Optional[CompletionOutput]:
        if child.finished:
            return None
        text, stop_str = child.detok.update(out.new_token_ids) if out.new_token_ids else ("", None)
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        token_ids = out.new_token_ids
        if stop_str is not None:
            finish_reason, stop_reason = "stop", stop_str
            if not out.finished:
                stopped.append(out.request_id)
        elif finish_reason is not None:
            text += child.detok.flush()
        if finish_reason is not None:
            child.finished = True
            child.parent.num_finished += 1
        # A request that asked for logprobs always carries a list (empty without new tokens).
        logprobs = _to_dicts(out.new_logprobs or ()) if child.num_logprobs is not None else None
        return CompletionOutput(child.index, text, list(token_ids), logprobs, finish_reason, stop_reason)

    def _observe(self, parent: _ParentState, num_new: int, now: float) -> None:
        m = parent.metrics
        if num_new:
            if m.first_token_time is None:
                m.first_token_time = now
                if self.metrics is not None:
                    self.metrics.ttft.observe(now - m.arrival_time)
                    self.metrics.prompt_tokens.inc(len(parent.prompt_token_ids))
            elif m.last_token_time is not None:
                parent.itl.append(now - m.last_token_time)
                if self.metrics is not None:
                    self.metrics.token_gap(now - m.last_token_time)
            m.last_token_time = now
            m.num_generation_tokens += num_new
            if self.metrics is not None:
                self.metrics.generation_tokens.inc(num_new)

    def _finish_parent(self, parent: _ParentState, completions: list[CompletionOutput]) -> None:
        self.parents.pop(parent.request_id, None)
        for cid in parent.child_ids:
            self.children.pop(cid, None)
        self._count_finished(parent, completions[-1].finish_reason or "abort")

    def abort(self, request_id: str) -> list[str]:
        """Forget a parent request; returns its child ids for the core to abort."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return []
        ids = parent.child_ids
        for cid in ids:
            self.children.pop(cid, None)
        if self.metrics is not None:
            parent.metrics.finished_time = time.monotonic()
        self._count_finished(parent, "abort")
        return ids

    def _count_finished(self, parent: _ParentState, reason: str) -> None:
        if self.metrics is None:
            return
        self.metrics.request_finished(
            reason, parent.metrics, len(parent.prompt_token_ids), max_tokens=parent.max_tokens, n=parent.num_children
        )


def _to_dicts(entries) -> list[dict[int, float]]:
    return [dict(zip(ids, lps)) for ids, lps, _rank in entries]
