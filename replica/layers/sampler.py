"""Batched sampling: one row of logits per request sampled this step.

    logits [N, V] ──(raw log-softmax, rows that asked for logprobs)──────────▶ logprobs
       │
       ├─ min_tokens: EOS and stop token ids -> -inf while the output is short
       ├─ penalties: repetition (prompt+output), frequency, presence (output)
       │
       ├─ greedy rows ─────────────────────────────── argmax ─────────────────▶ token
       └─ random rows: / temperature -> min-p -> softmax
              ├─ rows with top-k/top-p: the few largest probabilities
              │    (`topk`), cut by k then p, sample among them ───────────────▶ token
              └─ other rows: sample over the whole vocabulary ──────────────────▶ token

Every stage is one tensor operation over the rows that need it, never a
Python loop over the vocabulary; a stage no row uses costs nothing, and a batch
of greedy rows with no penalties is one `argmax`. A request's logit_bias and
allowed_token_ids are tensors built once, when the request is added
(`RequestSamplingTensors`); a step only gathers them per row. A row that the
masks together leave without any token fails alone (`SamplerOutput.failed_rows`),
and the rest of the batch is sampled as without it.

How a row is drawn differs from vLLM on purpose. vLLM divides the
probabilities by Exponential(1) noise and takes the argmax; on a CPU drawing
that noise costs more than the rest of sampling together, and its size would
depend on the candidate set, so a seeded row's draw would depend on the
batch. We use the inverse CDF instead: one uniform per row (from the row's own
generator when seeded), located in the cumulative distribution. It is exact
(float64 sums, found in two levels: blocks of 256, then inside one block) and
it draws the same token for a seeded row whatever else is in the batch.

top-p does not sort the vocabulary either (a batch-by-vocabulary sort is the
slowest thing sampling could do): the kept set is a prefix of the largest probabilities, so we take the
top 256 with `topk`, and only rows whose nucleus is wider than that are looked
at again with 8x more candidates. Figures for both: docs/deployment/cpu.md, "Figures behind the code".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Optional, Sequence, Union

import torch

from fleetserve.replica.kernels import ops_for
from fleetserve.replica.layers.request_tensors import (
    RequestSamplingTensors,
    fail_dead_rows,
    gather_disallowed,
    gather_logit_bias,
)
from fleetserve.scheduler.outputs import Logprobs
from fleetserve.scheduler.sampling_params import SamplingParams

# Candidates taken first for a top-p row; most nuclei fit.
_TOP_P_CANDIDATES = 256
# Block width of the two-level inverse CDF.
_CDF_BLOCK = 256
# Rows per chunk in compute_prompt_logprobs ([chunk, V] float32 at a time).
_PROMPT_LOGPROBS_CHUNK = 256


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The private RNG of a seeded request, on the device that samples it."""
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(int(seed) % (1 << 63))
    return gen


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, -1), through the CPU kernel when it applies: torch's CPU argmax
    walks each row one element at a time (docs/benchmarks/results/2026-11-25-cpu-kernels-epyc-avx512.md,
    "The argmax kernel")."""
    ops = ops_for(logits)
    if ops is not None and logits.dim() == 2 and logits.shape[1] > 0:
        return ops.argmax_rows(logits)
    return logits.argmax(-1)


Device = Union[torch.device, str]


def _long(values: Sequence[int], device: Device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _float(values: Sequence[float], device: Device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


@dataclass(slots=True)
class _Repetition:
    rows: torch.Tensor  # [T] row of each prompt/output token of a repetition row
    tokens: torch.Tensor  # [T]
    values: torch.Tensor  # [T] that row's repetition penalty


@dataclass(slots=True)
class _OutputPenalties:
    rows: torch.Tensor  # [U] row of each output token of a frequency/presence row
    tokens: torch.Tensor  # [U]
    frequency: torch.Tensor  # [N]
    presence: torch.Tensor  # [N]


@dataclass(slots=True)
class _Penalties:
    """Sparse (row, token) lists: the work is O(tokens seen), not O(N x V)."""

    repetition: Optional[_Repetition]  # None: no row has a repetition penalty
    output: Optional[_OutputPenalties]  # None: no row has a frequency or presence penalty


@dataclass(slots=True)
class _TopKTopP:
    """The random rows with top-k or top-p."""

    positions: torch.Tensor  # [F] positions in `_RandomRows.rows`
    top_k: torch.Tensor  # [F] k (V when top-k is off)
    top_p: torch.Tensor  # [F] p (1.0 when top-p is off)


@dataclass(slots=True)
class _RandomRows:
    """Parameters of the rows that are sampled (temperature > 0), in `rows` order."""

    rows: torch.Tensor  # [R] row index in the batch
    all_rows: bool  # rows == arange(N): work on the logits in place
    temperature: torch.Tensor  # [R]
    log_min_p: Optional[torch.Tensor]  # [R] log(min_p), -inf where min_p == 0; None: no row uses it
    filtered: Optional[_TopKTopP]  # None: no row has top-k or top-p
    unfiltered: Optional[torch.Tensor]  # [R-F] the other positions; None when empty
    first_k: int  # candidates to take first for the filtered rows
    generators: list[tuple[int, torch.Generator]]  # (position in `rows`, generator) of seeded rows


@dataclass(slots=True)
class SamplingBatch:
    """Everything the sampler needs for one step, as tensors on the device."""

    num_rows: int
    vocab_size: int
    device: torch.device
    greedy_rows: Optional[torch.Tensor]  # [G]; None when no row is greedy
    random: Optional[_RandomRows]  # None when every row is greedy
    penalties: Optional[_Penalties]  # None when no row uses a penalty
    min_tokens_mask: Optional[tuple[torch.Tensor, torch.Tensor]]  # (rows, token ids) to set to -inf
    logprobs_rows: Optional[torch.Tensor]  # [L] rows that asked for logprobs
    logprobs_k: list[int]  # [L] top-k asked by each of those rows
    # (rows, token ids, values) added to the logits: OpenAI's logit_bias.
    logit_bias: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
    # (rows, packed bitmask [C, ceil(V/32)] int32) of grammar-constrained rows: a token
    # whose bit is 0 is not allowed. Set by the model runner from the step's grammar output.
    token_bitmask: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    # (rows, [rows, V] bool, True where the token is not allowed): vLLM's allowed_token_ids.
    disallowed: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    # (rows, token ids) to set to -inf: the last token of each bad word whose other tokens
    # end the output (vLLM's bad_words).
    bad_words_mask: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[Optional[torch.Generator]],
        eos_token_id: Optional[int],
        vocab_size: int,
        device: Device,
        request_tensors: Optional[Sequence[Optional[RequestSamplingTensors]]] = None,
    ) -> "SamplingBatch":
        """`request_tensors`: each row's `RequestSamplingTensors` as built when its request
        was added (a request's draft positions share its entry); None builds them here, from
        `params` (callers that sample once)."""
        n = len(params)
        if not (len(prompt_token_ids) == len(output_token_ids) == len(generators) == n):
            raise ValueError("params, prompt_token_ids, output_token_ids and generators must have one entry per row")
        device = torch.device(device)
        if request_tensors is None:
            request_tensors = [RequestSamplingTensors.build(p, vocab_size, device) for p in params]
        elif len(request_tensors) != n:
            raise ValueError("request_tensors must have one entry per row")
        greedy = [i for i, p in enumerate(params) if p.greedy]
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        lp_asked = [(i, p.logprobs) for i, p in enumerate(params) if p.logprobs is not None]
        lp_rows = [i for i, _ in lp_asked]
        # Output so far as penalties and bad words see it: a migration continuation's
        # output began on the failed replica (the prompt's last continued_output_tokens).
        seen = [_seen(p, prompt, out) for p, prompt, out in zip(params, prompt_token_ids, output_token_ids)]
        return cls(
            num_rows=n,
            vocab_size=vocab_size,
            device=device,
            greedy_rows=_long(greedy, device) if greedy else None,
            random=_build_random(params, random_rows, generators, vocab_size, n, device) if random_rows else None,
            penalties=_build_penalties(params, prompt_token_ids, output_token_ids, seen, device),
            min_tokens_mask=_build_min_tokens(params, output_token_ids, eos_token_id, vocab_size, device),
            logprobs_rows=_long(lp_rows, device) if lp_rows else None,
            logprobs_k=[k for _, k in lp_asked],
            logit_bias=gather_logit_bias(request_tensors, device),
            disallowed=gather_disallowed(request_tensors, device),
            bad_words_mask=_build_bad_words(params, seen, vocab_size, device),
        )


def _seen(p: SamplingParams, prompt: list[int], out: list[int]) -> list[int]:
    k = p.continued_output_tokens
    return out if not k else list(prompt[len(prompt) - k :]) + list(out)


def _build_random(
    params: list[SamplingParams],
    rows: list[int],
    generators: list[Optional[torch.Generator]],
    vocab_size: int,
    n: int,
    device: Device,
) -> _RandomRows:
    ps = [params[i] for i in rows]
    # top_k >= vocab_size keeps everything: the same as no top-k.
    is_filtered = [0 < p.top_k < vocab_size or p.top_p < 1.0 for p in ps]
    filtered = [j for j, f in enumerate(is_filtered) if f]
    unfiltered = [j for j, f in enumerate(is_filtered) if not f]
    ks = [min(ps[j].top_k, vocab_size) if ps[j].top_k > 0 else vocab_size for j in filtered]
    # Enough candidates for every top-k row, and a first guess for rows with top-p alone.
    first_k = max((k for k in ks if k < vocab_size), default=1)
    if any(k == vocab_size for k in ks):
        first_k = min(vocab_size, max(first_k, _TOP_P_CANDIDATES))
    min_ps = [p.min_p for p in ps]
    return _RandomRows(
        rows=_long(rows, device),
        all_rows=len(rows) == n,
        temperature=_float([p.temperature for p in ps], device),
        log_min_p=_float(min_ps, device).log() if any(m > 0.0 for m in min_ps) else None,
        filtered=_TopKTopP(_long(filtered, device), _long(ks, device), _float([ps[j].top_p for j in filtered], device))
        if filtered
        else None,
        unfiltered=_long(unfiltered, device) if unfiltered else None,
        first_k=first_k,
        generators=[(j, g) for j, g in enumerate(generators[i] for i in rows) if g is not None],
    )


def _build_penalties(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    seen: list[list[int]],
    device: Device,
) -> Optional[_Penalties]:
    """Repetition counts prompt and output (the prompt already holds continued output);
    frequency and presence count the output as `seen` (continued output included)."""
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    out = [i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
    rep = [i for i in rep if prompt_token_ids[i] or output_token_ids[i]]
    out = [i for i in out if seen[i]]
    if not rep and not out:
        return None
    pen = _Penalties(None, None)
    if rep:
        lengths = [len(prompt_token_ids[i]) + len(output_token_ids[i]) for i in rep]
        counts = _long(lengths, device)
        pen.repetition = _Repetition(
            torch.repeat_interleave(_long(rep, device), counts),
            _long(list(chain.from_iterable(chain(prompt_token_ids[i], output_token_ids[i]) for i in rep)), device),
            torch.repeat_interleave(_float([params[i].repetition_penalty for i in rep], device), counts),
        )
    if out:
        counts = _long([len(seen[i]) for i in out], device)
        pen.output = _OutputPenalties(
            torch.repeat_interleave(_long(out, device), counts),
            _long(list(chain.from_iterable(seen[i] for i in out)), device),
            _float([p.frequency_penalty for p in params], device),
            _float([p.presence_penalty for p in params], device),
        )
    return pen


def _build_bad_words(
    params: list[SamplingParams], seen: list[list[int]], vocab_size: int, device: Device
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    rows: list[int] = []
    tokens: list[int] = []
    for i, p in enumerate(params):
        if not p.bad_words_token_ids:
            continue
        out = seen[i]
        for word in p.bad_words_token_ids:
            before = len(word) - 1
            if word[-1] < vocab_size and (
                before == 0 or (len(out) >= before and list(out[len(out) - before :]) == word[:-1])
            ):
                rows.append(i)
                tokens.append(word[-1])
    return (_long(rows, device), _long(tokens, device)) if rows else None


def _build_min_tokens(
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    eos_token_id: Optional[int],
    vocab_size: int,
    device: Device,
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    rows: list[int] = []
    tokens: list[int] = []
    for i, p in enumerate(params):
        if len(output_token_ids[i]) >= p.min_tokens:
            continue
        stops = set(p.stop_token_ids)
        if eos_token_id is not None and not p.ignore_eos:
            stops.add(eos_token_id)
        kept = sorted(t for t in stops if t < vocab_size)
        rows.extend([i] * len(kept))
        tokens.extend(kept)
    return (_long(rows, device), _long(tokens, device)) if rows else None


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: list[int]
    # Per row: ([sampled] + top-k ids, their raw logprobs, rank of the sampled
    # token), or None for a row that did not ask for logprobs.
    logprobs: list[Optional[tuple[list[int], list[float], int]]]
    # Rows whose masks together allowed no token at all (e.g. allowed_token_ids that the
    # grammar forbids): their entry in sampled_token_ids is a placeholder in the
    # vocabulary, never to be used; every other row is sampled as if they were not there.
    failed_rows: list[int] = field(default_factory=list)


class Sampler:
    """`Sampler()(logits, batch)`. The logits may be modified in place."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != batch.num_rows:
            raise ValueError(f"logits must be [{batch.num_rows}, V], got {tuple(logits.shape)}")
        if logits.shape[1] > batch.vocab_size:  # a padded LM head
            logits = logits[:, : batch.vocab_size]
        if logits.dtype != torch.float32:
            logits = logits.float()
        # vLLM reports the logprobs of the raw logits, before any processing.
        raw_logprobs = None
        if batch.logprobs_rows is not None:
            asked = logits if len(batch.logprobs_k) == batch.num_rows else logits.index_select(0, batch.logprobs_rows)
            raw_logprobs = asked.log_softmax(-1)
        if batch.logit_bias is not None:
            rows, tokens, values = batch.logit_bias
            logits.index_put_((rows, tokens), values, accumulate=True)
        if batch.token_bitmask is not None:
            apply_token_bitmask(logits, *batch.token_bitmask)
        if batch.min_tokens_mask is not None:
            logits.index_put_(batch.min_tokens_mask, torch.tensor(float("-inf"), device=logits.device))
        if batch.disallowed is not None:
            rows, mask = batch.disallowed
            logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(mask, float("-inf")))
        if batch.bad_words_mask is not None:
            logits.index_put_(batch.bad_words_mask, torch.tensor(float("-inf"), device=logits.device))
        if batch.penalties is not None:
            _apply_penalties(logits, batch.penalties)
        failed = fail_dead_rows(
            logits, (batch.disallowed, batch.token_bitmask, batch.min_tokens_mask, batch.bad_words_mask)
        )

        if batch.random is None:
            sampled = greedy(logits)
        else:
            sampled = torch.empty(batch.num_rows, dtype=torch.long, device=logits.device)
            if batch.greedy_rows is not None:
                sampled[batch.greedy_rows] = greedy(logits.index_select(0, batch.greedy_rows))
            sampled[batch.random.rows] = _sample_random(logits, batch.random)
        sampled_list = sampled.tolist()
        logprobs: list[Optional[tuple[list[int], list[float], int]]] = [None] * batch.num_rows
        lp_rows = batch.logprobs_rows
        if raw_logprobs is not None and lp_rows is not None:
            chosen = sampled.index_select(0, lp_rows)
            for row, entry in zip(lp_rows.tolist(), _gather_logprobs(raw_logprobs, chosen, batch.logprobs_k)):
                logprobs[row] = entry
        return SamplerOutput(sampled_list, logprobs, failed)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """-inf where a constrained row's packed bitmask has a 0 bit (xgrammar's layout: token t
    is bit t % 32 of word t // 32), in place; other rows are untouched. xgrammar's own kernel
    (CPU, CUDA), which is far faster than unpacking the bits with torch ops
    (docs/deployment/cpu.md, "Figures behind the code")."""
    import xgrammar

    full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32, device=logits.device)
    full.index_copy_(0, rows.to(logits.device), bitmask.to(logits.device))
    target = logits if logits.is_contiguous() else logits.contiguous()  # a padded LM head's view
    xgrammar.apply_token_bitmask_inplace(target, full, vocab_size=logits.shape[1], indices=rows.tolist())
    if target is not logits:
        logits.copy_(target)


