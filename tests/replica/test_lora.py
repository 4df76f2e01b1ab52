"""LoRA adapters in the engine (replica/lora/): PEFT adapter folders written by `peft` itself;
greedy tokens and embeddings equal PEFT's own model, for each adapter alone and in batches that
mix adapters, the base model, prefill chunks and decodes; --max-loras bounds the adapters of a
step; adapters that cannot be applied are refused with the reason; the prefix cache keeps each
adapter's KV apart."""

from __future__ import annotations

import json

import pytest
import torch

from fleetserve.replica.lora import LoRARequest
from fleetserve.scheduler import SamplingParams

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today?",
    "def add(a, b):\n    return a + b",
    "Ray Serve routes requests to replicas; each replica",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_loras):
    return tiny_loras  # (tests/replica/conftest.py)


@pytest.fixture(scope="module")
def peft(tiny_model_dir, adapters):
    """PEFT's model per adapter (None: the base model)."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    def load(name):
        base = LlamaForCausalLM.from_pretrained(str(tiny_model_dir), torch_dtype=torch.float32)
        return base if name is None else PeftModel.from_pretrained(base, str(adapters[name])).eval()

    return {name: load(name) for name in (None, *adapters)}


def peft_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=2)
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def llm(tiny_model_dir, adapters):
    from fleetserve.replica.llm import LLM

    # Small steps: prompts prefill in chunks beside other requests' decodes.
    return LLM(
        str(tiny_model_dir),
        dtype="float32",
        num_gpu_blocks_override=128,
        block_size=4,
        num_threads=1,
        enable_lora=True,
        max_loras=3,
        max_num_batched_tokens=24,
        long_prefill_token_threshold=8,
    )


def lora(adapters, name):
    ids = {"a": 1, "b": 2, "rs": 3}
    return None if name is None else LoRARequest(name, ids[name], str(adapters[name]))


def test_mixed_batches_equal_peft(llm, adapters, peft):
    # Adapters' requests apart in the scheduler's order (the runner puts each adapter's side by side).
    names = [None, "a", "b", "b", "a", "rs", None, "rs"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[lora(adapters, n) for n in names])
    expected = {}
    for name, prompt, out in zip(names, prompts, outs):
        key = (name, prompt)
        if key not in expected:
            expected[key] = peft_greedy(peft[name], out.prompt_token_ids, 10)
        assert out.outputs[0].token_ids == expected[key], key
    for prompt in PROMPTS[:2]:  # every adapter changes the answer
        got = {n: expected.get((n, prompt)) for n in (None, "a", "b", "rs") if (n, prompt) in expected}
        assert len({tuple(v) for v in got.values()}) == len(got)
    sched = llm.core.scheduler
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_embeddings_and_prefix_cache_are_per_adapter(llm, adapters, peft):
    prompt = "Once upon a time there was a little robot who liked to count: one, two, three. " * 2  # new here
    base = llm.embed(prompt, use_tqdm=False)[0]
    with_a = llm.embed(prompt, use_tqdm=False, lora_request=lora(adapters, "a"))[0]
    hidden = {}
    for name in (None, "a"):
        with torch.no_grad():
            states = peft[name](torch.tensor([base.prompt_token_ids]), output_hidden_states=True).hidden_states
        hidden[name] = torch.nn.functional.normalize(states[-1][0, -1], dim=-1)
    torch.testing.assert_close(torch.tensor(base.outputs.embedding), hidden[None], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(with_a.outputs.embedding), hidden["a"], atol=1e-4, rtol=1e-4)
    # The prompt's blocks are cached for the base model and for a now: b finds none of them,
    # a repeat with a finds a's.
    hits = []
    for name in ("b", "a"):
        out = llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False, lora_request=lora(adapters, name))[0]
        hits.append(out.num_cached_tokens)
    assert hits[0] == 0 and hits[1] >= 16, hits


def test_max_loras_bounds_a_step(tiny_model_dir, adapters):
    from fleetserve.replica.llm import LLM

    llm = LLM(
        str(tiny_model_dir),
        dtype="float32",
        num_gpu_blocks_override=64,
        block_size=4,
        num_threads=1,
        lora_modules=[f"a={adapters['a']}", f"b={adapters['b']}"],
        max_loras=1,
    )
    assert llm.args.enable_lora  # --lora-modules turns it on
    core = llm.core
    seen, stats = [], []
    step = core.step

    def watched():
        result = step()
        running = {r.lora_id for r in core.scheduler.running if r.lora_id}
        seen.append(running)
        stats.append(core.scheduler.get_stats())
        return result

    core.step = watched
    names = ["a", "b", None, "b", "a"]
    reqs = [None if n is None else LoRARequest(n, {"a": 1, "b": 2}[n], str(adapters[n])) for n in names]
    outs = llm.generate(PROMPTS[:1] * len(names), GREEDY, use_tqdm=False, lora_request=reqs)
    assert all(len(s) <= 1 for s in seen) and {1} in seen and {2} in seen
    # The first step ran a's two requests (and the base model's); b's two waited. vLLM's
    # vllm:lora_requests_info says so.
    first = stats[0]
    assert (first.max_loras, first.lora_running, first.lora_waiting) == (1, {"a": 2}, {"b": 2})
    from fleetserve.replica.engine.metrics import EngineMetrics

    metrics = EngineMetrics("tiny")
    metrics.update_scheduler_stats(first)
    metrics.update_scheduler_stats(stats[-1])  # the series of the first step's labels is gone
    text = metrics.text()
    assert 'max_lora="1",running_lora_adapters="",waiting_lora_adapters=""' in text
    assert text.count("vllm:lora_requests_info{") == 1
    assert outs[0].outputs[0].token_ids == outs[4].outputs[0].token_ids
    assert outs[1].outputs[0].token_ids == outs[3].outputs[0].token_ids != outs[0].outputs[0].token_ids
    assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.num_blocks


def test_adapters_that_cannot_apply_are_refused(tiny_model_dir, adapters, tmp_path, llm):
    from fleetserve.replica.engine.engine_args import EngineArgs
    from fleetserve.replica.testing import make_tiny_llama, make_tiny_lora

    with pytest.raises(ValueError, match="no such folder"):  # what `fleetserve serve` checks first
        EngineArgs(model=str(tiny_model_dir), lora_modules=[f"x={tmp_path / 'none'}"]).check_lora_files()
    with pytest.raises(ValueError, match="rank 16, above --max-lora-rank"):
        EngineArgs(model=str(tiny_model_dir), lora_modules=[f"x={adapters['rs']}"], max_lora_rank=8).check_lora_files()
    with pytest.raises(ValueError, match="expected name=path"):
        EngineArgs(model=str(tiny_model_dir), lora_modules=["just-a-name"])
    with pytest.raises(ValueError, match="given twice"):
        EngineArgs(model=str(tiny_model_dir), lora_modules=[f"x={adapters['a']}", f"x={adapters['b']}"])
    dora = tmp_path / "dora"
    dora.mkdir()
    cfg = json.loads((adapters["a"] / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(ValueError, match="DoRA"):
        EngineArgs(model=str(tiny_model_dir), lora_modules=[f"x={dora}"]).check_lora_files()
    with pytest.raises(ValueError, match="DoRA"):  # an engine checks them as it loads them
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("dora", 6, str(dora)))
    # An adapter of the embeddings, and one made for another base model: refused at load,
    # naming the weight; the engine serves on.
    emb = make_tiny_lora(tiny_model_dir, tmp_path / "emb", target_modules=("embed_tokens", "q_proj"))
    other = make_tiny_lora(make_tiny_llama(tmp_path / "wide", hidden_size=96), tmp_path / "wide-lora")
    with pytest.raises(ValueError, match="embed_tokens"):
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("emb", 7, str(emb)))
    with pytest.raises(ValueError, match="another base model"):
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("wide", 8, str(other)))
    with pytest.raises(ValueError, match="another adapter's"):
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 9, str(adapters["a"])))
    out = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, lora_request=lora(adapters, "a"))[0]
    assert len(out.outputs[0].token_ids) == 10


def test_lora_needs_enable_lora(tiny_model_dir, adapters):
    from fleetserve.replica.llm import LLM

    llm = LLM(str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=32, num_threads=1)
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, str(adapters["a"])))
    with pytest.raises(ValueError, match="not loaded"):
        llm.input_processor.process("hi", GREEDY, "r1", lora_name="a")


@pytest.mark.parametrize("core_process", [True, False], ids=["core-process", "core-thread"])
def test_async_engine_loads_and_unloads_while_serving(tiny_model_dir, adapters, llm, core_process):
    """AsyncEngine.add_lora / remove_lora (what /v1/load_lora_adapter runs on each replica), on
    both layouts: concurrent loads of one name load once; an unload refuses new requests at
    once, lets the running one finish with the adapter's weights, then frees them."""
    import asyncio

    from fleetserve.replica.engine.async_engine import AsyncEngine

    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = llm.generate(PROMPTS[0], long, use_tqdm=False, lora_request=lora(adapters, "a"))[0].outputs[0].token_ids
    engine = AsyncEngine(
        model=str(tiny_model_dir),
        dtype="float32",
        num_gpu_blocks_override=64,
        num_threads=1,
        enable_lora=True,
        lora_roots=[str(adapters["a"].parent)],
        core_process=core_process,
    )

    async def main():
        keys = await asyncio.gather(*(engine.add_lora("a", str(adapters["a"])) for _ in range(3)))
        assert len(set(keys)) == 1 and keys[0].startswith("a@") and engine.lora_keys == {"a": keys[0]}
        with pytest.raises(ValueError, match="loaded already"):
            await engine.add_lora("a", str(adapters["b"]))
        with pytest.raises(ValueError, match="not found or cannot be loaded"):
            await engine.add_lora("x", str(adapters["a"]) + "-missing")
        tokens = []
        async for out in engine.generate(PROMPTS[0], long, "r1", lora_name="a"):
            tokens += out.outputs[0].token_ids
            if len(tokens) == 1:
                assert await engine.remove_lora("a")
                with pytest.raises(ValueError, match="not loaded"):
                    async for _ in engine.generate(PROMPTS[0], long, "r2", lora_name="a"):
                        pass
        assert tokens == want  # the adapter's weights to the end
        assert not await engine.remove_lora("a")
        key = await engine.add_lora("a", str(adapters["a"]))  # back, under a new id
        assert key == keys[0]
        again = [
            t async for out in engine.generate(PROMPTS[0], long, "r3", lora_name="a") for t in out.outputs[0].token_ids
        ]
        assert again == want

    try:
        asyncio.run(main())
        if not core_process:  # the first load's weights went once r1 ended
            assert set(engine.core.executor.worker.runner.lora_adapters) == {2}
        assert engine.get_load()["num_free_blocks"] == engine.get_load()["num_blocks"]
    finally:
        engine.shutdown()


