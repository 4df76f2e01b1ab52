"""`/v1/embeddings` on the router suite's app (the generative tiny model): read with the official
client; each vector is the model's normalized last-token hidden state, as transformers computes
it; batched, base64, prefix-cached inputs agree; bad input is a 400 naming the field and the app
serves on with every KV block free."""

from __future__ import annotations

import base64
import struct
import time

import httpx
import openai
import pytest
import torch


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key, max_retries=0, timeout=120)


def ids_of(server, text: str) -> list[int]:
    r = httpx.post(server.base_url + "/tokenize", headers=server.headers(), json={"prompt": text}, timeout=60)
    return r.json()["tokens"]


def test_embeddings_are_the_last_token_hidden_state_normalized(client, server, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    texts = ["The quick brown fox", "jumps over the lazy dog, " * 6 + "again"]
    r = client.embeddings.create(model=server.model, input=texts)
    assert [d.index for d in r.data] == [0, 1] and r.object == "list"
    ids = [ids_of(server, t) for t in texts]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), torch_dtype=torch.float32)
    for d, tokens in zip(r.data, ids):
        with torch.no_grad():
            last = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0, -1]
        expected = torch.nn.functional.normalize(last, dim=-1)
        got = torch.tensor(d.embedding)
        assert got.shape == expected.shape and abs(got.norm().item() - 1) < 1e-5
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-3)
    # Token ids in, base64 out (little-endian float32): the same vectors.
    raw = httpx.post(
        server.base_url + "/v1/embeddings",
        headers=server.headers(),
        timeout=60,
        json={"model": server.model, "input": ids, "encoding_format": "base64"},
    ).json()
    for d, want in zip(raw["data"], r.data):
        data = base64.b64decode(d["embedding"])
        torch.testing.assert_close(
            torch.tensor(struct.unpack(f"<{len(data) // 4}f", data)), torch.tensor(want.embedding)
        )
    server.wait_idle()


