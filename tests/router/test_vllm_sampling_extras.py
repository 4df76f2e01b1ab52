"""vLLM's extra request fields `allowed_token_ids`, `bad_words` and `truncate_prompt_tokens`,
over HTTP (completions and chat) and gRPC, against the router suite's app; every refusal is a
400 naming the field, and the app serves afterwards with every block free."""

from __future__ import annotations

import grpc
import httpx
import pytest

from fleetserve.replica.engine.processor import MAX_LOGIT_BIAS
from fleetserve.router.grpc.proto import fleetserve_pb2 as pb
from fleetserve.router.grpc.proto import fleetserve_pb2_grpc as pb_grpc

PROMPT = "The quick brown fox jumps over the lazy dog. " * 3


def post(server, path, body, timeout=60):
    return httpx.post(server.base_url + path, headers=server.headers(), json=body, timeout=timeout)


def complete(server, prompt, **kw):
    body = {"model": server.model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **kw}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def tokenize(server, text):
    return post(server, "/tokenize", {"prompt": text}).json()["tokens"]


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.grpc_target) as channel:
        yield pb_grpc.FleetServeStub(channel)


def grpc_tokens(stub, server, prompt, **kw) -> list[int]:
    req = pb.GenerateRequest(
        prompt=prompt, sampling_params=pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, **kw)
    )
    meta = (("application", server.app), ("authorization", f"Bearer {server.api_key}"))
    return [t for m in stub.Generate(req, metadata=meta, timeout=60) for t in m.token_ids]


def test_allowed_token_ids_limit_what_is_sampled(server):
    (a,) = tokenize(server, "a")
    (b,) = tokenize(server, "b")
    assert complete(server, PROMPT, allowed_token_ids=[a])["choices"][0]["text"] == "a" * 8
    sampled = complete(server, PROMPT, allowed_token_ids=[a, b], temperature=1.0, seed=3, max_tokens=16)["choices"][0][
        "text"
    ]
    assert len(sampled) == 16 and set(sampled) <= {"a", "b"}
    chat = post(
        server,
        "/v1/chat/completions",
        {
            "model": server.model,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
            "allowed_token_ids": [b],
        },
    ).json()
    assert chat["choices"][0]["message"]["content"] == "bbbb"


def test_bad_words_never_appear_and_grpc_agrees(server, stub):
    free = grpc_tokens(stub, server, PROMPT)
    # A word the greedy output contains that is one token however it is written: banning it
    # must change the output, which then never holds that token.
    word, token = next(
        (w, t)
        for t in free
        for w in [post(server, "/detokenize", {"tokens": [t]}).json()["prompt"]]
        if w.strip().isalpha() and tokenize(server, w.strip()) == [t]
    )
    banned = grpc_tokens(stub, server, PROMPT, bad_words=[word])
    assert token not in banned and banned != free
    http = complete(server, PROMPT, bad_words=[word])["choices"][0]["text"]
    assert http == post(server, "/detokenize", {"tokens": banned}).json()["prompt"]
    assert grpc_tokens(stub, server, PROMPT, allowed_token_ids=[free[0]]) == [free[0]] * 8


def test_truncate_prompt_tokens_keeps_the_last_tokens(server, stub):
    ids = tokenize(server, PROMPT)
    assert len(ids) > 12
    r = complete(server, PROMPT, truncate_prompt_tokens=12)
    assert r["usage"]["prompt_tokens"] == 12
    assert r["choices"][0]["text"] == complete(server, ids[-12:])["choices"][0]["text"]
    # A prompt far longer than the context (refused without the field): -1 keeps what
    # leaves room for max_tokens.
    max_len = server.config.engine.max_model_len
    long = "ab " * 15000
    refused = post(server, "/v1/completions", {"model": server.model, "prompt": long, "max_tokens": 4})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    r = complete(server, long, truncate_prompt_tokens=-1, max_tokens=4)
    assert r["usage"]["prompt_tokens"] == max_len - 4 and r["choices"][0]["finish_reason"] == "length"
    chat = post(
        server,
        "/v1/chat/completions",
        {
            "model": server.model,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 2,
            "truncate_prompt_tokens": 10,
        },
    ).json()
    assert chat["usage"]["prompt_tokens"] == 10
    assert sum(1 for _ in grpc_tokens(stub, server, PROMPT, truncate_prompt_tokens=12)) == 8
    echoed = complete(server, PROMPT, truncate_prompt_tokens=12, echo=True, max_tokens=1)
    assert echoed["choices"][0]["text"].startswith(post(server, "/detokenize", {"tokens": ids[-12:]}).json()["prompt"])


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"truncate_prompt_tokens": 100000}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -1, "max_tokens": 4096}, "truncate_prompt_tokens"),
        ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": ["w"] * 33}, "bad_words"),
        ({"bad_words": [""]}, "bad_words"),
        # Bounds (issue 51): OpenAI's 300 logit_bias entries (allowed_token_ids' bound is past
        # this app's body limit: tests/router/test_token_list_bounds.py).
        ({"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
        # Contradictions validation can see: only EOS (id 2) allowed, which min_tokens masks.
        ({"allowed_token_ids": [2], "min_tokens": 4}, "allowed_token_ids"),
        ({"allowed_token_ids": [2, 7], "stop_token_ids": [7], "min_tokens": 1}, "allowed_token_ids"),
    ],
)
def test_bad_values_are_refused_naming_the_field_and_the_app_still_serves(server, fields, param):
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 4, **fields}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"], error
    assert complete(server, PROMPT)["choices"][0]["finish_reason"] == "length"
    server.wait_idle()


