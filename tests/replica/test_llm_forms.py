"""vLLM's Python forms of `LLM.generate` and `LLM.chat`, each against the plain call."""

import pytest

from fleetserve.replica.llm import LLM
from fleetserve.scheduler import SamplingParams

PROMPTS = ["The quick brown fox", "Hello, world!", "def add(a, b):"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=128)


@pytest.fixture(scope="module")
def plain(llm):
    """token ids of each prompt, and its greedy output, one plain call per prompt."""
    return {
        p: (llm.tokenizer.encode(p), llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) for p in PROMPTS
    }


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_every_prompt_form_matches_the_plain_call(llm, plain):
    p = PROMPTS[0]
    ids, expected = plain[p]
    for form in (
        p,
        [p],
        ids,
        [ids],
        {"prompt": p},
        {"prompt_token_ids": ids},
        [{"prompt_token_ids": ids, "prompt": p}],
    ):
        outs = llm.generate(form, GREEDY, use_tqdm=False)
        assert tokens(outs) == [expected], form
    # The text of a token prompt is what the dict says (or None).
    assert llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0].prompt is None
    assert llm.generate({"prompt": p}, GREEDY, use_tqdm=False)[0].prompt == p


def test_mixed_list_keeps_order(llm, plain):
    a, b, c = PROMPTS
    mixed = [a, {"prompt_token_ids": plain[b][0]}, plain[c][0], {"prompt": a}]
    outs = llm.generate(mixed, GREEDY, use_tqdm=True)
    assert tokens(outs) == [plain[a][1], plain[b][1], plain[c][1], plain[a][1]]
    assert [o.prompt_token_ids for o in outs] == [plain[a][0], plain[b][0], plain[c][0], plain[a][0]]


def test_per_prompt_sampling_params(llm, plain):
    a, b = PROMPTS[:2]
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    outs = llm.generate([a, b], [GREEDY, short], use_tqdm=False)
    assert tokens(outs) == [plain[a][1], plain[b][1][:2]]
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate(PROMPTS, [GREEDY, short], use_tqdm=False)


def test_vllm_sampling_extras_in_the_engine(llm, plain):
    """truncate_prompt_tokens, bad_words (tokenized by the engine) and allowed_token_ids,
    through `LLM` as vLLM's users call them."""
    p = PROMPTS[0]
    ids, expected = plain[p]
    long = ids * 4
    out = llm.generate(long, GREEDY.replace(truncate_prompt_tokens=len(ids)), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids and out.outputs[0].token_ids == expected
    # A bad word the plain output holds as one token: gone, and the output changed.
    token, word = next(
        (t, llm.tokenizer.decode([t]))
        for t in expected
        if llm.tokenizer.encode(llm.tokenizer.decode([t]).strip()) == [t]
    )
    banned = llm.generate(p, GREEDY.replace(bad_words=[word]), use_tqdm=False)[0].outputs[0].token_ids
    assert token not in banned and banned != expected
    allowed = llm.generate(p, GREEDY.replace(allowed_token_ids=[expected[-1]]), use_tqdm=False)
    assert allowed[0].outputs[0].token_ids == [expected[-1]] * 6
    with pytest.raises(ValueError, match="allowed_token_ids: token id"):
        llm.generate(p, GREEDY.replace(allowed_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be at most"):
        llm.generate(p, GREEDY.replace(truncate_prompt_tokens=10**6), use_tqdm=False)
    assert tokens(llm.generate(p, GREEDY, use_tqdm=False)) == [expected]


def test_bad_prompt_forms_are_value_errors(llm):
    for bad, match in (
        ({"text": "x"}, "unsupported keys"),
        ({"prompt": 3}, "needs 'prompt'"),
        ({"prompt_token_ids": ["a"]}, "list of token ids"),
        ([], "empty"),
    ):
        with pytest.raises(ValueError, match=match):
            llm.generate(bad, GREEDY, use_tqdm=False)
    # Nothing was left behind: the engine still serves and holds no blocks.
    assert llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    kv = llm.core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_chat_one_and_many_conversations(llm):
    conv_a = [{"role": "user", "content": "What is the capital of France?"}]
    conv_b = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    (one,) = llm.chat(conv_a, GREEDY, use_tqdm=False)
    both = llm.chat([conv_a, conv_b], [GREEDY, GREEDY], use_tqdm=False)
    assert tokens(both)[0] == one.outputs[0].token_ids
    text_b = llm.tokenizer.apply_chat_template(conv_b, tokenize=False, add_generation_prompt=True)
    ids_b = llm.tokenizer.encode(text_b, add_special_tokens=False)
    assert both[1].prompt_token_ids == ids_b and both[1].prompt == text_b
    assert tokens(both)[1] == tokens(llm.generate([ids_b], GREEDY, use_tqdm=False))[0]


def test_generation_config_gives_the_default_sampling_params(tiny_model_dir, tmp_path):
    """No sampling params: the model's generation_config.json decides (vLLM's
    `get_default_sampling_params`); `generation_config="vllm"` ignores it."""
    import json
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    cfg = json.loads((folder / "generation_config.json").read_text())
    cfg.update(temperature=0.0, max_new_tokens=5)
    (folder / "generation_config.json").write_text(json.dumps(cfg))
    llm = LLM(str(folder), dtype="float32", num_gpu_blocks_override=64)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 5)
    out = llm.generate(PROMPTS[0], use_tqdm=False)[0].outputs[0]
    explicit = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == explicit.token_ids and len(out.token_ids) <= 5
    plain = LLM(str(folder), dtype="float32", num_gpu_blocks_override=64, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()


def test_embed_is_the_normalized_last_token_state_batched_or_alone(llm, tiny_model_dir):
    """`LLM.embed` (vLLM's): per prompt, transformers' last hidden state at the last token,
    normalized; batched with other prompts (and a token-id form) the same as alone; no block
    stays held."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), torch_dtype=torch.float32)
    outs = llm.embed(PROMPTS + [{"prompt_token_ids": llm.tokenizer.encode(PROMPTS[1])}], use_tqdm=False)
    assert [o.prompt_token_ids for o in outs][:3] == [llm.tokenizer.encode(p) for p in PROMPTS]
    for o in outs:
        with torch.no_grad():
            last = hf(torch.tensor([o.prompt_token_ids]), output_hidden_states=True).hidden_states[-1][0, -1]
        torch.testing.assert_close(
            torch.tensor(o.outputs.embedding), torch.nn.functional.normalize(last, dim=-1), atol=2e-4, rtol=1e-3
        )
    alone = llm.embed(PROMPTS[2], use_tqdm=False)[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(alone), torch.tensor(outs[2].outputs.embedding), atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="embed needs n=1"):
        SamplingParams(embed=True, n=2)
    assert llm.core.scheduler.kv.num_free_blocks == llm.core.scheduler.kv.num_blocks
