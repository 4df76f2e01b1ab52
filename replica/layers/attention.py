"""Paged attention over a block-structured KV cache.

KV cache layout, one tensor per layer (each rank: its local kv heads):

    kv_cache: [2, num_kv_heads, num_blocks, block_size, head_dim]      (0 = K, 1 = V)

Head-major, so that the keys of one kv head for a whole decode batch come out
of one `index_select` as a contiguous [B, L, head_dim] slab per head, ready
for a batched matmul with no permute copy (see below). A token's slot is
`block_id * block_size + offset`; block b of a layer is `kv_cache[:, :, b]`
(what the KV connectors move). Where the CPU attention kernel keeps keys tiled
(`kv_cache_layout` == "k_tiled"), each key block's [block_size, head_dim] bytes hold
[head_dim/2, block_size, 2] instead; shapes, slots and block moves are unchanged.

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
  cache is never repeated per query head -- and an additive length mask.
  That gather copies every decode row's keys and values in every layer at
  every step (a large part of a big decode step: docs/deployment/cpu.md,
  "Figures behind the code"), so each layer keeps its
  gathered copy as a *decode buffer* [2, kv_heads, B, W, head_dim] from step
  to step: when this step's decode rows are last step's rows one token
  further (checked once per step from (request id, first block, length) per
  row; the runner passes request ids to `build`), the new
  token is appended (one small `index_copy_`) and the bmms read the buffer;
  the blocks are gathered again only when the batch changes or the width W
  (one block of headroom) runs out. The paged cache stays the source of truth
  (it is written as before), so prefix caching and KV transfer are unaffected;
* **prefill chunks** (query_len > 1) run `scaled_dot_product_attention` per
  request (its `enable_gqa`, no repeated K/V): causal on the new K/V when there is no cached context, otherwise
  over the request's blocks read back from the cache with a causal mask
  shifted by the context length. Adjacent chunks with no cached context (a batch of new
  prompts) are packed, up to `max_pack_tokens`, into one call with a block-diagonal causal
  mask, on a GPU: one call per layer instead of one per prompt, 30 attention calls per
  prefill step instead of ~500 (on a CPU the wasted arithmetic of the mask costs more).

On CPU with fleetserve's kernels built (replica/kernels), both paths above
give way to one call per layer: `paged_attention` runs every token against its
request's first `position + 1` cached keys straight from the blocks (AVX-512,
float accumulation), after `reshape_and_cache_` wrote the new keys/values.
The PyTorch paths remain for GPUs and for machines without a compiler.

**Sliding windows** (Mistral, Qwen2's upper layers, Gemma 3's local layers): a layer built with
`sliding_window=W` lets the query at position p attend to the keys at positions p - W < j <= p
(W keys, itself included: transformers' `sliding_window_overlay`, `kv_idx > q_idx - W`). The CPU
kernel reads only the keys inside the window (from the first block holding one: a long
context costs W keys per token, not p); the PyTorch paths read a prefill chunk's blocks from the
first one any of its queries sees, and mask the rest of the decode gather. When every layer has a
window, the scheduler gives back a request's blocks wholly before it (scheduler/kv_cache_manager.py)
while the block table here keeps their old ids: the kernel never reads them, and the masked gather
weighs whatever another request wrote there by zero. **Logit soft-capping**
(`logit_softcap=c`, Gemma 2/3's `attn_logit_softcapping`): scores become c * tanh(s / c) after
the scale, before the mask and softmax, as in transformers' eager attention.

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

from fleetserve.replica.kernels import ops_for


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
    # Part of a `PrefillPack` (attended in one call with its neighbours), not on its own.
    packed: bool = False


@dataclass(slots=True)
class PrefillPack:
    """Adjacent prefill chunks with no cached context, tokens [start, end): one attention call
    with a block-diagonal causal mask instead of one call per chunk (`seg_lens` its chunks'
    lengths, in order)."""

    start: int
    end: int
    seg_lens: list[int]


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
    prefill_packs: list[PrefillPack] = field(default_factory=list)
    # Per decode row (request id, first block id, sequence length incl. the new token), when the
    # caller passed request ids: lets a layer tell that this step's decode rows are last step's
    # rows, each one token longer. None: no carrying over between steps.
    decode_row_keys: Optional[tuple] = None
    decode_seq_lens: Optional[torch.Tensor] = None  # [B] long
    decode_max_len: int = 0
    # For the fused CPU kernel: [R, max_blocks] long block table, and per token its row in it
    # (None when every token is its own request's only token) and its causal length (position + 1).
    block_table: Optional[torch.Tensor] = None
    token_req: Optional[torch.Tensor] = None
    token_seq_lens: Optional[torch.Tensor] = None
    # Built from a CUDA graph's static buffers (`static_decode`): every tensor above is a view of
    # them or computed from them inside the graph, so nothing is carried between steps.
    static: bool = False
    _successor: dict = field(default_factory=dict)
    # (num_kv_heads, num_blocks) -> rows of the [kv_heads * num_blocks, block] cache view to gather.
    _gather_index: dict = field(default_factory=dict)

    def continues(self, prev_keys: Optional[tuple]) -> bool:
        """Whether this step's decode rows are exactly `prev_keys`' rows (same order), one token further."""
        if prev_keys is None or self.decode_row_keys is None:
            return False
        hit = self._successor.get(id(prev_keys))
        if hit is None or hit[0] is not prev_keys:
            cur = self.decode_row_keys
            ok = len(cur) == len(prev_keys) and all(
                r == pr and b == pb and n == pn + 1 for (r, b, n), (pr, pb, pn) in zip(cur, prev_keys)
            )
            hit = (prev_keys, ok)
            self._successor[id(prev_keys)] = hit
        return hit[1]

    def _decode_seq_lens(self) -> torch.Tensor:
        assert self.decode_seq_lens is not None, "built for a step with decode rows"
        return self.decode_seq_lens

    def decode_bias_width(self, width: int, window: Optional[int] = None) -> torch.Tensor:
        """[1, B, 1, width] float32: 0 where a key exists, -inf past the row's length and, with a
        sliding `window`, before its last `window` keys (memoized per width and window)."""
        key = ("bias", width, window)
        bias = self._gather_index.get(key)
        if bias is None:
            seq_lens = self._decode_seq_lens()
            key_pos = torch.arange(width, device=seq_lens.device)[None, :]
            valid = key_pos < seq_lens[:, None]
            if window is not None:
                valid &= key_pos >= seq_lens[:, None] - window
            bias = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device).masked_fill_(
                ~valid, float("-inf")
            )[None, :, None, :]
            self._gather_index[key] = bias
        return bias

    def decode_append_index(self, width: int) -> torch.Tensor:
        """[B] long: row b * width + (seq_len_b - 1), where each decode row's new token goes in a buffer."""
        key = ("append", width)
        idx = self._gather_index.get(key)
        if idx is None:
            seq_lens = self._decode_seq_lens()
            rows = torch.arange(self.num_decodes, device=seq_lens.device)
            idx = rows * width + seq_lens - 1
            self._gather_index[key] = idx
        return idx

    def decode_gather_index(self, num_kv_heads: int, num_blocks: int, extra_blocks: int = 0) -> torch.Tensor:
        """[kv_heads * B * (max_blocks + extra_blocks)] long: row h * num_blocks + block of every
        (head, decode row, block); the `extra_blocks` per row point at block 0 (headroom, masked)."""
        key = (num_kv_heads, num_blocks, extra_blocks)
        idx = self._gather_index.get(key)
        if idx is None:
            assert self.decode_block_ids is not None, "built for a step with decode rows"
            blocks = self.decode_block_ids.view(self.num_decodes, -1)
            if extra_blocks:
                blocks = torch.cat([blocks, blocks.new_zeros(self.num_decodes, extra_blocks)], dim=1)
            heads = torch.arange(num_kv_heads, device=blocks.device) * num_blocks
            idx = (heads[:, None] + blocks.reshape(1, -1)).reshape(-1)
            self._gather_index[key] = idx
        return idx

    @staticmethod
    def build(
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        request_ids: Optional[list] = None,
    ) -> "AttentionMetadata":
        """Index tensors for one step. `block_tables[i]` must cover context_lens[i] + query_lens[i] tokens.

        `request_ids` (one per request, unique among live requests) lets decode attention carry
        its per-layer buffer over from the previous step; without them it is rebuilt every step.
        """
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
        table = torch.tensor([list(bt) + [0] * (max_blocks - len(bt)) for bt in block_tables], dtype=torch.long).view(
            n, max_blocks
        )
        q_lens = torch.tensor(query_lens, dtype=torch.long)
        ctx = torch.tensor(context_lens, dtype=torch.long)
        starts = torch.cumsum(q_lens, 0) - q_lens
        num_tokens = int(q_lens.sum())
        req_of_token = torch.repeat_interleave(torch.arange(n), q_lens)
        positions = torch.arange(num_tokens) - starts[req_of_token] + ctx[req_of_token]
        slots = table[req_of_token, positions // block_size] * block_size + positions % block_size

        md = AttentionMetadata(
            num_tokens=num_tokens,
            block_size=block_size,
            query_lens=list(query_lens),
            context_lens=list(context_lens),
            slot_mapping=slots.to(device),
            positions=positions.to(device),
            last_token_indices=(starts + q_lens - 1).to(device),
            block_table=table.to(device),
            token_req=None if num_tokens == n else req_of_token.to(device),
            token_seq_lens=(positions + 1).to(device),
        )
        decode_rows = [i for i, q in enumerate(query_lens) if q == 1]
        if decode_rows:
            md._build_decodes(decode_rows, table, starts, seq_lens, block_size, device, request_ids)
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
        md._pack_fresh_prefills()
        return md

    # Packs hold at most this many tokens: the packed call computes (and masks) every pair of
    # its tokens, so its waste grows with the square of its length.
    max_pack_tokens = 2048

    def _pack_fresh_prefills(self) -> None:
        """Group adjacent prefill chunks with no cached context into `prefill_packs` (2+ chunks each)."""
        run: list[PrefillChunk] = []

        def close() -> None:
            if len(run) > 1:
                for c in run:
                    c.packed = True
                self.prefill_packs.append(PrefillPack(run[0].start, run[-1].end, [c.end - c.start for c in run]))
            run.clear()

        for chunk in self.prefills:
            if chunk.context_len != 0:
                close()
                continue
            if run and (run[-1].end != chunk.start or chunk.end - run[0].start > self.max_pack_tokens):
                close()
            run.append(chunk)
        close()

    def pack_mask(self, pack: PrefillPack, device: torch.device, window: Optional[int] = None) -> torch.Tensor:
        """[L, L] bool, True = attend: causal inside each of the pack's chunks, within the last
        `window` positions when given (memoized per step and window)."""
        key = ("pack", pack.start, window)
        mask = self._gather_index.get(key)
        if mask is None:
            lens = torch.tensor(pack.seg_lens, device=device)
            seg = torch.repeat_interleave(torch.arange(len(pack.seg_lens), device=device), lens)
            pos = torch.arange(pack.end - pack.start, device=device)
            mask = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
            if window is not None:
                mask &= pos[None, :] > pos[:, None] - window
            self._gather_index[key] = mask
        return mask

    def chunk_window(self, chunk: PrefillChunk, window: int, device: torch.device) -> tuple[int, torch.Tensor]:
        """A prefill chunk under a sliding window: (first key position read, its multiple of
        block_size; [query_len, keys] bool mask over keys [first, context_len + query_len),
        True = attend), memoized per step."""
        key = ("window", chunk.start, window)
        hit = self._gather_index.get(key)
        if hit is None:
            c, q = chunk.context_len, chunk.end - chunk.start
            first = max(0, c + 1 - window) // self.block_size * self.block_size
            q_pos = c + torch.arange(q, device=device)[:, None]
            k_pos = torch.arange(first, c + q, device=device)[None, :]
            hit = (first, (k_pos <= q_pos) & (k_pos > q_pos - window))
            self._gather_index[key] = hit
        return hit

    @staticmethod
    def static_decode(
        token_ids_positions_slots_lens: torch.Tensor, table: torch.Tensor, block_size: int
    ) -> "AttentionMetadata":
        """Metadata of a decode-only batch over fixed buffers, for CUDA graphs (worker/cuda_graph.py).

        `token_ids_positions_slots_lens` is [4, B] long (rows: token id, position, cache slot,
        sequence length incl. the new token), `table` [B, W] long: each row's first W block ids
        (padded with blocks whose keys the lengths mask). The index tensors derived from them
        (gather index, length mask) are computed here, so a graph captured around the forward
        recomputes them from whatever the buffers hold at replay. The decode buffer is off.
        """
        B, W = table.shape
        seq_lens = token_ids_positions_slots_lens[3]
        contiguous_table = table.contiguous()
        md = AttentionMetadata(
            num_tokens=B,
            block_size=block_size,
            query_lens=[1] * B,
            context_lens=[],
            slot_mapping=token_ids_positions_slots_lens[2],
            positions=token_ids_positions_slots_lens[1],
            last_token_indices=torch.arange(B, device=table.device),
            num_decodes=B,
            decode_slice=slice(0, B),
            decode_block_ids=contiguous_table.view(-1),
            decode_max_blocks=W,
            decode_seq_lens=seq_lens,
            decode_max_len=W * block_size,
            block_table=contiguous_table,
            token_req=None,
            token_seq_lens=seq_lens,
            static=True,
        )
        md.decode_bias = md.decode_bias_width(W * block_size)
        return md

    def _build_decodes(
        self,
        rows: list[int],
        table: torch.Tensor,
        starts: torch.Tensor,
        seq_lens: list[int],
        block_size: int,
        device: torch.device,
        request_ids: Optional[list] = None,
    ) -> None:
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
        if request_ids is not None:
            self.decode_row_keys = tuple(zip([request_ids[i] for i in rows], table[rows_t, 0].tolist(), lens.tolist()))
        self.decode_seq_lens = lens.to(device)
        self.decode_max_len = int(lens.max())
        valid = torch.arange(max_blocks * block_size)[None, :] < lens[:, None]  # [B, L]
        self.decode_bias = (
            torch.zeros(valid.shape, dtype=torch.float32)
            .masked_fill_(~valid, float("-inf"))[None, :, None, :]
            .to(device)
        )


def kv_cache_layout(dtype: torch.dtype, block_size: int, head_dim: int, device: torch.device | str = "cpu") -> str:
    """How a key block is laid out in this process's caches: "rows" ([block_size, head_dim],
    every path), or "k_tiled" where fleetserve's CPU attention kernel runs and supports it
    (bfloat16 with AVX-512 BF16, block sizes that are multiples of 16): [head_dim/2][block_size][2],
    so 16 keys' scores need no horizontal sums (replica/kernels/cpu_ops.cpp). Values are always
    rows. Engines exchange KV blocks only with the same layout (the KV fingerprint has it)."""
    ops = ops_for(torch.empty(0, dtype=dtype, device=device))
    if ops is None or not PagedAttention.use_attention_kernel or not hasattr(ops, "k_tiled_supported"):
        return "rows"
    return "k_tiled" if ops.k_tiled_supported(dtype, block_size, head_dim) else "rows"


class PagedAttention(nn.Module):
    """Attention of one layer (this rank's heads) over its paged KV cache."""

    # Keep a per-layer contiguous copy of the decode rows' keys/values across steps (see
    # `_decode_buffer`); past `decode_buffer_max_bytes` per layer, blocks are gathered every step.
    use_decode_buffer = True
    # On CPU with the fused kernels built, all attention (prefill and decode) is one kernel call
    # per layer reading the paged cache directly (replica/kernels/cpu_ops.cpp): no gathered copy,
    # no decode buffer, no per-request SDPA calls.
    use_attention_kernel = True
    decode_buffer_max_bytes = 16 << 20
    # Attend packed fresh prompts (`AttentionMetadata.prefill_packs`) in one call: None = on a
    # GPU only. A packed call computes every pair of its tokens; on a GPU that is cheaper than
    # ~17 launches per layer, on a CPU (the no-kernel fallback) it is 10x+ more arithmetic.
    pack_prefills: Optional[bool] = None

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: Optional[float] = None,
        sliding_window: Optional[int] = None,
        logit_softcap: Optional[float] = None,
    ):
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive integer or None, got {sliding_window!r}")
        if logit_softcap is not None and not logit_softcap > 0:
            raise ValueError(f"the attention logit soft-cap must be positive or None, got {logit_softcap!r}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        # A query at position p sees the keys at positions > p - sliding_window (None: all before it).
        self.sliding_window = sliding_window
        # Scores s -> c * tanh(s / c) after the scale (None: not capped).
        self.logit_softcap = float(logit_softcap) if logit_softcap is not None else None
        # Decode buffer: (buffer [2, KVH, B, W, D], row keys it holds, cache data_ptr) or None.
        self._dbuf: Optional[tuple] = None
        # Whether the CPU kernels keep this layer's keys tiled (kv_cache_layout), for _layout_key.
        self._layout_key: Optional[tuple] = None
        self._k_tiled = False

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, heads*d], k/v [T, kv_heads*d] -> [T, heads*d]; writes k/v into `kv_cache`."""
        T, KVH, D = q.shape[0], self.num_kv_heads, self.head_dim
        q = q.view(T, self.num_heads, D)
        k = k.view(T, KVH, D)
        v = v.view(T, KVH, D)
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [KVH, num_blocks, block_size, D]
        ops = ops_for(q)
        if ops is not None:
            key = (q.dtype, k_cache.shape[2], self.use_attention_kernel)
            if self._layout_key != key:  # the same answer as kv_cache_layout, asked once
                self._layout_key = key
                self._k_tiled = kv_cache_layout(q.dtype, k_cache.shape[2], D) == "k_tiled"
            ops.reshape_and_cache_(k, v, k_cache, v_cache, md.slot_mapping, self._k_tiled)
            if self.use_attention_kernel:
                # Every token (prefill chunk, continuation or decode) attends to its request's
                # first seq_len cached keys, read straight from the blocks.
                return ops.paged_attention(
                    q,
                    k_cache,
                    v_cache,
                    md.block_table,
                    md.token_seq_lens,
                    md.token_req,
                    self.scale,
                    self._k_tiled,
                    self.sliding_window or 0,
                    self.logit_softcap or 0.0,
                )
        else:
            k_cache.view(KVH, -1, D).index_copy_(1, md.slot_mapping, k.transpose(0, 1))
            v_cache.view(KVH, -1, D).index_copy_(1, md.slot_mapping, v.transpose(0, 1))

        if md.num_decodes == T:
            return self._decode(q, k, v, k_cache, v_cache, md)
        out = torch.empty_like(q)
        if md.num_decodes:
            rows = md.decode_slice if md.decode_slice is not None else md.decode_token_indices
            out[rows] = self._decode(q[rows], k[rows], v[rows], k_cache, v_cache, md).view(-1, self.num_heads, D)
        packs = md.prefill_packs if (q.is_cuda if self.pack_prefills is None else self.pack_prefills) else ()
        for pack in packs:
            out[pack.start : pack.end] = self._prefill_pack(q, k, v, pack, md)
        for chunk in md.prefills:
            if not (packs and chunk.packed):
                out[chunk.start : chunk.end] = self._prefill(q, k, v, k_cache, v_cache, chunk, md)
        return out.view(T, -1)

    def _attend(self, qs, ks, vs, mask: Optional[torch.Tensor], causal: bool) -> torch.Tensor:
        """qs [H, q, d] against ks/vs [KVH, n, d] -> [H, q, d]: SDPA, or with a soft-cap the same
        attention written out (SDPA has no soft-cap): scores in float, capped, masked, softmax."""
        if self.logit_softcap is None:
            o = F.scaled_dot_product_attention(
                qs.unsqueeze(0),
                ks.unsqueeze(0),
                vs.unsqueeze(0),
                attn_mask=mask,
                is_causal=causal,
                scale=self.scale,
                enable_gqa=self.group > 1,
            )
            return o[0]
        if self.group > 1:
            ks = ks.repeat_interleave(self.group, 0)
            vs = vs.repeat_interleave(self.group, 0)
        cap = self.logit_softcap
        scores = torch.bmm(qs, ks.transpose(1, 2)).float().mul_(self.scale).div_(cap).tanh_().mul_(cap)
        if causal:
            n, q = ks.shape[1], qs.shape[1]
            mask = torch.ones(q, n, dtype=torch.bool, device=qs.device).tril_(n - q)
        if mask is not None:
            scores.masked_fill_(~mask, float("-inf"))
        return torch.bmm(torch.softmax(scores, dim=-1).to(vs.dtype), vs)

    def _prefill_pack(self, q, k, v, pack: PrefillPack, md: AttentionMetadata) -> torch.Tensor:
        """Several fresh prompts in one SDPA call under a block-diagonal causal mask. K/V are
        repeated per query head here (small: these tokens' own keys), so the masked call does not
        depend on which of torch's SDPA kernels accept `enable_gqa` together with a mask."""
        qs = q[pack.start : pack.end].transpose(0, 1)  # [H, L, d]
        ks = k[pack.start : pack.end].transpose(0, 1)  # [KVH, L, d]
        vs = v[pack.start : pack.end].transpose(0, 1)
        mask = md.pack_mask(pack, q.device, self.sliding_window)
        if self.logit_softcap is not None:
            return self._attend(qs, ks, vs, mask, False).transpose(0, 1)
        if self.group > 1:
            ks = ks.repeat_interleave(self.group, 0)
            vs = vs.repeat_interleave(self.group, 0)
        o = F.scaled_dot_product_attention(
            qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0), attn_mask=mask[None, None], scale=self.scale
        )
        return o[0].transpose(0, 1)  # [L, H, d]

    def _prefill(self, q, k, v, k_cache, v_cache, chunk: PrefillChunk, md: AttentionMetadata) -> torch.Tensor:
        qs = q[chunk.start : chunk.end].transpose(0, 1)  # [H, q, d]
        window = self.sliding_window
        if chunk.context_len == 0 and (window is None or window >= chunk.end - chunk.start):
            ks = k[chunk.start : chunk.end].transpose(0, 1)  # [KVH, q, d]
            vs = v[chunk.start : chunk.end].transpose(0, 1)
            mask, causal = None, True
        elif chunk.context_len == 0:  # a fresh prompt longer than the window: its own keys, banded
            assert window is not None
            ks = k[chunk.start : chunk.end].transpose(0, 1)
            vs = v[chunk.start : chunk.end].transpose(0, 1)
            mask, causal = md.chunk_window(chunk, window, q.device)[1], False
        else:
            assert chunk.block_ids is not None and chunk.mask is not None, "built for a chunk with context"
            n = chunk.context_len + (chunk.end - chunk.start)
            block_ids, first = chunk.block_ids, 0
            if window is None:
                mask = chunk.mask
            else:  # from the first block any of the chunk's queries sees
                first, mask = md.chunk_window(chunk, window, q.device)
                block_ids = block_ids[first // md.block_size :]
            ks = k_cache.index_select(1, block_ids).flatten(1, 2)[:, : n - first]  # [KVH, n - first, d]
            vs = v_cache.index_select(1, block_ids).flatten(1, 2)[:, : n - first]
            causal = False
        return self._attend(qs, ks, vs, mask, causal).transpose(0, 1)  # [q, H, d]

    def _decode_buffer(
        self,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: AttentionMetadata,
    ) -> Optional[torch.Tensor]:
        """[2, KVH, B, W, D]: every decode row's keys/values, contiguous, kept from step to step.

        Gathering the rows' blocks out of the paged cache costs a copy of all their
        keys and values in every layer at every step (a quarter of a decode step
        at batch 64). Instead each layer keeps last step's gathered copy and, when
        this step's decode rows are the same requests one token further (the
        steady state of decoding), appends the new token; it is re-gathered when
        the batch changes or the width W (a block of headroom) runs out.
        """
        if not self.use_decode_buffer or md.static:
            return None
        KVH, D = self.num_kv_heads, self.head_dim
        B, bs = md.num_decodes, md.block_size
        state = self._dbuf
        if (
            state is not None
            and state[2] == k_cache.data_ptr()
            and md.decode_max_len <= state[0].shape[3]
            and md.continues(state[1])
        ):
            buf = state[0]
            W = buf.shape[3]
            idx = md.decode_append_index(W)
            buf[0].view(KVH, B * W, D).index_copy_(1, idx, k_new.view(B, KVH, D).transpose(0, 1))
            buf[1].view(KVH, B * W, D).index_copy_(1, idx, v_new.view(B, KVH, D).transpose(0, 1))
            self._dbuf = (buf, md.decode_row_keys, state[2])
            return buf
        W = (md.decode_max_blocks + 1) * bs  # one block of headroom
        if 2 * KVH * B * W * D * k_cache.element_size() > self.decode_buffer_max_bytes:
            self._dbuf = None
            return None
        self._dbuf = None  # free the old one first
        buf = torch.empty(2, KVH, B, W, D, dtype=k_cache.dtype, device=k_cache.device)
        num_blocks = k_cache.shape[1]
        # Straight into the buffer (no second copy): the headroom block is block 0's data, finite
        # (the cache is zero-initialized) and masked until this row's tokens overwrite it.
        idx = md.decode_gather_index(KVH, num_blocks, extra_blocks=1)
        for j, cache in enumerate((k_cache, v_cache)):
            torch.index_select(cache.view(KVH * num_blocks, -1), 0, idx, out=buf[j].view(idx.numel(), -1))
        self._dbuf = (buf, md.decode_row_keys, k_cache.data_ptr())
        return buf

    def _decode(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        """q [B, H, d] (one query per request), k_new/v_new its new keys/values -> [B, H * d]."""
        B, H, D = q.shape
        KVH, G = self.num_kv_heads, self.group
        buf = self._decode_buffer(k_new, v_new, k_cache, v_cache, md)
        if buf is not None:
            L = buf.shape[3]
            keys, values = buf[0].view(KVH * B, L, D), buf[1].view(KVH * B, L, D)
            bias = md.decode_bias_width(L, self.sliding_window)
        else:
            L = md.decode_max_blocks * md.block_size
            num_blocks = k_cache.shape[1]
            idx = md.decode_gather_index(KVH, num_blocks)
            # [KVH * B, L, d]: every decode row's blocks, per kv head, one contiguous copy.
            keys = k_cache.view(KVH * num_blocks, -1).index_select(0, idx).view(KVH * B, L, D)
            values = v_cache.view(KVH * num_blocks, -1).index_select(0, idx).view(KVH * B, L, D)
            if self.sliding_window is None:
                assert md.decode_bias is not None, "built for a step with decode rows"
                bias = md.decode_bias
            else:
                bias = md.decode_bias_width(L, self.sliding_window)
        # Query heads of one kv head are the rows of one small matmul: [KVH * B, G, d].
        qg = q.view(B, KVH, G, D).transpose(0, 1).reshape(KVH * B, G, D)
        scores = torch.bmm(qg, keys.transpose(1, 2)).view(KVH, B, G, L)
        scores = scores.float().mul_(self.scale)
        if self.logit_softcap is not None:
            scores.div_(self.logit_softcap).tanh_().mul_(self.logit_softcap)
        probs = torch.softmax(scores.add_(bias), dim=-1).to(q.dtype)
        out = torch.bmm(probs.view(KVH * B, G, L), values)  # [KVH * B, G, d]
        return out.view(KVH, B, G, D).transpose(0, 1).reshape(B, H * D)
