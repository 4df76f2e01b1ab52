"""OpenAI's Responses API (`POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`): text and
function calling.

A Responses request is a chat request in other words: `input` (a string, or message items
whose content is text, and the `function_call` / `function_call_output` items of a tool
loop) after `instructions` (a system message), with function `tools` as the chat API's, plus,
with `previous_response_id`, the stored conversation of that response. `ResponsesRequest.to_chat`
turns it into the `ChatCompletionRequest` the chat endpoint runs (same chat template,
sampling, structured outputs, routing), and this module turns the engine's deltas back into
a `response` object or its stream of typed events (`response.created` ...
`response.output_text.delta` ... `response.completed`), shaped as the official client parses
them.

Stored responses (`store`, true by default as OpenAI's) live in the ingress's memory, the
newest `MAX_STORED` of them: enough to chain a conversation with `previous_response_id` or
fetch a result again, gone when the ingress restarts (as vLLM's in-memory store). The store
is bounded in bytes as well (`MAX_STORED_BYTES`, the JSON size of each entry): a chain with
`previous_response_id` stores its whole conversation again at every turn, so a count alone
does not bound the memory. Oldest entries go first; one entry over the byte bound on its own
is not stored (the response still answers, with `store` reported false). Hosted
tools (web search, file search, MCP...), images, files and reasoning items are refused with
a 400 naming the field: with them the answer could not be what the client asked for.
"""

from __future__ import annotations

import collections
import json
import time
import uuid
from typing import Any, Literal, NamedTuple, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from fleetserve.router.api.errors import APIError, from_validation_error
from fleetserve.router.api.limits import MAX_MESSAGES
from fleetserve.router.api.protocol import ChatCompletionRequest, _SamplingRequest

