"""End to end over HTTP with the official `openai` client: 2 replicas, tiny real model."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key, max_retries=0)


def test_models(client, server):
    models = client.models.list()
    # both --served-model-names, then the LoRA adapters (tests/router/test_lora_api.py)
    assert [m.id for m in models.data] == [server.model, "tiny-chat", "tiny-lora-a", "tiny-lora-b"]
    for m in models.data:  # retrieve: the same card
        assert client.models.retrieve(m.id).model_dump() == m.model_dump()
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("org/no-such-model")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        client.with_options(api_key="wrong").models.retrieve(server.model)


def test_completion_non_stream_usage(client, server):
    r = client.completions.create(
        model=server.model, prompt="Hello, world!", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion"
    assert r.choices[0].finish_reason == "length"
    assert isinstance(r.choices[0].text, str)
    assert r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5


def test_completion_greedy_is_deterministic_and_matches_stream(client, server):
    kw = dict(
        model=server.model, prompt="The quick brown fox", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert a == b == streamed


def test_completion_stream_include_usage(client, server):
    chunks = list(
        client.completions.create(
            model=server.model,
            prompt="Once upon a time",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"


def test_continuous_usage_stats_count_up_in_every_chunk(client, server):
    """vLLM's stream_options.continuous_usage_stats: each chunk carries the usage so far
    (with include_usage; without it, none do)."""
    kw = dict(model=server.model, max_tokens=6, stream=True, extra_body={"ignore_eos": True})
    chunks = list(
        client.completions.create(
            prompt="Once upon a time", stream_options={"include_usage": True, "continuous_usage_stats": True}, **kw
        )
    )
    counted = [c.usage.completion_tokens for c in chunks[:-1]]
    assert counted == sorted(counted) and counted[-1] == 6 and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)
    chat = list(
        client.chat.completions.create(
            messages=[{"role": "user", "content": "Hi"}],
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            **kw,
        )
    )
    assert all(c.usage is not None for c in chat) and chat[-2].usage.completion_tokens == 6
    alone = list(
        client.completions.create(prompt="Once upon a time", stream_options={"continuous_usage_stats": True}, **kw)
    )
    assert all(c.usage is None for c in alone)


def test_stream_interval_per_request(client, server):
    """vLLM's `stream_interval` in the body: the first chunk at once, then chunks of 3 tokens,
    the same text as a request without it; 0 is a 400 naming the field, and the server then
    still serves with every block back."""
    kw = dict(model=server.model, prompt="The quick brown fox", max_tokens=8, temperature=0, logprobs=1)
    plain = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0]
    chunks = [
        c.choices[0]
        for c in client.completions.create(stream=True, **kw, extra_body={"ignore_eos": True, "stream_interval": 3})
        if c.choices
    ]
    assert [len(c.logprobs.tokens) for c in chunks] == [1, 3, 3, 1]
    assert "".join(c.text for c in chunks) == plain.text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(stream=True, **kw, extra_body={"stream_interval": 0})
    assert e.value.status_code == 400 and e.value.body["param"] == "stream_interval"
    assert client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text == plain.text
    server.wait_idle()


def test_completion_n_seed_stop_logprobs(client, server):
    r = client.completions.create(
        model=server.model,
        prompt="one two three",
        max_tokens=4,
        n=2,
        temperature=0.8,
        seed=7,
        logprobs=2,
        extra_body={"ignore_eos": True, "top_k": 20, "min_p": 0.01},
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    for c in r.choices:
        assert len(c.logprobs.tokens) == 4 and len(c.logprobs.token_logprobs) == 4
        assert all(len(t) <= 3 for t in c.logprobs.top_logprobs)
    assert r.usage.completion_tokens == 8


def test_chat_non_stream(client, server):
    r = client.chat.completions.create(
        model=server.model,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        max_completion_tokens=6,
        temperature=0,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        top_p=0.9,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    c = r.choices[0]
    assert r.object == "chat.completion"
    assert c.message.role == "assistant" and isinstance(c.message.content, str)
    assert c.finish_reason == "length"
    assert len(c.logprobs.content) == 6
    assert r.usage.completion_tokens == 6


def test_chat_stream_include_usage(client, server):
    stream = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 5
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(text, str)


def test_tokenize_detokenize(server):
    with httpx.Client(base_url=server.base_url, headers=server.headers()) as http:
        tok = http.post("/tokenize", json={"prompt": "Hello world"}).json()
        assert tok["count"] == len(tok["tokens"]) > 0
        detok = http.post("/detokenize", json={"tokens": tok["tokens"]}).json()
        assert "Hello world" in detok["prompt"]
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
        assert chat["count"] > 0


def test_health_and_metrics(client, server):
    client.completions.create(model=server.model, prompt="metrics please", max_tokens=2)
    with httpx.Client(base_url=server.base_url) as http:
        health = http.get("/health")
        assert health.status_code == 200 and health.json()["num_replicas"] == 2
        text = http.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:num_preemptions",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
    ):
        assert name in families, name
    replicas = {s.labels["replica"] for s in families["vllm:num_requests_running"].samples}
    assert len(replicas) == 2
    generated = sum(s.value for s in families["vllm:generation_tokens"].samples if s.name.endswith("_total"))
    assert generated >= 2


def test_stop_string_cuts_the_output(client, server):
    kw = dict(model=server.model, prompt="Hello, world!", temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(max_tokens=12, **kw).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    if not stop.strip():
        pytest.skip(f"no usable stop string in {full!r}")
    r = client.completions.create(max_tokens=12, stop=[stop], **kw).choices[0]
    assert r.finish_reason == "stop"
    assert stop not in r.text and full.startswith(r.text)


def test_seed_makes_sampling_reproducible(client, server):
    kw = dict(
        model=server.model,
        prompt="Once upon",
        temperature=1.0,
        max_tokens=8,
        seed=1234,
        extra_body={"ignore_eos": True},
    )
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_ingress_replica_serves_the_port_itself(server):
    """Direct ingress (cluster/deploy.py): the configured HTTP and gRPC ports are
    listened on by the ingress replica's own process, not by Serve's proxy actor,
    so a request skips the proxy hop."""
    import psutil

    listeners = {
        c.laddr.port: c.pid for c in psutil.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN and c.pid
    }
    for port in (server.config.http.port, server.config.grpc.port):
        assert port in listeners, f"nothing listens on {port}"
        name = " ".join(psutil.Process(listeners[port]).cmdline())
        assert "ServeReplica" in name and "ingress" in name, name
    # ... and it answers there.
    assert httpx.get(server.base_url + "/health", headers=server.headers()).status_code == 200
