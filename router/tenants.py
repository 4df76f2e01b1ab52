"""Who a request belongs to: its tenant, from its API key or the `x-tenant-id` header.

- With `--api-keys-file` (a YAML or JSON map: tenant name -> {key or key_sha256, weight,
  priority, limits}), the key decides the tenant. A request whose `x-tenant-id` names
  another tenant than its key's is refused (403, `tenant_mismatch`): a client that sends
  both learns at once that one of them is wrong, rather than being billed and shared as
  someone else. Naming a tenant of the file without its key (with the shared `--api-key`,
  or with no key where none is needed) is refused the same way.
- Otherwise (no file, or the shared `--api-key`, which keeps working as before) the
  `x-tenant-id` header (gRPC: metadata `x-tenant-id`) names the tenant, else `default`.
  Such a tenant is self-declared: weight 1, priority 0, no limits.
- The file stores keys as given or as SHA-256 hex digests (`key_sha256`); the ingress only
  ever holds the digests (router/auth.py compares them).

What a tenant gets: its `weight` travels to the engine with the request (the scheduler's
`--scheduling-policy fair` shares by it: scheduler/fair.py); its `priority` is the best
(lowest) priority its requests run at (a request may ask for a worse one, never a better
one); `limits.max_tokens` caps what one request may ask for (400 beyond it); `slo: {ttft_ms,
itl_ms}` are its own targets for SLO-aware admission (router/routing/slo.py).

Metrics (`TenantMetrics`, in the ingress's /metrics): requests, prompt tokens and generated
tokens per tenant. The `tenant` label takes at most `--max-tenant-labels` values: the
file's tenants first, then the first others seen; every later tenant counts as `other`.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import yaml
from prometheus_client import CollectorRegistry, Counter
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fleetserve.router.api.errors import APIError
from fleetserve.router.metrics import _OwnRegistry
from fleetserve.scheduler.request import DEFAULT_TENANT

TENANT_HEADER = "x-tenant-id"
OTHER_TENANTS = "other"
MAX_TENANT_LABELS = 32
# What a tenant name may be: it ends up in logs and metric labels.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,63}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class TenantLimits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: Optional[int] = Field(None, ge=1, description="The most output tokens one request may ask for.")


class TenantSlo(BaseModel):
    """A tenant's own SLO targets (router/routing/slo.py): SLO-aware admission routes and
    refuses its requests by these instead of the app's --slo-ttft-ms / --slo-itl-ms."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft_ms: Optional[float] = Field(None, gt=0, description="Time to first token, in milliseconds.")
    itl_ms: Optional[float] = Field(None, gt=0, description="Mean time between output tokens, in milliseconds.")


class TenantSpec(BaseModel):
    """One entry of `--api-keys-file`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: Optional[str] = Field(None, min_length=1, repr=False)
    key_sha256: Optional[str] = Field(None, repr=False)
    weight: float = Field(1.0, gt=0, description="Its share under --scheduling-policy fair.")
    priority: int = Field(0, description="The best priority its requests run at (lower runs first).")
    limits: TenantLimits = TenantLimits.model_validate({})
    slo: Optional[TenantSlo] = None

    @model_validator(mode="after")
    def _one_key(self) -> "TenantSpec":
        if (self.key is None) == (self.key_sha256 is None):
            raise ValueError("give exactly one of key and key_sha256")
        if self.key_sha256 is not None and not _SHA256.fullmatch(self.key_sha256.lower()):
            raise ValueError("key_sha256 must be 64 hexadecimal digits (sha256sum of the key)")
        return self

    def digest(self) -> str:
        if self.key is not None:
            return key_digest(self.key).hex()
        assert self.key_sha256 is not None
        return self.key_sha256.lower()


def key_digest(key: str) -> bytes:
    """The SHA-256 digest router/auth.py compares keys by."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True)
class Tenant:
    name: str = DEFAULT_TENANT
    weight: float = 1.0
    priority: int = 0
    max_tokens: Optional[int] = None
    keyed: bool = False  # named by its key (an entry of the keys file)
    slo_ttft_s: Optional[float] = None  # its own SLO targets (the keys file's `slo`), seconds
    slo_itl_s: Optional[float] = None


# A request that names no tenant.
NO_TENANT = Tenant()


@dataclass(frozen=True)
class TenantSettings:
    """What the ingress is built with: the keys file's tenants by key digest (hex; never the
    keys themselves), and the metric label bound."""

    by_digest: dict[str, Tenant] = field(default_factory=dict)
    max_labels: int = MAX_TENANT_LABELS

    def __post_init__(self) -> None:
        if self.max_labels < 1:
            raise ValueError(f"max_tenant_labels must be at least 1, got {self.max_labels}")

    @classmethod
    def from_keys_file(cls, path: Optional[str], max_labels: int = MAX_TENANT_LABELS) -> "TenantSettings":
        return cls(load_keys_file(path) if path else {}, max_labels)


