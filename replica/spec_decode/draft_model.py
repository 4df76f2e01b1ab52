"""A draft model beside the target: a smaller model that shares the tokenizer.

It has its own paged KV cache with the target's block ids and layout (one
block id names the same token positions in both caches), so it needs no
block table of its own: the scheduler reserves `num_speculative_tokens`
lookahead slots past each request's drafts for it.

Each step, after the target:

    1. mirror: run the target's exact forward (same tokens, positions,
       slots) through the draft model, so its KV covers everything the
       target's does (drafts included: where they were accepted, that KV
       is right; where not, the next mirror overwrites it);
    2. for each request that got tokens: feed its last token at position
       p0 = len(tokens) - 1, take the argmax, feed that, ... k times, one
       batched decode forward per draft position.

Drafts are greedy (a point mass per position), which keeps verification
exact for sampled requests too (see ModelRunner._sample_and_verify).
A request whose blocks end before p0 + k gets fewer drafts.
"""

from __future__ import annotations

import torch

from fleetserve.replica.layers.attention import AttentionMetadata
from fleetserve.replica.layers.sampler import greedy
from fleetserve.replica.model_loader.registry import resolve_model
from fleetserve.replica.model_loader.weights import allocate_kv_caches, kv_cache_bytes_per_block, load_model
from fleetserve.replica.spec_decode.proposer import ProposeInput


class DraftModelProposer:
    def __init__(
        self,
        model: str,
        num_speculative_tokens: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        target_hf_config,
    ) -> None:
        self.k = num_speculative_tokens
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.model, self.hf_config = load_model(resolve_model(model), dtype, device)
        if self.hf_config.vocab_size != target_hf_config.vocab_size:
            raise ValueError(
                f"the draft model {model!r} has a vocabulary of {self.hf_config.vocab_size} tokens, "
                f"the target {target_hf_config.vocab_size}: a draft model must share the tokenizer"
            )
        self.kv_caches: list[torch.Tensor] = []

    def bytes_per_block(self) -> int:
        return kv_cache_bytes_per_block(self.hf_config, self.block_size, self.dtype)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(self.hf_config, num_blocks, self.block_size, self.dtype, self.device)

    @torch.inference_mode()
    def propose(self, inp: ProposeInput) -> dict[str, list[int]]:
        self.model(inp.input_ids, inp.positions, self.kv_caches, inp.attn_metadata)
        if not inp.req_ids:
            return {}
        max_pos = self.model.max_position
        bs = self.block_size
        rows = []  # (req_id, p0, number of drafts, block ids)
        for rid, tokens, blocks in zip(inp.req_ids, inp.token_ids, inp.block_ids):
            p0 = len(tokens) - 1
            num = min(self.k, len(blocks) * bs - p0, max_pos - p0)
            if num > 0:
                rows.append((rid, p0, num, blocks))
        last = {rid: tokens[-1] for rid, tokens in zip(inp.req_ids, inp.token_ids)}
        drafts: dict[str, list[int]] = {rid: [] for rid, *_ in rows}
        for j in range(self.k):
            active = [r for r in rows if r[2] > j]
            if not active:
                break
            ids = [drafts[rid][-1] if j else last[rid] for rid, *_ in active]
            md = AttentionMetadata.build(
                [1] * len(active),
                [p0 + j for _, p0, _, _ in active],
                [blocks for *_, blocks in active],
                bs,
                self.device,
            )
            hidden = self.model(
                torch.tensor(ids, dtype=torch.long, device=self.device), md.positions, self.kv_caches, md
            )
            for (rid, *_), tok in zip(active, self._argmax(hidden)):
                drafts[rid].append(tok)
        return drafts

    def _argmax(self, hidden: torch.Tensor) -> list[int]:
        logits = self.model.compute_logits(hidden)[:, : self.hf_config.vocab_size]  # unpad the LM head
        return greedy(logits).tolist()
