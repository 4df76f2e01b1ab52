"""OpenAI's Responses API (`POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`), text only.

A Responses request is a chat request in other words: `input` (a string, or message items
whose content is text) after `instructions` (a system message), plus, with
`previous_response_id`, the stored conversation of that response. `ResponsesRequest.to_chat`
turns it into the `ChatCompletionRequest` the chat endpoint runs (same chat template,
sampling, structured outputs, routing), and this module turns the engine's deltas back into
a `response` object or its stream of typed events (`response.created` ...
`response.output_text.delta` ... `response.completed`), shaped as the official client parses
them.

Stored responses (`store`, true by default as OpenAI's) live in the ingress's memory, the
newest `MAX_STORED` of them: enough to chain a conversation with `previous_response_id` or
fetch a result again, gone when the ingress restarts (as vLLM's in-memory store). Function
tools, images, files and reasoning items are refused with a 400 naming the field: with them
the answer could not be what the client asked for.
"""

from __future__ import annotations

import collections
import json
import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from fleetserve.router.errors import APIError, from_validation_error
from fleetserve.router.limits import MAX_MESSAGES
from fleetserve.router.protocol import ChatCompletionRequest, _SamplingRequest

MAX_STORED = 1024
_ROLES = ("user", "assistant", "system", "developer")


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None
    description: Optional[str] = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: Optional[TextFormat] = None


class ResponsesRequest(_SamplingRequest):
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    previous_response_id: Optional[str] = None
    store: StrictBool = True
    text: Optional[TextConfig] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    metadata: Optional[dict[str, str]] = None

    def _max_tokens(self) -> Optional[int]:
        return self.max_output_tokens if self.max_output_tokens is not None else self.max_tokens

    def input_messages(self) -> list[dict]:
        """`input` as chat messages (`{"role", "content"}` with text content)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        if len(self.input) > MAX_MESSAGES:
            raise APIError(f"input may hold at most {MAX_MESSAGES} items", 400, param="input")
        return [_message(i, item) for i, item in enumerate(self.input)]

    def to_chat(self, history: list[dict]) -> ChatCompletionRequest:
        if self.tools:
            raise APIError("tools are not supported on /v1/responses yet; use /v1/chat/completions "
                           "for function calling", 400, param="tools")
        if self.n != 1:
            raise APIError("n must be 1 on /v1/responses", 400, param="n")
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) \
            + history + self.input_messages()
        data = self.model_dump(exclude={"input", "instructions", "max_output_tokens", "previous_response_id",
                                        "store", "text", "tools", "tool_choice", "metadata", "stream",
                                        "stream_options", "max_tokens", "prompt_logprobs"}, exclude_none=True)
        data["messages"] = messages
        data["max_completion_tokens"] = self._max_tokens()
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            data["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise APIError("text.format.schema is required for json_schema", 400, param="text.format.schema")
            data["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name or "response", "schema": fmt.schema_,
                **({"strict": fmt.strict} if fmt.strict is not None else {})}}
        try:
            return ChatCompletionRequest.model_validate(data)
        except ValidationError as e:  # the mapped request names a chat field
            raise from_validation_error(e) from e


def _message(i: int, item: Any) -> dict:
    param = f"input[{i}]"
    if not isinstance(item, dict):
        raise APIError(f"{param} must be a message object", 400, param=param)
    kind = item.get("type", "message")
    if kind != "message":
        raise APIError(f"{param}: items of type {kind!r} are not supported; send text messages",
                       400, param=f"{param}.type")
    role = item.get("role")
    if role not in _ROLES:
        raise APIError(f"{param}.role must be one of {', '.join(_ROLES)}", 400, param=f"{param}.role")
    content = item.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                    or not isinstance(part.get("text"), str):
                raise APIError(f"{param}.content[{j}]: only text parts (input_text, output_text) are "
                               "supported", 400, param=f"{param}.content")
            parts.append(part["text"])
        text = "".join(parts)
    else:
        raise APIError(f"{param}.content must be a string or a list of text parts", 400,
                       param=f"{param}.content")
    return {"role": "system" if role == "developer" else role, "content": text}


class ResponseStore:
    """The newest `capacity` stored responses: id -> (response object, the conversation it
    ends: the messages it was given, without instructions, plus its answer)."""

    def __init__(self, capacity: int = MAX_STORED) -> None:
        self.capacity = capacity
        self._items: collections.OrderedDict[str, tuple[dict, list[dict]]] = collections.OrderedDict()

    def put(self, response: dict, conversation: list[dict]) -> None:
        self._items[response["id"]] = (response, conversation)
        self._items.move_to_end(response["id"])
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: Optional[str] = None) -> tuple[dict, list[dict]]:
        try:
            return self._items[response_id]
        except KeyError:
            raise APIError(f"Response with id '{response_id}' not found (responses are kept in "
                           f"memory, the newest {self.capacity}, until the server restarts).", 404,
                           param=param) from None

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._items[response_id]


_CHAT_NAMES = ("max_completion_tokens", "max_tokens")


def in_responses_terms(body: dict) -> dict:
    """An error body from the chat path, naming the Responses API's field: the length
    limit is `max_output_tokens` here, not chat's `max_tokens`."""
    error = body["error"]
    if error.get("param") not in _CHAT_NAMES:
        return body
    message = error["message"]
    for name in _CHAT_NAMES:
        message = message.replace(name, "max_output_tokens")
    return {**body, "error": {**error, "param": "max_output_tokens", "message": message}}


