"""P/D end to end with the official `openai` client: 1 prefill + 1 decode replica.

Greedy output equals one colocated engine's (the offline `LLM`, the same engine code on
one replica); the decode side computes at most the last block of each prompt (the usage
body says so: prompt_tokens - cached_tokens, remote_tokens); streaming and not, chat
and completions; a short prompt skips the prefill pool. Faults, each followed by "the
app still serves and every replica has all blocks free".
"""

from __future__ import annotations

import json
import random

import httpx
import openai

from tests.pd.conftest import BLOCK, MAX_TOKENS
from tests.router.test_routing_e2e import feed_items


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def tokenize(server, **body) -> list[int]:
    r = httpx.post(server.base_url + "/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def long_prompt(rng: random.Random, words: int = 40) -> str:
    return " ".join(f"item{rng.randrange(500)}" for _ in range(words))


def check_usage(usage, prompt_len: int) -> None:
    details = usage.prompt_tokens_details
    assert usage.prompt_tokens == prompt_len
    computed = prompt_len - details.cached_tokens
    assert computed <= BLOCK, (prompt_len, details)
    remote = details.model_extra.get("remote_tokens") if details.model_extra else None
    assert remote is not None and remote >= prompt_len - BLOCK - (prompt_len % BLOCK), details


def stream_chat(c: openai.OpenAI, model: str, messages: list, n: int):
    """(text, usage, finish_reason) of a streamed greedy chat of `n` tokens (EOS ignored)."""
    chunks = c.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=n,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, usage, finish = "", None, None
    for ch in chunks:
        usage = ch.usage or usage
        for choice in ch.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, usage, finish


def completion_equals_colocated(server, colocated, prompt: str) -> None:
    """A greedy completion of a prompt longer than two blocks through P/D: one colocated
    engine's text, and the decode side computed at most its last block."""
    ids = tokenize(server, prompt=prompt)
    assert len(ids) > 2 * BLOCK
    r = client(server).completions.create(
        model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == colocated(ids)
    check_usage(r.usage, len(ids))


def test_completions_equal_colocated_and_decode_computes_at_most_a_block(pd_server, colocated):
    health = httpx.get(pd_server.base_url + "/health", timeout=10).json()
    assert health["status"] == "ok" and health["num_replicas"] == 1  # the decode pool
    assert health["prefill"] == {"num_replicas": 1, "unhealthy": {}}
    rng = random.Random(1)
    before = pd_server.pd_tokens()
    fed_before = feed_items(pd_server)
    for _ in range(3):
        completion_equals_colocated(pd_server, colocated, long_prompt(rng))
    after = pd_server.pd_tokens()
    assert after.get("loaded", 0) > before.get("loaded", 0)
    assert pd_server.pd_paths().get("pd", 0) >= 3
    # The first decode call opened the ingress's feed to the decode replica; the later
    # ones' tokens came over it (router/feed.py).
    assert feed_items(pd_server) > fed_before
    pd_server.wait_all_free()


def test_streaming_chat_equals_colocated(pd_server, colocated):
    c = client(pd_server)
    rng = random.Random(2)
    messages = [{"role": "system", "content": long_prompt(rng, 30)}, {"role": "user", "content": "Say something."}]
    ids = tokenize(pd_server, messages=messages)
    text, usage, finish = stream_chat(c, "tiny", messages, MAX_TOKENS)
    assert finish == "length"
    assert text == colocated(ids)
    check_usage(usage, len(ids))
    # Not streamed, the same conversation: the same answer.
    r = c.chat.completions.create(
        model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].message.content == text
    pd_server.wait_all_free()


def test_a_lora_adapter_runs_on_both_sides_of_the_hand_off(pd_server, colocated):
    """`model` names the pools' LoRA adapter: the prefill replica computes the prompt's KV with
    it, the decode replica loads that KV (its blocks salted with the adapter) and decodes with
    it: the adapter's colocated answer. The base model's answer to the same prompt never takes
    the adapter's blocks."""
    c = client(pd_server)
    prompt = long_prompt(random.Random(7))
    ids = tokenize(pd_server, prompt=prompt)
    kw = dict(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    r = c.completions.create(model="tiny-lora", **kw)
    assert r.choices[0].text == colocated(ids, lora=True) != colocated(ids)
    check_usage(r.usage, len(ids))
    base = c.completions.create(model="tiny", **kw)
    assert base.choices[0].text == colocated(ids)
    check_usage(base.usage, len(ids))  # prefilled again for the base model, and handed over
    pd_server.wait_all_free()


def test_short_prompt_skips_the_prefill_pool(pd_server, colocated):
    c = client(pd_server)
    before = pd_server.pd_paths()
    prompt = "hi there"
    ids = tokenize(pd_server, prompt=prompt)
    assert len(ids) < 32
    r = c.completions.create(
        model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == colocated(ids)
    after = pd_server.pd_paths()
    assert after.get("decode_only", 0) == before.get("decode_only", 0) + 1
    assert after.get("pd", 0) == before.get("pd", 0)
    pd_server.wait_all_free()


def test_embeddings_run_on_the_prefill_pool_and_equal_one_engine(pd_server, colocated):
    """An embedding is prompt work alone: the prefill pool answers it (path prefill_only),
    with one engine's vectors."""
    import torch

    texts = [long_prompt(random.Random(7)), "a short one"]
    before = pd_server.pd_paths().get("prefill_only", 0)
    r = client(pd_server).embeddings.create(model="tiny", input=texts)
    ids = [tokenize(pd_server, prompt=t) for t in texts]
    want = colocated.llm.embed([{"prompt_token_ids": i} for i in ids], use_tqdm=False)
    for got, w in zip(r.data, want):
        torch.testing.assert_close(torch.tensor(got.embedding), torch.tensor(w.outputs.embedding), atol=1e-5, rtol=1e-4)
    assert r.usage.prompt_tokens == sum(map(len, ids))
    assert pd_server.pd_paths().get("prefill_only", 0) == before + 2
    pd_server.wait_all_free()


def test_grpc_generate_goes_through_pd_too(pd_server, colocated):
    import grpc

    from fleetserve.router.grpc.proto import fleetserve_pb2 as pb
    from fleetserve.router.grpc.proto import fleetserve_pb2_grpc as pb_grpc

    ids = tokenize(pd_server, prompt=long_prompt(random.Random(5)))
    before = pd_server.pd_paths().get("pd", 0)
    req = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=ids),
        sampling_params=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    )
    with grpc.insecure_channel(pd_server.grpc_target) as channel:
        msgs = list(
            pb_grpc.FleetServeStub(channel).Generate(req, metadata=(("application", pd_server.app),), timeout=120)
        )
    assert "".join(m.text for m in msgs) == colocated(ids)
    assert pd_server.pd_paths().get("pd", 0) == before + 1
    pd_server.wait_all_free()


def complete(server, prompt: str, n: int = MAX_TOKENS) -> dict:
    r = httpx.post(
        server.base_url + "/v1/completions",
        timeout=120,
        json={"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_prefill_replica_dies_decode_recomputes_then_pd_resumes(pd_server, colocated):
    rng = random.Random(3)
    before = pd_server.pd_paths()
    prompt = long_prompt(rng)
    ids = tokenize(pd_server, prompt=prompt)
    old = pd_server.kill("prefill")
    body = complete(pd_server, prompt)  # the prefill calls fail: decode computes the prompt
    assert body["choices"][0]["text"] == colocated(ids)
    pd_server.wait_replaced("prefill", old)  # (until the new replica reports: wait_all_free)
    paths = pd_server.pd_paths()
    # It was counted on one path: prefill_failed, or pd if Serve had already replaced it.
    assert (
        paths.get("prefill_failed", 0) + paths.get("pd", 0) == before.get("prefill_failed", 0) + before.get("pd", 0) + 1
    )
    prompt = long_prompt(rng)
    body = complete(pd_server, prompt)
    assert body["choices"][0]["text"] == colocated(tokenize(pd_server, prompt=prompt))
    assert body["usage"]["prompt_tokens_details"]["remote_tokens"] > 0  # P/D again
    pd_server.wait_all_free()


def test_decode_replica_restart(pd_server, colocated):
    rng = random.Random(4)
    old = pd_server.kill("decode")
    # While it is down a request fails with a clear error (never a silent empty answer), or
    # is served by the replacement.
    r = httpx.post(
        pd_server.base_url + "/v1/completions",
        timeout=120,
        json={"model": "tiny", "prompt": long_prompt(rng), "max_tokens": 4, "stream": True},
    )
    if r.status_code == 200:
        events = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert any('"error"' in e for e in events) or any('"text"' in e for e in events), events
    else:
        assert "error" in r.json(), r.text
    pd_server.wait_replaced("decode", old)
    prompt = long_prompt(rng)
    body = complete(pd_server, prompt)
    assert body["choices"][0]["text"] == colocated(tokenize(pd_server, prompt=prompt))
    assert body["usage"]["prompt_tokens_details"]["remote_tokens"] > 0
    pd_server.wait_all_free()


def test_a_pd_request_is_one_trace_with_both_replicas_and_the_hand_off(pd_server, colocated, pd_model_dir):
    """Through `fleetserve serve` (issue 55): a P/D completion sent with a `traceparent` is one
    trace holding the ingress's spans, a route span per pool, the prefill replica's spans (its
    KV export) and the decode replica's (the load in WAITING_FOR_REMOTE_KVS, then the rest);
    a short prompt that skips the prefill pool has the decode replica's spans only."""
    import secrets

    rx = pd_server.traces
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    prompt = long_prompt(random.Random(55))
    ids = tokenize(pd_server, prompt=prompt)
    r = httpx.post(
        pd_server.base_url + "/v1/completions",
        headers={"traceparent": f"00-{trace_id}-{parent}-01"},
        json={"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == colocated(ids)
    want = {"POST /v1/completions", "ingress", "route", "engine prefill", "engine decode", "kv_transfer", "decode"}
    spans = rx.wait_for(lambda s: want <= {x.name for x in s}, timeout_s=60, trace_id=trace_id)
    by_id = {s.span_id: s for s in spans}
    root = next(s for s in spans if s.name == "POST /v1/completions")
    assert root.parent_span_id == parent and root.attributes["fleetserve.pd.path"] == "pd"
    engines = {s.name: s for s in spans if s.name.startswith("engine ")}
    assert all(e.parent_span_id == root.span_id for e in engines.values())
    assert {s.resource_attributes["fleetserve.role"] for s in spans} == {"ingress", "engine"}
    routes = {s.attributes["fleetserve.route.deployment"]: s for s in spans if s.name == "route"}
    assert set(routes) == {"prefill", "decode"}, routes
    assert (
        routes["decode"].attributes["fleetserve.route.replica"]
        == engines["engine decode"].attributes["fleetserve.replica"]
    )
    assert routes["decode"].attributes["fleetserve.route.reason"] == "pinned"  # the P/D flow chose it

    def children(engine: str) -> dict:
        return {s.name: s for s in spans if by_id.get(s.parent_span_id) is engines[engine]}

    prefill_side, decode_side = children("engine prefill"), children("engine decode")
    assert {"queue", "prefill", "kv_transfer"} <= set(prefill_side), prefill_side
    assert prefill_side["kv_transfer"].attributes["fleetserve.kv_transfer.direction"] == "export"
    assert prefill_side["kv_transfer"].attributes["fleetserve.kv_transfer.tokens"] >= len(ids) - BLOCK
    assert {"queue", "kv_transfer", "prefill", "decode"} <= set(decode_side), decode_side
    load = decode_side["kv_transfer"]
    assert load.attributes["fleetserve.kv_transfer.direction"] == "load"
    assert load.attributes["fleetserve.kv_transfer.outcome"] == "loaded"
    assert (
        load.attributes["fleetserve.kv_transfer.tokens"]
        == engines["engine decode"].attributes["fleetserve.remote_tokens"]
    )
    # the bytes each side moved: whole blocks of K and V over every layer, float32
    cfg = json.loads((pd_model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    block_bytes = 2 * cfg["num_key_value_heads"] * head_dim * cfg["num_hidden_layers"] * 4 * BLOCK
    for side in (load, prefill_side["kv_transfer"]):
        tokens = side.attributes["fleetserve.kv_transfer.tokens"]
        assert side.attributes["fleetserve.kv_transfer.bytes"] == -(-tokens // BLOCK) * block_bytes, side.attributes
    # the hand-off in time order: prefill, export, load, the decode side's own prefill, decode
    assert prefill_side["prefill"].end_ns <= load.start_ns + 5_000_000
    assert load.end_ns <= decode_side["prefill"].start_ns + 1000 <= decode_side["decode"].start_ns + 2000
    assert decode_side["decode"].attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS
    # --enable-log-requests: the decode replica logged this request's phases
    assert "transfer" in pd_server.log_path.read_text()

    # A short prompt: decode only, no prefill replica in its trace.
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    r = httpx.post(
        pd_server.base_url + "/v1/completions",
        headers={"traceparent": f"00-{trace_id}-{parent}-01"},
        json={"model": "tiny", "prompt": "short", "max_tokens": 2, "ignore_eos": True},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    spans = rx.wait_for(lambda s: {"engine decode", "POST /v1/completions"} <= {x.name for x in s}, 60, trace_id)
    assert "engine prefill" not in {s.name for s in spans}
    root = next(s for s in spans if s.name == "POST /v1/completions")
    assert root.attributes["fleetserve.pd.path"] == "decode_only"
    pd_server.wait_all_free()