MAX_STORED = 1024
MAX_STORED_BYTES = 256 << 20  # the JSON size of all stored entries together
_ROLES = ("user", "assistant", "system", "developer")


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
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
    parallel_tool_calls: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None

    def _max_tokens(self) -> Optional[int]:
        return self.max_output_tokens if self.max_output_tokens is not None else self.max_tokens

    def input_messages(self) -> list[dict]:
        """`input` as chat messages: message items as `{"role", "content"}` with text content;
        `function_call` items as the assistant's `tool_calls` (those of one turn in one
        message), `function_call_output` items as `tool` messages."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        if len(self.input) > MAX_MESSAGES:
            raise APIError(f"input may hold at most {MAX_MESSAGES} items", 400, param="input")
        messages: list[dict] = []
        for i, item in enumerate(self.input):
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if kind == "function_call":
                call = _function_call(i, item)
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "function_call_output":
                messages.append(_function_output(i, item))
            else:
                messages.append(_message(i, item))
        return messages

    def chat_tools(self) -> dict:
        """`tools`, `tool_choice`, `parallel_tool_calls` in the chat API's shapes: a Responses
        function tool is flat (`{"type": "function", "name", "parameters"}`), a chat one nests
        it under `function`. Other tool types (web search, files, MCP...) run at OpenAI, not
        in a model server: refused."""
        out: dict[str, Any] = {}
        if self.tools:
            tools = []
            for i, tool in enumerate(self.tools):
                if tool.get("type") != "function":
                    raise APIError(
                        f"tools[{i}]: only function tools are supported, got type {tool.get('type')!r}",
                        400,
                        param=f"tools[{i}].type",
                    )
                fields = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
                tools.append({"type": "function", "function": fields})
            out["tools"] = tools
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise APIError(
                    'tool_choice must be none, auto, required or {"type": "function", "name": ...}',
                    400,
                    param="tool_choice",
                )
            choice = {"type": "function", "function": {"name": choice["name"]}}
        if choice is not None:
            out["tool_choice"] = choice
        if self.parallel_tool_calls is not None:
            out["parallel_tool_calls"] = self.parallel_tool_calls
        return out

    def to_chat(self, history: list[dict]) -> ChatCompletionRequest:
        if self.n != 1:
            raise APIError("n must be 1 on /v1/responses", 400, param="n")
        messages = (
            ([{"role": "system", "content": self.instructions}] if self.instructions else [])
            + history
            + self.input_messages()
        )
        data = self.model_dump(
            exclude={
                "input",
                "instructions",
                "max_output_tokens",
                "previous_response_id",
                "store",
                "text",
                "tools",
                "tool_choice",
                "parallel_tool_calls",
                "metadata",
                "stream",
                "stream_options",
                "max_tokens",
                "prompt_logprobs",
            },
            exclude_none=True,
        )
        data["messages"] = messages
        data.update(self.chat_tools())
        data["max_completion_tokens"] = self._max_tokens()
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            data["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise APIError("text.format.schema is required for json_schema", 400, param="text.format.schema")
            data["response_format"] = {
                "type": "json_schema",
                "json_schema": {
                    "name": fmt.name or "response",
                    "schema": fmt.schema_,
                    **({"strict": fmt.strict} if fmt.strict is not None else {}),
                },
            }
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
        raise APIError(
            f"{param}: items of type {kind!r} are not supported; send text messages", 400, param=f"{param}.type"
        )
    role = item.get("role")
    if role not in _ROLES:
        raise APIError(f"{param}.role must be one of {', '.join(_ROLES)}", 400, param=f"{param}.role")
    content = item.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") not in ("input_text", "output_text", "text")
                or not isinstance(part.get("text"), str)
            ):
                raise APIError(
                    f"{param}.content[{j}]: only text parts (input_text, output_text) are supported",
                    400,
                    param=f"{param}.content",
                )
            parts.append(part["text"])
        text = "".join(parts)
    else:
        raise APIError(f"{param}.content must be a string or a list of text parts", 400, param=f"{param}.content")
    return {"role": "system" if role == "developer" else role, "content": text}


def _function_call(i: int, item: dict) -> dict:
    """A `function_call` input item (a call the model made earlier) as a chat tool call."""
    param = f"input[{i}]"
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise APIError(f"{param}.{key} must be a string", 400, param=f"{param}.{key}")
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }


def _function_output(i: int, item: dict) -> dict:
    """A `function_call_output` input item (the result of a call) as a chat `tool` message."""
    param = f"input[{i}]"
    if not isinstance(item.get("call_id"), str):
        raise APIError(f"{param}.call_id must be a string", 400, param=f"{param}.call_id")
    output = item.get("output")
    if isinstance(output, list):  # text parts
        if not all(
            isinstance(p, dict)
            and p.get("type") in ("input_text", "output_text", "text")
            and isinstance(p.get("text"), str)
            for p in output
        ):
            raise APIError(f"{param}.output: only text parts are supported", 400, param=f"{param}.output")
        output = "".join(p["text"] for p in output)
    if not isinstance(output, str):
        raise APIError(f"{param}.output must be a string or a list of text parts", 400, param=f"{param}.output")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}


class ResponseStore:
    """The newest stored responses, at most `capacity` of them and `max_bytes` of JSON:
    id -> (response object, the conversation it ends: the messages it was given, without
    instructions, plus its answer)."""

    def __init__(self, capacity: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES) -> None:
        self.capacity, self.max_bytes = capacity, max_bytes
        self._items: collections.OrderedDict[str, tuple[dict, list[dict], int]] = collections.OrderedDict()
        self.nbytes = 0  # the JSON size of what is stored

    def put(self, response: dict, conversation: list[dict]) -> bool:
        """Store it (the newest); False when the entry alone is over the byte bound."""
        size = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(conversation, ensure_ascii=False))
        if size > self.max_bytes:
            return False
        rid = response["id"]
        if rid in self._items:
            self.nbytes -= self._items.pop(rid)[2]
        self._items[rid] = (response, conversation, size)
        self.nbytes += size
        while len(self._items) > self.capacity or self.nbytes > self.max_bytes:
            self.nbytes -= self._items.popitem(last=False)[1][2]
        return True

    def __len__(self) -> int:
        return len(self._items)

    def get(self, response_id: str, param: Optional[str] = None) -> tuple[dict, list[dict]]:
        try:
            response, conversation, _ = self._items[response_id]
        except KeyError:
            raise APIError(
                f"Response with id '{response_id}' not found (responses are kept in "
                f"memory, the newest {self.capacity} up to {self.max_bytes >> 20} MiB, until the server restarts).",
                404,
                param=param,
            ) from None
        return response, conversation

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        self.nbytes -= self._items.pop(response_id)[2]


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


class Output(NamedTuple):
    thought: Optional[str] = None  # what a reasoning parser split off
    text: Optional[str] = None  # the answer (outside tool calls)
    calls: tuple = ()  # tool calls in the chat API's shape ({"id", "function": {"name", "arguments"}})


def output_items(stem: str, out: Output, status: str) -> list[dict]:
    """A reasoning item when there was thinking (a reasoning parser split it off), then the
    message, then a `function_call` item per tool call. The message is left out when the
    output never got past its thinking, or was calls alone."""
    items = []
    if out.thought:
        items.append(reasoning_item(stem, out.thought, status))
    if out.text or not (out.thought or out.calls):
        items.append(message_item(stem, out.text or "", status))
    items += [function_call_item(stem, j, call, status) for j, call in enumerate(out.calls)]
    return items


def response_object(
    rid: str,
    stem: str,
    req: ResponsesRequest,
    model: str,
    created: float,
    output: Optional[Output],
    finish_reason: Optional[str],
    usage: Optional[dict],
    status: Optional[str] = None,
    error: Optional[dict] = None,
) -> dict:
    """The `response` object; `output` None before there is any."""
    if status is None:
        status = "incomplete" if finish_reason == "length" else "completed"
    items = [] if output is None else output_items(stem, output, "completed" if status == "completed" else "incomplete")
    fmt = req.text.format if req.text is not None and req.text.format is not None else TextFormat()
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "model": model,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "output": items,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "store": req.store,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "truncation": "disabled",
        "user": req.user,
        "usage": usage,
    }


def message_item(stem: str, text: str, status: str) -> dict:
    return {
        "type": "message",
        "id": f"msg_{stem}",
        "status": status,
        "role": "assistant",
        "content": [output_text(text)],
    }


def function_call_item(stem: str, j: int, call: dict, status: str) -> dict:
    return {
        "type": "function_call",
        "id": f"fc_{stem}_{j}",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": status,
    }


def reasoning_item(stem: str, thought: str, status: str) -> dict:
    return {
        "type": "reasoning",
        "id": f"rs_{stem}",
        "status": status,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": thought}],
    }


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }


class EventWriter:
    """The stream's server-sent events, numbered (`sequence_number`) as the client expects.
    Output items open as their text comes: a reasoning item while the model thinks (with a
    reasoning parser), then the message; each is closed (its `.done` events) before the next
    opens, and the last at the end."""

    def __init__(self, rid: str, stem: str) -> None:
        self.rid, self.stem = rid, stem
        self._seq = 0
        self._index = -1  # output_index of the open item
        self._open: Optional[str] = None  # "reasoning" | "message" | "function_call"
        self._texts = {"reasoning": "", "message": ""}
        self.calls: list[dict] = []  # tool calls so far (the last one open while streaming)

    def event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"

    def start(self, response: dict) -> list[str]:
        return [
            self.event("response.created", response=response),
            self.event("response.in_progress", response=response),
        ]

    def reasoning_delta(self, text: str) -> list[str]:
        out = [] if self._open == "reasoning" else self._close() + self._start("reasoning")
        self._texts["reasoning"] += text
        out.append(
            self.event(
                "response.reasoning_text.delta",
                item_id=f"rs_{self.stem}",
                output_index=self._index,
                content_index=0,
                delta=text,
            )
        )
        return out

    def delta(self, text: str) -> list[str]:
        out = [] if self._open == "message" else self._close() + self._start("message")
        self._texts["message"] += text
        out.append(
            self.event(
                "response.output_text.delta",
                item_id=f"msg_{self.stem}",
                output_index=self._index,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return out

    @property
    def message_text(self) -> str:
        return self._texts["message"]

    def call_start(self, call_id: str, name: str) -> list[str]:
        """A tool call opens: its `function_call` item, arguments to come."""
        out = self._close() + self._start("function_call")
        self.calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": ""}})
        item = function_call_item(self.stem, len(self.calls) - 1, self.calls[-1], "in_progress")
        return out + [self.event("response.output_item.added", output_index=self._index, item=item)]

    def call_arguments(self, delta: str) -> list[str]:
        self.calls[-1]["function"]["arguments"] += delta
        return [
            self.event(
                "response.function_call_arguments.delta", item_id=self._call_id(), output_index=self._index, delta=delta
            )
        ]

    def _call_id(self) -> str:
        return f"fc_{self.stem}_{len(self.calls) - 1}"

    def finish(self, response: dict) -> list[str]:
        out = []
        if self._open != "message" and any(item["type"] == "message" for item in response["output"]):
            out += self._close() + self._start("message")
        out += self._close(response["status"])
        out.append(
            self.event(
                "response.completed" if response["status"] == "completed" else "response.incomplete", response=response
            )
        )
        return out

    def fail(self, response: dict, error: dict) -> list[str]:
        return [
            self.event(
                "error", code=error.get("code") or error.get("type"), message=error["message"], param=error.get("param")
            ),
            self.event("response.failed", response=response),
        ]

    def _start(self, kind: str) -> list[str]:
        self._open, self._index = kind, self._index + 1
        if kind == "function_call":
            return []  # call_start adds the item, which needs the call
        if kind == "reasoning":
            item = {"type": "reasoning", "id": f"rs_{self.stem}", "status": "in_progress", "summary": [], "content": []}
            return [self.event("response.output_item.added", output_index=self._index, item=item)]
        item = {
            "type": "message",
            "id": f"msg_{self.stem}",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        return [
            self.event("response.output_item.added", output_index=self._index, item=item),
            self.event(
                "response.content_part.added",
                item_id=f"msg_{self.stem}",
                output_index=self._index,
                content_index=0,
                part=output_text(""),
            ),
        ]

    def _close(self, status: str = "completed") -> list[str]:
        kind, self._open = self._open, None
        if kind is None:
            return []
        done = "completed" if status == "completed" else "incomplete"
        if kind == "function_call":
            call = self.calls[-1]
            return [
                self.event(
                    "response.function_call_arguments.done",
                    item_id=self._call_id(),
                    output_index=self._index,
                    name=call["function"]["name"],
                    arguments=call["function"]["arguments"],
                ),
                self.event(
                    "response.output_item.done",
                    output_index=self._index,
                    item=function_call_item(self.stem, len(self.calls) - 1, call, done),
                ),
            ]
        text = self._texts[kind]
        if kind == "reasoning":
            item_id = f"rs_{self.stem}"
            return [
                self.event(
                    "response.reasoning_text.done",
                    item_id=item_id,
                    output_index=self._index,
                    content_index=0,
                    text=text,
                ),
                self.event(
                    "response.output_item.done", output_index=self._index, item=reasoning_item(self.stem, text, done)
                ),
            ]
        item_id = f"msg_{self.stem}"
        return [
            self.event(
                "response.output_text.done",
                item_id=item_id,
                output_index=self._index,
                content_index=0,
                text=text,
                logprobs=[],
            ),
            self.event(
                "response.content_part.done",
                item_id=item_id,
                output_index=self._index,
                content_index=0,
                part=output_text(text),
            ),
            self.event("response.output_item.done", output_index=self._index, item=message_item(self.stem, text, done)),
        ]


def now() -> float:
    return float(int(time.time()))
