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
- Tenants' keys (`--api-keys-file`, router/tenants.py): each one opens what the API key
  opens, and names the request's tenant. With a keys file and no `--api-key`, only they do.
- The LoRA admin key (`--lora-admin-key`, `--lora-admin-key-file` or
  `FLEETSERVE_LORA_ADMIN_KEY`, kept the same way): when one is set, the admin paths
  (/v1/load_lora_adapter, /v1/unload_lora_adapter) take it instead of the API key, and
  nothing else opens them (not the API key, not `api_key_open_paths`); the API key opens
  every other path as before. Without one, the admin paths need the API key like the rest.
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
LORA_ADMIN_KEY_ENV = "FLEETSERVE_LORA_ADMIN_KEY"
# Environment variables holding keys: never copied into a Ray runtime_env.
SECRET_ENVS = frozenset({API_KEY_ENV, LORA_ADMIN_KEY_ENV})
# What the LoRA admin key guards (router/loras.py).
LORA_ADMIN_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def resolve_api_key(
    api_key: Optional[str], api_key_file: Optional[str], env: str = API_KEY_ENV, what: str = "api_key_file"
) -> Optional[str]:
    """The key from the config, else the file, else the environment; None: no key."""
    if api_key:
        return api_key
    if api_key_file:
        try:
            key = Path(api_key_file).expanduser().read_text().strip()
        except OSError as e:
            raise ValueError(f"{what} {api_key_file!r} cannot be read: {e.strerror}") from e
        if not key:
            raise ValueError(f"{what} {api_key_file!r} is empty")
        return key
    return os.environ.get(env) or None


def resolve_lora_admin_key(key: Optional[str], key_file: Optional[str]) -> Optional[str]:
    """`--lora-admin-key`, else `--lora-admin-key-file`, else $FLEETSERVE_LORA_ADMIN_KEY."""
    return resolve_api_key(key, key_file, LORA_ADMIN_KEY_ENV, "lora_admin_key_file")


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).digest()


def _matches(expected: bytes, authorization: Optional[str]) -> bool:
    scheme, _, token = (authorization or "").strip().partition(" ")
    # Compare even when the scheme is wrong: the time taken says nothing either way.
    matches = hmac.compare_digest(_digest(token.strip()), expected)
    return matches and scheme.lower() == "bearer"


class ApiKeyAuth:
    def __init__(
        self,
        api_key: Optional[str],
        open_paths: tuple[str, ...] = ("/health", "/ping", "/metrics"),
        admin_key: Optional[str] = None,
        admin_paths: tuple[str, ...] = LORA_ADMIN_PATHS,
        tenant_digests: frozenset[bytes] = frozenset(),
    ) -> None:
        self._digest = _digest(api_key) if api_key else None
        self._tenant_digests = tenant_digests
        self.open_paths = frozenset(open_paths)
        self._admin_digest = _digest(admin_key) if admin_key else None
        self.admin_paths = frozenset(admin_paths)

    @property
    def enabled(self) -> bool:
        return self._digest is not None or self._admin_digest is not None or bool(self._tenant_digests)

    def check(self, authorization: Optional[str]) -> None:
        """APIError(401) unless `authorization` is `Bearer <the key>` or a tenant's key (or
        no key is set)."""
        if self._tenant_digests and self._is_tenant_key(authorization):
            return
        needs_key = self._digest is not None or bool(self._tenant_digests)
        if needs_key and (self._digest is None or not _matches(self._digest, authorization)):
            raise APIError(
                "Incorrect API key provided: send 'Authorization: Bearer <key>'", 401, code="invalid_api_key"
            )

    def _is_tenant_key(self, authorization: Optional[str]) -> bool:
        # A set lookup by SHA-256 digest: its timing can tell only which digests are absent,
        # and finding a key from its digest is preimage search.
        scheme, _, token = (authorization or "").strip().partition(" ")
        return scheme.lower() == "bearer" and _digest(token.strip()) in self._tenant_digests

    def check_path(self, path: str, authorization: Optional[str]) -> None:
        """The key `path` needs: the admin key on the admin paths when one is set, else the
        API key on every path but the open ones."""
        if self._admin_digest is not None and path in self.admin_paths:
            if not _matches(self._admin_digest, authorization):
                raise APIError(
                    "Incorrect LoRA admin key provided: loading and unloading adapters takes "
                    "'Authorization: Bearer <lora admin key>'",
                    401,
                    code="invalid_api_key",
                )
        elif path not in self.open_paths:
            self.check(authorization)


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
        if scope["type"] == "http" and auth.enabled:
            try:
                auth.check_path(scope["path"], Headers(scope=scope).get("authorization"))
            except APIError as e:
                await to_response(e.body)(scope, receive, send)
                return
        await self.app(scope, receive, send)
