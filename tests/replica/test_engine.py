"""The full engine (scheduler + model runner + sampler + detokenizer) on a tiny model,
checked token for token against HF transformers."""

import asyncio
import json
import time

import pytest

from fleetserve.replica.engine.async_engine import AsyncEngine, QueueFullError
from fleetserve.replica.llm import LLM
from fleetserve.replica.model_loader.registry import ModelNotFoundError
from fleetserve.scheduler import SamplingParams
from tests.replica.conftest import hf_greedy

PROMPTS = [
    "The quick brown fox",
    "Hello, world! How are you today? I am fine, thank you. Paged attention stores keys",
    "def add(a, b):",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and symbols + - * / = < > ( ) [ ] { } # @ & % $ and more",
    "A",
]
MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=256)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    return ids, hf_greedy(tiny_model_dir, ids, MAX_NEW)


def assert_no_leak(core):
    sched = core.scheduler
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    sched.kv.check_invariants()


ENGINE_VARIANTS = {
    "default": dict(),
    "no_prefix_cache": dict(enable_prefix_caching=False),
    "chunked_small_budget": dict(max_num_batched_tokens=8, long_prefill_token_threshold=5),
    # 24 blocks x 4 tokens: the longest request (71 + 12 tokens) fits alone, all five do not.
    "preemption_tiny_pool": dict(num_gpu_blocks_override=24, block_size=4),
    "no_chunking": dict(enable_chunked_prefill=False, max_num_batched_tokens=2048),
    "priority_no_evict": dict(
        scheduling_policy="priority", capacity_policy="guaranteed_no_evict", num_gpu_blocks_override=24, block_size=4
    ),
}


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_greedy_matches_hf(tiny_model_dir, reference, variant):
    ids, expected = reference
    kwargs = dict(dtype="float32", num_gpu_blocks_override=256)
    kwargs.update(ENGINE_VARIANTS[variant])
    llm = LLM(str(tiny_model_dir), **kwargs)
    # Twice: the second pass hits the prefix cache (when on).
    for _ in range(2):
        outs = llm.generate(ids, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        assert_no_leak(llm.core)
    if variant == "preemption_tiny_pool":
        assert llm.core.scheduler.get_stats().num_preemptions > 0
    if variant == "default":
        assert llm.core.scheduler.get_stats().prefix_cache_hits > 0


def test_text_matches_tokens(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=128)
    (out,) = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    c = out.outputs[0]
    assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)


def test_kv_bytes_per_block_are_what_the_cache_holds_per_block(tiny_model_dir):
    """What a hand-off of one block moves (tracing's kv_transfer bytes): the KV cache's bytes
    over its blocks (K and V, every layer, float32 here)."""
    llm = LLM(str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=32, block_size=8)
    try:
        caches = llm.core.executor.worker.runner.kv_caches
        held = sum(c.numel() * c.element_size() for c in caches)
        assert llm.core.kv_bytes_per_block > 0
        assert llm.core.kv_bytes_per_block * 32 == held
    finally:
        llm.shutdown()


def test_step_trace_records_every_step(tiny_model_dir, tmp_path, monkeypatch):
    """FLEETSERVE_STEP_TRACE: one JSON line per step, whose token counts add up to the work done."""
    from fleetserve.replica.engine.engine_core import STEP_TRACE_ENV, StepTrace

    monkeypatch.setenv(STEP_TRACE_ENV, str(tmp_path / "trace"))
    llm = LLM(
        str(tiny_model_dir),
        dtype="float32",
        num_gpu_blocks_override=128,
        enable_prefix_caching=False,
        max_num_batched_tokens=32,
    )
    ids = [llm.tokenizer.encode(p) for p in PROMPTS[:3]]
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = llm.generate(ids, sp, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 5 for o in outs)
    llm.core.shutdown()
    (path,) = (tmp_path / "trace").glob("steps-*.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    # Every prompt token once, and every output token but the last fed back once.
    assert sum(r["tokens"] for r in rows) == sum(len(i) for i in ids) + 3 * (5 - 1)
    assert max(r["tokens"] for r in rows) <= 32  # chunked by the token budget
    assert any(r["waiting"] > 0 for r in rows) and rows[-1]["waiting"] == 0
    assert all(r["step_s"] >= r["model_s"] >= 0 and r["cpu_s"] >= 0 for r in rows)
    assert all(r["reqs"] >= 1 and r["model_s"] > 0 for r in rows if r["tokens"])
    assert [r["t"] for r in rows] == sorted(r["t"] for r in rows)
    # A folder that cannot be made: a warning and no trace, not a failed engine.
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(STEP_TRACE_ENV, str(blocker / "trace"))
    assert StepTrace.from_env() is None


def test_seeded_sampling_reproducible_and_n(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=128)
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True, n=3)
    a = llm.generate(PROMPTS[:2], sp, use_tqdm=False)
    # Different batch composition: the seeded request must still produce the same tokens.
    b = llm.generate([PROMPTS[3], PROMPTS[0]], sp, use_tqdm=False)
    assert [c.token_ids for c in a[0].outputs] == [c.token_ids for c in b[1].outputs]
    assert len(a[0].outputs) == 3 and [c.index for c in a[0].outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in a[0].outputs}) > 1  # children use different seeds
    assert_no_leak(llm.core)


