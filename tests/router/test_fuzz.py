"""Property-based fuzzing of the HTTP and gRPC APIs (hypothesis): every field of the request
models (their pydantic schemas: the HTTP routes parse bodies themselves, so the OpenAPI
document has no request schemas to generate from) gets hostile values; gRPC gets random
field values and random bytes. Never a 5xx / INTERNAL / UNKNOWN, never a hang, and the
server serves afterwards with no leaked block. A bounded number of examples here; raise
FLEETSERVE_FUZZ_EXAMPLES for a soak."""

from __future__ import annotations

import json
import os

import grpc
import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetserve.router.api.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from fleetserve.router.grpc.proto import fleetserve_pb2 as pb
from fleetserve.router.grpc.proto import fleetserve_pb2_grpc as pb_grpc

EXAMPLES = int(os.environ.get("FLEETSERVE_FUZZ_EXAMPLES", "40"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))

_text = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=40)
_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.floats(allow_nan=True, allow_infinity=True), _text
)
_hostile = st.recursive(
    _scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(_text, inner, max_size=4)),
    max_leaves=12,
)
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "robot", 3]), "content": _hostile})

ENDPOINTS = {
    "/v1/completions": (CompletionRequest, {"prompt": "hello", "max_tokens": 3}),
    "/v1/chat/completions": (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
    "/tokenize": (TokenizeRequest, {"prompt": "hello"}),
}


@st.composite
def _bodies(draw):
    path = draw(st.sampled_from(sorted(ENDPOINTS)))
    model, base = ENDPOINTS[path]
    body = dict(base)
    for name in draw(st.lists(st.sampled_from(sorted(model.model_fields)), max_size=4, unique=True)):
        body[name] = draw(
            st.lists(_message, min_size=1, max_size=2) if name == "messages" and draw(st.booleans()) else _hostile
        )
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
        body["max_tokens"] = 8  # keep generation short: this is about validation
    return path, body


def test_http_fuzz_never_5xx(server):
    client = httpx.Client(base_url=server.base_url, headers=server.headers(), timeout=60)

    @FUZZ
    @given(_bodies())
    def check(case):
        path, body = case
        raw = json.dumps(body, allow_nan=True).encode()
        r = client.post(path, content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code < 500, (path, body, r.status_code, r.text[:300])
        if r.status_code >= 400:
            assert r.json()["error"]["message"]

    check()
    client.close()
    _serves(server)


_sampling = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.integers(-(1 << 31), 8),
        "temperature": st.floats(width=32),
        "top_p": st.floats(width=32),
        "top_k": st.integers(-(1 << 31), (1 << 31) - 1),
        "min_p": st.floats(width=32),
        "seed": st.integers(-(1 << 63), (1 << 63) - 1),
        "presence_penalty": st.floats(width=32),
        "repetition_penalty": st.floats(width=32),
        "stop": st.lists(_text, max_size=3),
        "stop_token_ids": st.lists(st.integers(-(1 << 31), (1 << 31) - 1), max_size=3),
        "logprobs": st.integers(-(1 << 31), (1 << 31) - 1),
        "n": st.integers(-(1 << 31), 200),
        "min_tokens": st.integers(-(1 << 31), (1 << 31) - 1),
    },
)
_BAD_CODES = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED)


def _utf8(s: str) -> str:
    return s.encode("utf-8", "replace").decode("utf-8")  # protobuf strings must be UTF-8


def test_grpc_fuzz_never_internal(server):
    meta = (("application", server.app), ("authorization", f"Bearer {server.api_key}"))
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.FleetServeStub(channel)
        raw = channel.unary_stream(
            "/fleetserve.v1.FleetServe/Generate", request_serializer=lambda b: b, response_deserializer=lambda b: b
        )

        @FUZZ
        @given(
            _sampling,
            _text,
            st.lists(st.integers(-(1 << 31), (1 << 31) - 1), max_size=5),
            st.booleans(),
            st.binary(max_size=64),
        )
        def check(sampling, prompt, ids, use_ids, garbage):
            sampling = {k: ([_utf8(s) for s in v] if k == "stop" else v) for k, v in sampling.items()}
            req = pb.GenerateRequest(sampling_params=pb.SamplingParams(**sampling))
            if use_ids:
                req.prompt_token_ids.ids.extend(ids)
            else:
                req.prompt = _utf8(prompt)
            for call in (
                lambda: list(stub.Generate(req, metadata=meta, timeout=60)),
                lambda: list(raw(garbage, metadata=meta, timeout=60)),
            ):
                try:
                    call()
                except grpc.RpcError as e:
                    assert e.code() not in _BAD_CODES, (sampling, e.code(), e.details())

        check()
    _serves(server)


_json_text = st.one_of(_text, _hostile.map(lambda v: json.dumps(v, allow_nan=True)))


@st.composite
def _chat_requests(draw):
    sampling = {k: ([_utf8(s) for s in v] if k == "stop" else v) for k, v in draw(_sampling).items()}
    if sampling.get("max_tokens", 0) > 4 or "max_tokens" not in sampling:
        sampling["max_tokens"] = 4  # this is about validation
    messages = [
        pb.ChatMessage(
            role=_utf8(draw(st.sampled_from(["user", "assistant", "tool", "robot", ""]))), content=_utf8(draw(_text))
        )
        for _ in range(draw(st.integers(0, 2)))
    ]
    tools = [
        pb.Tool(function=pb.FunctionDefinition(name=_utf8(draw(_text)), parameters=_utf8(draw(_json_text))))
        for _ in range(draw(st.integers(0, 2)))
    ]
    req = pb.ChatRequest(messages=messages, tools=tools, sampling_params=pb.SamplingParams(**sampling))
    choice = draw(
        st.one_of(
            st.none(),
            st.sampled_from(["none", "auto", "required", "x"]).map(lambda m: pb.ToolChoice(mode=m)),
            _text.map(lambda n: pb.ToolChoice(function_name=_utf8(n))),
        )
    )
    if choice is not None:
        req.tool_choice.CopyFrom(choice)
    if draw(st.booleans()):
        req.response_format.CopyFrom(
            pb.ResponseFormat(
                type=draw(st.sampled_from(["text", "json_object", "json_schema", "xml"])),
                schema=_utf8(draw(_json_text)),
            )
        )
    return req


def test_grpc_chat_fuzz_never_internal(server):
    meta = (("application", server.app), ("authorization", f"Bearer {server.api_key}"))
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.FleetServeStub(channel)
        raw = channel.unary_stream(
            "/fleetserve.v1.FleetServe/Chat", request_serializer=lambda b: b, response_deserializer=lambda b: b
        )

        @FUZZ
        @given(_chat_requests(), st.binary(max_size=64))
        def check(req, garbage):
            for call in (
                lambda: list(stub.Chat(req, metadata=meta, timeout=60)),
                lambda: list(raw(garbage, metadata=meta, timeout=60)),
            ):
                try:
                    call()
                except grpc.RpcError as e:
                    assert e.code() not in _BAD_CODES, (req, e.code(), e.details())

        check()
    _serves(server)


def _serves(server):
    r = httpx.post(
        server.base_url + "/v1/completions",
        headers=server.headers(),
        timeout=60,
        json={"prompt": "still serving?", "max_tokens": 3, "ignore_eos": True},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    server.wait_idle()
