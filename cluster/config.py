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

from fleetserve.cluster.placement import AutoscalingOptions, PDOptions, ReplicaPlacement
from fleetserve.replica.engine.engine_args import EngineArgs

RoutingPolicyName = Literal["power_of_two", "least_loaded", "prefix_aware"]


class HTTPOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description=(
        "Address the HTTP and gRPC servers bind (0.0.0.0 or :: for every interface). "
        "With --address (a joined cluster) Ray Serve's proxy binds gRPC on every interface."))
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (OpenAI API, /metrics, /health).")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description=(
        "Largest request body; a larger one is refused with 413 before parsing."))


class GRPCOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="Serve the gRPC API (fleetserve.v1.FleetServe).")
    port: int = Field(9000, ge=0, le=65535, description="gRPC port.")


class RoutingOptions(BaseModel):
    """Knobs of the routing policies (see `router/policies/`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    imbalance_threshold: int = Field(4, ge=1, description=(
        "prefix_aware: a replica with this many more requests in flight than the least "
        "loaded one counts as overloaded, and its prefix match is ignored."))
    min_match_fraction: float = Field(0.5, gt=0.0, le=1.0, description=(
        "prefix_aware: the smallest fraction of the prompt's full blocks a match must cover "
        "to win over load (a shared chat header alone must not pin every request)."))
    max_table_entries: int = Field(200_000, ge=16, description=(
        "prefix_aware: most block hashes the router remembers (LRU)."))
    stats_period_s: float = Field(1.0, gt=0.0, description=(
        "How often replicas report their engine load to routers, in seconds."))


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    name: str = Field("fleetserve", min_length=1, description=(
        "Ray Serve application name (gRPC clients send it as metadata `application`)."))
    engine: EngineArgs = EngineArgs()
    num_replicas: int = Field(2, ge=1, description="Engine replicas behind the router.")
    routing_policy: RoutingPolicyName = Field("power_of_two", description=(
        "How the router picks a replica: two random ones and the less loaded "
        "(power_of_two), the least loaded, or the one holding the prompt's prefix "
        "(prefix_aware)."))
    routing: RoutingOptions = RoutingOptions()
    http: HTTPOptions = HTTPOptions()
    grpc: GRPCOptions = GRPCOptions()
    api_key: Optional[str] = Field(None, description=(
        "Require `Authorization: Bearer <key>` on HTTP (gRPC: metadata `authorization`)."))
    api_key_env: Optional[str] = Field(None, min_length=1, description=(
        "Or: the name of an environment variable holding the API key, read where the app is "
        "built (on Kubernetes a Secret exposed as env keeps the key out of the RayService)."))
    address: Optional[str] = Field(None, description=(
        "Ray cluster to join: 'auto' or host:port (unset: start an embedded local Ray "
        "sized for the topology)."))
    num_cpus_per_replica: float = Field(1.0, ge=0.0, description=(
        "CPUs Ray reserves for each engine replica (its torch threads); 0 lets Ray pack "
        "replicas. Tensor-parallel ranks take 1 CPU each on top."))
    enable_log_requests: bool = Field(False, description=(
        "Log one INFO line per request at the ingress: client, method, path, status, time."))
    engine_cls: str = Field("fleetserve.replica.engine.async_engine:AsyncEngine", description=(
        "The engine class each replica builds, 'module:Class' (tests may swap it)."))
    placement: ReplicaPlacement = Field(ReplicaPlacement(), description=(
        "Ray actor options of each engine replica: GPUs, custom resources, a node label "
        "selector (cluster/placement.py)."))
    autoscaling: Optional[AutoscalingOptions] = Field(None, description=(
        "Ray Serve autoscaling of the engine replicas; replaces num_replicas when set."))
    pd: PDOptions = Field(PDOptions(), description=(
        "Prefill/decode pools (the shape only; serving it is not in this build)."))

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
