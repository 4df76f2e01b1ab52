"""LoRA adapters through the router suite's app (`--lora-modules`, two PEFT adapters of the tiny
model, `--max-loras 1`): a request names an adapter in `model`; its tokens are what PEFT's own
model gives, alone or batched with the base model and the other adapter; /v1/models lists the
adapters; the prefix cache never hands one adapter's KV to another or to the base model; gRPC
and embeddings take the adapter too; and the app ends every test with all KV blocks free."""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import time

import grpc
import httpx
import pytest
import torch

from fleetserve.router.grpc.proto import fleetserve_pb2 as pb
from fleetserve.router.grpc.proto import fleetserve_pb2_grpc as pb_grpc
from tests.router.conftest import LORA_A, LORA_B, SECOND_NAME

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time there was a little robot"


def ids_of(server, text: str) -> list[int]:
    r = httpx.post(server.base_url + "/tokenize", headers=server.headers(), json={"prompt": text}, timeout=60)
    return r.json()["tokens"]


def complete(server, model: str, prompt, max_tokens: int = 8) -> dict:
    r = httpx.post(
        server.base_url + "/v1/completions",
        headers=server.headers(),
        timeout=120,
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()


def token_ids(body: dict) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in body["choices"][0]["logprobs"]["tokens"]]


@pytest.fixture(scope="module")
def peft_greedy(tiny_model_dir, lora_dirs):
    """PEFT's own greedy continuation of a prompt with an adapter (None: the base model)."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    models = {None: LlamaForCausalLM.from_pretrained(str(tiny_model_dir), torch_dtype=torch.float32)}
    for name, path in lora_dirs.items():  # (c: loaded at run time as tiny-lora-c)
        base = LlamaForCausalLM.from_pretrained(str(tiny_model_dir), torch_dtype=torch.float32)
        models[name] = PeftModel.from_pretrained(base, str(path)).eval()

    def run(name, ids: list[int], n: int) -> list[int]:
        with torch.no_grad():
            out = models[name].generate(
                torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=2
            )
        return out[0, len(ids) :].tolist()

    return run


def test_models_list_the_adapters_with_their_base(server, lora_dirs):
    models = httpx.get(server.base_url + "/v1/models", headers=server.headers(), timeout=30).json()["data"]
    cards = {m["id"]: m for m in models}
    # (b's --lora-modules entry names its base model: the card's parent)
    for name, parent in ((LORA_A, server.model), (LORA_B, SECOND_NAME)):
        assert cards[name]["parent"] == parent and cards[name]["root"] == str(lora_dirs[name])
        one = httpx.get(f"{server.base_url}/v1/models/{name}", headers=server.headers(), timeout=30).json()
        assert one == cards[name]
    assert "parent" not in cards[server.model]


def test_each_adapter_answers_as_peft_does_alone_and_mixed(server, peft_greedy):
    ids = ids_of(server, PROMPT)
    expected = {name: peft_greedy(name, ids, 8) for name in (None, LORA_A, LORA_B)}
    assert len({tuple(v) for v in expected.values()}) == 3  # the adapters change the answer
    for name, want in expected.items():  # alone
        assert token_ids(complete(server, name or server.model, ids)) == want, name
    # Mixed: six requests at once over the base model and both adapters (--max-loras 1: the
    # adapters take turns; the base model's requests run beside either).
    order = [None, LORA_A, LORA_B, LORA_B, None, LORA_A]
    with cf.ThreadPoolExecutor(len(order)) as pool:
        got = list(pool.map(lambda name: token_ids(complete(server, name or server.model, ids)), order))
    assert got == [expected[name] for name in order]
    server.wait_idle()


def test_prefix_cache_is_per_adapter(server):
    """A prompt cached for the base model is not a hit for an adapter (nor for the other
    adapter); the adapter's own repeat is."""
    prompt = ids_of(server, "Paged attention stores keys and values in fixed-size blocks of memory. " * 4)
    assert len(prompt) > 3 * 16
    cached = lambda body: body["usage"]["prompt_tokens_details"]["cached_tokens"]  # noqa: E731
    first = complete(server, server.model, prompt, 2)
    again = complete(server, server.model, prompt, 2)
    assert cached(first) == 0 and cached(again) >= 32  # prefix_aware routing: the same replica
    a1, a2 = complete(server, LORA_A, prompt, 2), complete(server, LORA_A, prompt, 2)
    b1 = complete(server, LORA_B, prompt, 2)
    assert cached(a1) == 0 and cached(a2) >= 32 and cached(b1) == 0
    server.wait_idle()


