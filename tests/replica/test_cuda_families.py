"""Every registered family on CUDA: the whole engine (scheduler, chunked prefill, paged cache,
sampler, CUDA graphs where the family allows them) in float32 against HF transformers on the
CPU, and the MoE experts' grouped GEMMs in bfloat16 against the per-expert matmuls.

Skipped where no GPU is visible (CI, the development machines). Run on a GPU machine with
`python -m pytest -q tests/replica/test_cuda_families.py`. The CPU suite checks each family
against transformers (test_model_vs_hf, test_qwen3_phi3, test_gemma3, test_moe) and through the
engine's features (test_families); this file is what only a GPU exercises: the families'
layers (per-head q/k norms, GeGLU and the (1 + w) norms, fused qkv, sliding windows with
soft-capping, routed experts) with CUDA tensors, decode steps replayed from CUDA graphs, and
torch's grouped_mm on the GPU (bfloat16, compute capability 8.0+).
"""

from __future__ import annotations

import pytest
import torch

from tests.replica.test_families import FAMILIES, PROMPTS, _family_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

NEW_TOKENS = 12
# A prompt longer than the windowed families' sliding window (24 tokens) by far, so that
# decode steps attend to a window that has slid past the prompt's first blocks.
LONG = [3 + (13 * i) % 390 for i in range(70)]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    return request.param, _family_model(request.param, tmp_path_factory)


def _hf_greedy(path, prompts: list[list[int]], n: int) -> list[tuple[list[int], list[torch.Tensor]]]:
    """HF transformers' greedy continuations on the CPU in float32 (full forwards of the growing
    sequence), with each step's logits (to tell a near tie from a real difference)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            seq, steps = list(ids), []
            for _ in range(n):
                logits = hf(torch.tensor([seq])).logits[0, -1].float()
                steps.append(logits)
                seq.append(int(logits.argmax()))
            outs.append((seq[len(ids) :], steps))
    return outs


def _assert_matches(name: str, ours: list[int], theirs: list[int], logits: list[torch.Tensor]) -> None:
    """Token for token; a difference only where HF's own logits of the two tokens tie (within
    float32 reduction-order noise), and nothing compared after it (the sequences part)."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            gap = float(logits[i][b] - logits[i][a])
            assert gap < 1e-3, f"{name}: token {i}: ours {a}, HF {b} (HF prefers its token by {gap:.2e})"
            return
    assert len(ours) == len(theirs)


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_family_greedy_on_cuda_matches_hf(family, enforce_eager):
    """fp32 on CUDA (TF32 off), a token budget small enough to chunk the long prompt beside
    decodes: each family's greedy tokens equal HF's on the CPU, every block back afterwards;
    decode steps replay CUDA graphs unless the family needs them eager (mixture of experts)."""
    from fleetserve.replica.llm import LLM
    from fleetserve.scheduler import SamplingParams

    name, path = family
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = [*PROMPTS, LONG]
    llm = LLM(
        str(path),
        device="cuda",
        dtype="float32",
        block_size=8,
        num_gpu_blocks_override=64,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        enforce_eager=enforce_eager,
    )
    try:
        worker = llm.core.executor.worker
        assert worker.device.type == "cuda" and next(worker.runner.model.parameters()).is_cuda
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
            use_tqdm=False,
        )
        graphs = worker.runner.decode_graphs
        if enforce_eager or not getattr(worker.runner.model, "cuda_graphs", True):
            assert graphs is None
        else:
            assert graphs.num_replays > 0, f"{name}: no decode step replayed a CUDA graph"
        kv = llm.core.scheduler.kv
        assert not llm.core.scheduler.has_unfinished_requests()
        assert kv.num_free_blocks == kv.num_blocks
    finally:
        llm.shutdown()
    for out, (theirs, logits) in zip(outs, _hf_greedy(path, prompts, NEW_TOKENS)):
        _assert_matches(
            f"{name} ({len(out.prompt_token_ids)}-token prompt)", list(out.outputs[0].token_ids), theirs, logits
        )


@pytest.mark.parametrize("T", [1, 8, 37, 256])
def test_moe_grouped_mm_on_cuda_matches_per_expert(T, monkeypatch):
    """Qwen3-MoE-like experts (64 experts, top-8) in bfloat16 on the GPU, with the same routing:
    the two grouped GEMMs (what the layer takes on CUDA) equal one matmul pair per expert, and
    both stay within bfloat16 rounding of the float32 experts."""
    from fleetserve.replica.layers.moe import FusedMoE, _grouped_mm_runs

    E, H, N, k = 64, 256, 128, 8
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(T)
    with torch.device("cuda"):
        experts = FusedMoE(E, H, N)
    for p in experts.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g, device="cuda") * 0.05)
    x = torch.randn(T, H, generator=g, device="cuda")
    scores = torch.randn(T, E, generator=g, device="cuda")
    weights, ids = torch.topk(scores.softmax(-1), k, dim=-1)
    with torch.inference_mode():
        want = experts(x, weights, ids)  # float32: per-expert matmuls (grouped_mm takes bfloat16 on CUDA)
        experts16 = experts.to(torch.bfloat16)
        x16, w16 = x.to(torch.bfloat16), weights.to(torch.bfloat16)
        assert _grouped_mm_runs(x16), "grouped_mm should run for bfloat16 rows on this GPU"
        monkeypatch.setattr(FusedMoE, "grouped_mm", True)
        grouped = experts16(x16, w16, ids)
        assert FusedMoE.grouped_mm is True, "the GPU refused grouped_mm and the layer fell back"
        monkeypatch.setattr(FusedMoE, "grouped_mm", False)
        each = experts16(x16, w16, ids)
    torch.testing.assert_close(grouped.float(), each.float(), atol=1e-2, rtol=2e-2)
    assert float((grouped.float() - want).norm() / want.norm()) < 1e-2
