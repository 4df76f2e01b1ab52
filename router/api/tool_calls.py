"""Tool calls on `/v1/chat/completions`: `tools` and `tool_choice` in OpenAI's shapes.

    tool_choice   what the model may write                   how it is enforced
    ───────────   ────────────────────────────────────────   ─────────────────────────────
    "none"        text                                       tools are not rendered
    "auto"        text, or Hermes-style calls:               the chat template renders the
                  <tool_call>{"name", "arguments"}</tool_call>  tools; the output is parsed
    "required"    a JSON array of {"name", "parameters"}     grammar: the array's schema
    {"function":  the named function's arguments (JSON)      grammar: the function's schema
      {"name"}}

The forced forms are constrained by the tools' JSON schemas (structured outputs), so the
calls parse and validate whatever the model. `auto` depends on the model knowing a
tool-call format: Hermes' `<tool_call>` tags (Qwen2.5, Hermes, many Llama fine-tunes) are
parsed; a template that never mentions tools (SmolLM2's) renders none, and such a
model answers in text. A choice with calls finishes with "tool_calls".
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict

from fleetserve.router.api.errors import APIError
from fleetserve.scheduler.structured_outputs import StructuredOutputsParams

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class ToolFields(BaseModel):
    """Mixed into the chat request model."""

    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Optional[bool] = None

    def tool_plan(self) -> Optional["ToolPlan"]:
        return ToolPlan.of(self.tools, self.tool_choice, self.parallel_tool_calls is not False)


def _params_schema(fn: FunctionDef) -> dict:
    return fn.parameters or {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    mode: str  # "auto" | "required" | "named"
    tools: list[Tool]
    named: Optional[str] = None
    parallel: bool = True  # parallel_tool_calls: false allows one call at most

    @staticmethod
    def of(tools: Optional[list[Tool]], choice: Optional[ToolChoice], parallel: bool = True) -> Optional["ToolPlan"]:
        if not tools:
            if choice not in (None, "none"):
                raise APIError("tool_choice needs tools", 400, param="tool_choice")
            return None
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise APIError("tools: function names must be unique", 400, param="tools")
        if choice == "none":
            return None
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise APIError(
                    f"tool_choice names {choice.function.name!r}, which is not in tools", 400, param="tool_choice"
                )
            return ToolPlan("named", tools, choice.function.name, parallel)
        return ToolPlan(choice or "auto", tools, None, parallel)

    def template_tools(self) -> list[dict]:
        """The tools as chat templates take them (HF's `tools=` argument)."""
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def structured_outputs(self) -> Optional[StructuredOutputsParams]:
        """The grammar of a forced call; None for auto."""
        if self.mode == "named":
            fn = next(t.function for t in self.tools if t.function.name == self.named)
            return StructuredOutputsParams(json=_params_schema(fn))
        if self.mode == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [t.function.name]},
                        "parameters": _params_schema(t.function),
                    },
                    "required": ["name", "parameters"],
                }
                for t in self.tools
            ]
            array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                array["maxItems"] = 1
            return StructuredOutputsParams(json=array)
        return None

    def parse(self, text: str) -> tuple[Optional[str], list[dict]]:
        """(content, tool_calls) of a finished choice's text, in OpenAI's shapes."""
        if self.named is not None:  # mode "named"
            return None, [_call(self.named, text)]
        if self.mode == "required":
            try:
                calls = json.loads(text)
            except ValueError:  # cut short by max_tokens: no complete call
                return text, []
            return None, [_call(c["name"], json.dumps(c["parameters"])) for c in calls]
        return parse_hermes(text)


def parse_hermes(text: str) -> tuple[Optional[str], list[dict]]:
    """Hermes-style calls: each `<tool_call>{"name", "arguments"}</tool_call>` block that parses
    becomes a call; the text outside the blocks is the content (None when empty)."""
    calls = []
    for m in _HERMES.finditer(text):
        try:
            obj = json.loads(m.group(1))
            name, args = obj["name"], obj.get("arguments", obj.get("parameters", {}))
        except (ValueError, KeyError, TypeError):
            return text, []  # not a call we can trust: leave it as text
        calls.append(_call(name, args if isinstance(args, str) else json.dumps(args)))
    if not calls:
        return text, []
    content = _HERMES.sub("", text).strip()
    return content or None, calls


def _call(name: str, arguments: str) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def finish_reason(reason: Optional[str], calls: Sequence[object]) -> Optional[str]:
    return "tool_calls" if calls and reason == "stop" else reason


@dataclass
class _ChoiceStream:
    text: str = ""  # everything generated so far
    sent: int = 0  # characters of `text` already sent as content
    call_sent: bool = False  # named mode: the call's header went out


@dataclass
class ToolDeltas:
    """Streaming: turns each choice's text deltas into OpenAI chat deltas.

    named: the call's header (id, name) first, then the arguments as they are generated.
    required: nothing until the end, then every call at once. auto: content streams
    until a `<tool_call>` tag begins (a possible tag prefix is held back), the rest waits
    for the end and is parsed then."""

    plan: ToolPlan
    choices: dict[int, _ChoiceStream] = field(default_factory=dict)

    def delta(self, index: int, text: str, finished: bool) -> tuple[dict, bool]:
        """(delta fields, whether calls were made) for one output of one choice."""
        st = self.choices.setdefault(index, _ChoiceStream())
        st.text += text
        if self.plan.named is not None:  # mode "named"
            if not st.call_sent:
                st.call_sent = True
                call = _call(self.plan.named, text)
                return {"tool_calls": [{"index": 0, **call}]}, True
            return ({"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}), True
        if not finished:
            if self.plan.mode == "required":
                return {}, False
            safe = _safe_prefix_end(st.text, st.sent)
            out, st.sent = st.text[st.sent : safe], safe
            return ({"content": out} if out else {}), False
        content, calls = self.plan.parse(st.text)
        delta: dict[str, Any] = {}
        if calls:
            # Content after what was sent already (text before the first tag).
            rest = (content or "")[st.sent :] if content and content.startswith(st.text[: st.sent]) else ""
            if rest:
                delta["content"] = rest
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
        elif st.text[st.sent :]:
            delta["content"] = st.text[st.sent :]
        st.sent = len(st.text)
        return delta, bool(calls)


def _safe_prefix_end(text: str, sent: int) -> int:
    """How far `text` can be sent as content: up to a `<tool_call>` tag, or to a suffix
    that might be the start of one."""
    tag = text.find(TOOL_CALL_START, sent)
    if tag >= 0:
        return tag
    for k in range(min(len(TOOL_CALL_START) - 1, len(text) - sent), 0, -1):
        if TOOL_CALL_START.startswith(text[-k:]):
            return len(text) - k
    return len(text)
