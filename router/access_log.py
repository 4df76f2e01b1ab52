"""The ingress's request log: one INFO line per request when asked, and one per failed request always.

    INFO ... 127.0.0.1:52144 "POST /v1/chat/completions" 200 35.1 ms tenant=acme
    INFO ... 127.0.0.1:52150 "POST /v1/completions" 404 0.9 ms: The model `x` does not exist; ...

(`tenant=`: the request's tenant, router/tenants.py, once the ingress named it: the
handler leaves it in the request's state.)

A pure ASGI middleware (not Starlette's BaseHTTPMiddleware, which would wrap
streaming responses in another task and hide client disconnects from the
handlers): it watches the response's status line, keeps the first few KB of an
error body to quote its OpenAI `error.message`, and logs when the response ends.
A client's mistake (4xx) or an unavailable server (503) is one INFO line with no
traceback; our own bugs (500) are logged with their traceback by the ingress's
exception handler. Requests that succeed are logged only with
`--enable-log-requests` (vLLM's flag), off by default.

Lines go to the `ray.serve` logger, so they land in the ingress replica's Serve log
file and on the driver's console, tagged with the replica and Serve's request id.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

logger = logging.getLogger("ray.serve")

_ERROR_BODY_LIMIT = 4096


@dataclass(slots=True)
class _Response:
    """What the middleware has seen of one response so far."""

    status: int = 0
    body: bytes = b""


class AccessLog:
    """ASGI middleware; `enabled` (all requests, not only failures) is set per process."""

    enabled = False

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        seen = _Response()

        async def watch(message) -> None:
            if message["type"] == "http.response.start":
                seen.status = message["status"]
            elif message["type"] == "http.response.body" and seen.status >= 400:
                if len(seen.body) < _ERROR_BODY_LIMIT:
                    seen.body += message.get("body", b"")[:_ERROR_BODY_LIMIT]
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            status = seen.status
            if self.enabled or (status >= 400 and status != 500):
                logger.info("%s", request_line(scope, status, time.perf_counter() - t0, error_message(seen.body)))


def request_line(scope, status: int, seconds: float, error: str = "") -> str:
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "-"
    line = f'{who} "{scope.get("method", "")} {scope.get("path", "")}" {status} {seconds * 1e3:.1f} ms'
    tenant = (scope.get("state") or {}).get("tenant")
    if tenant:
        line += f" tenant={tenant}"
    return f"{line}: {error}" if error else line


def error_message(body: bytes) -> str:
    if not body:
        return ""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return ""