def test_chat_streaming_grpc_and_embeddings_take_the_adapter(server):
    import openai

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Hello, world! How are you today?"}]
    kw = dict(messages=messages, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(model=LORA_A, **kw)
    assert whole.model == LORA_A
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model=LORA_A, stream=True, **kw)
        if c.choices
    )
    assert streamed == whole.choices[0].message.content
    base = client.chat.completions.create(model=server.model, **kw).choices[0].message.content
    assert base != whole.choices[0].message.content

    ids = ids_of(server, PROMPT)
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.FleetServeStub(channel)
        meta = (("application", server.app), ("authorization", f"Bearer {server.api_key}"))
        req = pb.GenerateRequest(
            model=LORA_B,
            prompt_token_ids=pb.TokenIds(ids=ids),
            sampling_params=pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        )
        got = [t for m in stub.Generate(req, metadata=meta, timeout=60) for t in m.token_ids]
        assert got == token_ids(complete(server, LORA_B, ids))
        models = [m.id for m in stub.ListModels(pb.ListModelsRequest(), metadata=meta, timeout=30).models]
        assert models[-2:] == [LORA_A, LORA_B]

    vectors = {m: client.embeddings.create(model=m, input=PROMPT).data[0].embedding for m in (server.model, LORA_A)}
    assert vectors[server.model] != vectors[LORA_A]
    assert client.embeddings.create(model=LORA_A, input=PROMPT).data[0].embedding == pytest.approx(
        vectors[LORA_A], abs=1e-5
    )
    server.wait_idle()


def test_an_unknown_adapter_is_a_404_and_the_app_serves_on(server, peft_greedy):
    r = httpx.post(
        server.base_url + "/v1/completions",
        headers=server.headers(),
        timeout=60,
        json={"model": "tiny-lora-c", "prompt": "hi", "max_tokens": 2},
    )
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    assert f"`{LORA_A}`, `{LORA_B}`" in r.json()["error"]["message"]
    ids = ids_of(server, PROMPT)
    assert token_ids(complete(server, LORA_A, ids)) == peft_greedy(LORA_A, ids, 8)
    server.wait_idle()
    # vLLM's LoRA info gauge, one series per replica, through the router's /metrics.
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    info = [s for f in text_string_to_metric_families(text) if f.name == "vllm:lora_requests_info" for s in f.samples]
    assert len(info) == 2 and {s.labels["max_lora"] for s in info} == {"1"}, info
    assert len({s.labels["replica"] for s in info}) == 2


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, headers=server.headers(), json=body, timeout=180)


