"""API keys: `Authorization: Bearer <key>` on HTTP, the same in gRPC metadata.

- Only the Bearer scheme counts (`Authorization: sk-x` without it is refused, as OpenAI
  and vLLM do); the scheme name is case-insensitive (RFC 7235).
- Keys are compared as SHA-256 digests with `hmac.compare_digest`: constant time, and
  the comparison does not even reveal the key's length.
- Every HTTP path needs the key except the configured open ones (`/health`, `/ping` and
  `/metrics` by default, as in vLLM; `api_key_open_paths: ["/health"]` closes the others).
  That includes FastAPI's `/openapi.json` and anything else the app serves: the check is
  a middleware in front of all routes, not a call each endpoint must remember. Serve's
  own `/-/routes` and `/-/healthz` are answered before the app sees the request (they
  reveal the application's name and route prefix only): keep them off the public
  network if that matters.
- Where the key comes from: `api_key` in the config (or `--api-key`), `api_key_file`
  (or `--api-key-file`: a file holding the key), or the environment variable
  `FLEETSERVE_API_KEY`: the last two keep it out of `ps` and shell history. It is
  never logged and never put in a Ray runtime_env (cluster.deploy.serve_env skips it).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path
from typing import Optional

from starlette.datastructures import Headers

from fleetserve.router.api.errors import APIError, to_response

API_KEY_ENV = "FLEETSERVE_API_KEY"


def resolve_api_key(api_key: Optional[str], api_key_file: Optional[str]) -> Optional[str]:
    """The key from the config, else the file, else the environment; None: no key."""
    if api_key:
        return api_key
    if api_key_file:
        try:
            key = Path(api_key_file).expanduser().read_text().strip()
        except OSError as e:
            raise ValueError(f"api_key_file {api_key_file!r} cannot be read: {e.strerror}") from e
        if not key:
            raise ValueError(f"api_key_file {api_key_file!r} is empty")
        return key
    return os.environ.get(API_KEY_ENV) or None


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).digest()


class ApiKeyAuth:
    def __init__(self, api_key: Optional[str], open_paths: tuple[str, ...] = ("/health", "/ping", "/metrics")) -> None:
        self._digest = _digest(api_key) if api_key else None
        self.open_paths = frozenset(open_paths)

    @property
    def enabled(self) -> bool:
        return self._digest is not None

    def check(self, authorization: Optional[str]) -> None:
        """APIError(401) unless `authorization` is `Bearer <the key>` (or no key is set)."""
        if self._digest is None:
            return
        scheme, _, token = (authorization or "").strip().partition(" ")
        presented = _digest(token.strip())
        # Compare even when the scheme is wrong: the time taken says nothing either way.
        matches = hmac.compare_digest(presented, self._digest)
        if not (matches and scheme.lower() == "bearer"):
            raise APIError(
                "Incorrect API key provided: send 'Authorization: Bearer <key>'", 401, code="invalid_api_key"
            )


# The ingress's auth. Serve builds the FastAPI app from a module-level object, so the
# middleware below cannot reach the ingress instance; the ingress installs its settings
# here when it starts (one ingress per replica process).
_installed = ApiKeyAuth(None)


def install(auth: ApiKeyAuth) -> None:
    global _installed
    _installed = auth


class RequireApiKey:
    """ASGI middleware: every path but the open ones needs the key.

    Pure ASGI on purpose: a function middleware (`@app.middleware("http")`) is Starlette's
    BaseHTTPMiddleware, which relays every chunk of a streaming response through an extra
    task and memory stream, paid on each token of each SSE stream whether or not a key is
    set. Here a request with the key (or with no key configured) goes straight to the app."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        auth = _installed
        if scope["type"] == "http" and auth.enabled and scope["path"] not in auth.open_paths:
            try:
                auth.check(Headers(scope=scope).get("authorization"))
            except APIError as e:
                await to_response(e.body)(scope, receive, send)
                return
        await self.app(scope, receive, send)