def test_grpc_bounds_logit_bias_and_the_app_still_serves(server, stub):
    bias = {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}
    with pytest.raises(grpc.RpcError) as info:
        grpc_tokens(stub, server, PROMPT, logit_bias=bias)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling_params.logit_bias" in info.value.details()
    assert len(grpc_tokens(stub, server, PROMPT, allowed_token_ids=[7, 7, 9])) == 8
    server.wait_idle()


def test_allowed_ids_the_grammar_forbids_end_that_choice_with_error(server):
    """Only sampling can see it: the request ends with finish_reason "error" (no token), a
    200, not a failed batch; the app serves afterwards and no block is held."""
    (a,) = tokenize(server, "a")
    body = {"allowed_token_ids": [a], "structured_outputs": {"regex": "[0-9]+"}, "temperature": 1.0}
    choice = complete(server, PROMPT, **body)["choices"][0]
    assert choice["finish_reason"] == "error" and choice["text"] == ""
    assert complete(server, PROMPT)["choices"][0]["finish_reason"] == "length"
    server.wait_idle()


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(server, stub):
    import json
    import re

    ids = grpc_tokens(stub, server, PROMPT)
    plain = complete(server, PROMPT, logprobs=2)["choices"][0]["logprobs"]
    named = complete(server, PROMPT, logprobs=2, return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
    assert named["tokens"] == [f"token_id:{t}" for t in ids]
    assert named["token_logprobs"] == plain["token_logprobs"] and named["text_offset"] == plain["text_offset"]
    assert all(re.fullmatch(r"token_id:\d+", k) for top in named["top_logprobs"] for k in top)
    # Chat, streamed: content tokens and top_logprobs by id; bytes stay the text's.
    with httpx.stream(
        "POST",
        server.base_url + "/v1/chat/completions",
        headers=server.headers(),
        timeout=60,
        json={
            "model": server.model,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 1,
            "stream": True,
            "return_tokens_as_token_ids": True,
        },
    ) as r:
        entries = [
            e
            for line in r.iter_lines()
            if line.startswith("data: {")
            for c in json.loads(line[6:])["choices"]
            if c.get("logprobs")
            for e in c["logprobs"]["content"]
        ]
    assert len(entries) == 4 and all(re.fullmatch(r"token_id:\d+", e["token"]) for e in entries)
    assert all(re.fullmatch(r"token_id:\d+", t["token"]) for e in entries for t in e["top_logprobs"])
    text = post(server, "/detokenize", {"tokens": [int(entries[0]["token"][9:])]}).json()["prompt"]
    assert entries[0]["bytes"] == list(text.encode())


def test_prompt_logprobs_are_vllm_s_shape_with_true_ranks(server):
    ids = tokenize(server, PROMPT)
    r = complete(server, PROMPT, prompt_logprobs=2, max_tokens=1)
    plp = r["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    echoed = complete(server, PROMPT, echo=True, logprobs=2, max_tokens=1)["choices"][0]["logprobs"]
    for i, position in enumerate(plp[1:], 1):
        own = position[str(ids[i])]
        assert own["logprob"] == pytest.approx(echoed["token_logprobs"][i], abs=1e-4)
        assert list(position)[0] == str(ids[i]) and own["rank"] >= 1
        assert own["decoded_token"] == post(server, "/detokenize", {"tokens": [ids[i]]}).json()["prompt"]
        # The two likeliest are ranks 1 and 2; the prompt's token keeps its true rank.
        assert sorted(e["rank"] for e in position.values()) == ([1, 2] if own["rank"] <= 2 else [1, 2, own["rank"]])
        if own["rank"] > 2:
            assert own["logprob"] < min(e["logprob"] for e in position.values() if e is not own)
    # Several prompts: each choice carries its own; chat: beside the choices.
    two = complete(server, [PROMPT, "Hello there, friend"], prompt_logprobs=0, max_tokens=1)["choices"]
    assert [len(c["prompt_logprobs"]) for c in two] == [len(ids), len(tokenize(server, "Hello there, friend"))]
    for mine, theirs, token in zip(two[0]["prompt_logprobs"][1:], plp[1:], ids[1:]):
        assert list(mine) == [str(token)] and mine[str(token)]["rank"] == theirs[str(token)]["rank"]
        assert mine[str(token)]["logprob"] == pytest.approx(theirs[str(token)]["logprob"], abs=1e-4)
    chat = post(
        server,
        "/v1/chat/completions",
        {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 1},
    ).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    refused = post(
        server, "/v1/completions", {"model": server.model, "prompt": PROMPT, "stream": True, "prompt_logprobs": 1}
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
    server.wait_idle()