def test_adapter_rows_by_slice_or_by_index_add_the_same_delta():
    """LoRABatch: an adapter's rows as one slice, or gathered by index when they are apart;
    rows of no adapter (or of one this linear does not adapt) are untouched."""
    from fleetserve.replica.lora.adapter import LoRASlot
    from fleetserve.replica.lora.layers import LoRABatch, active, add_lora

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(7, 5, generator=g), torch.randn(7, 6, generator=g)
    slots = {
        1: LoRASlot(torch.randn(3, 5, generator=g), torch.randn(6, 3, generator=g)),
        2: LoRASlot(torch.randn(2, 5, generator=g), torch.randn(6, 2, generator=g)),
    }
    lens, ids = [2, 1, 3, 1], [1, 0, 1, 3]  # adapter 1 apart: rows 0-1 and 3-5; 3: not here
    batch = LoRABatch.build(ids, lens, torch.device("cpu"))
    assert [(lid, type(rows).__name__) for lid, rows in batch.groups] == [(1, "Tensor"), (3, "slice")]
    want = y.clone()
    for r in (0, 1, 3, 4, 5):
        want[r] += (x[r] @ slots[1].a.t()) @ slots[1].b.t()
    with active(batch):
        got = add_lora(slots, x, y.clone())
    torch.testing.assert_close(got, want)
    side_by_side = LoRABatch.build([0, 1, 1], [1, 4, 2], torch.device("cpu"))
    assert side_by_side.groups[0][1] == slice(1, 7)
    with active(side_by_side):
        got = add_lora(slots, x, y.clone())
    want = y.clone()
    want[1:] += (x[1:] @ slots[1].a.t()) @ slots[1].b.t()
    torch.testing.assert_close(got, want)
    assert add_lora(slots, x, y) is y  # no batch active: nothing added