def load_keys_file(path: str) -> dict[str, Tenant]:
    """`path`'s tenants by key digest (hex); ValueError naming the file and the entry."""
    try:
        data = yaml.safe_load(Path(path).expanduser().read_text())  # JSON is YAML too
    except OSError as e:
        raise ValueError(f"api_keys_file {path!r} cannot be read: {e.strerror}") from e
    except yaml.YAMLError as e:
        # Where, not the parser's message: that quotes the line, which may hold a key.
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ValueError(f"api_keys_file {path!r} is not valid YAML or JSON{where}") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f"api_keys_file {path!r} must map tenant names to {{key or key_sha256, weight, ...}}")
    out: dict[str, Tenant] = {}
    for name, entry in data.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(
                f"api_keys_file {path!r}: tenant name {name!r} must be 1-64 letters, digits or ._:@- "
                "(starting with a letter or digit)"
            )
        try:
            spec = TenantSpec.model_validate(entry if entry is not None else {})
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first.get("loc", ())) or "entry"
            raise ValueError(f"api_keys_file {path!r}: tenant {name!r}: {where}: {first['msg']}") from None
        digest = spec.digest()
        if digest in out:
            raise ValueError(f"api_keys_file {path!r}: tenants {out[digest].name!r} and {name!r} have the same key")
        slo = spec.slo or TenantSlo.model_validate({})
        out[digest] = Tenant(
            name,
            spec.weight,
            spec.priority,
            spec.limits.max_tokens,
            keyed=True,
            slo_ttft_s=slo.ttft_ms / 1e3 if slo.ttft_ms is not None else None,
            slo_itl_s=slo.itl_ms / 1e3 if slo.itl_ms is not None else None,
        )
    return out


def _bearer(authorization: Optional[str]) -> Optional[str]:
    scheme, _, token = (authorization or "").strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class TenantDirectory:
    """Names the tenant of each request (HTTP headers or gRPC metadata) and counts it."""

    def __init__(self, settings: TenantSettings = TenantSettings()) -> None:
        self._by_digest = {bytes.fromhex(h): t for h, t in settings.by_digest.items()}
        self._keyed_names = {t.name for t in settings.by_digest.values()}
        self.metrics = TenantMetrics(settings.max_labels, sorted(self._keyed_names))

    @property
    def digests(self) -> frozenset[bytes]:
        """The tenants' key digests: router/auth.py lets them in."""
        return frozenset(self._by_digest)

    def identify(self, authorization: Optional[str], claimed: Optional[str]) -> Tenant:
        """The tenant of a request with these `authorization` and `x-tenant-id` values (the
        key itself was checked already). APIError 400 for a malformed name, 403 for a claim
        the key does not back."""
        token = _bearer(authorization) if self._by_digest else None
        keyed = self._by_digest.get(key_digest(token)) if token is not None else None
        if claimed is not None:
            claimed = claimed.strip()
            if not _NAME.fullmatch(claimed):
                raise APIError(
                    f"{TENANT_HEADER} must be 1-64 letters, digits or ._:@- (starting with a letter or digit)",
                    400,
                    param=TENANT_HEADER,
                    code="invalid_tenant",
                )
        if keyed is not None:
            if claimed is not None and claimed != keyed.name:
                raise APIError(
                    f"{TENANT_HEADER} names tenant {claimed!r}, but the API key belongs to another tenant",
                    403,
                    param=TENANT_HEADER,
                    code="tenant_mismatch",
                )
            return keyed
        if claimed is not None and claimed in self._keyed_names:
            raise APIError(
                f"tenant {claimed!r} is named by its own API key; send that key instead of {TENANT_HEADER}",
                403,
                param=TENANT_HEADER,
                code="tenant_mismatch",
            )
        return Tenant(claimed) if claimed else NO_TENANT


def stamp(body: dict, tenant: Tenant) -> dict:
    """`body` (an engine body: router/bodies.py) as `tenant`'s: its name and weight for the
    engine, its priority class, its limits checked (APIError 400)."""
    max_tokens = body.get("sampling_params", {}).get("max_tokens")
    if tenant.max_tokens is not None and max_tokens is not None and max_tokens > tenant.max_tokens:
        raise APIError(
            f"max_tokens {max_tokens} is above this tenant's limit of {tenant.max_tokens}",
            400,
            param="max_tokens",
            code="tenant_limit_exceeded",
        )
    body["tenant"] = tenant.name
    body["tenant_weight"] = tenant.weight
    body["priority"] = max(int(body.get("priority", 0)), tenant.priority)
    return body


class TenantMetrics(_OwnRegistry):
    """fleetserve:tenant_requests_total, _prompt_tokens_total, _generation_tokens_total
    {tenant}: counted at the ingress, with at most `max_labels` tenant values."""

    def __init__(self, max_labels: int = MAX_TENANT_LABELS, known: Sequence[str] = ()) -> None:
        self.registry = CollectorRegistry()
        self.max_labels = max_labels
        self._labels: set[str] = set()
        for name in known:
            self.label(name)
        labels = ["tenant"]
        self.requests = Counter(
            "fleetserve:tenant_requests", "Requests by tenant (at the ingress)", labels, registry=self.registry
        )
        self.prompt_tokens = Counter(
            "fleetserve:tenant_prompt_tokens",
            "Prompt tokens sent to the engines by tenant",
            labels,
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "fleetserve:tenant_generation_tokens", "Tokens generated by tenant", labels, registry=self.registry
        )

    def label(self, tenant: str) -> str:
        """`tenant`'s label value: itself while the bound allows, else `other`."""
        if tenant in self._labels:
            return tenant
        if len(self._labels) < self.max_labels and tenant != OTHER_TENANTS:
            self._labels.add(tenant)
            return tenant
        return OTHER_TENANTS

    def observe_request(self, tenant: str, prompt_tokens: int) -> None:
        label = self.label(tenant)
        self.requests.labels(label).inc()
        self.prompt_tokens.labels(label).inc(prompt_tokens)

    def observe_generated(self, tenant: str, tokens: int) -> None:
        if tokens > 0:
            self.generation_tokens.labels(self.label(tenant)).inc(tokens)
