"""Several `--served-model-name`s (vLLM's `--served-model-name a b`): /v1/models lists them
in order, a request may name any of them (or the --model value) and is answered under the
name it used, metrics carry the first, and an unknown name's 404 lists them."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.router.conftest import LORA_A, LORA_B, SECOND_NAME


def test_every_name_is_listed_and_served(server):
    models = httpx.get(server.base_url + "/v1/models", headers=server.headers(), timeout=30).json()["data"]
    assert [m["id"] for m in models] == [server.model, SECOND_NAME, LORA_A, LORA_B]
    for name in (server.model, SECOND_NAME, server.config.engine.model):
        r = httpx.post(
            server.base_url + "/v1/completions",
            headers=server.headers(),
            timeout=60,
            json={"model": name, "prompt": "hi", "max_tokens": 2},
        )
        assert r.status_code == 200 and r.json()["model"] == name, r.text
    r = httpx.post(
        server.base_url + "/v1/completions",
        headers=server.headers(),
        timeout=60,
        json={"model": "gpt-5", "prompt": "hi", "max_tokens": 2},
    )
    assert r.status_code == 404, r.text
    assert r.json()["error"]["message"] == (
        "The model `gpt-5` does not exist; this server serves "
        f"`{server.model}`, `{SECOND_NAME}` and the LoRA adapters "
        f"`{LORA_A}`, `{LORA_B}`"
    )
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    labels = {
        s.labels.get("model_name")
        for fam in text_string_to_metric_families(text)
        if fam.name == "vllm:request_success"
        for s in fam.samples
    }
    assert labels == {server.model}, labels
    server.wait_idle()