def test_stop_string_never_leaks(tiny_model_dir, reference):
    ids, expected = reference
    llm = LLM(str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=128)
    full = llm.tokenizer.decode(expected[1], skip_special_tokens=True)
    stop = full[3:6]
    assert stop.strip(), "the reference continuation is too short for this test"
    (out,) = llm.generate(
        [ids[1]], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, stop=[stop]), use_tqdm=False
    )
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == full[: full.index(stop)]
    assert stop not in c.text
    assert_no_leak(llm.core)


def test_stop_token_ids_and_min_tokens(tiny_model_dir, reference):
    ids, expected = reference
    llm = LLM(str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=128)
    stop_tok = expected[0][4]
    (out,) = llm.generate(
        [ids[0]],
        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, stop_token_ids=[stop_tok]),
        use_tqdm=False,
    )
    first = expected[0].index(stop_tok)
    assert out.outputs[0].token_ids == expected[0][: first + 1]
    assert out.outputs[0].stop_reason == stop_tok


def test_bad_input_then_still_serves(tiny_model_dir, reference):
    ids, expected = reference
    llm = LLM(str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=128, max_model_len=64)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([list(range(3, 70))], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[1, 2, 10**6]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    outs = llm.generate(ids[:2], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected[:2]
    assert_no_leak(llm.core)


def test_unknown_model_and_corrupt_weights(tmp_path, tiny_model_dir):
    with pytest.raises(ModelNotFoundError, match="unknown model"):
        LLM("no-such-model")
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(ValueError, match="safetensors|weight|corrupt|truncated"):
        LLM(str(broken))


# ---- AsyncEngine ---------------------------------------------------------------------


@pytest.fixture(scope="module", params=["core-process", "core-thread"])
def async_engine(tiny_model_dir, request):
    """Every AsyncEngine test runs on both layouts: the EngineCore in its own process (the
    default) and on a thread of the caller's process."""
    engine = AsyncEngine(
        model=str(tiny_model_dir),
        dtype="float32",
        num_gpu_blocks_override=128,
        max_waiting_requests=64,
        core_process=request.param == "core-process",
    )
    assert (engine.core_pid is not None) == (request.param == "core-process")
    yield engine
    engine.shutdown()


async def _collect(engine, prompt, sp, rid):
    text, tokens, final = "", [], None
    async for out in engine.generate(prompt, sp, rid):
        for c in out.outputs:
            text += c.text
            tokens += c.token_ids
        final = out
    return text, tokens, final


def test_async_streams_match_reference(async_engine, reference):
    ids, expected = reference

    async def main():
        return await asyncio.gather(*[_collect(async_engine, p, GREEDY, f"r{i}") for i, p in enumerate(ids)])

    results = asyncio.run(main())
    assert [tokens for _, tokens, _ in results] == expected
    for _, _, final in results:
        assert final.finished and final.metrics.ttft is not None and final.metrics.ttft >= 0
        assert len(final.itl) == MAX_NEW - 1
        m = final.metrics
        assert m.num_generation_tokens == MAX_NEW and m.decode_tokens_per_s > 0
        assert m.queue_time is not None and 0 <= m.queue_time <= m.ttft <= m.e2e
    load = async_engine.get_load()
    assert load["num_running"] == 0 and load["num_free_blocks"] == load["num_blocks"]
    text = async_engine.metrics_text()
    assert "vllm:generation_tokens_total" in text and "vllm:time_to_first_token_seconds_bucket" in text


def test_stream_interval_batches_tokens_after_the_first(tiny_model_dir, reference):
    """--stream-interval 4 (vLLM's semantics): the first output at once, then outputs of at
    least 4 new tokens, the last whatever is left; same tokens and text as interval 1, with
    logprobs kept in step; a request's stream_interval raises the engine's, never lowers it."""
    ids, expected = reference
    engine = AsyncEngine(model=str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=128, stream_interval=4)

    async def sizes(prompt, sp, rid):
        out = []
        async for o in engine.generate(prompt, sp, rid):
            c = o.outputs[0]
            assert len(c.logprobs or []) == (len(c.token_ids) if sp.logprobs is not None else 0)
            out.append((len(c.token_ids), o.finished, c.token_ids, c.text))
        return out

    async def main():
        with_lp = GREEDY.replace(logprobs=1)
        return await asyncio.gather(
            sizes(ids[0], with_lp, "a"),
            sizes(ids[1], GREEDY.replace(stream_interval=5), "b"),
            sizes(ids[2], GREEDY.replace(stream_interval=2), "c"),
        )

    try:
        results = asyncio.run(main())
        for i, (got, interval) in enumerate(zip(results, (4, 5, 4))):
            full, rest = divmod(MAX_NEW - 1, interval)  # one token a step, merged
            assert [n for n, *_ in got] == [1] + [interval] * full + ([rest] if rest else [])
            assert [f for _, f, *_ in got] == [False] * (len(got) - 1) + [True]
            assert [t for *_, toks, _ in got for t in toks] == expected[i]
        load = engine.get_load()
        assert load["num_running"] == 0 and load["num_free_blocks"] == load["num_blocks"]
        with pytest.raises(ValueError, match="stream_interval"):
            SamplingParams(stream_interval=0)
    finally:
        engine.shutdown()
    ref_text = (
        LLM(str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=64)
        .generate([ids[0]], GREEDY, use_tqdm=False)[0]
        .outputs[0]
        .text
    )
    assert "".join(text for *_, text in results[0]) == ref_text


def test_async_abort_frees_blocks(async_engine, reference):
    ids, _ = reference
    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        got = 0
        async for out in async_engine.generate(ids[1], sp, "to-abort"):
            got += len(out.outputs[0].token_ids)
            if got >= 3:
                break  # the client goes away
        await asyncio.sleep(0.3)

    asyncio.run(main())
    for _ in range(50):
        load = async_engine.get_load()
        if load["num_running"] == 0:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert load["num_running"] == 0 and load["num_free_blocks"] == load["num_blocks"]


def test_async_bad_input_keeps_serving(async_engine, reference):
    ids, expected = reference

    async def main():
        with pytest.raises(ValueError):
            async for _ in async_engine.generate("", GREEDY, "empty"):
                pass
        with pytest.raises(ValueError, match="maximum context length"):
            async for _ in async_engine.generate(list(range(3, 3000)), GREEDY, "long"):
                pass
        return await _collect(async_engine, ids[0], GREEDY, "after-bad")

    _, tokens, _ = asyncio.run(main())
    assert tokens == expected[0]


def test_async_queue_full(tiny_model_dir):
    engine = AsyncEngine(
        model=str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=64, max_waiting_requests=2, max_num_seqs=1
    )
    long = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)

    async def main():
        tasks = []
        deadline = time.monotonic() + 30
        for i in range(3):  # one runs (max_num_seqs=1), two wait: the queue is then full
            tasks.append(asyncio.create_task(_collect(engine, PROMPTS[0], long, f"q{i}")))
            # Each add reaches the engine before the next (adds in flight count as waiting);
            # polled, not slept, so a fast device has no time to finish the long request.
            while sum(engine.get_load()[k] for k in ("num_running", "num_waiting")) < i + 1:
                assert time.monotonic() < deadline, engine.get_load()
                await asyncio.sleep(0.005)
        with pytest.raises(QueueFullError):
            async for _ in engine.generate(PROMPTS[1], GREEDY, "overflow"):
                pass
        for t in tasks:  # the clients go away: their requests are aborted
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _ in range(100):
            if engine.get_load()["num_running"] == 0 and engine.get_load()["num_waiting"] == 0:
                break
            await asyncio.sleep(0.05)
        # Room again: a new request is served.
        return await _collect(engine, PROMPTS[0], GREEDY, "after-full")

    try:
        _, tokens, _ = asyncio.run(main())
        assert len(tokens) == MAX_NEW
        load = engine.get_load()
        assert load["num_free_blocks"] == load["num_blocks"]
    finally:
        engine.shutdown()


def test_prompt_logprobs_and_logprobs_match_hf(tiny_model_dir, reference):
    import torch
    from transformers import LlamaForCausalLM

    ids, expected = reference
    # A small budget splits the prompt into chunks: logprobs must join up across them.
    llm = LLM(str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=128, max_num_batched_tokens=16)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    (out,) = llm.generate([ids[3]], sp, use_tqdm=False)
    hf = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        full = ids[3] + out.outputs[0].token_ids
        logp = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), dim=-1)
    plp = out.prompt_logprobs
    assert plp[0] is None and len(plp) == len(ids[3])
    for i in range(1, len(ids[3])):
        entry = plp[i]
        tok = ids[3][i]
        assert tok in entry and abs(entry[tok] - logp[i - 1, tok].item()) < 1e-4
        assert len(entry) <= 3  # the prompt token plus the top 2
    for j, entry in enumerate(out.outputs[0].logprobs):
        pos = len(ids[3]) - 1 + j
        tok = out.outputs[0].token_ids[j]
        assert abs(entry[tok] - logp[pos, tok].item()) < 1e-4
        top = torch.topk(logp[pos], 3).indices.tolist()
        assert set(top) <= set(entry)
    # Prefix caching is bypassed for prompt logprobs, and nothing leaks.
    assert_no_leak(llm.core)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_request_computes_the_same_numbers_alone_and_in_a_batch(tiny_model_dir, dtype):
    """With the small-M linears every op of a small step treats each row on its own (linears,
    attention per token, norms, sampling), so a request's greedy tokens and logprobs are
    bit-identical whether it runs alone or beside others. (oneDNN's linears also kept this
    at these tiny shapes when tried; the kernels guarantee it up to their row limit.)"""
    from fleetserve.replica import kernels
    from fleetserve.replica.layers.linear import _SmallM, small_m_rows

    torch_dtype = getattr(__import__("torch"), dtype)
    rows = small_m_rows(torch_dtype) if kernels.cpu_ops() is not None else 0
    prompts = ["The quick brown", "def add(", "Hello"]
    llm = LLM(str(tiny_model_dir), dtype=dtype, num_gpu_blocks_override=128)
    layers = [m for m in llm.core.executor.worker.runner.model.modules() if getattr(m, "_small_m", None)]
    if not layers:
        pytest.skip(f"no small-M {dtype} kernel here (CPU kernels: {kernels.isa() or kernels.unavailable_reason()})")
    assert all(isinstance(m._small_m, _SmallM) for m in layers)
    lens = [len(llm.tokenizer.encode(p)) for p in prompts]
    assert sum(lens) <= rows, (lens, rows)  # the batched prefill stays on the kernel too
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]
    together = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs  # exact floats, not approximately


