"""N-gram prompt lookup (vLLM's "ngram" method): no model, just the context.

Find the longest n-gram (prompt_lookup_min <= n <= prompt_lookup_max) that
ends the sequence and occurred earlier in it; propose the k tokens that
followed its latest earlier occurrence. Copy-heavy outputs (quoting, editing,
summarising with quotes) repeat long stretches of the prompt, so whole
drafts are accepted; elsewhere short n-grams rarely recur and little is
proposed.

Cost: one vectorised numpy comparison per request for the shortest n-gram
(any longer match contains a shortest one, so no match ends the search), then
a few comparisons on the candidate positions only.
"""

from __future__ import annotations

import numpy as np

from fleetserve.replica.spec_decode.proposer import ProposeInput


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.lo = prompt_lookup_min
        self.hi = prompt_lookup_max

    def bytes_per_block(self) -> int:
        return 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        return None

    def propose(self, inp: ProposeInput) -> dict[str, list[int]]:
        out = {}
        for rid, tokens in zip(inp.req_ids, inp.token_ids):
            drafts = self.propose_one(np.asarray(tokens, dtype=np.int64))
            if drafts:
                out[rid] = drafts
        return out

    def propose_one(self, tokens: np.ndarray) -> list[int]:
        n_tok = len(tokens)
        lo = self.lo
        if n_tok <= lo:
            return []
        # ends[i]: the index right after an earlier occurrence of the last `lo` tokens
        # (windows of tokens[:-1] only, so every occurrence has a continuation).
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], lo)
        ends = np.flatnonzero((windows == tokens[n_tok - lo :]).all(axis=1)) + lo
        if ends.size == 0:
            return []
        # Extend every candidate backwards, one token at a time, up to prompt_lookup_max.
        length = np.full(ends.shape, lo)
        alive = np.ones(ends.shape, dtype=bool)
        for n in range(lo + 1, min(self.hi, n_tok - 1) + 1):
            idx = ends - n
            ok = alive & (idx >= 0)
            ok[ok] = tokens[idx[ok]] == tokens[n_tok - n]
            length[ok] = n
            alive = ok
            if not alive.any():
                break
        # Longest match; among equals the latest occurrence (the freshest context).
        best = np.flatnonzero(length == length.max())[-1]
        start = ends[best]
        return tokens[start : start + self.k].tolist()
