"""Where engine replicas run and how many: the parts of the app config that a
cluster (a `ray up` cluster, a KubeRay RayService) needs beyond one machine.

    placement:   {num_gpus: 1, label_selector: {fleetserve.io/pool: engine}}
    autoscaling: {min_replicas: 1, max_replicas: 4, target_ongoing_requests: 64}
    pd:          {enabled: true, connector: ray_object_store,
                  prefill: {num_replicas: 1, placement: {label_selector: {fleetserve.io/pool: prefill}}},
                  decode:  {num_replicas: 2, placement: {label_selector: {fleetserve.io/pool: decode}}}}

`placement` becomes the engine deployment's Ray actor options. A Ray node label
selector is a hard constraint: a replica whose selector no node matches waits
(Pending) rather than landing elsewhere, which is how the Helm chart keeps engines
off the head and prefill replicas on prefill nodes (each worker group carries its
`fleetserve.io/pool` label).

`pd` is prefill/decode disaggregation (served by router/routing/pd.py): the pools' replicas,
placement and engine settings, and the connector between them. The chart's mapping to these keys lives in one place:
`helm/fleetserve/templates/_appconfig.tpl`.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fleetserve.kv_transfer.registry import check_connector_name, check_connector_options

POOL_LABEL = "fleetserve.io/pool"


class ReplicaPlacement(BaseModel):
    """Ray actor options of one engine replica (CPUs are `num_cpus_per_replica`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # GPUs the replica's actor holds. TP=1 on a GPU: 1. TP>1: 0 (the TP workers
    # reserve one GPU each in their placement group).
    num_gpus: float = Field(default=0.0, ge=0.0)
    # Custom Ray resources per replica, e.g. {"fleetserve-prefill": 1}.
    resources: dict[str, float] = {}
    # Ray node labels the replica's node must carry (hard constraint).
    label_selector: dict[str, str] = {}

    def actor_options(self) -> dict:
        out: dict = {}
        if self.num_gpus:
            out["num_gpus"] = self.num_gpus
        if self.resources:
            out["resources"] = dict(self.resources)
        if self.label_selector:
            out["label_selector"] = dict(self.label_selector)
        return out


class AutoscalingOptions(BaseModel):
    """Ray Serve autoscaling of the engine deployment (replaces `num_replicas`).
    Serve adds replicas while the average number of requests in flight per
    replica exceeds `target_ongoing_requests`; each new replica needs a node with
    room (on Kubernetes, KubeRay's autoscaler adds GPU pods up to the group's
    maxReplicas)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=4, ge=1)
    target_ongoing_requests: float = Field(default=64.0, gt=0.0)
    upscale_delay_s: float = Field(default=30.0, ge=0.0)
    downscale_delay_s: float = Field(default=600.0, ge=0.0)

    @model_validator(mode="after")
    def _bounds(self) -> "AutoscalingOptions":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must be <= max_replicas ({self.max_replicas})")
        return self

    def serve_config(self) -> dict:
        return self.model_dump()


class PDPool(BaseModel):
    """One engine pool of a P/D app: its replicas, where they run, its engine settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_replicas: int = Field(default=1, ge=1, description="Engine replicas in this pool.")
    placement: ReplicaPlacement = ReplicaPlacement()
    engine: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "EngineArgs fields laid over the app's `engine` for this pool (tensor_parallel_size, "
            "max_num_seqs, max_num_batched_tokens, ...); model and kv_transfer_config are set once "
            "for the app."
        ),
    )
    num_cpus_per_replica: Optional[float] = Field(
        default=None,
        ge=0.0,
        description=("CPUs reserved per replica of this pool (unset: the app's num_cpus_per_replica)."),
    )

    @field_validator("engine")
    @classmethod
    def _engine_fields(cls, v: dict[str, Any]) -> dict[str, Any]:
        from fleetserve.replica.engine.engine_args import EngineArgs

        unknown = set(v) - set(EngineArgs.model_fields)
        if unknown:
            raise ValueError(f"unknown engine fields {sorted(unknown)}")
        if "kv_transfer_config" in v or "model" in v:
            raise ValueError("set model and the connector once for the app (engine.model, pd.connector), not per pool")
        return v


class PDOptions(BaseModel):
    """Prefill/decode disaggregation: prompts are prefilled on the prefill pool and
    their KV cache handed to the decode pool through `connector` (router/routing/pd.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(
        default=False,
        description=("Serve with a prefill pool and a decode pool instead of num_replicas colocated replicas."),
    )
    connector: str = Field(
        default="ray_object_store",
        min_length=1,
        description=(
            "The KV connector between the pools: ray_object_store, shared_storage, p2p, or a "
            "kv_transfer registered name / 'module:Class'."
        ),
    )
    prefill: PDPool = Field(default=PDPool(), description="The prefill pool.")
    decode: PDPool = Field(default=PDPool(), description="The decode pool.")
    kv_connector_extra_config: dict[str, Any] = Field(
        default_factory=dict, description=('The connector\'s options (shared_storage: {"path": "/mnt/kv"}).')
    )
    kv_load_failure_policy: Literal["recompute", "fail"] = Field(
        default="fail",
        description=(
            "When a decode-side load fails or times out: the decode engine recomputes the prompt, "
            "or fails the request before its first token and the router sends it again as a "
            "recompute (within max_attempts). The client gets the right tokens either way."
        ),
    )
    kv_lease_s: float = Field(
        default=30.0,
        gt=0,
        description=("How long the prefill side keeps exported KV unless the decode side confirms first."),
    )
    kv_load_timeout_s: float = Field(
        default=10.0, gt=0, description=("The decode side's deadline in WAITING_FOR_REMOTE_KVS, in seconds.")
    )
    min_prefill_tokens: int = Field(
        default=64,
        ge=0,
        description=(
            "Skip the prefill pool when the decode replica would compute fewer prompt tokens than "
            "this itself (its cache covers the rest, or the prompt is short)."
        ),
    )
    max_attempts: int = Field(
        default=2,
        ge=1,
        description=(
            "Tries of the prefill call before the decode replica computes the prompt itself; "
            "and of the decode call after a failed load."
        ),
    )
    prefill_timeout_s: float = Field(default=60.0, gt=0, description="Deadline of one prefill call.")

    @field_validator("connector")
    @classmethod
    def _known_connector(cls, v: str) -> str:
        check_connector_name(v)
        return v

    @model_validator(mode="after")
    def _connector_options(self) -> "PDOptions":
        if self.enabled:  # (pd.connector has a default: its options are checked once P/D is on)
            check_connector_options(
                self.connector,
                self.kv_connector_extra_config,
                "pd.kv_connector_extra_config; flag --pd-kv-connector-extra-config",
            )
        return self

    @property
    def connector_name(self) -> str:
        return check_connector_name(self.connector)

    def kv_transfer_config(self, role: str) -> dict[str, Any]:
        return {
            "kv_connector": self.connector_name,
            "kv_role": role,
            "kv_connector_extra_config": dict(self.kv_connector_extra_config),
            "kv_load_failure_policy": self.kv_load_failure_policy,
            "kv_lease_s": self.kv_lease_s,
            "kv_load_timeout_s": self.kv_load_timeout_s,
        }
