"""The tool-call plan, Hermes parser and streaming deltas (pure functions)."""

import json

import jsonschema
import pytest

from fleetserve.router.api.errors import APIError
from fleetserve.router.api.tool_calls import NamedToolChoice, Tool, ToolDeltas, ToolPlan, parse_hermes

TOOLS = [
    Tool.model_validate(
        {
            "function": {
                "name": "add",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"],
                },
            }
        }
    ),
    Tool.model_validate({"function": {"name": "now"}}),
]


def test_plan_modes_and_errors():
    assert ToolPlan.of(TOOLS, "none") is None and ToolPlan.of(None, None) is None
    assert ToolPlan.of(TOOLS, None).mode == "auto"
    named = ToolPlan.of(TOOLS, NamedToolChoice.model_validate({"function": {"name": "add"}}))
    assert named.structured_outputs().json == TOOLS[0].function.parameters
    required = ToolPlan.of(TOOLS, "required").structured_outputs().json
    call = [{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "now", "parameters": {}}]
    jsonschema.validate(call, required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "add", "parameters": {}}], required)
    assert ToolPlan.of(TOOLS, "required", parallel=False).structured_outputs().json["maxItems"] == 1
    with pytest.raises(APIError):
        ToolPlan.of(TOOLS, NamedToolChoice.model_validate({"function": {"name": "sub"}}))
    with pytest.raises(APIError):
        ToolPlan.of(TOOLS + TOOLS[:1], "auto")
    content, calls = ToolPlan.of(TOOLS, "required").parse(json.dumps(call))
    assert content is None and [c["function"]["name"] for c in calls] == ["add", "now"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}


def test_hermes_parser():
    text = (
        'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    )
    content, calls = parse_hermes(text)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("add", {"a": 1, "b": 2}),
        ("now", {}),
    ]
    assert parse_hermes("plain answer") == ("plain answer", [])
    broken = "<tool_call>{not json}</tool_call>"
    assert parse_hermes(broken) == (broken, [])


def test_auto_stream_holds_back_the_tag():
    deltas = ToolDeltas(ToolPlan.of(TOOLS, "auto"))
    pieces = ["Sure", ". <tool", '_call>{"name": "now", ', '"arguments": {}}</tool_call>']
    out = [deltas.delta(0, p, False) for p in pieces]
    sent = "".join(d.get("content", "") for d, _ in out)
    assert sent == "Sure. "  # nothing of the tag leaked
    final, called = deltas.delta(0, "", True)
    assert called and final["tool_calls"][0]["function"]["name"] == "now" and "content" not in final
    plain = ToolDeltas(ToolPlan.of(TOOLS, "auto"))
    got = [plain.delta(0, p, False)[0].get("content", "") for p in ["a <", "b"]] + [
        plain.delta(0, "", True)[0].get("content", "")
    ]
    assert "".join(got) == "a <b"
