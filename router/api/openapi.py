"""The request bodies in /openapi.json.

The ingress's routes read and parse their bodies themselves (size and time limits, JSON
depth, 400s naming the field: ingress._parse), so FastAPI sees no body parameter and its
generated schema had none: a client generator or a schema-driven fuzzer (schemathesis,
tests/router/test_schemathesis.py) saw bodiless POSTs. Here each route's pydantic model is
added to the schema as its JSON request body; request handling is unchanged.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

REF_TEMPLATE = "#/components/schemas/{model}"


def add_request_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Make `app.openapi()` describe `bodies` (POST path -> model) as required JSON bodies."""
    generate = app.openapi  # FastAPI's own (caches in app.openapi_schema)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        models = sorted(set(bodies.values()), key=lambda m: m.__name__)
        refs, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF_TEMPLATE)
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        for path, model in bodies.items():
            operation = schema.get("paths", {}).get(path, {}).get("post")
            if operation is None:
                continue
            operation["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": refs[(model, "validation")]}},
            }
            responses = operation.setdefault("responses", {})
            for status, what in (
                ("400", "Invalid request (the error names the field)"),
                ("404", "Unknown model"),
                ("413", "Body too large"),
                ("429", "Overloaded: retry after Retry-After seconds"),
            ):
                responses.setdefault(status, {"description": what})
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
