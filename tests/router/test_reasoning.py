"""--reasoning-parser end to end: the router suite's app runs with `qwen3`; a regex makes the
tiny model write a <think> block, which arrives as reasoning_content (and reasoning) on chat,
streamed or not, on gRPC Chat, and as a reasoning item on the Responses API."""

from __future__ import annotations

import json
import re

import grpc
import httpx
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from fleetserve.router.grpc.proto import fleetserve_pb2 as pb
from fleetserve.router.grpc.proto import fleetserve_pb2_grpc as pb_grpc

REGEX = "<think>[a-z]{3,6}</think>[a-z]{3,6}"
MESSAGES = [{"role": "user", "content": "Think, then answer."}]
BODY = {"messages": MESSAGES, "max_tokens": 40, "temperature": 0, "structured_outputs": {"regex": REGEX}}


def post(server, path, body):
    r = httpx.post(server.base_url + path, headers=server.headers(), timeout=60, json={"model": server.model, **body})
    assert r.status_code == 200, r.text
    return r.json()


def sse(server, path, body) -> list[dict]:
    with httpx.stream(
        "POST",
        server.base_url + path,
        headers=server.headers(),
        timeout=60,
        json={"model": server.model, **body, "stream": True},
    ) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_thinking_is_split_off_on_chat_streamed_or_not_and_on_grpc(server):
    whole = post(server, "/v1/chat/completions", BODY)
    message = whole["choices"][0]["message"]
    raw = "<think>" + message["reasoning_content"] + "</think>" + message["content"]
    assert re.fullmatch(REGEX, raw), message
    assert message["reasoning"] == message["reasoning_content"]
    chunks = sse(server, "/v1/chat/completions", BODY)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    assert all("<think>" not in (d.get("content") or "") + d.get("reasoning_content", "") for d in deltas)
    meta = (("application", server.app), ("authorization", f"Bearer {server.api_key}"))
    with grpc.insecure_channel(server.grpc_target) as channel:
        msgs = list(
            pb_grpc.FleetServeStub(channel).Chat(
                pb.ChatRequest(
                    messages=[pb.ChatMessage(role="user", content=MESSAGES[0]["content"])],
                    sampling_params=pb.SamplingParams(
                        max_tokens=40, temperature=0.0, structured_outputs=pb.StructuredOutputs(regex=REGEX)
                    ),
                ),
                metadata=meta,
                timeout=60,
            )
        )
    assert "".join(m.reasoning_content for m in msgs) == message["reasoning_content"]
    assert "".join(m.content for m in msgs) == message["content"]
    # Output that does not open with <think> is all content, untouched (every other chat test).
    plain = post(
        server,
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, "structured_outputs": {"regex": "[a-z]{4}"}},
    )
    assert plain["choices"][0]["message"]["reasoning_content"] is None
    assert len(plain["choices"][0]["message"]["content"]) == 4
    server.wait_idle()


def test_responses_api_returns_a_reasoning_item_then_the_message(server):
    body = {
        "input": MESSAGES[0]["content"],
        "max_output_tokens": 40,
        "temperature": 0,
        "structured_outputs": {"regex": REGEX},
    }
    chat = post(server, "/v1/chat/completions", BODY)["choices"][0]["message"]
    r = post(server, "/v1/responses", body)
    Response.model_validate(r)
    assert [item["type"] for item in r["output"]] == ["reasoning", "message"]
    assert r["output"][0]["content"][0]["text"] == chat["reasoning_content"]
    assert r["output"][1]["content"][0]["text"] == chat["content"]
    adapter = TypeAdapter(ResponseStreamEvent)
    events = [adapter.validate_python(e) for e in sse(server, "/v1/responses", body)]
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == chat["reasoning_content"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == chat["content"]
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1]
    assert [i.type for i in events[-1].response.output] == ["reasoning", "message"]
    server.wait_idle()
