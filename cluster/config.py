"""The application config: one pydantic schema for everything `fleetserve serve` deploys.

The CLI flags, a YAML file (`--config app.yaml`) and the Helm values all produce
an `AppConfig`. Engine settings live under `engine` with vLLM's field names
(`EngineArgs`); the rest describes the serving topology. An invalid value raises
`pydantic.ValidationError`, which names the field (`engine.max_num_seqs`).

YAML shape (every key optional)::

    engine: {model: smollm2-135m, max_num_seqs: 32, block_size: 16}
    num_replicas: 2
    routing_policy: prefix_aware
    routing: {imbalance_threshold: 4}
    http: {host: 127.0.0.1, port: 8000}
    grpc: {port: 9000}
    api_key: null
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field

from fleetserve.replica.engine.engine_args import EngineArgs

RoutingPolicyName = Literal["power_of_two", "least_loaded", "prefix_aware"]


class HTTPOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # Bodies larger than this are refused with 413 before parsing.
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)


class GRPCOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    port: int = Field(9000, ge=0, le=65535)


class RoutingOptions(BaseModel):
    """Knobs of the routing policies (see `router/policies/`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # prefix_aware: a replica counts as overloaded (so the prefix match is
    # ignored) when it has this many more requests in flight than the least
    # loaded one.
    imbalance_threshold: int = Field(4, ge=1)
    # prefix_aware: the match must cover at least this fraction of the prompt's
    # full blocks to win over load (a shared chat header alone must not pin
    # every request to one replica).
    min_match_fraction: float = Field(0.5, gt=0.0, le=1.0)
    # prefix_aware: most block hashes remembered by the router (LRU).
    max_table_entries: int = Field(200_000, ge=16)
    # How often replicas report their engine load to routers (seconds).
    stats_period_s: float = Field(1.0, gt=0.0)


class ReliabilityOptions(BaseModel):
    """Failure handling, drain and admission (issue 15; router/README.md explains each)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # A request body that has not fully arrived after this long gets 408 (a client that
    # announced more bytes than it sends would otherwise hold its connection forever).
    body_timeout_s: float = Field(30.0, gt=0.0)
    # Drain: a replica asked to stop (SIGTERM, redeploy, scale-down) refuses new requests
    # and waits up to this long for its in-flight ones (Serve's graceful_shutdown_timeout_s;
    # Helm's terminationGracePeriodSeconds must exceed it).
    graceful_shutdown_timeout_s: float = Field(60.0, ge=0.0)
    graceful_shutdown_wait_loop_s: float = Field(1.0, gt=0.0)
    # Serve's health check of each engine replica; a failing one is replaced.
    health_check_period_s: float = Field(5.0, gt=0.0)
    health_check_timeout_s: float = Field(20.0, gt=0.0)
    # An engine core that holds work but has made no step for this long, or does not
    # answer a ping within it, is wedged: its replica reports unhealthy.
    engine_stall_timeout_s: float = Field(30.0, gt=0.0)
    # A stream whose replica fails continues on another one (router/migration.py), at
    # most this many times per request; 0 turns migration off.
    max_migrations: int = Field(2, ge=0)
    # Overload. Requests waiting in Serve's queue for a free replica slot, per ingress,
    # beyond which new ones get 429 (Serve's max_queued_requests; -1: unbounded).
    max_queued_requests: int = Field(512, ge=-1)
    # A replica refuses (429) a request when the tokens it already has queued exceed this
    # many times its KV cache's capacity in tokens (router/admission.py).
    max_queued_kv_ratio: float = Field(4.0, gt=0.0)


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    name: str = Field("fleetserve", min_length=1)
    engine: EngineArgs = EngineArgs()
    num_replicas: int = Field(2, ge=1)
    routing_policy: RoutingPolicyName = "power_of_two"
    routing: RoutingOptions = RoutingOptions()
    http: HTTPOptions = HTTPOptions()
    grpc: GRPCOptions = GRPCOptions()
    # When set, every HTTP request must carry `Authorization: Bearer <api_key>`
    # (gRPC: metadata `authorization`).
    api_key: Optional[str] = None
    # The key in a file instead (kept out of `ps`); else $FLEETSERVE_API_KEY (router/auth.py).
    api_key_file: Optional[str] = None
    # HTTP paths that need no key (Prometheus scrapers and probes; vLLM leaves these open
    # too). ["/health"] protects /metrics as well.
    api_key_open_paths: tuple[str, ...] = ("/health", "/metrics")
    reliability: ReliabilityOptions = ReliabilityOptions()
    # Ray address: None starts an embedded local Ray; "auto" (or host:port) joins.
    address: Optional[str] = None
    # CPUs reserved per engine replica (its torch threads); 0 lets Ray pack them.
    num_cpus_per_replica: float = Field(1.0, ge=0.0)
    # The engine class each replica builds, "module:Class" (tests may swap it).
    engine_cls: str = "fleetserve.replica.engine.async_engine:AsyncEngine"

    @property
    def served_model_name(self) -> str:
        return self.engine.served_model_name or self.engine.model

    @property
    def max_ongoing_requests(self) -> int:
        """Serve's per-replica cap: above the engine's own queue so the engine
        answers 429 (bounded waiting) rather than Serve queueing forever."""
        return self.engine.max_num_seqs + self.engine.max_waiting_requests + 8

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> "AppConfig":
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
        return cls.model_validate(merge(data, overrides))


def merge(base: dict, overrides: dict) -> dict:
    """Deep-merge `overrides` into a copy of `base` (nested dicts merge, the rest replace)."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out
