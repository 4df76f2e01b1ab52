"""The CUDA path of the replica runtime: model, paged attention, sampler, engine.

Skipped where no GPU is visible (CI, the development machines). Run on a GPU
machine with `python -m pytest -q tests/replica/test_cuda.py`. What these cover
is the code the CPU suite exercises with kernels disabled (SDPA prefill, the
decode buffer, torch's sampler ops), now with CUDA tensors, and the CUDA graphs
of decode steps (replica/worker/cuda_graph.py) against HF and the eager engine:
the references are HF transformers in float32 on the CPU, the same ones the CPU
tests use.

Not covered (needs two GPUs): NCCL tensor parallelism (`replica.parallel`
with world_size > 1, the Ray TP executor on GPUs).
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

BLOCK = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from fleetserve.replica.testing import make_tiny_llama

    return make_tiny_llama(
        tmp_path_factory.mktemp("tiny-cuda"), num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, seed=3
    )


@pytest.fixture(scope="module")
def hf_cpu(model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def test_paged_forward_on_cuda_matches_hf(model_dir, hf_cpu):
    """fp32 on CUDA (TF32 off): prefill, a chunked continuation and decodes mixed in one
    forward, through a shuffled paged cache, equal HF's CPU float32 logits."""
    from fleetserve.replica.layers.attention import AttentionMetadata
    from fleetserve.replica.model_loader.registry import resolve_model
    from fleetserve.replica.model_loader.weights import allocate_kv_caches, load_model

    torch.backends.cuda.matmul.allow_tf32 = False
    model, cfg = load_model(resolve_model(str(model_dir)), torch.float32, "cuda")
    assert next(model.parameters()).is_cuda
    caches = allocate_kv_caches(cfg, 64, BLOCK, torch.float32, "cuda")
    assert all(c.is_cuda for c in caches)
    free = list(range(1, 64))
    random.Random(0).shuffle(free)

    def blocks(n):
        return [free.pop() for _ in range(-(-n // BLOCK))]

    def step(chunks):
        md = AttentionMetadata.build(
            [len(c[0]) for c in chunks], [c[1] for c in chunks], [c[2] for c in chunks], BLOCK, device="cuda"
        )
        ids = torch.tensor([t for c in chunks for t in c[0]], device="cuda")
        with torch.no_grad():
            logits = model.compute_logits(model(ids, md.positions, caches, md)).cpu()
        out, start = [], 0
        for c in chunks:
            out.append(logits[start : start + len(c[0])])
            start += len(c[0])
        return out

    def ref(ids):
        with torch.no_grad():
            return hf_cpu(torch.tensor([ids])).logits[0]

    v = cfg.vocab_size
    fresh, cont, dec = _prompt(9, 1, v), _prompt(17, 2, v), _prompt(12, 3, v)
    t_fresh, t_cont, t_dec = blocks(len(fresh)), blocks(len(cont)), blocks(len(dec))
    step([(cont[:10], 0, t_cont), (dec[:11], 0, t_dec)])
    got = step([(fresh, 0, t_fresh), (dec[11:], 11, t_dec), (cont[10:], 10, t_cont)])
    torch.testing.assert_close(got[0], ref(fresh), atol=1e-4, rtol=0)
    torch.testing.assert_close(got[1][0], ref(dec)[11], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[2], ref(cont)[10:], atol=1e-4, rtol=0)
    # Then decode one token at a time on top of the continuation.
    longer = cont + _prompt(6, 4, v)
    table = t_cont + blocks(len(longer) - len(t_cont) * BLOCK)
    expect = ref(longer)
    for t in range(len(cont), len(longer)):
        (d,) = step([(longer[t : t + 1], t, table)])
        torch.testing.assert_close(d[0], expect[t], atol=1e-4, rtol=0)


def _hf_greedy(hf, prompts, n):
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            seq = list(ids)
            for _ in range(n):
                seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
            outs.append(seq[len(ids) :])
    return outs


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_llm_greedy_on_cuda_matches_hf(model_dir, hf_cpu, enforce_eager):
    """The whole engine (scheduler, persistent batch, sampler) on CUDA in fp32, with a cache
    small enough to preempt: the same greedy tokens as HF on the CPU, with decode steps
    replayed from CUDA graphs and without."""
    from fleetserve.replica.llm import LLM
    from fleetserve.scheduler import SamplingParams

    torch.backends.cuda.matmul.allow_tf32 = False
    llm = LLM(
        str(model_dir),
        device="cuda",
        dtype="float32",
        num_gpu_blocks_override=24,
        block_size=BLOCK,
        max_num_seqs=8,
        enforce_eager=enforce_eager,
    )
    assert llm.core.executor.worker.device.type == "cuda"
    prompts = [_prompt(n, 10 + n, 380) for n in (5, 11, 17, 8, 23, 3)]
    outs = llm.generate(
        [list(p) for p in prompts], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False
    )
    assert [list(o.outputs[0].token_ids) for o in outs] == _hf_greedy(hf_cpu, prompts, 12)
    graphs = llm.core.executor.worker.runner.decode_graphs
    if enforce_eager:
        assert graphs is None
    else:
        assert graphs.num_replays > 0 and graphs.num_graphs >= 2
    stats = llm.core.scheduler.get_stats()
    assert stats.num_free_blocks == stats.num_blocks  # nothing leaked
    llm.core.shutdown()


def test_cuda_graphs_equal_eager_as_the_batch_changes(model_dir):
    """fp32, 24 requests of varied lengths through 8 slots and a cache that preempts: rows
    join and leave (every padded batch size), contexts cross width buckets (narrow ones here,
    so that several are captured on first use) and the capture limit (longer rows run
    eagerly); greedy tokens and logprobs equal the eager engine's, and no block leaks."""
    from fleetserve.replica.llm import LLM
    from fleetserve.replica.worker.cuda_graph import DecodeGraphConfig
    from fleetserve.scheduler import SamplingParams

    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = [_prompt(3 + (7 * i) % 29, 100 + i, 380) for i in range(24)]
    params = [
        SamplingParams(max_tokens=4 + (5 * i) % 23, temperature=0, ignore_eos=True, logprobs=1) for i in range(24)
    ]
    results = {}
    for eager in (True, False):
        llm = LLM(
            str(model_dir),
            device="cuda",
            dtype="float32",
            num_gpu_blocks_override=40,
            block_size=BLOCK,
            max_num_seqs=8,
            enforce_eager=eager,
        )
        runner = llm.core.executor.worker.runner
        if not eager:
            graphs = runner.decode_graphs  # 1, 2, 4, 8 rows x widths up to 2048 tokens, at start
            assert graphs.num_graphs == len(graphs.start_shapes(2048)) == 16 and graphs.num_replays == 0
            runner.initialize_kv_cache(
                40,
                decode_graphs=DecodeGraphConfig(
                    max_batch=8, max_len=40, min_width_tokens=BLOCK, start_width_tokens=BLOCK
                ),
            )
            assert runner.decode_graphs.num_graphs == 4  # one block wide at start; the rest on first use
        outs = llm.generate([list(p) for p in prompts], params, use_tqdm=False)
        results[eager] = [o.outputs[0] for o in outs]
        stats = llm.core.scheduler.get_stats()
        assert stats.num_free_blocks == stats.num_blocks
        if not eager:
            graphs = runner.decode_graphs
            assert graphs.num_replays > 20 and graphs.num_graphs >= 8, (graphs.num_replays, graphs.num_graphs)
        llm.core.shutdown()
    assert [o.token_ids for o in results[False]] == [o.token_ids for o in results[True]]
    for a, b in zip(results[False], results[True]):
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys()
            assert all(abs(x[t] - y[t]) < 1e-4 for t in x)


def test_bf16_sampling_and_prefix_cache_on_cuda(model_dir):
    """bf16 (the CUDA default dtype): seeded sampling repeats itself, penalties, top-k/p,
    logprobs and prefix-cache hits all work with CUDA tensors."""
    from fleetserve.replica.llm import LLM
    from fleetserve.scheduler import SamplingParams

    llm = LLM(str(model_dir), device="cuda", num_gpu_blocks_override=256, block_size=BLOCK)
    assert llm.core.executor.worker.dtype == torch.bfloat16
    prompt = _prompt(40, 5, 380)
    sp = SamplingParams(
        max_tokens=16,
        temperature=0.9,
        top_k=50,
        top_p=0.9,
        min_p=0.01,
        repetition_penalty=1.1,
        presence_penalty=0.2,
        frequency_penalty=0.1,
        seed=1234,
        logprobs=3,
        ignore_eos=True,
    )
    a, b = llm.generate([list(prompt), list(prompt)], [sp, sp], use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert len(a.outputs[0].token_ids) == 16
    assert all(len(lp) >= 3 for lp in a.outputs[0].logprobs)
    (c,) = llm.generate([list(prompt)], sp, use_tqdm=False)  # served from the prefix cache
    assert c.num_cached_tokens >= 32
    assert c.outputs[0].token_ids == a.outputs[0].token_ids
    greedy = llm.generate([list(prompt)] * 3, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in greedy}) == 1
    stats = llm.core.scheduler.get_stats()
    assert stats.num_free_blocks == stats.num_blocks
    llm.core.shutdown()


def test_async_engine_streams_and_aborts_on_cuda(model_dir):
    """The serving engine on CUDA: concurrent streams, and an abandoned stream's blocks
    go back to the pool."""
    from fleetserve.replica.engine.async_engine import AsyncEngine
    from fleetserve.scheduler import SamplingParams

    engine = AsyncEngine(model=str(model_dir), device="cuda", num_gpu_blocks_override=128, block_size=BLOCK)

    async def run_one(i):
        text = ""
        async for out in engine.generate(
            f"Hello number {i}", SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
        ):
            text += out.outputs[0].text
        return text

    async def abandon():
        agen = engine.generate("to be dropped", SamplingParams(max_tokens=200, ignore_eos=True))
        await agen.__anext__()
        await agen.aclose()

    async def main():
        texts = await asyncio.gather(*(run_one(i) for i in range(4)))
        await abandon()
        for _ in range(100):
            if engine.get_load()["num_free_blocks"] == engine.get_load()["num_blocks"]:
                break
            await asyncio.sleep(0.02)
        return texts

    try:
        texts = asyncio.run(main())
        assert all(texts)
        load = engine.get_load()
        assert load["num_free_blocks"] == load["num_blocks"] and load["num_running"] == 0
    finally:
        engine.shutdown()


def test_default_kv_budget_on_cuda():
    """Without an override the KV cache takes a share of the free GPU memory, not host RAM."""
    from fleetserve.replica.worker.device import default_kv_cache_bytes

    free, _ = torch.cuda.mem_get_info()
    budget = default_kv_cache_bytes(torch.device("cuda"))
    assert 0 < budget <= free


@pytest.fixture(scope="module")
def cuda_loras(model_dir, tmp_path_factory):
    from fleetserve.replica.testing import make_tiny_lora

    root = tmp_path_factory.mktemp("cuda-loras")
    return {
        "a": make_tiny_lora(model_dir, root / "a", seed=1),
        "b": make_tiny_lora(model_dir, root / "b", r=4, lora_alpha=8, target_modules=("q_proj", "v_proj"), seed=2),
        "rs": make_tiny_lora(
            model_dir,
            root / "rs",
            r=16,
            lora_alpha=4,
            use_rslora=True,
            target_modules=("o_proj", "gate_proj", "down_proj"),
            seed=3,
        ),
    }


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_lora_adapters_on_cuda_match_peft(model_dir, cuda_loras, enforce_eager):
    """LoRA on the GPU, fp32: batches that mix the base model and three adapters (two a step; one loaded
    at start, two when a request names them, which grows the graphs' LoRA stacks and
    recaptures) give PEFT's greedy tokens on the CPU, with decode steps replayed from CUDA
    graphs that hold the adapters (lora/stack.py) and without; no block leaks."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from fleetserve.replica.llm import LLM
    from fleetserve.replica.lora import LoRARequest
    from fleetserve.scheduler import SamplingParams

    torch.backends.cuda.matmul.allow_tf32 = False
    llm = LLM(
        str(model_dir),
        device="cuda",
        dtype="float32",
        num_gpu_blocks_override=64,
        block_size=BLOCK,
        max_num_seqs=8,
        enforce_eager=enforce_eager,
        enable_lora=True,
        max_loras=2,
        max_cpu_loras=2,
        lora_modules=[f"a={cuda_loras['a']}"],
    )
    runner = llm.core.executor.worker.runner
    if not enforce_eager:
        assert runner.lora_stacks.capacity == 2 and runner.decode_graphs.num_graphs == 2 * 16
    requests = {n: LoRARequest(n, i, str(cuda_loras[n])) for i, n in enumerate(("a", "b", "rs"), start=1)}
    names = [None, "a", "b", "rs", "a", None, "rs", "b"]
    prompts = [_prompt(3 + 5 * i, 40 + i, 380) for i in range(len(names))]
    outs = llm.generate(
        [list(p) for p in prompts],
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        use_tqdm=False,
        lora_request=[requests.get(n) for n in names],
    )
    want = []
    for name, ids in zip(names, prompts):
        base = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        model = base if name is None else PeftModel.from_pretrained(base, str(cuda_loras[name])).eval()
        want.append(_hf_greedy(model, [ids], 12)[0])
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert len({tuple(w) for w in want}) == len(want)
    stats = llm.core.scheduler.get_stats()
    assert stats.num_free_blocks == stats.num_blocks
    if not enforce_eager:
        graphs = runner.decode_graphs
        assert runner.lora_stacks.capacity == 4 and graphs.lora_slots == 4  # grew for the third
        assert graphs.num_lora_steps > 5 and graphs.num_replays >= graphs.num_lora_steps
    llm.core.shutdown()
