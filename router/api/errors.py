"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`.

Inside fleetserve an error travels as that body plus a top-level `"status"`
(the HTTP status); `to_response` strips it off into the status line.
"""

from __future__ import annotations

from typing import Optional

from fastapi.responses import JSONResponse
from pydantic import ValidationError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """Raised inside the ingress; becomes one OpenAI error response."""

    def __init__(
        self, message: str, status: int = 400, param: Optional[str] = None, code: Optional[str] = None
    ) -> None:
        super().__init__(message)
        self.body = error_body(message, status=status, param=param, code=code)

    @property
    def status(self) -> int:
        return self.body["status"]


def error_body(message: str, status: int = 400, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    return {
        "status": status,
        "error": {"message": message, "type": _TYPES.get(status, "error"), "param": param, "code": code},
    }


def is_error(item: dict) -> bool:
    return "error" in item


RETRY_AFTER_S = 1  # what 429/503 answers tell a client to wait (Retry-After)


def to_response(body: dict) -> JSONResponse:
    status = body.get("status", 400)
    # An SLO refusal says how long its replica's queue needs (router/routing/slo.py).
    headers = {"Retry-After": str(int(body.get("retry_after", RETRY_AFTER_S)))} if status in (429, 503) else None
    return JSONResponse({"error": body["error"]}, status_code=status, headers=headers)


def from_validation_error(e: ValidationError) -> APIError:
    """The first pydantic error, with its field path as `param`."""
    first = e.errors()[0]
    param = field_path(first.get("loc", ()))
    return APIError(f"{param}: {first.get('msg')}" if param else str(first.get("msg")), 400, param)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def field_path(loc) -> Optional[str]:
    """pydantic's error location as a dotted field path, without union-member tags
    (`("prompt", "list[int]", 0)` -> `"prompt"`)."""
    parts = []
    for p in loc:
        if p == "body":
            continue
        if isinstance(p, str) and (p in _TYPE_TAGS or "[" in p or "-" in p):
            break
        parts.append(str(p))
    return ".".join(parts) or None
