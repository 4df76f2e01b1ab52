"""The fleetserve.v1 gRPC service through Ray Serve's gRPC proxy, with a grpcio client."""

from __future__ import annotations

import grpc
import pytest

from fleetserve.router.grpc.proto import fleetserve_pb2 as pb
from fleetserve.router.grpc.proto import fleetserve_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.grpc_target) as channel:
        yield pb_grpc.FleetServeStub(channel)


def meta(server, key=None):
    return (("application", server.app), ("authorization", f"Bearer {key or server.api_key}"))


def test_generate_streams_prompt(stub, server):
    req = pb.GenerateRequest(
        prompt="Hello there", sampling_params=pb.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    )
    msgs = list(stub.Generate(req, metadata=meta(server), timeout=60))
    assert len(msgs) >= 2  # streamed, not one blob
    assert msgs[-1].finish_reason == "length" and msgs[-1].completion_tokens == 6
    assert sum(len(m.token_ids) for m in msgs) == 6
    assert all(m.prompt_tokens > 0 for m in msgs)


def test_generate_token_ids_matches_http_greedy(stub, server):
    import httpx

    ids = httpx.post(
        server.base_url + "/tokenize", headers=server.headers(), json={"prompt": "The quick brown fox"}
    ).json()["tokens"]
    req = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=ids),
        sampling_params=pb.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
    )
    grpc_text = "".join(m.text for m in stub.Generate(req, metadata=meta(server), timeout=60))
    http_text = httpx.post(
        server.base_url + "/v1/completions",
        headers=server.headers(),
        timeout=60,
        json={"prompt": ids, "max_tokens": 5, "temperature": 0, "ignore_eos": True},
    ).json()["choices"][0]["text"]
    assert grpc_text == http_text


def test_health_and_list_models(stub, server):
    assert stub.Health(pb.HealthRequest(), metadata=meta(server), timeout=30).ok
    models = stub.ListModels(pb.ListModelsRequest(), metadata=meta(server), timeout=30).models
    # every --served-model-name, in order, then the LoRA adapters
    assert [m.id for m in models] == [server.model, "tiny-chat", "tiny-lora-a", "tiny-lora-b"]
    assert models[0].max_model_len == server.config.engine.max_model_len


@pytest.mark.parametrize(
    "request_kwargs,code",
    [
        ({"prompt": "x", "sampling_params": pb.SamplingParams(max_tokens=0)}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"prompt": "x", "sampling_params": pb.SamplingParams(temperature=-1)}, grpc.StatusCode.INVALID_ARGUMENT),
        ({}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"prompt": "word " * 2500}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"prompt": "x", "model": "nope"}, grpc.StatusCode.NOT_FOUND),
    ],
)
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
    req = pb.GenerateRequest(
        prompt="cancel me " * 5, sampling_params=pb.SamplingParams(max_tokens=200, ignore_eos=True)
    )
    call = stub.Generate(req, metadata=meta(server), timeout=60)
    next(call)
    call.cancel()
    server.wait_idle()


def test_generate_structured_outputs_and_logit_bias(stub, server):
    """The constraint fields of SamplingParams: the output is one of the choices / matches."""
    import re

    choice = pb.StructuredOutputs(choice=pb.Choices(values=["north", "south"]))
    msgs = list(
        stub.Generate(
            pb.GenerateRequest(
                prompt="Go", sampling_params=pb.SamplingParams(max_tokens=10, structured_outputs=choice)
            ),
            metadata=meta(server),
            timeout=60,
        )
    )
    assert "".join(m.text for m in msgs) in ("north", "south") and msgs[-1].finish_reason == "stop"
    regex = pb.StructuredOutputs(regex="[0-9]{4}")
    text = "".join(
        m.text
        for m in stub.Generate(
            pb.GenerateRequest(
                prompt="Year", sampling_params=pb.SamplingParams(max_tokens=10, seed=2, structured_outputs=regex)
            ),
            metadata=meta(server),
            timeout=60,
        )
    )
    assert re.fullmatch("[0-9]{4}", text)
    with pytest.raises(grpc.RpcError) as e:
        list(
            stub.Generate(
                pb.GenerateRequest(
                    prompt="x", sampling_params=pb.SamplingParams(structured_outputs=pb.StructuredOutputs(regex="a(b"))
                ),
                metadata=meta(server),
                timeout=60,
            )
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "regular expression" in e.value.details()


# ---- Chat ------------------------------------------------------------------------

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
}
TIME_PARAMS = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}


