"""What the ingress deployment is built with: `IngressSettings`, which cluster/deploy.py
fills from the application config (`AppConfig`) and hands to `Ingress` with the engine
handles (`ingress.bind(engine, settings, prefill=...)`).

The app config has been validated by then (pydantic, naming the field); the checks here
catch a settings object built by hand (tests, another deploy script) at construction,
before Serve starts a replica with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from fleetserve.replica.lora.request import LORA_LOAD_TIMEOUT_S
from fleetserve.router.cors import CorsSettings
from fleetserve.router.routing.pd import PDSettings
from fleetserve.router.routing.prefix_reuse import ReuseSettings
from fleetserve.router.tenants import TenantSettings

OPEN_PATHS = ("/health", "/ping", "/metrics")


@dataclass(frozen=True)
class LoRASettings:
    """The LoRA adapters the ingress serves by name (router/loras.py)."""

    adapters: dict[str, str] = field(default_factory=dict)  # name -> path (--lora-modules)
    parents: dict[str, str] = field(default_factory=dict)  # name -> its base_model_name, where given
    allow_runtime_updating: bool = False  # /v1/load_lora_adapter and /v1/unload_lora_adapter
    admin_key: Optional[str] = field(default=None, repr=False)  # what those take when set (router/auth.py)
    load_timeout_s: float = LORA_LOAD_TIMEOUT_S  # the engines' --lora-load-timeout
    # Where adapters loaded at run time are kept for a restarted ingress (router/runtime_loras.py):
    # the app's name, and a digest of its config (a restart with the same config takes them back).
    app_name: Optional[str] = None
    instance_id: Optional[str] = None


@dataclass(frozen=True)
class IngressSettings:
    """Everything but the engine handles. `pd` with a prefill pool: P/D disaggregation
    (router/routing/pd.py); `reuse` (no P/D): cluster-wide prefix reuse."""

    served_model_name: str
    model_aliases: tuple[str, ...] = ()  # accepted in `model`, not listed in /v1/models
    listed_names: tuple[str, ...] = ()  # more served names: accepted and listed
    api_key: Optional[str] = None
    # Tenants by key digest (--api-keys-file) and the metric label bound (router/tenants.py).
    tenants: TenantSettings = TenantSettings()
    open_paths: tuple[str, ...] = OPEN_PATHS  # paths that need no API key
    bind_host: Optional[str] = None  # the host the ingress's own HTTP/gRPC servers bind
    cors: CorsSettings = CorsSettings()
    max_body_bytes: int = 4 << 20
    body_timeout_s: float = 30.0
    max_migrations: int = 2
    graceful_shutdown_timeout_s: float = 60.0
    log_requests: bool = False
    return_tokens_as_token_ids: bool = False
    reasoning_parser: Optional[str] = None
    lora: LoRASettings = LoRASettings()
    tracing: Optional[dict] = None  # router.tracing.TracingSettings' fields (None: off)
    pd: Optional[PDSettings] = None
    reuse: Optional[ReuseSettings] = None
    # SLO-aware admission's settings (router.routing.slo.SloSettings.to_dict(); None: off): the
    # ingress judges finished requests by its targets for the goodput metrics.
    slo: Optional[dict] = None

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")
        if self.body_timeout_s <= 0:
            raise ValueError(f"body_timeout_s must be positive, got {self.body_timeout_s}")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be 0 or more, got {self.max_migrations}")
        if self.graceful_shutdown_timeout_s < 0:
            raise ValueError(f"graceful_shutdown_timeout_s must be 0 or more, got {self.graceful_shutdown_timeout_s}")
        if self.pd is not None and self.reuse is not None:
            raise ValueError("pd and reuse exclude each other (prefix reuse is for colocated apps)")

    @property
    def served_names(self) -> frozenset[str]:
        """Every name `model` may give for the base model."""
        return frozenset({self.served_model_name, *self.model_aliases, *self.listed_names})
