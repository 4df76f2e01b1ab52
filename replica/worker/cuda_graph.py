"""CUDA graphs for decode steps.

A decode step of a small model on a GPU is bound by kernel launches, not by the GPU:
SmolLM2-135M's 30 layers launch some 400 kernels of a few microseconds each, and the
Python that launches them takes longer than the GPU takes to run them. Captured once
as a CUDA graph, the whole forward of a decode batch is one graph launch.

A graph replays fixed shapes and fixed addresses, so every decode step is written into
the same static buffers and padded to a captured shape:

* rows to the next capture size (1, 2, 4, then multiples of 8 up to `max_num_seqs`,
  at most 512, as vLLM's default sizes);
* every row's block table to a width bucket: a power of two of blocks, up to the
  blocks of `max_seq_len_to_capture` tokens. Attention gathers that many blocks per
  row, so buckets keep short contexts cheap.

Padded rows read and write a *scratch block*: the KV cache holds one block more than
the scheduler knows of, so nothing a padded row writes lands in a request's cache.
Padded table entries of real rows point at it too and are masked by the row's length.

Every row count at every width up to 2048 tokens is captured when the runner is built
(11 row counts x 4 widths for `--max-num-seqs 64`); a wider shape the first time a step
needs it (a warm-up forward and a capture, on dummy inputs that touch only the
scratch block, while the step loop waits; its cost:
docs/benchmarks/results/2026-11-26-gpu-cuda-graphs-h100-h200.md). Graphs are replayed
from then on and share one memory pool; a graph's output lives in that pool and is
read (logits computed) before the next replay. Steps that prefill, carry draft tokens,
need a KV connector, or run tensor-parallel collectives run eagerly (see
`Worker._decode_graph_config`).

With LoRA (`lora_slots`), the linears hold every loaded adapter in fixed buffers
(replica/lora/stack.py) and a step's rows pick theirs through a one-hot buffer: each shape is
captured twice, with the adapters' kernels (steps where some row has an adapter) and without
(base-model steps pay nothing for LoRA being on).

`capture=False` runs the very same padded, static-buffer forward without a graph: how
the CPU test suite checks the padding and the buffer bookkeeping where no GPU is.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from fleetserve.replica.layers.attention import AttentionMetadata
from fleetserve.replica.lora import layers as lora_layers

if TYPE_CHECKING:
    from torch.cuda.graphs import _POOL_HANDLE  # what CUDAGraph.pool() hands back

logger = logging.getLogger(__name__)

# vLLM's default largest capture size: past it, decode batches run eagerly.
MAX_CAPTURE_BATCH = 512


@dataclass(frozen=True)
class DecodeGraphConfig:
    max_batch: int  # largest decode batch to capture (max_num_seqs, at most MAX_CAPTURE_BATCH)
    max_len: int  # longest sequence (tokens) a captured step may hold (max_seq_len_to_capture)
    capture: bool = True  # False: the same static-shape forward, eagerly (no CUDA needed)
    # Narrowest width bucket, in tokens: fewer shapes to capture, at the cost of gathering
    # up to this many keys per row for short contexts.
    min_width_tokens: int = 256
    # Capture every batch size at every width up to `start_width_tokens` when the runner is
    # built (as vLLM captures at start-up), so steps within it never wait for a capture;
    # wider shapes are captured on first use.
    capture_at_start: bool = True
    start_width_tokens: int = 2048
    # LoRA adapters stacked for the graphs (0: no LoRA; steps with adapters run eagerly).
    lora_slots: int = 0
    max_lora_rank: int = 16


def capture_sizes(max_batch: int) -> list[int]:
    """Row counts a decode step is padded to: 1, 2, 4, 8, 16, 24, ..., up to the first that holds `max_batch`."""
    sizes = [1, 2, 4] + list(range(8, max_batch + 8, 8))
    return [s for s in sizes if s < max_batch] + [next(s for s in sizes if s >= max_batch)]


def width_bucket(blocks: int, max_blocks: int, min_blocks: int = 1) -> int:
    """Blocks per row for a step whose longest row needs `blocks`: the next power of two (at
    least `min_blocks`), capped at `max_blocks`."""
    return min(max(1 << max(blocks - 1, 0).bit_length(), min_blocks), max_blocks)


class DecodeGraphs:
    """Captured decode forwards of one model over one set of KV caches."""

    def __init__(
        self,
        model,
        kv_caches: list[torch.Tensor],
        *,
        scratch_block: int,
        block_size: int,
        config: DecodeGraphConfig,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.model = model
        self.config = config
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.capture = config.capture
        self.sizes = capture_sizes(min(config.max_batch, MAX_CAPTURE_BATCH))
        self.max_batch = self.sizes[-1]
        self.max_blocks = max(1, -(-config.max_len // block_size))
        self.min_blocks = max(1, -(-config.min_width_tokens // block_size))
        self.device = device
        self.dtype = dtype
        # Rows: token id, position, cache slot, sequence length (incl. the new token).
        self._rows = torch.zeros(4, self.max_batch, dtype=torch.long, device=device)
        self._table = torch.zeros(self.max_batch, self.max_blocks, dtype=torch.long, device=device)
        # Rows' one-hot over the LoRA slots (None without LoRA).
        self._onehot = (
            torch.zeros(self.max_batch, config.lora_slots, dtype=dtype, device=device) if config.lora_slots else None
        )
        # (rows, width, with adapters) -> (graph, its output)
        self._graphs: dict[tuple[int, int, bool], tuple[Optional[torch.cuda.CUDAGraph], Optional[torch.Tensor]]] = {}
        self._pool: Optional[_POOL_HANDLE] = None  # the memory pool every graph shares
        self.num_steps = 0  # steps run through here (graph replays, or static eager steps)
        self.num_replays = 0
        self.num_lora_steps = 0  # of which with adapters
        self.capture_seconds = 0.0
        self._capture_at_start()

    def _capture_at_start(self) -> None:
        if not (self.capture and self.config.capture_at_start):
            return
        t0 = self.capture_seconds
        shapes = self.start_shapes(self.config.start_width_tokens)
        variants = (False, True) if self._onehot is not None else (False,)
        for lora in variants:
            for rows, width in shapes:
                self._graphs[(rows, width, lora)] = self._capture(rows, width, lora)
        logger.info(
            "captured %d decode CUDA graphs (1..%d rows, up to %d tokens per row%s) in %.1f s",
            len(shapes) * len(variants),
            self.max_batch,
            shapes[0][1] * self.block_size,
            ", each with and without LoRA" if len(variants) == 2 else "",
            self.capture_seconds - t0,
        )

    @property
    def lora_slots(self) -> int:
        return 0 if self._onehot is None else self._onehot.shape[1]

    def set_lora_slots(self, slots: int) -> None:
        """The LoRA stacks grew to `slots` (new buffers, new addresses): every graph is dropped
        and those of the start-up shapes captured again."""
        self._onehot = torch.zeros(self.max_batch, slots, dtype=self.dtype, device=self.device)
        self._graphs.clear()
        self._pool = None
        self._capture_at_start()

    def start_shapes(self, max_tokens: int) -> list[tuple[int, int]]:
        """(rows, width) of every shape captured at start: each batch size at each width bucket
        up to `max_tokens` per row (at least the narrowest), the largest first so that the
        shared pool's first blocks are big enough for every later capture."""
        widths = sorted(
            {
                width_bucket(b, self.max_blocks, self.min_blocks)
                for b in range(1, max(1, -(-max_tokens // self.block_size)) + 1)
            },
            reverse=True,
        )
        return [(rows, w) for w in widths for rows in reversed(self.sizes)]

    @property
    def num_graphs(self) -> int:
        return sum(1 for g, _ in self._graphs.values() if g is not None)

    def bucket(self, num_rows: int, max_blocks: int) -> Optional[tuple[int, int]]:
        """The captured shape for a decode step of `num_rows` rows needing at most `max_blocks`
        blocks per row, or None when the step is too big to capture (it runs eagerly)."""
        if num_rows > self.max_batch or max_blocks > self.max_blocks:
            return None
        return (
            self.sizes[bisect.bisect_left(self.sizes, num_rows)],
            width_bucket(max_blocks, self.max_blocks, self.min_blocks),
        )

    def run(
        self,
        key: tuple[int, int],
        token_ids: list[int],
        positions: list[int],
        block_tables: list[list[int]],
        lora_onehot: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Final hidden states [len(token_ids), hidden] of one decode token per row.
        `lora_onehot` ([rows, lora_slots], LoRAStacks.onehot): the rows' adapters, None: none."""
        rows, width = key
        lora = lora_onehot is not None
        gkey = (rows, width, lora)
        if gkey not in self._graphs:
            self._graphs[gkey] = self._capture(rows, width, lora)
        self._fill(rows, width, token_ids, positions, block_tables)
        if lora_onehot is not None:  # rows past len(token_ids) keep stale picks: they touch the scratch block only
            self._lora_onehot(len(token_ids)).copy_(lora_onehot, non_blocking=True)
            self.num_lora_steps += 1
        graph, out = self._graphs[gkey]
        self.num_steps += 1
        if graph is None or out is None:
            out = self._forward(rows, width, lora)
        else:
            graph.replay()
            self.num_replays += 1
        return out[: len(token_ids)]

    def _lora_onehot(self, rows: int) -> torch.Tensor:
        """The first `rows` rows of the adapters' one-hot buffer."""
        if self._onehot is None:
            raise RuntimeError("a decode step with LoRA adapters, but the graphs hold no LoRA slots")
        return self._onehot[:rows]

    # ---- internals ------------------------------------------------------------------
    def _fill(
        self, rows: int, width: int, token_ids: list[int], positions: list[int], block_tables: list[list[int]]
    ) -> None:
        n, bs, scratch = len(token_ids), self.block_size, self.scratch_block
        pad = rows - n
        slots = [bt[p // bs] * bs + p % bs for bt, p in zip(block_tables, positions)]
        header = torch.tensor(
            [
                token_ids + [0] * pad,
                positions + [0] * pad,
                slots + [scratch * bs] * pad,
                [p + 1 for p in positions] + [1] * pad,
            ],
            dtype=torch.long,
        )
        table = torch.tensor(
            [bt[:width] + [scratch] * (width - len(bt)) for bt in block_tables] + [[scratch] * width] * pad,
            dtype=torch.long,
        )
        self._rows[:, :rows].copy_(header, non_blocking=True)
        self._table[:rows, :width].copy_(table, non_blocking=True)

    def _fill_dummy(self, rows: int, width: int) -> None:
        """Inputs that read and write only the scratch block (for warm-up and capture)."""
        self._rows[:, :rows] = torch.tensor(
            [0, 0, self.scratch_block * self.block_size, 1], dtype=torch.long, device=self.device
        )[:, None]
        self._table[:rows, :width] = self.scratch_block

    def _forward(self, rows: int, width: int, lora: bool = False) -> torch.Tensor:
        md = AttentionMetadata.static_decode(self._rows[:, :rows], self._table[:rows, :width], self.block_size)
        with lora_layers.active(lora_layers.LoRABatch.stacked(self._lora_onehot(rows)) if lora else None):
            return self.model(self._rows[0, :rows], self._rows[1, :rows], self.kv_caches, md)

    def _capture(
        self, rows: int, width: int, lora: bool = False
    ) -> tuple[Optional[torch.cuda.CUDAGraph], Optional[torch.Tensor]]:
        if not self.capture:
            return None, None
        t0 = time.perf_counter()
        self._fill_dummy(rows, width)
        if lora:
            self._lora_onehot(rows).zero_()
        # Warm up on a side stream first (cuBLAS handles and workspaces, lazy inits), as
        # torch.cuda.graph's documentation asks; then capture into the shared pool.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(rows, width, lora)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._forward(rows, width, lora)
        if self._pool is None:
            self._pool = graph.pool()
        self.capture_seconds += time.perf_counter() - t0
        logger.debug(
            "captured a decode CUDA graph for %d rows x %d blocks%s in %.0f ms",
            rows,
            width,
            " with LoRA" if lora else "",
            1e3 * (time.perf_counter() - t0),
        )
        return graph, out