def new_ids() -> tuple[str, str]:
    """(response id, id stem of its output items: msg_<stem>, rs_<stem>)."""
    stem = uuid.uuid4().hex
    return f"resp_{stem}", stem


def output_items(stem: str, thought: Optional[str], text: Optional[str], status: str) -> list[dict]:
    """A reasoning item when there was thinking (a reasoning parser split it off), then the
    message, which is left out only when the output never got past its thinking."""
    items = []
    if thought:
        items.append(reasoning_item(stem, thought, status))
    if text or not thought:
        items.append(message_item(stem, text or "", status))
    return items


def response_object(rid: str, stem: str, req: ResponsesRequest, model: str, created: float,
                    output: Optional[tuple[Optional[str], Optional[str]]], finish_reason: Optional[str],
                    usage: Optional[dict], status: Optional[str] = None, error: Optional[dict] = None) -> dict:
    """The `response` object; `output`: (thinking, text), None before there is any."""
    if status is None:
        status = "incomplete" if finish_reason == "length" else "completed"
    items = [] if output is None else output_items(stem, output[0], output[1],
                                                  "completed" if status == "completed" else "incomplete")
    fmt = req.text.format if req.text is not None and req.text.format is not None else TextFormat()
    return {
        "id": rid, "object": "response", "created_at": created, "model": model, "status": status,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {}, "output": items, "parallel_tool_calls": True,
        "previous_response_id": req.previous_response_id, "store": req.store,
        "temperature": req.temperature, "top_p": req.top_p,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
        "tool_choice": "auto", "tools": [], "truncation": "disabled", "user": req.user,
        "usage": usage,
    }


def message_item(stem: str, text: str, status: str) -> dict:
    return {"type": "message", "id": f"msg_{stem}", "status": status, "role": "assistant",
            "content": [output_text(text)]}


def reasoning_item(stem: str, thought: str, status: str) -> dict:
    return {"type": "reasoning", "id": f"rs_{stem}", "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": thought}]}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


class EventWriter:
    """The stream's server-sent events, numbered (`sequence_number`) as the client expects.
    Output items open as their text comes: a reasoning item while the model thinks (with a
    reasoning parser), then the message; each is closed (its `.done` events) before the next
    opens, and the last at the end."""

    def __init__(self, rid: str, stem: str) -> None:
        self.rid, self.stem = rid, stem
        self._seq = 0
        self._index = -1  # output_index of the open item
        self._open: Optional[str] = None  # "reasoning" | "message"
        self._texts = {"reasoning": "", "message": ""}

    def event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"

    def start(self, response: dict) -> list[str]:
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def reasoning_delta(self, text: str) -> list[str]:
        out = [] if self._open == "reasoning" else self._close() + self._start("reasoning")
        self._texts["reasoning"] += text
        out.append(self.event("response.reasoning_text.delta", item_id=f"rs_{self.stem}",
                              output_index=self._index, content_index=0, delta=text))
        return out

    def delta(self, text: str) -> list[str]:
        out = [] if self._open == "message" else self._close() + self._start("message")
        self._texts["message"] += text
        out.append(self.event("response.output_text.delta", item_id=f"msg_{self.stem}",
                              output_index=self._index, content_index=0, delta=text, logprobs=[]))
        return out

    def finish(self, response: dict) -> list[str]:
        out = []
        if self._open != "message" and any(item["type"] == "message" for item in response["output"]):
            out += self._close() + self._start("message")
        out += self._close(response["status"])
        out.append(self.event("response.completed" if response["status"] == "completed"
                              else "response.incomplete", response=response))
        return out

    def fail(self, response: dict, error: dict) -> list[str]:
        return [self.event("error", code=error.get("code") or error.get("type"), message=error["message"],
                           param=error.get("param")),
                self.event("response.failed", response=response)]

    def _start(self, kind: str) -> list[str]:
        self._open, self._index = kind, self._index + 1
        if kind == "reasoning":
            item = {"type": "reasoning", "id": f"rs_{self.stem}", "status": "in_progress", "summary": [],
                    "content": []}
            return [self.event("response.output_item.added", output_index=self._index, item=item)]
        item = {"type": "message", "id": f"msg_{self.stem}", "status": "in_progress", "role": "assistant",
                "content": []}
        return [self.event("response.output_item.added", output_index=self._index, item=item),
                self.event("response.content_part.added", item_id=f"msg_{self.stem}",
                           output_index=self._index, content_index=0, part=output_text(""))]

    def _close(self, status: str = "completed") -> list[str]:
        kind, self._open = self._open, None
        if kind is None:
            return []
        text = self._texts[kind]
        done = "completed" if status == "completed" else "incomplete"
        if kind == "reasoning":
            item_id = f"rs_{self.stem}"
            return [self.event("response.reasoning_text.done", item_id=item_id, output_index=self._index,
                               content_index=0, text=text),
                    self.event("response.output_item.done", output_index=self._index,
                               item=reasoning_item(self.stem, text, done))]
        item_id = f"msg_{self.stem}"
        return [self.event("response.output_text.done", item_id=item_id, output_index=self._index,
                           content_index=0, text=text, logprobs=[]),
                self.event("response.content_part.done", item_id=item_id, output_index=self._index,
                           content_index=0, part=output_text(text)),
                self.event("response.output_item.done", output_index=self._index,
                           item=message_item(self.stem, text, done))]


def now() -> float:
    return float(int(time.time()))