def test_a_followed_long_step_computes_what_the_one_call_kernel_does(tiny_model_dir):
    """With progress followed (replica.engine.progress), a step of PROGRESS_SPLIT_ROWS tokens or
    more runs the layers one kernel call each: the same logprobs as the one-call path."""
    from fleetserve.replica.engine.progress import hook_layers
    from fleetserve.replica.llm import LLM
    from fleetserve.replica.models.llama import PROGRESS_SPLIT_ROWS

    llm = LLM(str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=128, enable_prefix_caching=False)
    prompt = [(7 * i) % 300 + 5 for i in range(PROGRESS_SPLIT_ROWS + 100)]
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    before = llm.generate(prompt, sp, use_tqdm=False)[0]
    bumps = []
    model = llm.core.executor.worker.runner.model
    assert hook_layers(model, lambda: bumps.append(1))
    after = llm.generate(prompt, sp, use_tqdm=False)[0]
    assert after.outputs[0].token_ids == before.outputs[0].token_ids
    for a, b in zip(
        after.prompt_logprobs[1:] + after.outputs[0].logprobs, before.prompt_logprobs[1:] + before.outputs[0].logprobs
    ):
        assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-4 for k in a)
    num_layers = len(model.model.layers) if hasattr(model, "model") else len(model.layers)
    assert len(bumps) >= num_layers  # the prefill step bumped at every layer
