"""/v1/completions with the official `openai` client: prompt lists, n, echo, logit_bias."""

from __future__ import annotations

import openai
import pytest

PROMPTS = ["The quick brown fox", "Hello, world!", "def add(a, b):"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key, max_retries=0, timeout=60)


def greedy(client, server, prompt, **kw):
    kw = {"max_tokens": 5, "temperature": 0, "extra_body": {"ignore_eos": True}, **kw}
    return client.completions.create(model=server.model, prompt=prompt, **kw)


@pytest.fixture(scope="module")
def singles(client, server):
    return [greedy(client, server, p).choices[0].text for p in PROMPTS]


def tokenize(server, text):
    import httpx

    return httpx.post(server.base_url + "/tokenize", headers=server.headers(), json={"prompt": text}).json()["tokens"]


def test_prompt_list_one_choice_per_prompt_and_n(client, server, singles):
    r = greedy(client, server, PROMPTS, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3, 4, 5]
    # OpenAI's numbering: prompt i's choices are i*n .. i*n+n-1.
    assert [c.text for c in r.choices] == [t for t in singles for _ in range(2)]
    assert r.usage.completion_tokens == 6 * 5
    assert r.usage.prompt_tokens == sum(len(tokenize(server, p)) for p in PROMPTS)


def test_token_id_prompts_match_text_prompts(client, server, singles):
    ids = [tokenize(server, p) for p in PROMPTS]
    assert [c.text for c in greedy(client, server, ids).choices] == singles
    assert greedy(client, server, ids[1]).choices[0].text == singles[1]


def test_prompt_list_streaming(client, server, singles):
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in greedy(client, server, PROMPTS, n=2, stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert texts == {i: singles[i // 2] for i in range(6)}
    assert finish == {i: "length" for i in range(6)}
    assert chunk.usage.completion_tokens == 30


def test_echo_with_prompt_logprobs(client, server, singles):
    r = greedy(client, server, PROMPTS[:2], echo=True, logprobs=1)
    for prompt, single, c in zip(PROMPTS, singles, r.choices):
        assert c.text == prompt + single
        n_prompt = len(tokenize(server, prompt))
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == n_prompt + 5
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
        assert "".join(lp.tokens) == c.text
        assert lp.text_offset[n_prompt] == len(prompt)
    streamed = {}
    for chunk in greedy(client, server, PROMPTS[:2], echo=True, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {0: PROMPTS[0] + singles[0], 1: PROMPTS[1] + singles[1]}


def test_logit_bias(client, server, singles):
    (token,) = tokenize(server, "a")
    forced = greedy(client, server, PROMPTS[0], logit_bias={str(token): 100})
    assert forced.choices[0].text == "a" * 5
    # A ban on the greedy first token changes the first token; a tiny bias changes nothing.
    first = tokenize(server, PROMPTS[0] + singles[0])[len(tokenize(server, PROMPTS[0]))]
    banned = greedy(client, server, PROMPTS[0], logit_bias={str(first): -100}, max_tokens=1)
    assert (
        banned.choices[0].text != singles[0][: len(banned.choices[0].text)]
        or tokenize(server, PROMPTS[0] + banned.choices[0].text)[len(tokenize(server, PROMPTS[0]))] != first
    )
    chat = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logit_bias={str(token): 100},
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.content == "aaa"


def test_suffix_refused_and_still_serving(client, server):
    with pytest.raises(openai.BadRequestError, match="fill-in-the-middle"):
        greedy(client, server, "def f(", suffix="return x")
    assert greedy(client, server, PROMPTS[0]).choices[0].finish_reason == "length"
    server.wait_idle()


def test_unset_max_tokens_runs_to_the_end_of_the_context(client, server):
    """vLLM's default: no `max_tokens` (or null) on chat means whatever of max_model_len
    (the fixture's) the prompt leaves; the fuzzing in test_schemathesis.py bounds it instead."""
    for kw in ({}, {"max_tokens": None}):
        r = client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": "Count to ten."}],
            temperature=0,
            extra_body={"ignore_eos": True},
            **kw,
        )
        assert r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens + r.usage.completion_tokens == server.config.engine.max_model_len, r.usage
    server.wait_idle()