def test_many_inputs_come_back_in_order_and_a_cached_prefix_changes_nothing(client, server):
    texts = [f"input number {i} says {'hello ' * (i % 5)}" for i in range(40)]
    many = client.embeddings.create(model=server.model, input=texts).data
    assert [d.index for d in many] == list(range(40))
    for i in (0, 17, 39):  # alone: the same vector (batched with others or not)
        alone = client.embeddings.create(model=server.model, input=texts[i]).data[0].embedding
        torch.testing.assert_close(torch.tensor(alone), torch.tensor(many[i].embedding), atol=1e-5, rtol=1e-4)
    long = "a shared system prompt that fills a few KV blocks " * 8
    first = client.embeddings.create(model=server.model, input=long).data[0].embedding
    again = client.embeddings.create(model=server.model, input=long).data[0].embedding  # prefix-cache hits
    torch.testing.assert_close(torch.tensor(again), torch.tensor(first), atol=1e-5, rtol=1e-4)
    server.wait_idle()


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["ok", ""]}, "input"),
        ({"input": [[1, 2, 99_999_999]]}, "input"),
        ({"input": "x " * 3000}, "input"),
        ({"input": "hi", "dimensions": 7}, "dimensions"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "truncate_prompt_tokens": 5000}, "truncate_prompt_tokens"),
        ({"input": ["a"] * 2049}, "input"),
    ],
)
def test_bad_input_is_refused_naming_the_field_and_the_app_still_serves(client, server, body, param):
    r = httpx.post(
        server.base_url + "/v1/embeddings", headers=server.headers(), timeout=60, json={"model": server.model, **body}
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert len(client.embeddings.create(model=server.model, input="still here").data[0].embedding) > 0
    server.wait_idle()


def test_grpc_embed_gives_the_http_vectors_and_refuses_bad_input(client, server):
    import grpc

    from fleetserve.router.grpc.proto import fleetserve_pb2 as pb
    from fleetserve.router.grpc.proto import fleetserve_pb2_grpc as pb_grpc

    texts = ["over gRPC", "the same vectors"]
    http = client.embeddings.create(model=server.model, input=texts).data
    meta = (("application", server.app), ("authorization", f"Bearer {server.api_key}"))
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.FleetServeStub(channel)
        r = stub.Embed(pb.EmbedRequest(texts=texts), metadata=meta, timeout=60)
        assert r.prompt_tokens == sum(len(ids_of(server, t)) for t in texts)
        for got, want in zip(r.embeddings, http):
            torch.testing.assert_close(
                torch.tensor(list(got.values)), torch.tensor(want.embedding), atol=1e-5, rtol=1e-4
            )
        by_ids = stub.Embed(
            pb.EmbedRequest(token_ids=[pb.TokenIds(ids=ids_of(server, texts[0]))]), metadata=meta, timeout=60
        )
        torch.testing.assert_close(
            torch.tensor(list(by_ids.embeddings[0].values)), torch.tensor(http[0].embedding), atol=1e-5, rtol=1e-4
        )
        for bad in (
            pb.EmbedRequest(),
            pb.EmbedRequest(texts=["a"], token_ids=[pb.TokenIds(ids=[1])]),
            pb.EmbedRequest(texts=["a", ""]),
            pb.EmbedRequest(texts=["a"], truncate_prompt_tokens=0),
        ):
            with pytest.raises(grpc.RpcError) as e:
                stub.Embed(bad, metadata=meta, timeout=60)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (bad, e.value.details())
        with pytest.raises(grpc.RpcError) as e:
            stub.Embed(pb.EmbedRequest(texts=["a"]), metadata=(("application", server.app),), timeout=60)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    server.wait_idle()


def _dot(a, b) -> float:
    return sum(x * y for x, y in zip(a, b))


def test_score_and_rerank_are_the_cosine_of_the_embeddings(client, server):
    """vLLM's /v1/score (1:N and N:N) and /v1/rerank (Jina's / Cohere's shape, also at /rerank
    and /v2/rerank): each score is the cosine similarity of the two texts' /v1/embeddings
    vectors; rerank orders the documents by it and keeps top_n."""
    query = "Where is the Eiffel tower?"
    docs = [
        "The Eiffel tower is in Paris.",
        "Bananas are yellow.",
        "Paris is the capital of France.",
        "The Eiffel tower is in Paris.",
    ]  # a repeat: embedded once, scored twice
    vec = {
        t: d.embedding
        for t, d in zip([query, *docs[:3]], client.embeddings.create(model=server.model, input=[query, *docs[:3]]).data)
    }
    want = [_dot(vec[query], vec[d]) for d in docs]
    r = httpx.post(
        server.base_url + "/v1/score",
        headers=server.headers(),
        timeout=60,
        json={"model": server.model, "text_1": query, "text_2": docs},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == server.model and body["id"].startswith("score-")
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3] and {d["object"] for d in body["data"]} == {"score"}
    assert all(abs(d["score"] - w) < 1e-4 for d, w in zip(body["data"], want)), (body["data"], want)
    tokens = sum(len(ids_of(server, t)) for t in [query, *docs[:3]])
    assert body["usage"]["prompt_tokens"] == tokens
    r = httpx.post(
        server.base_url + "/score",
        headers=server.headers(),
        timeout=60,  # N:N
        json={"text_1": [query, docs[1]], "text_2": [docs[2], docs[1]]},
    )
    got = [d["score"] for d in r.json()["data"]]
    assert abs(got[0] - _dot(vec[query], vec[docs[2]])) < 1e-4 and abs(got[1] - 1.0) < 1e-4
    order = sorted(range(4), key=lambda i: (-want[i], i))
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        r = httpx.post(
            server.base_url + path,
            headers=server.headers(),
            timeout=60,
            json={"model": server.model, "query": query, "documents": docs, "top_n": 3},
        )
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == order[:3]
        assert all(abs(x["relevance_score"] - want[x["index"]]) < 1e-4 for x in results)
        assert [x["document"]["text"] for x in results] == [docs[i] for i in order[:3]]
    r = httpx.post(
        server.base_url + "/v1/rerank",
        headers=server.headers(),
        timeout=60,
        json={"query": query, "documents": docs[:2], "return_documents": False},
    )
    assert len(r.json()["results"]) == 2 and "document" not in r.json()["results"][0]
    server.wait_idle()


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
        ("/v1/score", {"text_1": [], "text_2": "c"}, "text_2"),
        ("/v1/score", {"text_1": "a"}, "text_2"),
        ("/v1/score", {"text_1": "a", "text_2": "b", "model": "no-such-model"}, "model"),
        ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
        ("/v1/rerank", {"query": 3, "documents": ["a"]}, "query"),
    ],
)
def test_bad_score_and_rerank_input_is_a_400_and_the_app_serves_on(client, server, path, body, param):
    r = httpx.post(server.base_url + path, headers=server.headers(), timeout=60, json=body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert len(client.embeddings.create(model=server.model, input="still here").data[0].embedding) > 0
    server.wait_idle()


def test_a_dimensions_other_than_the_models_is_refused_before_any_input_is_computed(client, server):
    """The width is known from the engines' info: 64 inputs with a `dimensions` the model cannot
    give are refused at once, not after embedding all of them (no prompt token is computed)."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.fresh_metrics import fresh_metrics_text

    def prompt_tokens() -> float:
        text = fresh_metrics_text(server.base_url, server.headers())  # reports made after the requests
        return sum(
            s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "vllm:prompt_tokens_total"
        )

    width = len(client.embeddings.create(model=server.model, input="how wide").data[0].embedding)
    server.wait_idle()
    before, t0 = prompt_tokens(), time.monotonic()
    while (now := prompt_tokens()) != before and time.monotonic() - t0 < 10:  # settled
        before = now
        time.sleep(0.5)
    r = httpx.post(
        server.base_url + "/v1/embeddings",
        headers=server.headers(),
        timeout=60,
        json={
            "model": server.model,
            "dimensions": width // 2,
            "input": [f"input number {i} of many" for i in range(64)],
        },
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "dimensions" and str(width) in r.json()["error"]["message"]
    time.sleep(1.0)
    assert prompt_tokens() == before
    assert (
        len(client.embeddings.create(model=server.model, input="still here", dimensions=width).data[0].embedding)
        == width
    )
    server.wait_idle()