def _tools():
    import json

    return [
        pb.Tool(
            function=pb.FunctionDefinition(
                name="get_weather", description="Weather in a city", parameters=json.dumps(WEATHER_PARAMS)
            )
        ),
        pb.Tool(function=pb.FunctionDefinition(name="get_time", parameters=json.dumps(TIME_PARAMS))),
    ]


def _chat(stub, server, **kwargs):
    kwargs.setdefault("messages", [pb.ChatMessage(role="user", content="What is the weather in Paris?")])
    return list(stub.Chat(pb.ChatRequest(**kwargs), metadata=meta(server), timeout=120))


def _calls(msgs, index=0):
    """Tool-call deltas of one choice put together: [(id, name, arguments)]."""
    calls: dict[int, list] = {}
    for m in msgs:
        if m.index != index:
            continue
        for d in m.tool_calls:
            call = calls.setdefault(d.index, [d.id, d.function.name, ""])
            call[2] += d.function.arguments
    return [tuple(calls[i]) for i in sorted(calls)]


def test_chat_plain_matches_http(stub, server):
    """Chat renders the chat template and samples as /v1/chat/completions does."""
    import httpx

    msgs = _chat(
        stub,
        server,
        sampling_params=pb.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
        request_id="mine",
    )
    assert len(msgs) >= 2 and msgs[0].role == "assistant" and all(m.request_id == "mine" for m in msgs)
    assert msgs[-1].finish_reason == "length" and msgs[-1].completion_tokens == 6
    assert sum(len(m.token_ids) for m in msgs) == 6 and not any(m.tool_calls for m in msgs)
    http = httpx.post(
        server.base_url + "/v1/chat/completions",
        headers=server.headers(),
        timeout=60,
        json={
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
        },
    ).json()
    assert "".join(m.content for m in msgs) == http["choices"][0]["message"]["content"]
    assert msgs[-1].prompt_tokens == http["usage"]["prompt_tokens"]


def test_chat_named_tool_call_validates(stub, server):
    """A named tool_choice is constrained by the function's schema: the arguments validate
    whatever the (random) model, and equal what the HTTP endpoint gives for the same seed."""
    import json

    import httpx
    import jsonschema

    body = {
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [
            {
                "type": "function",
                "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER_PARAMS},
            },
            {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS}},
        ],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 60,
        "temperature": 1.0,
        "seed": 11,
    }
    # Both calls below must compute the prompt alike: with its blocks cached (prefix routing
    # sends both to the replica that holds them). A full prefill's float rounding differs from
    # a cached prefix's (other matmul shapes), enough to flip a temperature-1 draw.
    httpx.post(
        server.base_url + "/v1/chat/completions", headers=server.headers(), timeout=60, json={**body, "max_tokens": 1}
    ).raise_for_status()
    msgs = _chat(
        stub,
        server,
        tools=_tools(),
        tool_choice=pb.ToolChoice(function_name="get_weather"),
        sampling_params=pb.SamplingParams(max_tokens=60, temperature=1.0, seed=11),
    )
    assert msgs[-1].finish_reason == "tool_calls" and not "".join(m.content for m in msgs)
    ((call_id, name, arguments),) = _calls(msgs)
    assert call_id.startswith("call_") and name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMS)
    http = httpx.post(server.base_url + "/v1/chat/completions", headers=server.headers(), timeout=60, json=body).json()
    assert http["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == arguments


def test_chat_required_tool_calls_validate(stub, server):
    import json

    import jsonschema

    msgs = _chat(
        stub,
        server,
        tools=_tools(),
        tool_choice=pb.ToolChoice(mode="required"),
        parallel_tool_calls=False,
        sampling_params=pb.SamplingParams(max_tokens=160, temperature=1.0, seed=5, n=4),
    )
    finish = {m.index: m.finish_reason for m in msgs if m.finish_reason}
    assert sorted(finish) == [0, 1, 2, 3]
    done = [i for i, f in finish.items() if f == "tool_calls"]
    assert done
    schemas = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
    for i in done:
        (call,) = _calls(msgs, i)  # parallel_tool_calls=false: one call
        jsonschema.validate(json.loads(call[2]), schemas[call[1]])
        assert not "".join(m.content for m in msgs if m.index == i)


def test_chat_response_format_and_history(stub, server):
    """response_format json_schema on Chat; a history with an assistant tool call and a
    tool turn renders (the template gets them as OpenAI's shapes)."""
    import json

    import jsonschema

    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
        "required": ["ok", "n"],
    }
    history = [
        pb.ChatMessage(role="user", content="Weather?"),
        pb.ChatMessage(
            role="assistant",
            tool_calls=[
                pb.ToolCall(
                    id="call_1",
                    type="function",
                    function=pb.FunctionCall(name="get_weather", arguments='{"city": "Paris", "unit": "C"}'),
                )
            ],
        ),
        pb.ChatMessage(role="tool", tool_call_id="call_1", content="21"),
        pb.ChatMessage(role="user", content="As JSON"),
    ]
    msgs = _chat(
        stub,
        server,
        messages=history,
        sampling_params=pb.SamplingParams(max_tokens=80, temperature=1.0, seed=3, n=4),
        response_format=pb.ResponseFormat(type="json_schema", name="r", schema=json.dumps(schema)),
    )
    stopped = [m.index for m in msgs if m.finish_reason == "stop"]
    assert stopped  # the random model may spend its tokens on whitespace before one ends
    for i in stopped:
        jsonschema.validate(json.loads("".join(m.content for m in msgs if m.index == i)), schema)


