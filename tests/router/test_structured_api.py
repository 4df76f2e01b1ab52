"""Structured outputs and tool calls over HTTP with the official `openai` client (tiny
random model: only the constraint makes the output parse)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "population": {"type": "integer", "minimum": 0, "maximum": 1000},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]},
    },
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key, max_retries=0, timeout=120)


def test_chat_response_format_json_schema(client, server):
    r = client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        n=4,
        temperature=1.0,
        seed=3,
        max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}},
    )
    stopped = [c for c in r.choices if c.finish_reason == "stop"]
    assert stopped
    for c in stopped:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_chat_json_object_and_completion_fields(client, server):
    r = client.chat.completions.create(
        model=server.model, messages=MESSAGES, n=3, seed=1, max_tokens=60, response_format={"type": "json_object"}
    )
    for c in r.choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), (dict, list))
    choice = client.completions.create(
        model=server.model, prompt="Pick one:", max_tokens=10, extra_body={"guided_choice": ["red", "green", "blue"]}
    )
    assert choice.choices[0].text in ("red", "green", "blue")
    assert choice.choices[0].finish_reason == "stop"
    texts = {}
    for chunk in client.completions.create(
        model=server.model,
        prompt="Code:",
        max_tokens=12,
        n=2,
        seed=4,
        stream=True,
        extra_body={"structured_outputs": {"regex": "[A-F]{2}-[0-9]{1,3}"}},
    ):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert all(re.fullmatch("[A-F]{2}-[0-9]{1,3}", t) for t in texts.values()), texts


@pytest.mark.parametrize(
    "extra,param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "structured_outputs.json",
        ),
        ({"guided_regex": "a(b"}, "structured_outputs.regex"),
        # A pattern xgrammar's schema front end converts in quadratic time (8 s for this one).
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"pattern": "a{1,10000}"}},
                }
            },
            "response_format",
        ),
        ({"guided_json": {"type": "string", "pattern": "[a-z]{1000}[0-9]{1000}[a-z]{1000}[0-9]{1001}"}}, "guided_json"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex"),
        ({"guided_grammar": "root ::= nothing"}, "structured_outputs.grammar"),
        ({"response_format": {"type": "json_object"}, "guided_choice": ["b"]}, "guided_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_bad_constraints_are_400(client, server, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=4, extra_body=extra)
    assert e.value.body["param"] == param, e.value.body


def test_named_tool_call_valid_for_any_model(client, server):
    kw = dict(
        model=server.model,
        messages=MESSAGES,
        tools=[WEATHER, TIME],
        temperature=1.0,
        seed=11,
        max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # Streamed: the header, then the arguments in pieces; the same call once put together.
    args, names, finish = "", [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                names += [d.function.name] if d.function.name else []
                args += d.function.arguments or ""
            finish = ch.finish_reason or finish
    assert names == ["get_weather"] and args == call.function.arguments and finish == "tool_calls"


def test_required_tool_calls(client, server):
    kw = dict(
        model=server.model,
        messages=MESSAGES,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        max_tokens=160,
        n=6,
        seed=5,
    )
    r = client.chat.completions.create(**kw)
    done = [c for c in r.choices if c.finish_reason == "tool_calls"]
    assert done
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for c in done:
        assert c.message.content is None and len(c.message.tool_calls) == 1  # not parallel
        for call in c.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    streamed = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                streamed.setdefault(ch.index, []).append((d.function.name, d.function.arguments))
    for c in done:
        assert streamed[c.index] == [(t.function.name, t.function.arguments) for t in c.message.tool_calls]


def test_auto_and_none_answer_in_text(client, server):
    """The tiny model's ChatML template has no tool format: auto renders nothing extra, and
    its random text has no <tool_call> tags, so the answer is content."""
    for choice in ("auto", "none"):
        r = client.chat.completions.create(
            model=server.model,
            messages=MESSAGES,
            tools=[WEATHER],
            tool_choice=choice,
            max_tokens=5,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        c = r.choices[0]
        assert isinstance(c.message.content, str) and not c.message.tool_calls
        assert c.finish_reason == "length"
    server.wait_idle()
