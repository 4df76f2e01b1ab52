"""The request fields that ask for structured outputs, on both endpoints.

Three spellings of one thing, as vLLM accepts them:

- OpenAI's `response_format`: `{"type": "json_object"}`, or `{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}` (`"text"` means unconstrained);
- vLLM's `structured_outputs: {json | regex | choice | grammar | json_object}`;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

A request may use one of them; each becomes `StructuredOutputsParams`. Tool calls
(router/api/tool_calls.py) build the same params from a function's JSON schema.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from fleetserve.router.api.errors import APIError
from fleetserve.scheduler.structured_outputs import StructuredOutputsParams


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: Optional[str] = None
    description: Optional[str] = None
    # "schema" shadows a BaseModel attribute: keep it under an alias.
    json_schema: Optional[Union[dict[str, Any], bool]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputFields(BaseModel):
    """Mixed into the completion and chat request models."""

    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None

    def structured_outputs_params(self) -> Optional[StructuredOutputsParams]:
        """The one constraint this request asks for, or None; APIError (400) otherwise."""
        asked = []
        rf = self.response_format
        if rf is not None and rf.type != "text":
            asked.append(("response_format", _from_response_format(rf)))
        if self.structured_outputs is not None:
            asked.append(("structured_outputs", dict(self.structured_outputs)))
        guided = {kind: getattr(self, f"guided_{kind}") for kind in ("json", "regex", "choice", "grammar")}
        guided = {k: v for k, v in guided.items() if v is not None}
        if guided:
            asked.append((f"guided_{next(iter(guided))}", guided))
        if not asked:
            return None
        if len(asked) > 1:
            names = ", ".join(name for name, _ in asked)
            raise APIError(f"give one structured-output constraint, not several ({names})", 400, param=asked[1][0])
        param, fields = asked[0]
        try:
            return StructuredOutputsParams(**fields)
        except (TypeError, ValueError) as e:
            raise APIError(f"{param}: {e}", 400, param=param) from None


def _from_response_format(rf: ResponseFormat) -> dict[str, Any]:
    if rf.type == "json_object":
        return {"json_object": True}
    if rf.json_schema is None or rf.json_schema.json_schema is None:
        raise APIError("response_format json_schema needs json_schema.schema", 400, param="response_format")
    return {"json": rf.json_schema.json_schema}