def _apply_penalties(logits: torch.Tensor, pen: _Penalties) -> None:
    """vLLM's order: repetition (HF semantics), then frequency, then presence (OpenAI)."""
    rep = pen.repetition
    if rep is not None:
        # Duplicated (row, token) pairs compute the same value from the same
        # input, so writing them all is correct without deduplication.
        idx = (rep.rows, rep.tokens)
        seen = logits[idx]
        logits.index_put_(idx, torch.where(seen > 0, seen / rep.values, seen * rep.values))
    out = pen.output
    if out is not None:
        idx = (out.rows, out.tokens)
        # Each occurrence subtracts the frequency penalty once: count * penalty.
        logits.index_put_(idx, -out.frequency[out.rows], accumulate=True)
        vocab = logits.shape[1]
        unique = torch.unique(out.rows * vocab + out.tokens)
        rows, tokens = unique // vocab, unique % vocab
        logits.index_put_((rows, tokens), -out.presence[rows], accumulate=True)


def _sample_random(logits: torch.Tensor, rnd: _RandomRows) -> torch.Tensor:
    """Token ids [R] for the random rows."""
    x = logits if rnd.all_rows else logits.index_select(0, rnd.rows)  # [R, V]
    x.div_(rnd.temperature.unsqueeze(1))
    if rnd.log_min_p is not None:
        # min-p on the tempered distribution: p < min_p * p_max  <=>  x < x_max + log(min_p).
        threshold = x.amax(-1, keepdim=True) + rnd.log_min_p.unsqueeze(1)
        x.masked_fill_(x < threshold, float("-inf"))
    probs = x.softmax(-1)
    uniforms = _uniforms(len(rnd.temperature), rnd.generators, probs.device)
    filtered = rnd.filtered
    if filtered is None:
        return _inverse_cdf(probs, uniforms)
    if rnd.unfiltered is None:
        return _sample_top_k_top_p(probs, filtered.top_k, filtered.top_p, uniforms, rnd.first_k)
    out = torch.empty(len(rnd.temperature), dtype=torch.long, device=probs.device)
    f = filtered.positions
    out[f] = _sample_top_k_top_p(
        probs.index_select(0, f), filtered.top_k, filtered.top_p, uniforms.index_select(0, f), rnd.first_k
    )
    u = rnd.unfiltered
    out[u] = _inverse_cdf(probs.index_select(0, u), uniforms.index_select(0, u))
    return out