def test_load_and_unload_at_run_time(server, lora_dirs, peft_greedy, tmp_path):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, on every replica at once."""
    ids = ids_of(server, PROMPT)
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "tiny-lora-c", "lora_path": str(lora_dirs["c"])})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'tiny-lora-c' added successfully.", r.text
    cards = httpx.get(server.base_url + "/v1/models", headers=server.headers(), timeout=30).json()["data"]
    assert cards[-1]["id"] == "tiny-lora-c" and cards[-1]["parent"] == server.model
    want = peft_greedy("c", ids, 8)
    assert want != peft_greedy(None, ids, 8)
    for _ in range(3):  # whichever replica serves it
        assert token_ids(complete(server, "tiny-lora-c", ids)) == want
    # Refused: a name in use, a folder outside --lora-roots, one missing inside them (the same
    # words for both: nothing about the file system), no path; the app serves on (and no
    # replica kept a half-loaded adapter under the refused name).
    refusals = []
    for body, status, text in (
        ({"lora_name": "tiny-lora-c", "lora_path": str(lora_dirs["c"])}, 400, "already in use"),
        ({"lora_name": server.model, "lora_path": str(lora_dirs["c"])}, 400, "already in use"),
        ({"lora_name": "x", "lora_path": str(tmp_path / "nothing")}, 404, "not found or cannot be loaded"),
        ({"lora_name": "x", "lora_path": str(lora_dirs["c"]) + "-none"}, 404, "not found or cannot be loaded"),
        ({"lora_name": "x"}, 400, "lora_path"),
    ):
        r = post(server, "/v1/load_lora_adapter", body)
        assert r.status_code == status and text in r.json()["error"]["message"], r.text
        refusals.append(r.json()["error"])
    assert refusals[2] == refusals[3] and str(tmp_path) not in str(refusals[2]), refusals
    assert complete(server, server.model, ids, 2)["choices"][0]["finish_reason"] == "length"
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "tiny-lora-c"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'tiny-lora-c' removed successfully.", r.text
    r = post(server, "/v1/completions", {"model": "tiny-lora-c", "prompt": ids, "max_tokens": 2})
    assert r.status_code == 404, r.text
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "tiny-lora-c"})
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"], r.text
    server.wait_idle()


def test_a_replica_without_a_runtime_adapter_loads_it_on_first_use(server, lora_dirs, peft_greedy):
    """A replica that started after the load (here: every replica unloads it behind the
    router's back, as a restarted one lacks it) loads it when a request for it arrives."""
    import asyncio

    from ray import serve

    from fleetserve.router.routing.registry import get_router
    from fleetserve.router.routing.request_router import TARGET_KWARG

    r = post(server, "/v1/load_lora_adapter", {"lora_name": "tiny-lora-c2", "lora_path": str(lora_dirs["c"])})
    assert r.status_code == 200, r.text
    handle = serve.get_deployment_handle("engine", server.app)

    async def unload_everywhere():
        await handle.get_info.remote()
        router = get_router(server.app, "engine")
        return [  # (evict: an unload would also refuse the requests built before it)
            await handle.control.remote("unload_lora", name="tiny-lora-c2", evict=True, **{TARGET_KWARG: rid})
            for rid in router.replica_ids()
        ]

    assert all(r["removed"] for r in asyncio.run(unload_everywhere()))
    ids = ids_of(server, PROMPT)
    want = peft_greedy("c", ids, 8)
    with cf.ThreadPoolExecutor(4) as pool:  # at once: one load per replica, the others wait for it
        got = list(pool.map(lambda _: token_ids(complete(server, "tiny-lora-c2", ids)), range(4)))
    assert got == [want] * 4
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "tiny-lora-c2"}).status_code == 200
    server.wait_idle()


def test_runtime_adapters_survive_an_ingress_restart(server, lora_dirs, peft_greedy):
    """The ingress is the app's list of adapter names. Killed (Serve starts a new one with the
    same arguments), it takes back the adapters loaded at run time from Ray's GCS
    (router/runtime_loras.py): still listed and served with their own tokens; one unloaded
    before the restart stays gone. The list is tagged with a hash of the app's config: an app
    of another config reads none, and only this one's graceful stop drops it."""
    import ray
    import ray.experimental.internal_kv

    from fleetserve.cluster.app_spec import app_args
    from fleetserve.cluster.deploy import INGRESS_DEPLOYMENT
    from fleetserve.router.runtime_loras import RuntimeLoRAs

    for name in ("tiny-lora-c3", "tiny-lora-c4"):
        r = post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(lora_dirs["c"])})
        assert r.status_code == 200
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "tiny-lora-c4"}).status_code == 200
    prefix = f"SERVE_REPLICA::{server.app}#{INGRESS_DEPLOYMENT}#"
    [old] = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    ray.kill(ray.get_actor(old, namespace="serve"), no_restart=True)
    deadline = time.time() + 120
    while True:  # until the new ingress answers
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
        try:
            r = httpx.get(server.base_url + "/v1/models", headers=server.headers(), timeout=10)
        except httpx.HTTPError:
            r = None
        if names and old not in names and r is not None and r.status_code == 200:
            break
        assert time.time() < deadline, "the killed ingress was not replaced"
        time.sleep(0.5)
    cards = {m["id"]: m for m in r.json()["data"]}
    assert "tiny-lora-c3" in cards and "tiny-lora-c4" not in cards
    assert cards["tiny-lora-c3"]["root"] == str(lora_dirs["c"]) and LORA_A in cards  # and the configured ones
    ids = ids_of(server, PROMPT)
    assert token_ids(complete(server, "tiny-lora-c3", ids)) == peft_greedy("c", ids, 8)
    r = post(server, "/v1/completions", {"model": "tiny-lora-c4", "prompt": ids, "max_tokens": 2})
    assert r.status_code == 404, r.text
    # What the new ingress reads is this deployment's list; another deployment's id reads none.
    key = RuntimeLoRAs(server.app, "x").key
    stored = json.loads(ray.experimental.internal_kv._internal_kv_get(key, namespace="fleetserve"))
    assert set(stored["adapters"]) == {"tiny-lora-c3"}
    config_hash = hashlib.sha256(json.dumps(app_args(server.config), sort_keys=True).encode()).hexdigest()
    assert stored["instance"] == config_hash[:16]
    assert RuntimeLoRAs(server.app, stored["instance"]).restore().keys() == {"tiny-lora-c3"}
    assert RuntimeLoRAs(server.app, "another-config").restore() == {}
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "tiny-lora-c3"}).status_code == 200
    assert RuntimeLoRAs(server.app, stored["instance"]).restore() == {}
    RuntimeLoRAs(server.app, "another-config").drop()  # not its list: kept
    assert ray.experimental.internal_kv._internal_kv_get(key, namespace="fleetserve") is not None
    RuntimeLoRAs(server.app, stored["instance"]).drop()
    assert ray.experimental.internal_kv._internal_kv_get(key, namespace="fleetserve") is None
    server.wait_idle()


