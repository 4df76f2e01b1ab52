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
      connector: ray_object_store         # or shared_storage, or a registered/"module:Class" name
      kv_connector_extra_config: {}       # e.g. {path: /mnt/kv} for shared_storage
      min_prefill_tokens: 64              # uncached prompt tokens below this: decode computes them

With `pd.enabled`, `num_replicas` is unused: the app has two engine pools, each a
Ray Serve deployment of its own (`prefill`, `decode`), each pool's `engine` a set of
`EngineArgs` fields laid over the top-level `engine` (so the model is named once),
and its own `num_replicas` and `num_cpus_per_replica`. The pools' KV transfer
configs are derived from `connector` (prefill: `kv_producer`, decode:
`kv_consumer`); clients see the same HTTP and gRPC API (`router/routing/pd.py` has the flow).
"""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fleetserve.cluster.placement import AutoscalingOptions, PDOptions, PDPool, ReplicaPlacement
from fleetserve.kv_transfer.config import KVTransferConfig
from fleetserve.kv_transfer.registry import check_connector_name, check_connector_options
from fleetserve.replica.engine.engine_args import EngineArgs
from fleetserve.router.cors import LOCAL_ORIGINS, origin_pattern

# prefix_aware routes on the engines' KV events (a cluster-wide index of what each
# replica caches); prefix_aware_approx guesses from where prompts were sent.
RoutingPolicyName = Literal["power_of_two", "least_loaded", "prefix_aware", "prefix_aware_approx"]


class HTTPOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field(
        default="127.0.0.1",
        description=(
            "Address the HTTP and gRPC servers bind (0.0.0.0 or :: for every interface). "
            "With --address (a joined cluster) Ray Serve's proxy binds gRPC on every interface."
        ),
    )
    port: int = Field(default=8000, ge=0, le=65535, description="HTTP port (OpenAI API, /metrics, /health).")
    max_body_bytes: int = Field(
        default=4 * 1024 * 1024,
        ge=1024,
        description=("Largest request body; a larger one is refused with 413 before parsing."),
    )
    allowed_origins: tuple[str, ...] = Field(
        default=LOCAL_ORIGINS,
        description=(
            "Web pages whose scripts may call the API from a browser (CORS), a JSON list: exact "
            "origins, 'http://localhost:*' (any port), 'https://*.example.com', or '*' (any; "
            "vLLM's default). Default: pages served from this machine; [] turns CORS off."
        ),
    )
    allow_credentials: bool = Field(
        default=False, description=("CORS: let those pages send cookies and HTTP authentication.")
    )
    allowed_methods: tuple[str, ...] = Field(default=("*",), description="CORS: allowed methods (JSON list).")
    allowed_headers: tuple[str, ...] = Field(default=("*",), description="CORS: allowed request headers (JSON list).")
    return_tokens_as_token_ids: bool = Field(
        default=False,
        description=(
            "Logprobs name tokens 'token_id:<id>' instead of their text (vLLM's flag; a request "
            "can ask with its own return_tokens_as_token_ids), so tokens that are not whole "
            "UTF-8 text can be told apart."
        ),
    )

    @field_validator("allowed_origins")
    @classmethod
    def _check_origins(cls, value):
        for origin in value:
            origin_pattern(origin)  # ValueError naming the entry
        return value

    def cors(self) -> dict:
        return {
            "allowed_origins": self.allowed_origins,
            "allow_credentials": self.allow_credentials,
            "allowed_methods": self.allowed_methods,
            "allowed_headers": self.allowed_headers,
        }


class GRPCOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(default=True, description="Serve the gRPC API (fleetserve.v1.FleetServe).")
    port: int = Field(default=9000, ge=0, le=65535, description="gRPC port.")


class RoutingOptions(BaseModel):
    """Knobs of the routing policies (see `router/routing/policies/`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    imbalance_threshold: int = Field(
        default=4,
        ge=1,
        description=(
            "prefix_aware: a replica with this many more requests in flight than the least "
            "loaded one counts as overloaded, and its prefix match is ignored."
        ),
    )
    min_match_fraction: float = Field(
        default=0.5,
        gt=0.0,
        le=1.0,
        description=(
            "prefix_aware: the smallest fraction of the prompt's full blocks a match must cover "
            "to win over load (a shared chat header alone must not pin every request)."
        ),
    )
    max_table_entries: int = Field(
        default=200_000, ge=16, description=("prefix_aware: most block hashes the router remembers (LRU).")
    )
    stats_period_s: float = Field(
        default=1.0, gt=0.0, description=("How often replicas report their engine load to routers, in seconds.")
    )


class ClusterReuseOptions(BaseModel):
    """Cluster-wide prefix reuse (router/routing/prefix_reuse.py), for colocated apps: a replica
    the router picks that lacks a long prefix another replica caches loads it from that
    replica through `kv_connector` (every replica runs it as kv_both) instead of
    recomputing it. Needs routing_policy prefix_aware (the KV index says who holds what)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(
        default=False, description=("Let a replica load a long prefix its busy peer caches instead of recomputing it.")
    )
    kv_connector: str = Field(
        default="ray_object_store",
        description=(
            "The connector every replica runs as kv_both: ray_object_store, shared_storage, p2p, "
            "or a kv_transfer registered name / 'module:Class'."
        ),
    )
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict, description=("The connector's options."))
    min_tokens: int = Field(
        default=256,
        ge=1,
        description=(
            "Export from the holder only when the chosen replica would compute this many more prompt tokens itself."
        ),
    )
    kv_lease_s: float = Field(default=30.0, gt=0, description="How long the holder keeps an export.")
    kv_load_timeout_s: float = Field(default=10.0, gt=0, description="The loading side's deadline.")

    @field_validator("kv_connector")
    @classmethod
    def _known_connector(cls, v: str) -> str:
        check_connector_name(v)
        return v

    @model_validator(mode="after")
    def _connector_options(self) -> "ClusterReuseOptions":
        if self.enabled:
            check_connector_options(
                self.kv_connector,
                self.kv_connector_extra_config,
                "cluster_reuse.kv_connector_extra_config; flag --cluster-reuse-kv-connector-extra-config",
            )
        return self

    def kv_transfer_config(self) -> dict[str, Any]:
        return {
            "kv_connector": check_connector_name(self.kv_connector),
            "kv_role": "kv_both",
            "kv_connector_extra_config": dict(self.kv_connector_extra_config),
            "kv_load_failure_policy": "fail",
            "kv_lease_s": self.kv_lease_s,
            "kv_load_timeout_s": self.kv_load_timeout_s,
        }


class TracingOptions(BaseModel):
    """OpenTelemetry traces of requests (router/tracing.py; docs/serving/tracing.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    otlp_traces_endpoint: Optional[str] = Field(
        default=None,
        description=(
            "Send one trace per request (ingress, route, queue, prefill, kv_transfer, decode, "
            "migration spans) to this OTLP endpoint, e.g. http://127.0.0.1:4318/v1/traces "
            "(vLLM's flag; unset: the standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else no tracing)."
        ),
    )
    otlp_traces_protocol: Literal["http/protobuf", "grpc"] = Field(
        default="http/protobuf",
        description="OTLP transport: http/protobuf (port 4318 by convention) or grpc (4317, host:port).",
    )
    collect_detailed_traces: bool = Field(
        default=False,
        description=(
            "Also put every routing candidate's load on the route span and every prefill chunk "
            "on the prefill span (more bytes per trace)."
        ),
    )
    service_name: str = Field(
        default="fleetserve", description="The traces' service.name (OTEL_SERVICE_NAME wins when exported)."
    )
    max_queue_spans: int = Field(
        default=4096,
        ge=1,
        description=(
            "Spans each process holds for export; past it (a collector down or slow) spans are "
            "dropped and counted, never waited for."
        ),
    )
    export_timeout_s: float = Field(default=5.0, gt=0, description="One export call's deadline.")

    @model_validator(mode="after")
    def _check_endpoint(self) -> "TracingOptions":
        url = self.otlp_traces_endpoint
        if url is None:
            return self
        parsed = urllib.parse.urlsplit(url if "://" in url else f"//{url}")
        if self.otlp_traces_protocol == "http/protobuf" and (
            parsed.scheme not in ("http", "https") or not parsed.hostname
        ):
            raise ValueError(
                f"otlp_traces_endpoint {url!r}: http/protobuf needs an http(s) URL, e.g. "
                "http://127.0.0.1:4318/v1/traces (or --otlp-traces-protocol grpc for host:port)"
            )
        if self.otlp_traces_protocol == "grpc":
            try:
                port = parsed.port
            except ValueError:
                port = None
            if not parsed.hostname or port is None:
                raise ValueError(f"otlp_traces_endpoint {url!r}: grpc needs host:port, e.g. 127.0.0.1:4317")
        return self

    def settings(self) -> dict:
        """router.tracing.TracingSettings' fields."""
        return {
            "endpoint": self.otlp_traces_endpoint,
            "protocol": self.otlp_traces_protocol,
            "service_name": self.service_name,
            "detailed": self.collect_detailed_traces,
            "max_queue_spans": self.max_queue_spans,
            "export_timeout_s": self.export_timeout_s,
        }


class SloOptions(BaseModel):
    """SLO-aware admission at the router (router/routing/slo.py; docs/serving/slo.md): off
    until a target is set here or in a tenant's `slo` in --api-keys-file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft_ms: Optional[float] = Field(
        default=None,
        gt=0,
        description=(
            "Time-to-first-token SLO in milliseconds: the router sends a request to a replica predicted "
            "to meet it, and refuses it early (429 with Retry-After) when none is (unset: no TTFT target)."
        ),
    )
    itl_ms: Optional[float] = Field(
        default=None,
        gt=0,
        description="Inter-token latency SLO in milliseconds (a replica whose steps are slower is not chosen).",
    )
    profile: Optional[str] = Field(
        default=None,
        description=(
            "A step-cost profile: a shipped one's name (as `fleetserve sim --profile` takes, e.g. "
            "h100-llama-3.1-8b) or a JSON file (`fleetserve profile`'s output) the "
            "router predicts TTFT and ITL with; unset: estimated online from the replicas' load reports."
        ),
    )
    headroom: float = Field(
        default=0.6,
        gt=0.0,
        le=1.0,
        description="Admit when the predicted TTFT/ITL is at most this fraction of the target (a safety margin).",
    )

    @field_validator("profile")
    @classmethod
    def _readable_profile(cls, v: Optional[str]) -> Optional[str]:
        if v is not None:
            from fleetserve.scheduler.step_cost import read_profile_json

            read_profile_json(os.path.expanduser(v))  # ValueError naming the file and field
        return v


class ReliabilityOptions(BaseModel):
    """Failure handling, drain and admission (issue 15; docs/serving/reliability.md explains each)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    body_timeout_s: float = Field(
        default=30.0,
        gt=0.0,
        description=(
            "A request body not fully arrived after this many seconds gets 408 (a client that "
            "announced more bytes than it sends would otherwise hold its connection)."
        ),
    )
    graceful_shutdown_timeout_s: float = Field(
        default=60.0,
        ge=0.0,
        description=(
            "Drain: a replica asked to stop (SIGTERM, redeploy, scale-down) finishes its "
            "in-flight requests for up to this many seconds (Serve's setting, both deployments; "
            "Kubernetes' terminationGracePeriodSeconds must exceed it)."
        ),
    )
    graceful_shutdown_wait_loop_s: float = Field(
        default=1.0, gt=0.0, description=("How often a draining replica checks whether its requests are done.")
    )
    health_check_period_s: float = Field(
        default=5.0,
        gt=0.0,
        description=("Serve's health check of each engine replica and of the ingress (a failing one is replaced)."),
    )
    health_check_timeout_s: float = Field(
        default=20.0, gt=0.0, description=("A health check slower than this counts as failed.")
    )
    engine_stall_timeout_s: float = Field(
        default=30.0,
        gt=0.0,
        description=(
            "An engine that holds work but made no step for this long, or whose core answers "
            "no ping within it, is wedged: unhealthy."
        ),
    )
    max_migrations: int = Field(
        default=2,
        ge=0,
        description=(
            "A stream whose replica fails continues on another one at most this many times "
            "(router/routing/migration.py); 0 turns migration off."
        ),
    )
    max_queued_requests: int = Field(
        default=512,
        ge=-1,
        description=(
            "Requests waiting in Serve's queue for a replica slot beyond which new ones get 429 "
            "(Serve's max_queued_requests; -1: unbounded)."
        ),
    )
    max_queued_kv_ratio: float = Field(
        default=4.0,
        gt=0.0,
        description=(
            "A replica refuses (429) a request when its queued tokens exceed this many times "
            "its KV cache's capacity in tokens (router/routing/admission.py)."
        ),
    )
    metrics_report_interval_s: float = Field(
        default=1.0,
        gt=0.0,
        le=60.0,
        description=(
            "How often each engine replica reports its metrics to the app's metrics hub; /metrics "
            "answers from the latest reports and calls no replica (router/metrics_hub.py). A "
            "report 5 intervals old is left out (its age: fleetserve:replica_metrics_age_seconds)."
        ),
    )


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    name: str = Field(
        default="fleetserve",
        min_length=1,
        description=("Ray Serve application name (gRPC clients send it as metadata `application`)."),
    )
    # (model_validate({}) is EngineArgs(): EngineArgs gives its defaults positionally,
    # `Field(x, ...)`, which type checkers do not count as defaults.)
    engine: EngineArgs = EngineArgs.model_validate({})
    num_replicas: int = Field(default=2, ge=1, description="Engine replicas behind the router.")
    routing_policy: RoutingPolicyName = Field(
        default="power_of_two",
        description=(
            "How the router picks a replica: two random ones and the less loaded "
            "(power_of_two), the least loaded, or the one holding the prompt's prefix "
            "(prefix_aware)."
        ),
    )
    routing: RoutingOptions = RoutingOptions()
    http: HTTPOptions = HTTPOptions()
    grpc: GRPCOptions = GRPCOptions()
    api_key: Optional[str] = Field(
        default=None, description=("Require `Authorization: Bearer <key>` on HTTP (gRPC: metadata `authorization`).")
    )
    api_key_env: Optional[str] = Field(
        default=None,
        min_length=1,
        description=(
            "Or: the name of an environment variable holding the API key, read where the app is "
            "built (on Kubernetes a Secret exposed as env keeps the key out of the RayService)."
        ),
    )
    api_key_file: Optional[str] = Field(
        default=None, description=("Or: a file holding the API key (else $FLEETSERVE_API_KEY); keeps it out of `ps`.")
    )
    api_keys_file: Optional[str] = Field(
        default=None,
        description=(
            "A YAML/JSON map of tenant -> {key or key_sha256, weight, priority, limits: "
            "{max_tokens}}: each key opens the API and names the request's tenant (docs: Tenants). "
            "Without it the x-tenant-id header names the tenant (else 'default')."
        ),
    )
    max_tenant_labels: int = Field(
        default=32, ge=1, description="Most tenant label values in /metrics; later tenants count as 'other'."
    )
    api_key_open_paths: tuple[str, ...] = Field(
        default=("/health", "/ping", "/metrics"),
        description=('HTTP paths that need no API key (a JSON list); ["/health"] protects /metrics too.'),
    )
    reliability: ReliabilityOptions = ReliabilityOptions()
    slo: SloOptions = Field(
        default=SloOptions(),
        description="SLO-aware admission (--slo-ttft-ms, --slo-itl-ms, --slo-profile, --slo-headroom).",
    )
    tracing: TracingOptions = Field(
        default=TracingOptions(),
        description="OpenTelemetry traces of requests (--otlp-traces-endpoint, --collect-detailed-traces).",
    )
    address: Optional[str] = Field(
        default=None,
        description=(
            "Ray cluster to join: 'auto' or host:port (unset: start an embedded local Ray sized for the topology)."
        ),
    )
    num_cpus_per_replica: Optional[float] = Field(
        default=None,
        ge=0.0,
        description=(
            "CPUs Ray reserves for each engine replica (its torch threads); 0 lets Ray pack "
            "replicas (1 thread each). Tensor-parallel ranks take 1 CPU each on top. Unset: "
            "`fleetserve serve` with its embedded local Ray splits this machine's cores between "
            "the engine replicas (one replica uses them all, as `vllm serve` does); 1 otherwise."
        ),
    )
    allow_runtime_lora_updating: bool = Field(
        default_factory=lambda: os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
        description=(
            "Serve vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter, which load a PEFT "
            "folder from the replicas' disks on every engine replica (needs --enable-lora, and "
            "--lora-roots or --allow-any-lora-path; VLLM_ALLOW_RUNTIME_LORA_UPDATING=True sets it "
            "too). Off: those paths are a 404."
        ),
    )
    lora_admin_key: Optional[str] = Field(
        default=None,
        description=(
            "The key /v1/load_lora_adapter and /v1/unload_lora_adapter take instead of the API key "
            "(Authorization: Bearer); unset: --lora-admin-key-file, else $FLEETSERVE_LORA_ADMIN_KEY, "
            "else those paths take the API key like the others."
        ),
    )
    lora_admin_key_file: Optional[str] = Field(
        default=None, description=("Or: a file holding the LoRA admin key; keeps it out of `ps`.")
    )
    reasoning_parser: Optional[Literal["deepseek_r1", "qwen3"]] = Field(
        default=None,
        description=(
            "Chat: put a thinking model's <think>...</think> text in the message's reasoning_content "
            "(and reasoning), the rest in content (vLLM's flag). deepseek_r1: the output starts "
            "inside the block (the template opened it); qwen3: it thinks when it opens with <think>."
        ),
    )
    enable_log_requests: bool = Field(
        default=False, description=("Log one INFO line per request at the ingress: client, method, path, status, time.")
    )
    engine_cls: str = Field(
        default="fleetserve.replica.engine.async_engine:AsyncEngine",
        description=("The engine class each replica builds, 'module:Class' (tests may swap it)."),
    )
    placement: ReplicaPlacement = Field(
        default=ReplicaPlacement(),
        description=(
            "Ray actor options of each engine replica: GPUs, custom resources, a node label "
            "selector (cluster/placement.py)."
        ),
    )
    autoscaling: Optional[AutoscalingOptions] = Field(
        default=None, description=("Ray Serve autoscaling of the engine replicas; replaces num_replicas when set.")
    )
    pd: PDOptions = Field(
        default=PDOptions(),
        description=(
            "Prefill/decode disaggregation: a prefill pool and a decode pool of engine replicas "
            "and the KV connector between them (router/routing/pd.py)."
        ),
    )
    cluster_reuse: ClusterReuseOptions = Field(
        default=ClusterReuseOptions(),
        description=("Cluster-wide prefix reuse between colocated replicas (router/routing/prefix_reuse.py)."),
    )

    @model_validator(mode="after")
    def _check_reuse(self) -> "AppConfig":
        if self.cluster_reuse.enabled:
            if self.pd.enabled:
                raise ValueError(
                    "cluster_reuse is for colocated apps; with pd the prefill pool "
                    "computes what the decode replica lacks"
                )
            if self.routing_policy != "prefix_aware":
                raise ValueError(
                    "cluster_reuse needs routing_policy prefix_aware (the KV index says which replica holds a prefix)"
                )
        if self.allow_runtime_lora_updating and not self.engine.enable_lora:
            raise ValueError("allow_runtime_lora_updating needs enable_lora (--enable-lora)")
        if self.allow_runtime_lora_updating and not (self.engine.lora_roots or self.engine.allow_any_lora_path):
            raise ValueError(
                "allow_runtime_lora_updating loads adapters from the folders clients name: give the "
                "folders they may name (--lora-roots DIR ...), or --allow-any-lora-path"
            )
        if self.pd.enabled:  # a request's adapter runs on both sides of the hand-off
            held = {
                pool: tuple(m.name for m in self.pool_engine(pool).lora_modules or ()) for pool in ("prefill", "decode")
            }
            if held["prefill"] != held["decode"]:
                raise ValueError(
                    f"pd: the prefill pool's LoRA adapters {list(held['prefill'])} differ "
                    f"from the decode pool's {list(held['decode'])}; give both the same lora_modules"
                )
        return self

    @property
    def lora_adapters(self) -> dict[str, str]:
        """The adapters clients may name in `model`: name -> path (the decode pool's with P/D)."""
        engine = self.pool_engine("decode") if self.pd.enabled else self.engine
        return {m.name: m.path for m in engine.lora_modules or ()}

    @property
    def lora_parents(self) -> dict[str, str]:
        """The `base_model_name` the --lora-modules entries that give one name (their /v1/models
        card's parent; the others': the served model name)."""
        engine = self.pool_engine("decode") if self.pd.enabled else self.engine
        return {m.name: m.base_model_name for m in engine.lora_modules or () if m.base_model_name}

    def slo_settings(self):
        """The router's SLO admission settings (router.routing.slo.SloSettings), or None when no
        target is set (the app's or any tenant's in the keys file): admission is off."""
        from fleetserve.router.routing.slo import SloSettings, SloTarget
        from fleetserve.router.tenants import load_keys_file
        from fleetserve.scheduler.step_cost import read_profile_json

        o = self.slo
        default = SloTarget(
            o.ttft_ms / 1e3 if o.ttft_ms is not None else None, o.itl_ms / 1e3 if o.itl_ms is not None else None
        )
        tenants = {}
        for t in (load_keys_file(self.api_keys_file) if self.api_keys_file else {}).values():
            if t.slo_ttft_s is not None or t.slo_itl_s is not None:
                tenants[t.name] = SloTarget(t.slo_ttft_s, t.slo_itl_s)
        if not default.active and not tenants:
            return None
        engine = self.pool_engine("decode") if self.pd.enabled else self.engine
        return SloSettings(
            default=default,
            tenants=tenants,
            profile=read_profile_json(os.path.expanduser(o.profile)) if o.profile else None,
            max_num_batched_tokens=engine.max_num_batched_tokens,
            max_num_seqs=engine.max_num_seqs,
            block_size=engine.block_size,
            headroom=o.headroom,
        )

    def reuse_engine(self) -> EngineArgs:
        """The app's engine with the kv_both connector cluster reuse needs."""
        return self.engine.model_copy(
            update={"kv_transfer_config": KVTransferConfig.model_validate(self.cluster_reuse.kv_transfer_config())}
        )

    def pool_engine(self, pool: str) -> EngineArgs:
        """The EngineArgs of a P/D pool ("prefill" or "decode"): the app's engine, the pool's
        fields over it, and the KV transfer config of the pool's role."""
        pool_cfg: PDPool = getattr(self.pd, pool)
        role = "kv_producer" if pool == "prefill" else "kv_consumer"
        return EngineArgs.model_validate(
            {
                **self.engine.model_dump(exclude_unset=True),
                **pool_cfg.engine,
                "kv_transfer_config": self.pd.kv_transfer_config(role),
            }
        )

    @property
    def served_model_name(self) -> str:
        return self.engine.served_name or self.engine.model

    @property
    def max_ongoing_requests(self) -> int:
        """Serve's per-replica cap: above the engine's own queue so the engine
        answers 429 (bounded waiting) rather than Serve queueing forever."""
        return self.engine.max_num_seqs + self.engine.max_waiting_requests + 8

    @property
    def cpus_per_replica(self) -> float:
        """`num_cpus_per_replica`, 1 when unset (`topology.split_cores` sets it for an
        embedded Ray)."""
        return 1.0 if self.num_cpus_per_replica is None else self.num_cpus_per_replica

    @property
    def max_engine_replicas(self) -> int:
        """Engine replicas at most: both pools with P/D, the autoscaling ceiling."""
        if self.pd.enabled:
            return self.pd.prefill.num_replicas + self.pd.decode.num_replicas
        return self.autoscaling.max_replicas if self.autoscaling else self.num_replicas

    @property
    def replica_cpus(self) -> float:
        """CPUs the engine replicas reserve in all (both pools with P/D)."""
        if not self.pd.enabled:
            return self.num_replicas * self.cpus_per_replica
        return sum(
            p.num_replicas * (self.cpus_per_replica if p.num_cpus_per_replica is None else p.num_cpus_per_replica)
            for p in (self.pd.prefill, self.pd.decode)
        )

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