def _uniforms(num: int, generators: list[tuple[int, torch.Generator]], device: Device) -> torch.Tensor:
    """One U[0, 1) per row, float64; seeded rows draw from their own generator."""
    u = torch.rand(num, dtype=torch.float64, device=device)
    if generators:
        pos = _long([j for j, _ in generators], device)
        u[pos] = torch.cat([torch.rand(1, dtype=torch.float64, device=device, generator=g) for _, g in generators])
    return u


def _sample_top_k_top_p(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor, first_k: int
) -> torch.Tensor:
    """Sample rows [F, V] restricted to their top-k, then to their nucleus of mass p.

    top-k keeps the k largest probabilities; top-p then keeps, in decreasing
    order, every token whose preceding mass (renormalized over the top-k) is
    below p, so at least one. Both keep a prefix of the sorted probabilities,
    so `topk` of enough candidates is exact. `first_k` covers every top-k row;
    a row with top-p alone whose nucleus is wider is redone with more.
    """
    vocab = probs.shape[1]
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    pending = torch.arange(probs.shape[0], device=probs.device)
    k_cand = first_k
    while pending.numel():
        rows = probs if pending.numel() == probs.shape[0] else probs.index_select(0, pending)
        vals, idx = rows.topk(k_cand, dim=-1)  # [P, K], descending
        ks, ps = top_k.index_select(0, pending), top_p.index_select(0, pending)
        vals64 = vals.double()
        cum = vals64.cumsum(-1)
        k_eff = ks.clamp(max=k_cand)
        mass = torch.where(ks < vocab, cum.gather(1, (k_eff - 1).unsqueeze(1)).squeeze(1), torch.ones_like(cum[:, 0]))
        position = torch.arange(k_cand, device=probs.device).unsqueeze(0)
        keep = ((cum - vals64) < ps.double().unsqueeze(1) * mass.unsqueeze(1)) & (position < k_eff.unsqueeze(1))
        # A row is settled when its cut lies inside the candidates: it has a
        # top-k (first_k >= k), the nucleus ends before the last candidate, or
        # all of the vocabulary is in.
        done = (ks < vocab) | ~keep[:, -1] | (k_cand >= vocab)
        if bool(done.all()):
            chosen = _inverse_cdf(vals * keep, uniforms.index_select(0, pending))
            out[pending] = idx.gather(1, chosen.unsqueeze(1)).squeeze(1)
            break
        d = done.nonzero().squeeze(1)
        if d.numel():
            chosen = _inverse_cdf((vals * keep).index_select(0, d), uniforms.index_select(0, pending[d]))
            out[pending[d]] = idx.index_select(0, d).gather(1, chosen.unsqueeze(1)).squeeze(1)
        pending = pending[~done]
        k_cand = min(vocab, k_cand * 8)
    return out


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index [R] drawn from each row of non-negative `weights` [R, C] (need not sum to 1).

    Two levels so that float64 sums stay cheap: pick a block of `_CDF_BLOCK`
    columns from the blocks' cumulative mass, then a column inside it. A
    column of weight 0 is never drawn: `searchsorted(..., right=True)` returns
    the first position whose running sum exceeds the target, and that
    position added mass.
    """
    r, c = weights.shape
    pad = (-c) % _CDF_BLOCK
    w = torch.nn.functional.pad(weights, (0, pad)) if pad else weights
    blocks = w.reshape(r, -1, _CDF_BLOCK)  # [R, B, 256]
    # A block's float32 sum is accurate relative to that block's own mass;
    # only the running sum across blocks needs float64.
    block_cum = blocks.sum(-1).double().cumsum_(-1)  # [R, B]
    total = block_cum[:, -1:]
    target = torch.minimum(uniforms.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    b = torch.searchsorted(block_cum, target, right=True).clamp_(max=block_cum.shape[1] - 1)  # [R, 1]
    before = torch.where(b > 0, block_cum.gather(1, (b - 1).clamp(min=0)), torch.zeros_like(target))
    inner = blocks.gather(1, b.unsqueeze(2).expand(r, 1, _CDF_BLOCK)).squeeze(1).double().cumsum_(-1)  # [R, 256]
    rest = torch.minimum(target - before, torch.nextafter(inner[:, -1:], torch.zeros_like(target)))
    j = torch.searchsorted(inner, rest.clamp_(min=0.0), right=True).clamp_(max=_CDF_BLOCK - 1)
    return (b * _CDF_BLOCK + j).squeeze(1)


def _gather_logprobs(
    logprobs: torch.Tensor, chosen: torch.Tensor, ks: list[int]
) -> list[tuple[list[int], list[float], int]]:
    """Rows of ([chosen] + top-k ids, logprobs, rank of chosen); rank 1 = most likely."""
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))  # [L, 1]
    # As vLLM: the rank counts tokens at least as likely as the chosen one.
    ranks = (logprobs >= chosen_lp).sum(-1, dtype=torch.int32).tolist()
    max_k = max(ks, default=0)
    top_lp: list[list[float]] = []
    top_ids: list[list[int]] = []
    if max_k:
        top_lp_t, top_ids_t = logprobs.topk(max_k, dim=-1)
        top_lp, top_ids = top_lp_t.tolist(), top_ids_t.tolist()
    chosen_ids: list[int] = chosen.tolist()
    chosen_lps: list[float] = chosen_lp.squeeze(1).tolist()
    out = []
    for i, k in enumerate(ks):
        ids, lps = [chosen_ids[i]], [chosen_lps[i]]
        if k:
            ids += top_ids[i][:k]
            lps += top_lp[i][:k]
        out.append((ids, lps, ranks[i]))
    return out


def compute_prompt_logprobs(logits: torch.Tensor, target_token_ids: torch.Tensor | Sequence[int], num: int) -> Logprobs:
    """Entry i: the logprob of target i (prompt token i+1) under logits row i, plus the top-`num`."""
    targets = torch.as_tensor(target_token_ids, dtype=torch.long, device=logits.device)
    if logits.dim() != 2 or logits.shape[0] != targets.shape[0]:
        raise ValueError(f"logits [P, V] and targets [P] disagree: {tuple(logits.shape)} vs {tuple(targets.shape)}")
    out: Logprobs = []
    for start in range(0, logits.shape[0], _PROMPT_LOGPROBS_CHUNK):
        chunk = logits[start : start + _PROMPT_LOGPROBS_CHUNK].float().log_softmax(-1)
        out.extend(_gather_logprobs(chunk, targets[start : start + _PROMPT_LOGPROBS_CHUNK], [num] * chunk.shape[0]))
    return out
