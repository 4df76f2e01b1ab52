"""CORS for the HTTP API: which web pages' scripts may call it from a browser (vLLM's
`--allowed-origins`, `--allow-credentials`, `--allowed-methods`, `--allowed-headers`).

Origins are exact (`https://app.example.com`), with a port wildcard (`http://localhost:*`:
any port, or none), a subdomain wildcard (`https://*.example.com`), or `*` (any page).
The default admits pages served from this machine only (localhost, 127.0.0.1, [::1], any
port): a chat UI under development works, while an arbitrary web site the user happens to
visit cannot script the local server. vLLM admits every origin by default;
`--allowed-origins '["*"]'` does that here.

A pure ASGI middleware, outermost: a browser's preflight (OPTIONS, no API key) is
answered before the key check, and a 401's body is readable by the page that got it.
Starlette's CORSMiddleware does the work (it is pure ASGI as well, so SSE streams pass
through untouched); it acts only on requests that carry an `Origin` header.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Optional

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware

logger = logging.getLogger("ray.serve")  # the ingress replica's log, as router/access_log.py

_LOGGED_ORIGINS = 100  # refused origins logged per process, at most (each once)

LOCAL_ORIGINS = ("http://localhost:*", "http://127.0.0.1:*", "http://[::1]:*")


def origin_pattern(origin: str) -> str:
    """The regex of one allowed-origins entry; ValueError if it cannot be an origin."""
    if origin == "*":
        return ".*"
    scheme, sep, rest = origin.partition("://")
    if not sep or scheme not in ("http", "https") or not rest or "/" in rest:
        raise ValueError(
            f"allowed origin {origin!r} is not an origin like https://app.example.com, "
            "http://localhost:*, https://*.example.com or *"
        )
    any_port = rest.endswith(":*")
    host = rest[:-2] if any_port else rest
    core = host[2:] if host.startswith("*.") else host
    if not core or "*" in core:
        raise ValueError(
            f"allowed origin {origin!r}: '*' may only be a whole leading label "
            "(https://*.example.com) or the port (http://localhost:*)"
        )
    pattern = re.escape(host)
    if host.startswith("*."):
        pattern = r"[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*" + re.escape(host[1:])
    return re.escape(scheme + "://") + pattern + (r"(:[0-9]+)?" if any_port else "")


@dataclass(frozen=True)
class CorsSettings:
    allowed_origins: tuple[str, ...] = LOCAL_ORIGINS
    allow_credentials: bool = False
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)

    def origin_regex(self) -> str:
        """What an allowed origin fully matches (asked only when some origin is allowed)."""
        return "|".join(f"(?:{origin_pattern(o)})" for o in self.allowed_origins)


_installed: Optional[CorsSettings] = None


def install(settings: Optional[CorsSettings]) -> None:
    """The ingress's settings (Serve builds the app from a module-level object, so the
    middleware cannot reach the ingress instance: one ingress per replica process)."""
    global _installed
    _installed = settings


class Cors:
    """ASGI middleware: Starlette's CORSMiddleware with the installed settings. The first
    request from each origin it refuses is logged (a browser shows the page a CORS error;
    the operator sees which origin to allow)."""

    def __init__(self, app) -> None:
        self.app = app
        # (the settings they were built from, the allowed-origin pattern, Starlette's middleware)
        self._built: Optional[tuple[CorsSettings, re.Pattern[str], CORSMiddleware]] = None
        self._refused: set[str] = set()

    async def __call__(self, scope, receive, send) -> None:
        settings = _installed
        if scope["type"] != "http" or settings is None or not settings.allowed_origins:
            await self.app(scope, receive, send)
            return
        if self._built is None or self._built[0] is not settings:
            regex = settings.origin_regex()
            self._built = (
                settings,
                re.compile(regex),
                CORSMiddleware(
                    self.app,
                    allow_origin_regex=regex,
                    # "*" with credentials: Starlette answers with the request's origin, as browsers require
                    allow_origins=("*",) if "*" in settings.allowed_origins else (),
                    allow_credentials=settings.allow_credentials,
                    allow_methods=settings.allowed_methods,
                    allow_headers=settings.allowed_headers,
                ),
            )
        _, allowed, cors = self._built
        origin = Headers(scope=scope).get("origin")
        if (
            origin
            and origin not in self._refused
            and not allowed.fullmatch(origin)
            and len(self._refused) < _LOGGED_ORIGINS
        ):
            self._refused.add(origin)
            logger.info(
                "CORS: refused a request from the web page origin %r (allowed: %s); --allowed-origins admits it",
                origin,
                ", ".join(settings.allowed_origins),
            )
        await cors(scope, receive, send)
