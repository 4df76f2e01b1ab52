"""Decode steps through the CUDA-graph runner's static, padded buffers (replica/worker/cuda_graph.py).

No GPU here: the runner runs its very forward without capturing (`capture=False`), which
checks what a graph replays -- padding rows to a capture size and block tables to a width
bucket, the scratch block, the metadata derived from the buffers -- against the ordinary
eager path. tests/replica/test_cuda.py runs the captured graphs on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from fleetserve.replica.llm import LLM
from fleetserve.replica.worker.cuda_graph import DecodeGraphConfig, DecodeGraphs, capture_sizes, width_bucket
from fleetserve.scheduler import SamplingParams

BLOCK = 4
NUM_BLOCKS = 40


def test_capture_sizes_and_buckets():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(100)[-2:] == [96, 104]
    assert [width_bucket(b, 40) for b in (1, 2, 3, 5, 16, 17, 40)] == [1, 2, 4, 8, 16, 32, 40]
    assert [width_bucket(b, 40, 16) for b in (1, 16, 17)] == [16, 16, 32]
    g = DecodeGraphs(
        None,
        [],
        scratch_block=9,
        block_size=BLOCK,
        device=torch.device("cpu"),
        config=DecodeGraphConfig(max_batch=6, max_len=30, capture=False, min_width_tokens=8),
    )
    assert g.max_batch == 8 and g.max_blocks == 8
    assert g.bucket(3, 1) == (4, 2)
    assert g.bucket(3, 3) == (4, 4)
    assert g.bucket(8, 8) == (8, 8)
    assert g.bucket(9, 1) is None  # more rows than captured: eager
    assert g.bucket(1, 9) is None  # a row longer than max_seq_len_to_capture: eager
    # Captured at start: every size at widths 2 and 4 (up to 16 tokens), widest and largest first.
    assert g.start_shapes(16) == [(8, 4), (4, 4), (2, 4), (1, 4), (8, 2), (4, 2), (2, 2), (1, 2)]
    assert g.start_shapes(1) == [(8, 2), (4, 2), (2, 2), (1, 2)]  # at least the narrowest
    assert g.start_shapes(1000)[0] == (8, 8)  # capped at max_seq_len_to_capture
    big = DecodeGraphs(
        None,
        [],
        scratch_block=0,
        block_size=16,
        device=torch.device("cpu"),
        config=DecodeGraphConfig(max_batch=64, max_len=8192, capture=False),
    )
    assert len(big.start_shapes(2048)) == 11 * 4  # 1..64 rows x 256, 512, 1024, 2048 tokens


def _prompts(n: int, vocab: int = 380) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [
        torch.randint(3, vocab, (int(torch.randint(2, 14, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


def _run(model_dir, dtype: str, static: bool):
    llm = LLM(
        str(model_dir), dtype=dtype, num_gpu_blocks_override=NUM_BLOCKS, block_size=BLOCK, max_num_seqs=6, device="cpu"
    )
    runner = llm.core.executor.worker.runner
    if static:
        # Rows up to 6 (padded to 8) and 32 tokens per row: the larger steps of this workload
        # (7+ rows can't happen; rows past 32 tokens can) run eagerly, the rest through the buffers.
        runner.initialize_kv_cache(
            NUM_BLOCKS, decode_graphs=DecodeGraphConfig(max_batch=6, max_len=32, capture=False, min_width_tokens=1)
        )
        assert runner.kv_caches[0].shape[2] == NUM_BLOCKS + 1  # the scratch block
    # Varied lengths: rows join and leave (batch sizes 1..6 padded), contexts cross width
    # buckets and the capture limit, and 40 blocks of 4 tokens force preemptions.
    prompts = _prompts(10)
    params = [
        SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True, logprobs=2) for i in range(len(prompts))
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.core.scheduler.get_stats()
    assert stats.num_free_blocks == stats.num_blocks  # nothing leaked
    graphs = runner.decode_graphs
    llm.core.shutdown()
    return [o.outputs[0] for o in outs], graphs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_static_decode_path_matches_eager(tiny_model_dir, dtype):
    """With the fused CPU kernels every op treats each row on its own, so the padded static
    path must give bit-identical tokens and logprobs; without them (PyTorch attention, what
    GPUs run) the tokens must match."""
    from fleetserve.replica import kernels

    eager, _ = _run(tiny_model_dir, dtype, static=False)
    static, graphs = _run(tiny_model_dir, dtype, static=True)
    assert graphs.num_steps > 10 and graphs.num_replays == 0
    assert len(graphs._graphs) >= 3  # several (rows, width) shapes
    assert [o.token_ids for o in static] == [o.token_ids for o in eager]
    if kernels.cpu_ops() is not None:
        assert [o.logprobs for o in static] == [o.logprobs for o in eager]


def test_static_decode_path_matches_eager_with_pytorch_attention(tiny_model_dir, monkeypatch):
    from fleetserve.replica.layers.attention import PagedAttention

    monkeypatch.setattr(PagedAttention, "use_attention_kernel", False)
    eager, _ = _run(tiny_model_dir, "float32", static=False)
    static, graphs = _run(tiny_model_dir, "float32", static=True)
    assert graphs.num_steps > 10
    assert [o.token_ids for o in static] == [o.token_ids for o in eager]


@pytest.fixture(scope="module")
def loras(tiny_loras):
    return tiny_loras  # (tests/replica/conftest.py)


def _run_lora(model_dir, loras, static: bool):
    from fleetserve.replica.lora import LoRARequest

    llm = LLM(
        str(model_dir),
        dtype="float32",
        num_gpu_blocks_override=NUM_BLOCKS,
        block_size=BLOCK,
        max_num_seqs=6,
        device="cpu",
        enable_lora=True,
        max_loras=3,
        lora_modules=[f"a={loras['a']}", f"b={loras['b']}"],
    )
    runner = llm.core.executor.worker.runner
    if static:
        # Two slots for the two adapters loaded at start; the third (loaded when a request
        # names it) doubles the stacks, and the graphs start over with the new buffers.
        runner.initialize_kv_cache(
            NUM_BLOCKS,
            decode_graphs=DecodeGraphConfig(max_batch=6, max_len=32, capture=False, min_width_tokens=1, lora_slots=2),
        )
        assert runner.lora_stacks.capacity == runner.decode_graphs.lora_slots == 2
        assert runner.lora_stacks.slot_of == {1: 0, 2: 1}
    requests = {
        "a": LoRARequest("a", 1, str(loras["a"])),
        "b": LoRARequest("b", 2, str(loras["b"])),
        "rs": LoRARequest("rs", 3, str(loras["rs"])),
    }
    names = [None, "a", "b", "rs", "a", None, "rs", "b", None, "a"]
    prompts = _prompts(len(names))
    params = [
        SamplingParams(temperature=0, max_tokens=5 + 3 * i, ignore_eos=True, logprobs=2) for i in range(len(prompts))
    ]
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=[requests.get(n) for n in names])
    stats = llm.core.scheduler.get_stats()
    assert stats.num_free_blocks == stats.num_blocks  # nothing leaked
    return llm, runner, [o.outputs[0] for o in outs]


def test_static_decode_path_with_lora_adapters_matches_eager(tiny_model_dir, loras):
    """Decode steps with adapters through the stacked LoRA buffers (what a CUDA graph replays:
    lora/stack.py) give the tokens of the eager, per-adapter path, in batches that mix the
    base model and three adapters (eager steps with several adapters take the stacks too); the
    stacks grow when a third adapter is loaded, and an
    unloaded adapter's slot is zeroed and handed to the next one."""
    llm, _, eager = _run_lora(tiny_model_dir, loras, static=False)
    llm.core.shutdown()
    llm, runner, static = _run_lora(tiny_model_dir, loras, static=True)
    graphs, stacks = runner.decode_graphs, runner.lora_stacks
    assert stacks.capacity == graphs.lora_slots == 4 and stacks.slot_of == {1: 0, 2: 1, 3: 2}
    assert graphs.num_lora_steps > 5
    assert [o.token_ids for o in static] == [o.token_ids for o in eager]
    for a, b in zip(static, eager):
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x)
    # Every adapter differs from the base model somewhere (the one-hot picked real slots).
    assert len({tuple(o.token_ids) for o in static}) > 3
    qkv = runner.model.model.layers[0].self_attn.qkv_proj.lora_stack
    rc = qkv.rc
    assert qkv.a[rc : 2 * rc].abs().sum() > 0  # b's q and v
    # Base-model steps take the graphs without the adapters' kernels, and give the same tokens.
    steps, lora_steps = graphs.num_steps, graphs.num_lora_steps
    again = llm.generate(_prompts(1), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert again[0].outputs[0].token_ids == static[0].token_ids
    assert graphs.num_steps > steps and graphs.num_lora_steps == lora_steps
    assert {lora for _, _, lora in graphs._graphs} == {False, True}
    llm.core.executor.remove_lora(2)
    assert 2 not in stacks.slot_of and qkv.a[rc : 2 * rc].abs().sum() == 0 and qkv.b[:, rc : 2 * rc].abs().sum() == 0
    llm.core.executor.add_lora(4, "b2", str(loras["b"]))
    assert stacks.slot_of[4] == 1 and qkv.a[rc : 2 * rc].abs().sum() > 0 and stacks.capacity == 4
    llm.core.shutdown()


def test_no_graphs_on_cpu_or_when_eager(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_gpu_blocks_override=16, device="cpu")
    worker = llm.core.executor.worker
    assert worker.runner.decode_graphs is None and worker._decode_graph_config() is None
    llm.core.shutdown()


def test_which_workers_would_capture(tiny_model_dir, monkeypatch, caplog):
    """The worker's choice on a GPU (its device faked: nothing is captured here): graphs with
    the run's batch and length limits, none with --enforce-eager, TP, a KV connector or a
    speculative proposer (and the log says why)."""
    llm = LLM(str(tiny_model_dir), num_gpu_blocks_override=16, device="cpu", max_num_seqs=24, max_model_len=300)
    worker = llm.core.executor.worker
    monkeypatch.setattr(worker, "device", torch.device("cuda"))
    cfg = worker._decode_graph_config()
    assert (cfg.max_batch, cfg.max_len, cfg.capture, cfg.lora_slots) == (24, 300, True, 0)
    # With LoRA: slots for every adapter held (--max-cpu-loras), else at least 4 (they grow).
    monkeypatch.setattr(worker, "args", worker.args.model_copy(update={"enable_lora": True, "max_loras": 2}))
    assert (worker._decode_graph_config().lora_slots, worker._decode_graph_config().max_lora_rank) == (4, 16)
    monkeypatch.setattr(worker, "args", worker.args.model_copy(update={"max_cpu_loras": 6, "max_lora_rank": 8}))
    assert (worker._decode_graph_config().lora_slots, worker._decode_graph_config().max_lora_rank) == (6, 8)
    monkeypatch.setattr(worker, "args", worker.args.model_copy(update={"max_seq_len_to_capture": 128}))
    assert worker._decode_graph_config().max_len == 128
    monkeypatch.setattr(worker, "args", worker.args.model_copy(update={"enforce_eager": True}))
    assert worker._decode_graph_config() is None
    monkeypatch.setattr(worker, "args", worker.args.model_copy(update={"enforce_eager": False}))
    monkeypatch.setattr(worker, "world_size", 2)
    monkeypatch.setattr(worker, "kv_connector", object())
    with caplog.at_level("INFO"):
        assert worker._decode_graph_config() is None
    assert "CUDA graphs off (tensor parallelism, a KV connector)" in caplog.text
    monkeypatch.setattr(worker, "world_size", 1)
    monkeypatch.setattr(worker, "kv_connector", None)
    monkeypatch.setattr(worker.runner, "proposer", object())
    assert worker._decode_graph_config() is None
    llm.core.shutdown()
