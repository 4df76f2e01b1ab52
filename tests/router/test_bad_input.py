"""Every user mistake gets the right status and an OpenAI error body; nothing leaks."""

from __future__ import annotations

import json

import httpx
import pytest

GOOD_PROMPT = {"prompt": "hello", "max_tokens": 2}

# (name, path, body (dict -> JSON, bytes -> raw), headers override, status, param, code)
CASES = [
    ("malformed json", "/v1/completions", b'{"prompt": "hi",', None, 400, None, None),
    ("json not an object", "/v1/completions", b'["prompt"]', None, 400, None, None),
    ("missing prompt", "/v1/completions", {"max_tokens": 2}, None, 400, "prompt", None),
    ("prompt wrong type", "/v1/completions", {"prompt": 12}, None, 400, "prompt", None),
    ("max_tokens wrong type", "/v1/completions", {"prompt": "a", "max_tokens": "many"}, None, 400, "max_tokens", None),
    ("max_tokens zero", "/v1/completions", {"prompt": "a", "max_tokens": 0}, None, 400, "max_tokens", None),
    (
        "max_tokens negative",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "max_tokens": -3},
        None,
        400,
        "max_tokens",
        None,
    ),
    (
        "max_completion_tokens zero",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 0},
        None,
        400,
        "max_tokens",
        None,
    ),
    ("temperature negative", "/v1/completions", {"prompt": "a", "temperature": -0.5}, None, 400, "temperature", None),
    ("top_p out of range", "/v1/completions", {"prompt": "a", "top_p": 1.5}, None, 400, "top_p", None),
    ("n zero", "/v1/completions", {"prompt": "a", "n": 0}, None, 400, "n", None),
    ("stream not bool", "/v1/completions", {"prompt": "a", "stream": "yes"}, None, 400, "stream", None),
    ("empty messages", "/v1/chat/completions", {"messages": []}, None, 400, "messages", None),
    (
        "bad role",
        "/v1/chat/completions",
        {"messages": [{"role": "robot", "content": "a"}]},
        None,
        400,
        "messages.0.role",
        None,
    ),
    ("empty prompt", "/v1/completions", {"prompt": ""}, None, 400, "prompt", None),
    ("token id out of vocab", "/v1/completions", {"prompt": [1, 10**9]}, None, 400, "prompt", None),
    ("unknown model", "/v1/completions", {"model": "gpt-17", "prompt": "a"}, None, 404, "model", "model_not_found"),
    ("over-long prompt", "/v1/completions", {"prompt": "word " * 2500}, None, 400, "prompt", "context_length_exceeded"),
    (
        "prompt + max_tokens too long",
        "/v1/completions",
        {"prompt": "a b c", "max_tokens": 10_000},
        None,
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    ("bad api key", "/v1/completions", GOOD_PROMPT, {"Authorization": "Bearer wrong"}, 401, None, "invalid_api_key"),
    ("no api key", "/v1/chat/completions", GOOD_PROMPT, {}, 401, None, "invalid_api_key"),
    ("oversized body", "/v1/completions", {"prompt": "x" * (80 * 1024)}, None, 413, None, None),
    ("suffix without FIM tokens", "/v1/completions", {"prompt": "a", "suffix": "b"}, None, 400, "suffix", None),
    ("empty prompt in a list", "/v1/completions", {"prompt": ["a", ""]}, None, 400, "prompt", None),
    (
        "logit_bias out of range",
        "/v1/completions",
        {"prompt": "a", "logit_bias": {"5": 300}},
        None,
        400,
        "logit_bias",
        None,
    ),
    (
        "logit_bias not a token id",
        "/v1/completions",
        {"prompt": "a", "logit_bias": {"x": 1}},
        None,
        400,
        "logit_bias",
        None,
    ),
    (
        "logit_bias out of vocab",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "logit_bias": {"99999999": 1}},
        None,
        400,
        "logit_bias",
        None,
    ),
    (
        "top_logprobs without logprobs",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2},
        None,
        400,
        "top_logprobs",
        None,
    ),
    (
        "top_logprobs above 20",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 25},
        None,
        400,
        "top_logprobs",
        None,
    ),
    ("unknown route", "/v1/embedding", GOOD_PROMPT, None, 404, None, None),
]


@pytest.mark.parametrize("name,path,body,headers,status,param,code", CASES, ids=[c[0] for c in CASES])
def test_bad_input(server, name, path, body, headers, status, param, code):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(server.headers() if headers is None else headers)}
    r = httpx.post(server.base_url + path, content=raw, headers=hdrs, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err


def test_still_serves_and_no_leaks_after_bad_input(server):
    for _, path, body, _headers, *_ in CASES[:8]:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        httpx.post(
            server.base_url + path,
            content=raw,
            headers={"Content-Type": "application/json", **server.headers()},
            timeout=30,
        )
    r = httpx.post(
        server.base_url + "/v1/completions",
        headers=server.headers(),
        timeout=30,
        json={"prompt": "still alive?", "max_tokens": 3, "ignore_eos": True},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    server.wait_idle()
