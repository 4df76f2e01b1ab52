"""The fleetserve.v1 gRPC service through Ray Serve's gRPC proxy, with a grpcio client."""

from __future__ import annotations

import grpc
import pytest

from fleetserve.router.proto import fleetserve_pb2 as pb
from fleetserve.router.proto import fleetserve_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.grpc_target) as channel:
        yield pb_grpc.FleetServeStub(channel)


def meta(server, key=None):
    return (("application", server.app), ("authorization", f"Bearer {key or server.api_key}"))


def test_generate_streams_prompt(stub, server):
    req = pb.GenerateRequest(prompt="Hello there", sampling_params=pb.SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True))
    msgs = list(stub.Generate(req, metadata=meta(server), timeout=60))
    assert len(msgs) >= 2  # streamed, not one blob
    assert msgs[-1].finish_reason == "length" and msgs[-1].completion_tokens == 6
    assert sum(len(m.token_ids) for m in msgs) == 6
    assert all(m.prompt_tokens > 0 for m in msgs)


def test_generate_token_ids_matches_http_greedy(stub, server):
    import httpx

    ids = httpx.post(server.base_url + "/tokenize", headers=server.headers(),
                     json={"prompt": "The quick brown fox"}).json()["tokens"]
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids), sampling_params=pb.SamplingParams(
        max_tokens=5, temperature=0.0, ignore_eos=True))
    grpc_text = "".join(m.text for m in stub.Generate(req, metadata=meta(server), timeout=60))
    http_text = httpx.post(server.base_url + "/v1/completions", headers=server.headers(), timeout=60,
                           json={"prompt": ids, "max_tokens": 5, "temperature": 0,
                                 "ignore_eos": True}).json()["choices"][0]["text"]
    assert grpc_text == http_text


def test_health_and_list_models(stub, server):
    assert stub.Health(pb.HealthRequest(), metadata=meta(server), timeout=30).ok
    models = stub.ListModels(pb.ListModelsRequest(), metadata=meta(server), timeout=30).models
    assert [m.id for m in models] == [server.model] and models[0].max_model_len == 256


@pytest.mark.parametrize("request_kwargs,code", [
    ({"prompt": "x", "sampling_params": pb.SamplingParams(max_tokens=0)},
     grpc.StatusCode.INVALID_ARGUMENT),
    ({"prompt": "x", "sampling_params": pb.SamplingParams(temperature=-1)},
     grpc.StatusCode.INVALID_ARGUMENT),
    ({}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"prompt": "word " * 400}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"prompt": "x", "model": "nope"}, grpc.StatusCode.NOT_FOUND),
])
def test_generate_errors(stub, server, request_kwargs, code):
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(**request_kwargs), metadata=meta(server), timeout=30))
    assert e.value.code() == code
    assert e.value.details()


def test_bad_key(stub, server):
    with pytest.raises(grpc.RpcError) as e:
        stub.ListModels(pb.ListModelsRequest(), metadata=meta(server, key="wrong"), timeout=30)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_cancelled_call_frees_blocks(stub, server):
    req = pb.GenerateRequest(prompt="cancel me " * 5, sampling_params=pb.SamplingParams(
        max_tokens=200, ignore_eos=True))
    call = stub.Generate(req, metadata=meta(server), timeout=60)
    next(call)
    call.cancel()
    server.wait_idle()


def test_generate_structured_outputs_and_logit_bias(stub, server):
    """The constraint fields of SamplingParams: the output is one of the choices / matches."""
    import re

    choice = pb.StructuredOutputs(choice=pb.Choices(values=["north", "south"]))
    msgs = list(stub.Generate(pb.GenerateRequest(prompt="Go", sampling_params=pb.SamplingParams(
        max_tokens=10, structured_outputs=choice)), metadata=meta(server), timeout=60))
    assert "".join(m.text for m in msgs) in ("north", "south") and msgs[-1].finish_reason == "stop"
    regex = pb.StructuredOutputs(regex="[0-9]{4}")
    text = "".join(m.text for m in stub.Generate(pb.GenerateRequest(prompt="Year", sampling_params=pb.SamplingParams(
        max_tokens=10, seed=2, structured_outputs=regex)), metadata=meta(server), timeout=60))
    assert re.fullmatch("[0-9]{4}", text)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(prompt="x", sampling_params=pb.SamplingParams(
            structured_outputs=pb.StructuredOutputs(regex="a(b"))), metadata=meta(server), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "regular expression" in e.value.details()
