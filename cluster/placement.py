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

`pd` is the minimal shape of prefill/decode disaggregation that the Helm chart and
the cluster files map onto; the P/D topology itself (routing, KV transfer) is not
in this module. The chart's mapping to these keys lives in one place:
`helm/fleetserve/templates/_appconfig.tpl`.
"""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

POOL_LABEL = "fleetserve.io/pool"


class ReplicaPlacement(BaseModel):
    """Ray actor options of one engine replica (CPUs are `num_cpus_per_replica`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # GPUs the replica's actor holds. TP=1 on a GPU: 1. TP>1: 0 (the TP workers
    # reserve one GPU each in their placement group).
    num_gpus: float = Field(0.0, ge=0.0)
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

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    target_ongoing_requests: float = Field(64.0, gt=0.0)
    upscale_delay_s: float = Field(30.0, ge=0.0)
    downscale_delay_s: float = Field(600.0, ge=0.0)

    @model_validator(mode="after")
    def _bounds(self) -> "AutoscalingOptions":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must be <= "
                             f"max_replicas ({self.max_replicas})")
        return self

    def serve_config(self) -> dict:
        return self.model_dump()


class PDPool(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    num_replicas: int = Field(1, ge=1)
    placement: ReplicaPlacement = ReplicaPlacement()


class PDOptions(BaseModel):
    """Prefill/decode disaggregation: prompts are prefilled on the prefill pool and
    their KV cache handed to the decode pool through `connector`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    connector: str = Field("ray_object_store", min_length=1)
    prefill: PDPool = PDPool()
    decode: PDPool = PDPool()


def check_supported(pd: Optional[PDOptions]) -> None:
    """The serving side of P/D is not part of this build: refuse clearly rather than
    serve a plain topology the user did not ask for."""
    if pd is not None and pd.enabled:
        raise ValueError("pd.enabled: prefill/decode disaggregation is not available in this "
                         "build of fleetserve (set pd.enabled: false)")
