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
    pd:                                  # prefill/decode disaggregation (off by default)
      enabled: true
      prefill: {num_replicas: 1, engine: {max_num_batched_tokens: 4096}}
      decode: {num_replicas: 1, engine: {tensor_parallel_size: 1, max_num_seqs: 64}}
      kv_connector: ray_object_store      # or shared_storage, or a registered/"module:Class" name
      kv_connector_extra_config: {}       # e.g. {path: /mnt/kv} for shared_storage
      min_prefill_tokens: 64              # uncached prompt tokens below this: decode computes them

With `pd.enabled`, `num_replicas` is unused: the app has two engine pools, each a
Ray Serve deployment of its own (`prefill`, `decode`), each pool's `engine` a set of
`EngineArgs` fields laid over the top-level `engine` (so the model is named once),
and its own `num_replicas` and `num_cpus_per_replica`. The pools' KV transfer
configs are derived from `kv_connector` (prefill: `kv_producer`, decode:
`kv_consumer`); clients see the same HTTP and gRPC API (`router/pd.py` has the flow).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fleetserve.kv_transfer.config import KVTransferConfig
from fleetserve.replica.engine.engine_args import EngineArgs

# prefix_aware routes on the engines' KV events (a cluster-wide index of what each
# replica caches); prefix_aware_approx guesses from where prompts were sent.
RoutingPolicyName = Literal["power_of_two", "least_loaded", "prefix_aware", "prefix_aware_approx"]


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


# Short connector names (the CLI's --kv-connector) -> kv_transfer's registered names.
KV_CONNECTORS = {"ray_object_store": "RayObjectStoreConnector",
                 "shared_storage": "SharedStorageConnector"}


class PDPool(BaseModel):
    """One engine pool of a P/D app: its replicas and its engine settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_replicas: int = Field(1, ge=1)
    # EngineArgs fields laid over the app's `engine` for this pool (tensor_parallel_size,
    # max_num_seqs, max_num_batched_tokens, ...). kv_transfer_config is derived: leave it out.
    engine: dict[str, Any] = Field(default_factory=dict)
    # CPUs reserved per replica of this pool; None: the app's num_cpus_per_replica.
    num_cpus_per_replica: Optional[float] = Field(None, ge=0.0)

    @field_validator("engine")
    @classmethod
    def _engine_fields(cls, v: dict[str, Any]) -> dict[str, Any]:
        unknown = set(v) - set(EngineArgs.model_fields)
        if unknown:
            raise ValueError(f"unknown engine fields {sorted(unknown)}")
        if "kv_transfer_config" in v or "model" in v:
            raise ValueError("set model and the connector once for the app (engine.model, "
                             "pd.kv_connector), not per pool")
        return v


class PDOptions(BaseModel):
    """Prefill/decode disaggregation: a prefill pool, a decode pool, the connector between."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    prefill: PDPool = PDPool()
    decode: PDPool = PDPool()
    # ray_object_store | shared_storage | a kv_transfer registered name or "module:Class".
    kv_connector: str = "ray_object_store"
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict)
    # What the decode engine does when a load fails or times out: recompute the prompt
    # itself, or fail the request so the router retries it (as a recompute) within
    # max_attempts. Either way the client gets the right tokens.
    kv_load_failure_policy: Literal["recompute", "fail"] = "fail"
    kv_lease_s: float = Field(30.0, gt=0)  # the prefill engine holds exported KV this long
    kv_load_timeout_s: float = Field(10.0, gt=0)  # decode's deadline in WAITING_FOR_REMOTE_KVS
    # Skip the prefill pool when the decode replica would compute fewer prompt tokens than
    # this itself (its cache covers the rest, or the prompt is short).
    min_prefill_tokens: int = Field(64, ge=0)
    # Tries of the prefill call (another prefill replica each time) before the decode
    # replica computes the prompt itself; and of the decode call after a failed load.
    max_attempts: int = Field(2, ge=1)
    prefill_timeout_s: float = Field(60.0, gt=0)

    @property
    def connector_name(self) -> str:
        return KV_CONNECTORS.get(self.kv_connector, self.kv_connector)

    def kv_transfer_config(self, role: str) -> dict[str, Any]:
        return {"kv_connector": self.connector_name, "kv_role": role,
                "kv_connector_extra_config": dict(self.kv_connector_extra_config),
                "kv_load_failure_policy": self.kv_load_failure_policy,
                "kv_lease_s": self.kv_lease_s, "kv_load_timeout_s": self.kv_load_timeout_s}


