"""OpenAI's Responses API (`/v1/responses`) against the router suite's app, read with the
official client's types: the same answer as the chat endpoint for the same conversation,
streamed events in order, chained and stored responses, and refusals naming the field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

GREEDY = {"temperature": 0, "ignore_eos": True}


def post(server, path, body):
    return httpx.post(server.base_url + path, headers=server.headers(), json=body, timeout=60)


def respond(server, **body) -> dict:
    r = post(server, "/v1/responses", {"model": server.model, **GREEDY, **body})
    assert r.status_code == 200, r.text
    Response.model_validate(r.json())  # the official shape, strictly
    return r.json()


def chat(server, messages, **body) -> dict:
    r = post(server, "/v1/chat/completions", {"model": server.model, "messages": messages, **GREEDY, **body})
    assert r.status_code == 200, r.text
    return r.json()


def text_of(response: dict) -> str:
    return "".join(
        part["text"] for item in response["output"] if item["type"] != "function_call" for part in item["content"]
    )


def test_a_response_is_the_chat_answer_to_the_same_conversation(server):
    r = respond(server, input="Name a colour.", instructions="Be brief.", max_output_tokens=6)
    c = chat(
        server,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
        max_tokens=6,
    )
    assert text_of(r) == c["choices"][0]["message"]["content"]
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert r["usage"]["input_tokens"] == c["usage"]["prompt_tokens"] and r["usage"]["output_tokens"] == 6
    assert r["output"][0]["role"] == "assistant" and r["id"].startswith("resp_")
    # Message items with text parts, and the official client reading it.
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
    ]
    assert text_of(respond(server, input=items, max_output_tokens=6)) == text_of(r)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key, max_retries=0, timeout=60)
    parsed = client.responses.create(
        model=server.model,
        input="Name a colour.",
        instructions="Be brief.",
        max_output_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert parsed.output_text == text_of(r)
    server.wait_idle()


def test_streamed_events_come_in_order_and_add_up_to_the_answer(server):
    whole = respond(server, input="Say hi.", max_output_tokens=8)
    adapter = TypeAdapter(ResponseStreamEvent)
    events = []
    with httpx.stream(
        "POST",
        server.base_url + "/v1/responses",
        headers=server.headers(),
        timeout=60,
        json={"model": server.model, "input": "Say hi.", "max_output_tokens": 8, "stream": True, **GREEDY},
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(adapter.validate_python(json.loads(line[6:])))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == text_of(whole) == events[-4].text
    final = events[-1].response
    assert final.output_text == deltas and final.usage.output_tokens == 8
    # The official client's streaming reader.
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key, max_retries=0, timeout=60)
    stream = client.responses.create(
        model=server.model,
        input="Say hi.",
        max_output_tokens=8,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(e.delta for e in stream if e.type == "response.output_text.delta") == deltas
    server.wait_idle()


def test_previous_response_id_continues_the_stored_conversation(server):
    first = respond(server, input="Pick a number.", instructions="Only digits.", max_output_tokens=4)
    second = respond(server, input="Another one?", previous_response_id=first["id"], max_output_tokens=4)
    # Instructions are not carried over (OpenAI's rule); the earlier turns are.
    c = chat(
        server,
        [
            {"role": "user", "content": "Pick a number."},
            {"role": "assistant", "content": text_of(first)},
            {"role": "user", "content": "Another one?"},
        ],
        max_tokens=4,
    )
    assert text_of(second) == c["choices"][0]["message"]["content"]
    assert second["usage"]["input_tokens"] == c["usage"]["prompt_tokens"]
    assert second["previous_response_id"] == first["id"]
    got = httpx.get(f"{server.base_url}/v1/responses/{first['id']}", headers=server.headers(), timeout=30)
    assert got.status_code == 200 and got.json() == first
    assert httpx.get(f"{server.base_url}/v1/responses/{first['id']}", timeout=30).status_code == 401
    assert (
        httpx.delete(f"{server.base_url}/v1/responses/{first['id']}", headers=server.headers(), timeout=30).json()[
            "deleted"
        ]
        is True
    )
    gone = httpx.get(f"{server.base_url}/v1/responses/{first['id']}", headers=server.headers(), timeout=30)
    assert gone.status_code == 404 and "not found" in gone.json()["error"]["message"]
    unstored = respond(server, input="Hi", store=False, max_output_tokens=2)
    r = post(server, "/v1/responses", {"model": server.model, "input": "Hi", "previous_response_id": unstored["id"]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    server.wait_idle()


def test_text_format_json_schema_is_chat_s_response_format(server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    r = respond(
        server,
        input="As JSON",
        max_output_tokens=24,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "r", "schema": schema, "strict": True}},
    )
    c = chat(
        server,
        [{"role": "user", "content": "As JSON"}],
        max_tokens=24,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}},
    )
    assert text_of(r) == c["choices"][0]["message"]["content"]
    assert r["text"]["format"]["type"] == "json_schema"
    if r["status"] == "completed":  # the random model may spend its tokens on whitespace
        assert isinstance(json.loads(text_of(r))["ok"], bool)


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
    },
}
TIME = {
    "type": "function",
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]},
}
ASK = "What is the weather in Paris?"


def test_function_tools_call_stream_and_loop_as_chat_does(server):
    """Function tools: a forced call is a function_call item whose arguments fit the schema,
    the call chat makes for the same conversation; streamed, the typed events add up to it; the
    call's output sent back (as input items, or after previous_response_id) is answered as chat
    answers the same tool turn."""
    import jsonschema

    sampling = {"temperature": 1.0, "seed": 11, "max_output_tokens": 60, "ignore_eos": False}
    forced = {"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "name": "get_weather"}}
    r = respond(server, input=ASK, **forced, **sampling)
    assert r["status"] == "completed" and [i["type"] for i in r["output"]] == ["function_call"], r
    call = r["output"][0]
    assert call["name"] == "get_weather" and call["call_id"].startswith("call_")
    jsonschema.validate(json.loads(call["arguments"]), WEATHER["parameters"])
    assert r["tools"] == [WEATHER, TIME] and r["tool_choice"] == forced["tool_choice"]
    chat_tools = [
        {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in (WEATHER, TIME)
    ]
    c = chat(
        server,
        [{"role": "user", "content": ASK}],
        tools=chat_tools,
        temperature=1.0,
        seed=11,
        max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        ignore_eos=False,
    )
    assert c["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == call["arguments"]

    adapter = TypeAdapter(ResponseStreamEvent)
    with httpx.stream(
        "POST",
        server.base_url + "/v1/responses",
        headers=server.headers(),
        timeout=60,
        json={"model": server.model, "input": ASK, "stream": True, **forced, **sampling},
    ) as s:
        assert s.status_code == 200
        events = [adapter.validate_python(json.loads(line[6:])) for line in s.iter_lines() if line.startswith("data: ")]
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == events[-3].arguments == call["arguments"] == events[-1].response.output[0].arguments

    # The loop: the call's result goes back; the answer equals chat's for the same turns.
    result = {"type": "function_call_output", "call_id": call["call_id"], "output": "18 C, sunny"}
    items = [{"role": "user", "content": ASK}, {k: call[k] for k in ("type", "call_id", "name", "arguments")}, result]
    answer = respond(server, input=items, tools=[WEATHER, TIME], max_output_tokens=6)
    turns = [
        {"role": "user", "content": ASK},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call["call_id"],
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call["arguments"]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call["call_id"], "content": "18 C, sunny"},
    ]
    expected = chat(server, turns, tools=chat_tools, max_tokens=6)["choices"][0]["message"]["content"]
    assert text_of(answer) == expected
    chained = respond(server, input=[result], previous_response_id=r["id"], tools=[WEATHER, TIME], max_output_tokens=6)
    assert text_of(chained) == expected
    # The official client reads the call.
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key, max_retries=0, timeout=60)
    got = client.responses.create(
        model=server.model,
        input=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        max_output_tokens=160,
        extra_body={"seed": 5},
    )
    calls = [o for o in got.output if o.type == "function_call"]
    if got.status == "completed":  # (160 tokens may not close the array)
        assert len(calls) == 1 and calls[0].name in ("get_weather", "get_time")
    server.wait_idle()


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": [{"type": "computer_call_output", "call_id": "c", "output": "x"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
            "input[0].content",
        ),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input[0].output"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "r"}}}, "text.format.schema"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "max_output_tokens": 100_000_000}, "max_output_tokens"),
        ({"input": 5}, "input"),
        ({"input": "hi", "previous_response_id": "resp_nope"}, "previous_response_id"),
    ],
)
def test_what_cannot_be_answered_is_refused_naming_the_field(server, body, param):
    r = post(server, "/v1/responses", {"model": server.model, **body})
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.json()
    if param == "max_output_tokens":  # the message names the field this API has
        assert "max_output_tokens" in r.json()["error"]["message"] and "max_tokens" not in r.json()["error"]["message"]
    assert text_of(respond(server, input="hi", max_output_tokens=2))
    server.wait_idle()
