"""The ingress's bounds on logit_bias and allowed_token_ids (issue 51), on the HTTP request
models and the gRPC mapping themselves: sizes are refused as sent, before SamplingParams
walks the lists, and allowed ids arrive at the engine deduplicated. (The live app's body limit
is smaller than the allowed-ids bound; tests/router/test_vllm_sampling_extras.py covers the
refusals that fit in it, end to end.)"""

from __future__ import annotations

import pytest

from fleetserve.replica.engine.processor import MAX_ALLOWED_TOKEN_IDS, MAX_LOGIT_BIAS
from fleetserve.router.api.errors import APIError
from fleetserve.router.api.protocol import ChatCompletionRequest, CompletionRequest
from fleetserve.router.grpc.proto import fleetserve_pb2 as pb
from fleetserve.router.grpc.service import sampling_from_proto

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("model,base", [(CompletionRequest, {"prompt": "a"}), (ChatCompletionRequest, CHAT)])
@pytest.mark.parametrize(
    "fields,param",
    [
        ({"logit_bias": {str(i): 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
        ({"allowed_token_ids": [5] * (MAX_ALLOWED_TOKEN_IDS + 1)}, "allowed_token_ids"),
    ],
)
def test_http_refuses_oversized_lists_naming_the_field(model, base, fields, param):
    with pytest.raises(APIError) as info:
        model.model_validate({**base, **fields}).sampling_params(16)
    error = info.value
    assert error.status == 400 and error.body["error"]["param"] == param
    assert str(MAX_LOGIT_BIAS if param == "logit_bias" else MAX_ALLOWED_TOKEN_IDS) in error.body["error"]["message"]


def test_http_accepts_the_bounds_and_dedupes_allowed_ids():
    bias = {str(i): 1.0 for i in range(MAX_LOGIT_BIAS)}
    allowed = [9, 4, 9, 9, 4, 7]
    params = CompletionRequest.model_validate(
        {"prompt": "a", "logit_bias": bias, "allowed_token_ids": allowed}
    ).sampling_params(16)
    assert len(params.logit_bias) == MAX_LOGIT_BIAS and params.allowed_token_ids == [9, 4, 7]
    full = CompletionRequest.model_validate(
        {"prompt": "a", "allowed_token_ids": list(range(MAX_ALLOWED_TOKEN_IDS))}
    ).sampling_params(16)
    assert len(full.allowed_token_ids) == MAX_ALLOWED_TOKEN_IDS


def test_grpc_refuses_oversized_lists_and_dedupes():
    with pytest.raises(APIError) as info:
        sampling_from_proto(pb.SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}))
    assert info.value.status == 400 and info.value.body["error"]["param"] == "sampling_params.logit_bias"
    with pytest.raises(APIError) as info:
        sampling_from_proto(pb.SamplingParams(allowed_token_ids=[3] * (MAX_ALLOWED_TOKEN_IDS + 1)))
    assert info.value.body["error"]["param"] == "sampling_params.allowed_token_ids"
    assert sampling_from_proto(pb.SamplingParams(allowed_token_ids=[3, 3, 1])).allowed_token_ids == [3, 1]
    assert sampling_from_proto(pb.SamplingParams(logit_bias={2: 1.0})).allowed_token_ids is None