@pytest.mark.parametrize(
    "request_kwargs,needle",
    [
        ({"messages": []}, "messages"),
        ({"messages": [pb.ChatMessage(role="robot", content="hi")]}, "messages.0.role"),
        ({"tools": "bad-json"}, "tools.0.function.parameters"),
        ({"tools": "ok", "tool_choice": pb.ToolChoice(function_name="nope")}, "not in tools"),
        ({"tool_choice": pb.ToolChoice(mode="required")}, "tool_choice needs tools"),
        ({"tool_choice": pb.ToolChoice(mode="sometimes")}, "tool_choice"),
        (
            {
                "tools": "ok",
                "tool_choice": pb.ToolChoice(mode="required"),
                "sampling_params": pb.SamplingParams(structured_outputs=pb.StructuredOutputs(regex="a+")),
            },
            "forced tool_choice",
        ),
        ({"response_format": pb.ResponseFormat(type="json_schema")}, "json_schema.schema"),
        (
            {
                "response_format": pb.ResponseFormat(type="json_object"),
                "sampling_params": pb.SamplingParams(structured_outputs=pb.StructuredOutputs(regex="a+")),
            },
            "not several",
        ),
        (
            {"response_format": pb.ResponseFormat(type="json_schema", schema='{"type": "nope"}')},
            "structured_outputs.json",
        ),
        ({"sampling_params": pb.SamplingParams(logprobs=2)}, "logprobs"),
        ({"sampling_params": pb.SamplingParams(temperature=-1)}, "temperature"),
        ({"sampling_params": pb.SamplingParams(max_tokens=10_000)}, "maximum context length"),
        ({"messages": [pb.ChatMessage(role="user", content="word " * 2500)]}, "context length"),
    ],
)
def test_chat_bad_input_then_serves(stub, server, request_kwargs, needle):
    """Bad input is INVALID_ARGUMENT naming the problem; the server answers the next Chat
    and holds no request or KV block afterwards."""
    kwargs = dict(request_kwargs)
    if kwargs.get("tools") == "ok":
        kwargs["tools"] = _tools()
    elif kwargs.get("tools") == "bad-json":
        kwargs["tools"] = [pb.Tool(function=pb.FunctionDefinition(name="f", parameters="{not json"))]
    with pytest.raises(grpc.RpcError) as e:
        _chat(stub, server, **kwargs)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert needle in e.value.details(), e.value.details()
    ok = _chat(stub, server, sampling_params=pb.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert ok[-1].finish_reason == "length"
    server.wait_idle()


def test_chat_cancelled_call_frees_blocks(stub, server):
    call = stub.Chat(
        pb.ChatRequest(
            messages=[pb.ChatMessage(role="user", content="cancel me " * 5)],
            sampling_params=pb.SamplingParams(max_tokens=200, ignore_eos=True),
        ),
        metadata=meta(server),
        timeout=60,
    )
    next(call)
    call.cancel()
    server.wait_idle()


def test_chat_unknown_model_and_bad_key(stub, server):
    with pytest.raises(grpc.RpcError) as e:
        _chat(stub, server, model="nope")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        list(
            stub.Chat(
                pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="hi")]),
                metadata=meta(server, key="wrong"),
                timeout=30,
            )
        )
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