def test_requests_for_an_adapter_go_to_a_replica_that_holds_it(server, lora_dirs, peft_greedy):
    """With replicas that hold different adapters (here: one drops a run-time adapter behind the
    router's back, as --max-cpu-loras evicts), requests naming the adapter go to the replica
    that has it (the engines report theirs with their load) instead of making the other read
    it from disk: after six of them, the other replica still lacks it."""
    import asyncio

    from ray import serve

    from fleetserve.router.routing.registry import get_router
    from fleetserve.router.routing.request_router import TARGET_KWARG

    name = "tiny-lora-c5"
    r = post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(lora_dirs["c"])})
    assert r.status_code == 200
    handle = serve.get_deployment_handle("engine", server.app)

    async def on_each(op: str) -> dict[str, dict]:
        await handle.get_info.remote()
        router = get_router(server.app, "engine")
        return {
            rid: await handle.control.remote(op, name=name, **{TARGET_KWARG: rid})
            for rid in sorted(router.replica_ids())
        }

    replicas = sorted(asyncio.run(on_each("unload_lora")))
    assert len(replicas) == 2
    holder, victim = replicas

    async def load_on_holder():
        return await handle.control.remote("load_lora", name=name, path=str(lora_dirs["c"]), **{TARGET_KWARG: holder})

    assert "key" in asyncio.run(load_on_holder())
    time.sleep(3 * server.config.routing.stats_period_s)  # the routers see who holds it now
    ids = ids_of(server, PROMPT)
    want = peft_greedy("c", ids, 8)
    for i in range(6):  # distinct prompts: no prefix match to follow; sequential: equal loads
        body = complete(server, name, [ids[0] + 1 + i] + ids[1:])
        assert len(token_ids(body)) == 8
    assert token_ids(complete(server, name, ids)) == want
    removed = {rid: r["removed"] for rid, r in asyncio.run(on_each("unload_lora")).items()}
    assert removed == {holder: True, victim: False}, removed
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200
    server.wait_idle()


def test_a_load_replaces_weights_a_replica_kept_under_a_name_the_app_forgot(server, lora_dirs, peft_greedy):
    """An ingress of another config forgets the adapters loaded at run time while unchanged
    replicas keep their weights: loading the name again (other weights) replaces that copy
    instead of failing with 'loaded already'."""
    import asyncio

    from ray import serve

    from fleetserve.router.routing.registry import get_router
    from fleetserve.router.routing.request_router import TARGET_KWARG

    name = "tiny-lora-c6"
    handle = serve.get_deployment_handle("engine", server.app)

    async def stale_copy():  # one replica holds adapter a's weights under the name
        await handle.get_info.remote()
        rid = sorted(get_router(server.app, "engine").replica_ids())[0]
        return await handle.control.remote("load_lora", name=name, path=str(lora_dirs[LORA_A]), **{TARGET_KWARG: rid})

    assert "key" in asyncio.run(stale_copy())
    r = post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(lora_dirs["c"])})
    assert r.status_code == 200, r.text
    ids = ids_of(server, PROMPT)
    want = peft_greedy("c", ids, 8)
    for _ in range(4):  # whichever replica serves it: c's tokens
        assert token_ids(complete(server, name, ids)) == want
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200
    server.wait_idle()
