"""Paged attention over a block-structured KV cache.

KV cache layout, one tensor per layer (each rank: its local kv heads):

    kv_cache: [2, num_kv_heads, num_blocks, block_size, head_dim]      (0 = K, 1 = V)

Head-major, so that the keys of one kv head for a whole decode batch come out
of one `index_select` as a contiguous [B, L, head_dim] slab per head, ready
for a batched matmul with no permute copy (see below). A token's slot is
`block_id * block_size + offset`; block b of a layer is `kv_cache[:, :, b]`
(what the KV connectors move).

One forward mixes requests, their tokens flattened in request order with no
padding. For request i with `context_lens[i]` tokens already cached and
`query_lens[i]` new tokens:

    tokens  |---- req 0 (prefill chunk) ----|r1|r2|---- req 3 (continuation) ----|
    keys    req 3 sees its cached context [0, ctx) and, causally, its own chunk

* every new K/V is written through `slot_mapping` (one `index_copy_` per layer);
* **decodes** (query_len == 1) go through one batched computation per layer:
  the blocks of all decode rows (all kv heads at once) are gathered with one
  `index_select` into [kv_heads, B, L, head_dim] (L = longest row, padded to
  whole blocks), and attention is two `bmm`s over the kv_heads * B batch with
  the query heads of a group as the M dimension -- GQA costs nothing, the
  cache is never repeated per query head -- and an additive length mask;
* **prefill chunks** (query_len > 1) run `scaled_dot_product_attention` per
  request (its `enable_gqa`, no repeated K/V): causal on the new K/V when there is no cached context, otherwise
  over the request's blocks read back from the cache with a causal mask
  shifted by the context length.

All index tensors are built once per step (`AttentionMetadata.build`, and the
per-cache-shape gather index memoized on first use) and reused by every layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(slots=True)
class PrefillChunk:
    """One request with query_len > 1: tokens [start, end) attending to `context_len` cached tokens."""

    start: int
    end: int
    context_len: int
    # Blocks covering [0, context_len + query_len): set only when context_len > 0.
    block_ids: Optional[torch.Tensor] = None
    # [query_len, context_len + query_len] bool, True = attend: set only when context_len > 0.
    mask: Optional[torch.Tensor] = None


@dataclass(slots=True)
class AttentionMetadata:
    num_tokens: int
    block_size: int
    query_lens: list[int]
    context_lens: list[int]
    # [T] long: cache slot of every new token.
    slot_mapping: torch.Tensor
    # [T] long: absolute position of every new token (the runner may pass its own).
    positions: torch.Tensor
    # [R] long: index of each request's last token in the flattened batch (for logits).
    last_token_indices: torch.Tensor
    # Decode rows (query_len == 1), in request order.
    num_decodes: int = 0
    # Token index of each decode row; `decode_slice` instead when they are contiguous.
    decode_token_indices: Optional[torch.Tensor] = None
    decode_slice: Optional[slice] = None
    # [B * max_blocks] long: the blocks of every decode row, padded with block 0.
    decode_block_ids: Optional[torch.Tensor] = None
    decode_max_blocks: int = 0
    # [1, B, 1, max_blocks * block_size] float32: 0 where a key exists, -inf past the row's length.
    decode_bias: Optional[torch.Tensor] = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    # (num_kv_heads, num_blocks) -> rows of the [kv_heads * num_blocks, block] cache view to gather.
    _gather_index: dict = field(default_factory=dict)

    def decode_gather_index(self, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
        """[kv_heads * B * max_blocks] long: row h * num_blocks + block of every (head, decode row, block)."""
        key = (num_kv_heads, num_blocks)
        idx = self._gather_index.get(key)
        if idx is None:
            heads = torch.arange(num_kv_heads, device=self.decode_block_ids.device) * num_blocks
            idx = (heads[:, None] + self.decode_block_ids[None, :]).reshape(-1)
            self._gather_index[key] = idx
        return idx

    @staticmethod
    def build(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], block_size: int,
              device: torch.device | str = "cpu") -> "AttentionMetadata":
        """Index tensors for one step. `block_tables[i]` must cover context_lens[i] + query_lens[i] tokens."""
        n = len(query_lens)
        if not (len(context_lens) == len(block_tables) == n):
            raise ValueError("query_lens, context_lens and block_tables must have one entry per request")
        seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
        for i, (q, s, bt) in enumerate(zip(query_lens, seq_lens, block_tables)):
            if q < 1:
                raise ValueError(f"request {i}: query_len must be >= 1, got {q}")
            if len(bt) * block_size < s:
                raise ValueError(f"request {i}: {len(bt)} blocks of {block_size} cannot hold {s} tokens")
        device = torch.device(device)
        max_blocks = max((len(bt) for bt in block_tables), default=1) or 1
        table = torch.tensor([list(bt) + [0] * (max_blocks - len(bt)) for bt in block_tables],
                             dtype=torch.long).view(n, max_blocks)
        q_lens = torch.tensor(query_lens, dtype=torch.long)
        ctx = torch.tensor(context_lens, dtype=torch.long)
        starts = torch.cumsum(q_lens, 0) - q_lens
        num_tokens = int(q_lens.sum())
        req_of_token = torch.repeat_interleave(torch.arange(n), q_lens)
        positions = torch.arange(num_tokens) - starts[req_of_token] + ctx[req_of_token]
        slots = table[req_of_token, positions // block_size] * block_size + positions % block_size

        md = AttentionMetadata(
            num_tokens=num_tokens, block_size=block_size, query_lens=list(query_lens),
            context_lens=list(context_lens), slot_mapping=slots.to(device), positions=positions.to(device),
            last_token_indices=(starts + q_lens - 1).to(device))
        decode_rows = [i for i, q in enumerate(query_lens) if q == 1]
        if decode_rows:
            md._build_decodes(decode_rows, table, starts, seq_lens, block_size, device)
        start_list = starts.tolist()
        for i, (q, c) in enumerate(zip(query_lens, context_lens)):
            if q == 1:
                continue
            chunk = PrefillChunk(start_list[i], start_list[i] + q, c)
            if c > 0:
                nblk = -(-(c + q) // block_size)
                chunk.block_ids = table[i, :nblk].to(device)
                key_pos = torch.arange(c + q)
                chunk.mask = (key_pos[None, :] <= (c + torch.arange(q))[:, None]).to(device)
            md.prefills.append(chunk)
        return md

    def _build_decodes(self, rows: list[int], table: torch.Tensor, starts: torch.Tensor, seq_lens: list[int],
                       block_size: int, device: torch.device) -> None:
        rows_t = torch.tensor(rows, dtype=torch.long)
        lens = torch.tensor([seq_lens[i] for i in rows], dtype=torch.long)
        max_blocks = -(-int(lens.max()) // block_size)
        token_idx = starts[rows_t]
        first = int(token_idx[0])
        if int(token_idx[-1]) - first == len(rows) - 1:  # consecutive rows: a slice, no gather
            self.decode_slice = slice(first, first + len(rows))
        else:
            self.decode_token_indices = token_idx.to(device)
        self.num_decodes = len(rows)
        self.decode_max_blocks = max_blocks
        self.decode_block_ids = table[rows_t, :max_blocks].reshape(-1).to(device)
        valid = torch.arange(max_blocks * block_size)[None, :] < lens[:, None]  # [B, L]
        self.decode_bias = torch.zeros(valid.shape, dtype=torch.float32).masked_fill_(
            ~valid, float("-inf"))[None, :, None, :].to(device)


class PagedAttention(nn.Module):
    """Attention of one layer (this rank's heads) over its paged KV cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: Optional[float] = None):
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: AttentionMetadata) -> torch.Tensor:
        """q [T, heads*d], k/v [T, kv_heads*d] -> [T, heads*d]; writes k/v into `kv_cache`."""
        T, KVH, D = q.shape[0], self.num_kv_heads, self.head_dim
        q = q.view(T, self.num_heads, D)
        k = k.view(T, KVH, D)
        v = v.view(T, KVH, D)
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [KVH, num_blocks, block_size, D]
        k_cache.view(KVH, -1, D).index_copy_(1, md.slot_mapping, k.transpose(0, 1))
        v_cache.view(KVH, -1, D).index_copy_(1, md.slot_mapping, v.transpose(0, 1))

        if md.num_decodes == T:
            return self._decode(q, k_cache, v_cache, md)
        out = torch.empty_like(q)
        if md.num_decodes:
            rows = md.decode_slice if md.decode_slice is not None else md.decode_token_indices
            out[rows] = self._decode(q[rows], k_cache, v_cache, md).view(-1, self.num_heads, D)
        for chunk in md.prefills:
            out[chunk.start:chunk.end] = self._prefill(q, k, v, k_cache, v_cache, chunk)
        return out.view(T, -1)

    def _prefill(self, q, k, v, k_cache, v_cache, chunk: PrefillChunk) -> torch.Tensor:
        qs = q[chunk.start:chunk.end].transpose(0, 1)  # [H, q, d]
        if chunk.context_len == 0:
            ks = k[chunk.start:chunk.end].transpose(0, 1)  # [KVH, q, d]
            vs = v[chunk.start:chunk.end].transpose(0, 1)
            mask, causal = None, True
        else:
            n = chunk.context_len + (chunk.end - chunk.start)
            ks = k_cache.index_select(1, chunk.block_ids).flatten(1, 2)[:, :n]  # [KVH, n, d]
            vs = v_cache.index_select(1, chunk.block_ids).flatten(1, 2)[:, :n]
            mask, causal = chunk.mask, False
        o = F.scaled_dot_product_attention(qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0), attn_mask=mask,
                                           is_causal=causal, scale=self.scale, enable_gqa=self.group > 1)
        return o[0].transpose(0, 1)  # [q, H, d]

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                md: AttentionMetadata) -> torch.Tensor:
        """q [B, H, d] (one query per request) -> [B, H * d]."""
        B, H, D = q.shape
        KVH, G = self.num_kv_heads, self.group
        L = md.decode_max_blocks * md.block_size
        num_blocks = k_cache.shape[1]
        idx = md.decode_gather_index(KVH, num_blocks)
        # [KVH * B, L, d]: every decode row's blocks, per kv head, one contiguous copy.
        keys = k_cache.view(KVH * num_blocks, -1).index_select(0, idx).view(KVH * B, L, D)
        values = v_cache.view(KVH * num_blocks, -1).index_select(0, idx).view(KVH * B, L, D)
        # Query heads of one kv head are the rows of one small matmul: [KVH * B, G, d].
        qg = q.view(B, KVH, G, D).transpose(0, 1).reshape(KVH * B, G, D)
        scores = torch.bmm(qg, keys.transpose(1, 2)).view(KVH, B, G, L)
        probs = torch.softmax(scores.float().mul_(self.scale).add_(md.decode_bias), dim=-1).to(q.dtype)
        out = torch.bmm(probs.view(KVH * B, G, L), values)  # [KVH * B, G, d]
        return out.view(KVH, B, G, D).transpose(0, 1).reshape(B, H * D)