class ClusterReuseOptions(BaseModel):
    """Cluster-wide prefix reuse (router/prefix_reuse.py), for colocated apps: a replica
    the router picks that lacks a long prefix another replica caches loads it from that
    replica through `kv_connector` (every replica runs it as kv_both) instead of
    recomputing it. Needs routing_policy prefix_aware (the KV index says who holds what)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    kv_connector: str = "ray_object_store"
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict)
    # Export from the holder only when the chosen replica would compute this many more tokens.
    min_tokens: int = Field(256, ge=1)
    kv_lease_s: float = Field(30.0, gt=0)
    kv_load_timeout_s: float = Field(10.0, gt=0)

    def kv_transfer_config(self) -> dict[str, Any]:
        return {"kv_connector": KV_CONNECTORS.get(self.kv_connector, self.kv_connector),
                "kv_role": "kv_both", "kv_connector_extra_config": dict(self.kv_connector_extra_config),
                "kv_load_failure_policy": "fail", "kv_lease_s": self.kv_lease_s,
                "kv_load_timeout_s": self.kv_load_timeout_s}


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
    # Ray address: None starts an embedded local Ray; "auto" (or host:port) joins.
    address: Optional[str] = None
    # CPUs reserved per engine replica (its torch threads); 0 lets Ray pack them.
    num_cpus_per_replica: float = Field(1.0, ge=0.0)
    # The engine class each replica builds, "module:Class" (tests may swap it).
    engine_cls: str = "fleetserve.replica.engine.async_engine:AsyncEngine"
    # Prefill/decode disaggregation (see PDOptions and the module docstring).
    pd: PDOptions = PDOptions()
    # Cluster-wide prefix reuse between colocated replicas (see ClusterReuseOptions).
    cluster_reuse: ClusterReuseOptions = ClusterReuseOptions()

    @model_validator(mode="after")
    def _check_reuse(self) -> "AppConfig":
        if self.cluster_reuse.enabled:
            if self.pd.enabled:
                raise ValueError("cluster_reuse is for colocated apps; with pd the prefill pool "
                                 "computes what the decode replica lacks")
            if self.routing_policy != "prefix_aware":
                raise ValueError("cluster_reuse needs routing_policy prefix_aware (the KV index "
                                 "says which replica holds a prefix)")
        return self

    def reuse_engine(self) -> EngineArgs:
        """The app's engine with the kv_both connector cluster reuse needs."""
        return self.engine.model_copy(update={"kv_transfer_config": KVTransferConfig.model_validate(
            self.cluster_reuse.kv_transfer_config())})

    def pool_engine(self, pool: str) -> EngineArgs:
        """The EngineArgs of a P/D pool ("prefill" or "decode"): the app's engine, the pool's
        fields over it, and the KV transfer config of the pool's role."""
        pool_cfg: PDPool = getattr(self.pd, pool)
        role = "kv_producer" if pool == "prefill" else "kv_consumer"
        return EngineArgs.model_validate({**self.engine.model_dump(exclude_unset=True),
                                          **pool_cfg.engine,
                                          "kv_transfer_config": self.pd.kv_transfer_config(role)})

    @property
    def served_model_name(self) -> str:
        return self.engine.served_model_name or self.engine.model

    @property
    def max_ongoing_requests(self) -> int:
        """Serve's per-replica cap: above the engine's own queue so the engine
        answers 429 (bounded waiting) rather than Serve queueing forever."""
        return self.engine.max_num_seqs + self.engine.max_waiting_requests + 8

    @property
    def replica_cpus(self) -> float:
        """CPUs the engine replicas reserve in all (both pools with P/D)."""
        if not self.pd.enabled:
            return self.num_replicas * self.num_cpus_per_replica
        return sum(p.num_replicas * (self.num_cpus_per_replica if p.num_cpus_per_replica is None
                                     else p.num_cpus_per_replica)
                   for p in (self.pd.prefill, self.pd.decode))

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
