"""Our model on the paged cache against transformers' own on the same checkpoint (float32):
prompts prefilled in chunks (a fresh chunk, then continuations over cached context) and
decoded token by token, over shuffled non-contiguous blocks, on whichever attention path the
caller selects (kernels on, or `kernels.disabled()`)."""

from __future__ import annotations

import random
from typing import Sequence

import torch

from fleetserve.replica.layers.attention import AttentionMetadata
from fleetserve.replica.model_loader.registry import resolve_model
from fleetserve.replica.model_loader.weights import allocate_kv_caches, load_model

ATOL = 1e-4


class HFCompare:
    def __init__(self, path, block_size: int = 4, num_blocks: int = 256, attn_implementation: str = "eager"):
        from transformers import AutoModelForCausalLM

        self.block_size = block_size
        self.model, self.cfg = load_model(resolve_model(str(path)), torch.float32, "cpu")
        self.hf = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation=attn_implementation
        ).eval()
        self.free = list(range(1, num_blocks))
        random.Random(0).shuffle(self.free)
        self.caches = allocate_kv_caches(self.cfg, num_blocks, block_size, torch.float32)

    def reference(self, ids: Sequence[int]) -> torch.Tensor:
        """transformers' logits [n, V] for the whole sequence in one forward."""
        with torch.no_grad():
            return self.hf(torch.tensor([list(ids)])).logits[0].float()

    def step(self, chunks: list[tuple[list[int], int, list[int]]]) -> list[torch.Tensor]:
        """(new ids, context length, block table) per request -> our logits [q, V] per request."""
        md = AttentionMetadata.build(
            [len(c[0]) for c in chunks], [c[1] for c in chunks], [c[2] for c in chunks], self.block_size
        )
        ids = torch.tensor([t for c in chunks for t in c[0]])
        with torch.no_grad():
            logits = self.model.compute_logits(self.model(ids, md.positions, self.caches, md))
        out, start = [], 0
        for c in chunks:
            out.append(logits[start : start + len(c[0])])
            start += len(c[0])
        return out

    def blocks_for(self, n_tokens: int) -> list[int]:
        return [self.free.pop() for _ in range(-(-n_tokens // self.block_size))]

    def chunked_logits(self, ids: list[int], cuts: Sequence[int]) -> torch.Tensor:
        """Our logits [n, V] for `ids` prefilled in chunks ending at each of `cuts`, then decoded
        one token per step."""
        table = self.blocks_for(len(ids))
        bounds = [0, *cuts] + list(range(cuts[-1] + 1, len(ids) + 1)) if cuts else [0, len(ids)]
        got = []
        for start, end in zip(bounds, bounds[1:]):
            (logits,) = self.step([(ids[start:end], start, table)])
            got.append(logits)
        return torch.cat(got)

    def greedy(self, prompt: list[int], new_tokens: int) -> tuple[list[int], list[int]]:
        """(ours, transformers') greedy continuations of `prompt`: ours prefilled at once and
        decoded on the paged cache, theirs by full forwards of the growing sequence."""
        table = self.blocks_for(len(prompt) + new_tokens)
        ours: list[int] = []
        (logits,) = self.step([(prompt, 0, table)])
        for _ in range(new_tokens):
            ours.append(int(logits[-1].argmax()))
            if len(ours) == new_tokens:
                break
            (logits,) = self.step([([ours[-1]], len(prompt) + len(ours) - 1, table)])
        theirs: list[int] = []
        for _ in range(new_tokens):
            theirs.append(int(self.reference(prompt + theirs)[-1].argmax()))
        return ours, theirs


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def assert_same_outputs(a, b, what: str = "", atol: float = 1e-4) -> None:
    """Two runs' completion outputs (one per prompt, e.g. TP=1 and TP=2): equal tokens, and at
    each position the same top-logprob ids with values within `atol`."""
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids, what
        for lx, ly in zip(x.logprobs, y.logprobs, strict=True):
            assert lx.keys() == ly.keys(), what
            assert all(abs(lx[t] - ly[t]) < atol for t in lx), what