def test_max_cpu_loras_evicts_the_least_recently_used_idle_adapter(tiny_model_dir, adapters):
    """--max-cpu-loras 2: a third adapter evicts the least recently used idle one, which a later
    request reloads from its folder (same tokens as before); one with running requests is
    never evicted; with every held adapter in use, a load is refused as retry-later (429)."""
    import asyncio

    from fleetserve.replica.engine.async_engine import AsyncEngine, LoRACapacityError

    engine = AsyncEngine(
        model=str(tiny_model_dir),
        dtype="float32",
        num_gpu_blocks_override=64,
        num_threads=1,
        enable_lora=True,
        max_cpu_loras=2,
        lora_roots=[str(adapters["a"].parent)],
        core_process=False,
    )
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    def start(name, rid, sp=GREEDY):
        return engine.generate(PROMPTS[1], sp, rid, lora_name=name, lora_path=str(adapters[name]))

    async def run(name, rid):
        return [t async for out in start(name, rid) for t in out.outputs[0].token_ids]

    async def main():
        first = {"a": await run("a", "1"), "b": await run("b", "2")}
        assert set(engine.lora_keys) == {"a", "b"}
        assert await run("a", "3") == first["a"]  # a: used after b
        first["rs"] = await run("rs", "4")
        assert set(engine.lora_keys) == {"a", "rs"}  # b went (least recently used)
        assert await run("b", "5") == first["b"]  # loaded again; a went
        assert set(engine.lora_keys) == {"rs", "b"}
        busy = start("rs", "6", long)
        await busy.__anext__()  # rs runs now
        assert await run("a", "7") == first["a"]  # b went, not the busy rs
        assert set(engine.lora_keys) == {"rs", "a"}
        busy2 = start("a", "8", long)
        await busy2.__anext__()
        with pytest.raises(LoRACapacityError, match="all in use"):
            await run("b", "9")
        await busy.aclose()
        await busy2.aclose()
        assert await run("b", "10") == first["b"]

    try:
        asyncio.run(main())
        assert len(engine.core.executor.worker.runner.lora_adapters) == 2  # evicted weights freed
        load = engine.get_load()
        assert load["num_free_blocks"] == load["num_blocks"] and load["num_running"] == 0
    finally:
        engine.shutdown()


def test_speculative_decoding_with_an_adapter_gives_its_tokens(tiny_model_dir, adapters, llm):
    """N-gram drafts are verified by the target with the request's adapter (the drafts' rows
    are the request's rows): the same greedy tokens as without speculation."""
    from fleetserve.replica.llm import LLM

    prompt = "one two three four one two three four one two three four one two"
    spec = LLM(
        str(tiny_model_dir),
        dtype="float32",
        num_gpu_blocks_override=64,
        block_size=4,
        num_threads=1,
        enable_lora=True,
        max_loras=2,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        },
    )
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    loras = [lora(adapters, "a"), None, lora(adapters, "b")]
    got = [o.outputs[0].token_ids for o in spec.generate([prompt] * 3, sp, use_tqdm=False, lora_request=loras)]
    want = [o.outputs[0].token_ids for o in llm.generate([prompt] * 3, sp, use_tqdm=False, lora_request=loras)]
    assert got == want and got[0] != got[1]
    stats = spec.core.scheduler.get_stats().spec_decoding
    assert stats is not None and stats.num_draft_tokens > 0, stats
