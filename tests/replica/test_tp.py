"""Tensor parallelism over Ray actors and gloo: TP>1 gives the same tokens as TP=1."""

import time

import pytest

from fleetserve.scheduler import SamplingParams
from tests.replica.hf_compare import assert_same_outputs

ray = pytest.importorskip("ray")

PROMPTS = ["The quick brown fox", "Hello, world! How are you today?", "def add(a, b):"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)


def _run(model_dir, tp, **kw):
    from fleetserve.replica.llm import LLM

    llm = LLM(
        str(model_dir),
        dtype="float32",
        num_gpu_blocks_override=64,
        block_size=4,
        tensor_parallel_size=tp,
        num_threads=1,
        **kw,
    )
    try:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        sched = llm.core.scheduler
        assert sched.kv.num_free_blocks == sched.kv.num_blocks
        # a block over every rank: the ranks' shares of the KV heads add up to the whole
        # (tiny_model_dir: 2 KV heads of 16 dims, 2 layers, K and V, float32, blocks of 4)
        if tp in (1, 2):
            assert llm.core.kv_bytes_per_block == 2 * 2 * 16 * 2 * 4 * 4, llm.core.kv_bytes_per_block
        return outs
    finally:
        llm.core.shutdown()


@pytest.mark.slow
def test_tp2_matches_tp1(local_ray, tiny_model_dir):
    kw = dict(max_num_batched_tokens=8, long_prefill_token_threshold=6)  # chunked prefill
    ref = _run(tiny_model_dir, 1, **kw)
    got = _run(tiny_model_dir, 2, **kw)
    assert_same_outputs([o.outputs[0] for o in ref], [o.outputs[0] for o in got])


@pytest.mark.slow
def test_tp2_lora_matches_tp1(local_ray, tiny_model_dir, tmp_path):
    """LoRA adapters sharded over two ranks (B's rows on q/k/v and gate/up, A's columns on o and
    down, whose partial deltas add up in the all-reduce) give TP=1's tokens."""
    from fleetserve.replica.lora import LoRARequest
    from fleetserve.replica.testing import make_tiny_lora

    a = make_tiny_lora(tiny_model_dir, tmp_path / "a", seed=1)
    b = make_tiny_lora(tiny_model_dir, tmp_path / "b", r=4, target_modules=("k_proj", "up_proj", "down_proj"), seed=2)
    loras = [LoRARequest("a", 1, str(a)), None, LoRARequest("b", 2, str(b))]
    outs = {}
    for tp in (1, 2):
        from fleetserve.replica.llm import LLM

        llm = LLM(
            str(tiny_model_dir),
            dtype="float32",
            num_gpu_blocks_override=64,
            block_size=4,
            tensor_parallel_size=tp,
            num_threads=1,
            enable_lora=True,
            max_loras=2,
        )
        try:
            outs[tp] = [
                o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)
            ]
        finally:
            llm.core.shutdown()
    assert outs[1] == outs[2]
    base = [o.outputs[0].token_ids for o in _run(tiny_model_dir, 1)]
    assert outs[1][0] != base[0] and outs[1][1] == base[1] and outs[1][2] != base[2]


@pytest.mark.slow
def test_tp2_with_preemption(local_ray, tiny_model_dir):
    ref = _run(tiny_model_dir, 1)
    from fleetserve.replica.llm import LLM

    llm = LLM(
        str(tiny_model_dir),
        dtype="float32",
        num_gpu_blocks_override=9,
        block_size=4,
        tensor_parallel_size=2,
        num_threads=1,
    )
    try:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
        assert llm.core.scheduler.get_stats().num_preemptions > 0
    finally:
        llm.core.shutdown()


def test_tp_size_not_dividing_heads_is_refused(local_ray, tiny_model_dir):
    from fleetserve.replica.llm import LLM

    with pytest.raises(Exception, match="divisible|divide"):
        LLM(str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=16, tensor_parallel_size=3, num_threads=1)


@pytest.mark.slow
def test_killed_worker_fails_requests_not_hang(local_ray, tiny_model_dir):
    import asyncio

    from fleetserve.replica.engine.async_engine import AsyncEngine, EngineDeadError

    engine = AsyncEngine(
        model=str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=64, tensor_parallel_size=2, num_threads=1
    )
    sp = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    executor = engine.core.executor

    async def main():
        got = 0
        t0 = time.monotonic()
        with pytest.raises((EngineDeadError, RuntimeError)):
            async for out in engine.generate(PROMPTS[0], sp, "victim"):
                got += len(out.outputs[0].token_ids)
                if got == 3:
                    ray.kill(executor.workers[1])
        return time.monotonic() - t0

    try:
        elapsed = asyncio.run(main())
        assert elapsed < 60
        with pytest.raises(EngineDeadError):
            engine.check_health()
    finally:
        engine.shutdown()


@pytest.mark.real_model
@pytest.mark.slow
def test_smollm2_tp3_matches_tp1(local_ray):
    from fleetserve.replica.llm import LLM

    prompts = ["The capital of France is", "def fibonacci(n):"]
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    outs = {}
    for tp in (1, 3):
        llm = LLM("smollm2-135m", dtype="float32", num_gpu_blocks_override=64, tensor_parallel_size=tp, num_threads=1)
        try:
            outs[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        finally:
            llm.core.shutdown()
    assert outs[1] == outs[3]


@pytest.mark.real_model
def test_smollm2_tp2_refused_clearly():
    from fleetserve.replica.llm import LLM

    with pytest.raises(ValueError, match="9 attention heads.*not divisible by 2"):
        LLM("smollm2-135m", tensor_parallel_size=2)
