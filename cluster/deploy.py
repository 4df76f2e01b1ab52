"""Turn an `AppConfig` into a running Ray Serve application.

    connect_ray(config)      # embedded local Ray, or join `config.address`
    start_serve(config)      # HTTP proxy + gRPC proxy options (must precede serve.run)
    deploy(config)           # ingress + N engine replicas with the chosen request router

The gRPC servicer is registered at `serve.start`; Serve ignores later changes,
so a process that needs different gRPC options needs a fresh Serve instance.

Direct ingress (embedded Ray, the default): the ingress replica itself listens on
the configured HTTP and gRPC ports (Ray Serve's `RAY_SERVE_ENABLE_DIRECT_INGRESS`,
with each port range pinned to the one configured port), so a request reaches the
ingress without passing through Serve's proxy actor: through the proxy, every
request costs an extra actor call plus a call back from the ingress to the proxy
for the body (what that costs in TTFT: docs/design/router.md, "Serve settings on
the request path"). Serve's proxy still runs (Serve starts direct-ingress servers
only while proxies are enabled), on free loopback ports nobody is told about. A joined
cluster (`--address`), or a Ray that was already running, keeps Serve's proxy on
the configured ports: its controller and replicas were started without our pins.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import socket
import sys
import time
from typing import Optional

import ray
from ray import serve
from ray.serve.config import HTTPOptions, RequestRouterConfig, gRPCOptions

from fleetserve.cluster.app_spec import GRPC_SERVICER, app_args, resolve_api_key
from fleetserve.cluster.config import AppConfig
from fleetserve.kv_transfer.secret import KV_SECRET_ENV
from fleetserve.router.auth import SECRET_ENVS, resolve_lora_admin_key
from fleetserve.router.cors import CorsSettings
from fleetserve.router.ingress import IngressDeployment
from fleetserve.router.replica import EngineReplica
from fleetserve.router.routing.pd import PDSettings
from fleetserve.router.routing.policies import POLICIES
from fleetserve.router.routing.prefix_reuse import ReuseSettings
from fleetserve.router.routing.request_router import FleetRequestRouter
from fleetserve.router.settings import IngressSettings, LoRASettings
from fleetserve.router.tenants import TenantSettings

logger = logging.getLogger(__name__)

ENGINE_DEPLOYMENT = "engine"
# With P/D (config.pd.enabled) the engines form two pools instead of "engine".
PREFILL_DEPLOYMENT = "prefill"
DECODE_DEPLOYMENT = "decode"
INGRESS_DEPLOYMENT = "ingress"
_NO_ACCESS_LOG = {"enable_access_log": False}

# Ray Serve settings on the request path. By default Serve runs user code on a
# second event loop in its own thread and a handle's router on a third, so every
# request and every streamed chunk crosses threads (and the GIL) several times in
# the ingress and in the engine replica. Our user code never blocks its loop (the
# engine steps on its own thread; the ingress's per-request work is tokenizing and
# validation), so it can run on Serve's loop. RAY_SERVE_USE_GRPC_BY_DEFAULT: the
# ingress calls engine replicas over a direct gRPC channel instead of Ray actor
# calls. These three are what Ray's documented "throughput optimized" mode
# (RAY_SERVE_THROUGHPUT_OPTIMIZED=1) sets for the request path; what each saves:
# docs/design/router.md, "Serve settings on the request path".
# A value already in the environment wins (export ...=1 to get Serve's defaults back).
SERVE_ENV_DEFAULTS = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
}


# Direct ingress (see the module docstring). One ingress replica on one pinned
# port: nothing sits in front of it, so its ports need neither the quarantine
# (150 s by default, for HAProxy's stale server lists) nor the 30 s drain
# (for load balancers to deregister it) that Serve applies after a replica stops.
DIRECT_INGRESS_ENV_DEFAULTS = {
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
    "RAY_SERVE_PORT_QUARANTINE_S": "0",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
}


# Housekeeping of an embedded Ray (one machine, nobody scraping Ray's own metrics),
# slowed down: an idle server's polling takes its CPU from the engines' OpenMP threads.
# - Serve's controller reconciles (and asks the GCS for node info) every 0.5 s, not every
#   0.1 s: replica failures and autoscaling decisions are acted on up to 0.4 s later.
# - Ray's own metrics (ray_serve_*, ray_* from every worker through the dashboard agent's
#   OpenTelemetry export) are off: fleetserve's /metrics (vLLM's names) does not use
#   them. A cluster started with `ray start` or KubeRay keeps them.
# - The log monitor re-globs the session's log folder at its own 0.5 s interval, not
#   every 0.1 s while the folder holds under 1000 files.
# What it saves: docs/benchmarks/results/2026-11-28-avx2-zen3.md ("The embedded Ray's
# housekeeping, slowed down"), summed up in docs/deployment/one-machine.md.
# Exported values win.
EMBEDDED_RAY_ENV_DEFAULTS = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_enable_metrics_collection": "0",
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
}


def embedded_ray_env() -> dict[str, str]:
    """EMBEDDED_RAY_ENV_DEFAULTS, exported values applied."""
    return {k: os.environ.get(k, v) for k, v in EMBEDDED_RAY_ENV_DEFAULTS.items()}


def serve_env() -> dict[str, str]:
    """The Serve request-path settings, environment overrides applied, plus any
    FLEETSERVE_* setting exported here (e.g. FLEETSERVE_ENGINE_CORE_PROCESS=0), so the
    replicas of a joined cluster see what this process sees."""
    env = {k: os.environ.get(k, v) for k, v in SERVE_ENV_DEFAULTS.items()}
    env.update(
        {k: v for k, v in os.environ.items() if k.startswith("FLEETSERVE_") and k not in SECRET_ENVS | {KV_SECRET_ENV}}
    )  # secrets stay out
    return env


# The (HTTP, gRPC) ports this process's embedded Ray was started to give the ingress
# replica directly; None when connect_ray did not start Ray that way.
_direct_ports: Optional[tuple[int, int]] = None


def direct_ingress(config: AppConfig) -> bool:
    """Whether the ingress replica serves the configured ports itself (embedded Ray,
    unless `RAY_SERVE_ENABLE_DIRECT_INGRESS=0` is exported)."""
    return not config.address and os.environ.get("RAY_SERVE_ENABLE_DIRECT_INGRESS", "1") != "0"


def connect_ray(config: AppConfig, **init_kwargs) -> None:
    """Start an embedded local Ray (loopback) or join `config.address`."""
    global _direct_ports
    if ray.is_initialized():
        return
    # Serve reads these when its modules are imported in each process: set here,
    # the embedded Ray's processes (proxy, controller, replicas) inherit them; the
    # replicas also get them through their runtime_env (a joined cluster).
    for key, value in serve_env().items():
        os.environ.setdefault(key, value)
    if config.address:
        ray.init(address=config.address, **init_kwargs)
        return
    os.environ.update(embedded_ray_env())
    if direct_ingress(config):
        for key, value in DIRECT_INGRESS_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        # The controller hands ingress replicas ports from these ranges ([min, max)):
        # pinned to the configured ports (one ingress replica), these are the ports
        # users see.
        for proto, port in (("HTTP", config.http.port), ("GRPC", config.grpc.port)):
            os.environ[f"RAY_SERVE_DIRECT_INGRESS_MIN_{proto}_PORT"] = str(port)
            os.environ[f"RAY_SERVE_DIRECT_INGRESS_MAX_{proto}_PORT"] = str(port + 1)
        _direct_ports = (config.http.port, config.grpc.port)
    if "num_cpus" not in init_kwargs:
        from fleetserve.cluster.topology import embedded_num_cpus

        init_kwargs["num_cpus"] = embedded_num_cpus(config)
    init_kwargs.setdefault("include_dashboard", False)
    init_kwargs.setdefault("_node_ip_address", "127.0.0.1")
    # "local": always a new embedded Ray. With no address, ray.init joins the latest cluster
    # that `ray start` left on this machine (its /tmp/ray/ray_current_cluster), or RAY_ADDRESS.
    with ray_processes_in_their_own_session():
        ray.init(address="local", **init_kwargs)


@contextlib.contextmanager
def ray_processes_in_their_own_session():
    """While an embedded Ray starts, its processes (GCS, raylet, log monitor, ...; and through
    the raylet its workers) get a session of their own instead of this process's group.

    A stop signal sent to a whole process group (`timeout`, `kill -- -PGID`, a supervisor's
    stop-as-group) reached them too: Ray shields them from SIGINT only, so a SIGTERM stopped
    the GCS under the graceful drain and Serve's delete then waited 60 s for it ("Failed to
    connect to GCS"). Kept apart, they leave the stop to this process, as a plain SIGTERM to
    its pid does. They still end with it: Ray starts them with PR_SET_PDEATHSIG. (A
    cgroup-wide stop, systemd's default KillMode, still reaches every process: lifecycle
    then stops waiting as soon as the GCS or raylet is gone.)"""
    from ray._private import services

    base = getattr(services, "ConsolePopen", None)
    if base is None or sys.platform == "win32":  # Ray's internals moved: start as Ray does
        yield
        return

    class OwnSession(base):
        def __init__(self, *args, **kwargs) -> None:
            kwargs.setdefault("start_new_session", True)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnSession
    try:
        yield
    finally:
        services.ConsolePopen = base


def start_serve(config: AppConfig) -> None:
    http_port, grpc_port = config.http.port, config.grpc.port
    # The ingress replica takes the configured ports, if Ray was started for that
    # (a Ray that was already running keeps Serve's proxy on them).
    if _direct_ports == (config.http.port, config.grpc.port):
        http_port, grpc_port = _free_port(config.http.host), _free_port("127.0.0.1")
    grpc = gRPCOptions(port=grpc_port, grpc_servicer_functions=[GRPC_SERVICER]) if config.grpc.enabled else None
    serve.start(
        http_options=HTTPOptions(host=config.http.host, port=http_port),
        grpc_options=grpc,
        logging_config=_NO_ACCESS_LOG,
    )


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def build_app(config: AppConfig):
    """The Serve application: one ingress in front of `num_replicas` engine replicas, or,
    with `pd.enabled`, in front of a decode pool and a prefill pool (router/routing/pd.py)."""
    engine = config.engine
    # Accepted in `model`: every served name, and the --model value itself; listed in
    # /v1/models: the served names.
    others = tuple(n for n in engine.served_model_names if n != config.served_model_name)
    aliases = tuple({engine.model} - {config.served_model_name, *others})
    ingress = serve.deployment(
        name=INGRESS_DEPLOYMENT,
        num_replicas=1,
        max_ongoing_requests=100_000,
        ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": serve_env()}},
        logging_config=_NO_ACCESS_LOG,
        **_lifecycle_options(config, health=False),
    )(IngressDeployment)
    settings = ingress_settings(config, others, aliases)
    if not config.pd.enabled:
        reuse = config.cluster_reuse
        replicas = _engine_deployment(
            config,
            ENGINE_DEPLOYMENT,
            config.reuse_engine() if reuse.enabled else engine,
            config.num_replicas,
            config.cpus_per_replica,
            config.routing_policy,
        )
        if reuse.enabled:
            settings = dataclasses.replace(settings, reuse=ReuseSettings(min_tokens=reuse.min_tokens))
        return ingress.bind(replicas, settings)
    pd = config.pd
    decode = _engine_deployment(
        config,
        DECODE_DEPLOYMENT,
        config.pool_engine("decode"),
        pd.decode.num_replicas,
        _pool_cpus(config, pd.decode),
        config.routing_policy,
        pd.decode.placement,
    )
    # Prefill replicas are chosen by what they cache too (a shared system prompt is prefilled
    # once per prefill replica), guarded by load like any prefix routing.
    prefill = _engine_deployment(
        config,
        PREFILL_DEPLOYMENT,
        config.pool_engine("prefill"),
        pd.prefill.num_replicas,
        _pool_cpus(config, pd.prefill),
        "prefix_aware",
        pd.prefill.placement,
    )
    settings = dataclasses.replace(
        settings,
        pd=PDSettings(
            min_prefill_tokens=pd.min_prefill_tokens,
            max_attempts=pd.max_attempts,
            prefill_timeout_s=pd.prefill_timeout_s,
        ),
    )
    return ingress.bind(decode, settings, prefill=prefill)


def ingress_settings(config: AppConfig, listed: tuple[str, ...], aliases: tuple[str, ...]) -> IngressSettings:
    """The ingress's settings from the app config (without P/D or reuse: build_app adds them)."""
    r = config.reliability
    lora = LoRASettings(
        adapters=config.lora_adapters,
        parents=config.lora_parents,
        allow_runtime_updating=config.allow_runtime_lora_updating,
        admin_key=resolve_lora_admin_key(config.lora_admin_key, config.lora_admin_key_file),
        load_timeout_s=config.engine.lora_load_timeout,
        # the app as configured: an ingress that Serve restarts after a crash (same
        # config) takes back the adapters loaded at run time (router/runtime_loras.py)
        app_name=config.name,
        instance_id=hashlib.sha256(json.dumps(app_args(config), sort_keys=True).encode()).hexdigest()[:16],
    )
    return IngressSettings(
        served_model_name=config.served_model_name,
        model_aliases=aliases,
        listed_names=listed,
        api_key=resolve_api_key(config),
        tenants=TenantSettings.from_keys_file(config.api_keys_file, config.max_tenant_labels),
        open_paths=tuple(config.api_key_open_paths),
        bind_host=config.http.host,
        cors=CorsSettings(**config.http.cors()),
        max_body_bytes=config.http.max_body_bytes,
        body_timeout_s=r.body_timeout_s,
        max_migrations=r.max_migrations,
        graceful_shutdown_timeout_s=r.graceful_shutdown_timeout_s,
        log_requests=config.enable_log_requests,
        return_tokens_as_token_ids=config.http.return_tokens_as_token_ids,
        reasoning_parser=config.reasoning_parser,
        lora=lora,
        tracing=config.tracing.settings(),
        slo=slo.to_dict() if (slo := config.slo_settings()) is not None else None,
    )


def _pool_cpus(config: AppConfig, pool) -> float:
    return config.cpus_per_replica if pool.num_cpus_per_replica is None else pool.num_cpus_per_replica


def _engine_deployment(
    config: AppConfig, name: str, engine, num_replicas: int, num_cpus: float, policy: str, placement=None
):
    """One pool of engine replicas (a Serve deployment) behind FleetRequestRouter."""
    placement = placement or config.placement
    # Prefix policies hash prompts with the engines' block size and hash function, which
    # the ingress takes from the engines' info (router/engine_pools.py: _set_pool_hashing).
    policy_kwargs = {
        "deployment": name,
        "policy": policy,
        "imbalance_threshold": config.routing.imbalance_threshold,
        "min_match_fraction": config.routing.min_match_fraction,
        "max_table_entries": config.routing.max_table_entries,
    }
    # SLO-aware admission decides where requests enter: the colocated pool, or the decode pool
    # (the P/D flow picks the decode replica first); the prefill pool's router has none.
    slo = config.slo_settings() if name in (ENGINE_DEPLOYMENT, DECODE_DEPLOYMENT) else None
    if slo is not None:
        policy_kwargs["slo"] = slo.to_dict()
    # (The ignores: Ray annotates RequestRouterConfig(**kwargs: dict[str, Any]), every value a dict.)
    router_config = RequestRouterConfig(
        request_router_class=FleetRequestRouter,  # type: ignore[arg-type]
        request_router_kwargs=policy_kwargs,
        request_routing_stats_period_s=config.routing.stats_period_s,  # type: ignore[arg-type]
    )
    # Autoscaling applies to the colocated engine deployment; P/D pools have fixed sizes.
    scale = (
        {"autoscaling_config": config.autoscaling.serve_config()}
        if config.autoscaling and name == ENGINE_DEPLOYMENT
        else {"num_replicas": num_replicas}
    )
    replica = serve.deployment(
        name=name,
        **scale,
        max_ongoing_requests=engine.max_num_seqs + engine.max_waiting_requests + 8,
        ray_actor_options={"num_cpus": num_cpus, "runtime_env": {"env_vars": serve_env()}, **placement.actor_options()},
        request_router_config=router_config,
        logging_config=_NO_ACCESS_LOG,
        **_lifecycle_options(config, health=True),
    )(EngineReplica)
    engine_args = engine.model_dump()
    if engine_args["num_threads"] is None:
        # Each replica gets the CPUs Ray reserves for it, not every core of the
        # machine: replicas sharing cores with all-core OpenMP pools spin against each
        # other (docs/benchmarks/results/2026-11-22-epyc-avx2-first-figures.md,
        # "Threads per engine process").
        engine_args["num_threads"] = max(1, int(num_cpus))
    if POLICIES[policy].uses_kv_events:
        engine_args["enable_kv_cache_events"] = True  # the router's prefix index reads them
    return replica.bind(
        engine_args,
        config.engine_cls,
        config.reliability.model_dump(),
        {**config.tracing.settings(), "log_phases": config.enable_log_requests},
    )


def _lifecycle_options(config: AppConfig, health: bool) -> dict:
    """Serve's drain and health-check settings from `config.reliability`: a replica asked to
    stop finishes its in-flight requests for up to graceful_shutdown_timeout_s (both
    deployments: the ingress holds the client streams, the engines produce them); `health`:
    an engine deployment, which also gets the bounded queue."""
    r = config.reliability
    options = {
        "graceful_shutdown_timeout_s": r.graceful_shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": r.graceful_shutdown_wait_loop_s,
    }
    # Both deployments: an ingress whose loop is wedged is replaced as an engine is (its
    # replacement waits for the ports: router/serve_patches.py).
    options.update(health_check_period_s=r.health_check_period_s, health_check_timeout_s=r.health_check_timeout_s)
    if health:  # the engine deployments
        options.update(max_queued_requests=r.max_queued_requests)
    return options


def deploy(config: AppConfig, blocking: bool = False):
    """Deploy (or update) the application; returns the ingress handle."""
    return serve.run(build_app(config), name=config.name, route_prefix="/", blocking=blocking)


def delete_and_drain(config: AppConfig) -> None:
    """Delete the application and wait until its replicas have drained and exited.

    `serve.delete` returns once the application is gone from the controller's state, while
    its replicas are still finishing their in-flight requests (up to
    graceful_shutdown_timeout_s); shutting Serve or Ray down at that point cut the streams.
    Here we also wait for the replica actors to exit, with a deadline of that timeout plus a
    margin (after it Serve has force-killed them anyway)."""
    serve.delete(config.name)
    prefix = f"SERVE_REPLICA::{config.name}#"
    deadline = time.monotonic() + config.reliability.graceful_shutdown_timeout_s + 15
    said = 0.0
    while time.monotonic() < deadline:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        left = [n for n in names if n.startswith(prefix)]
        if not left:
            return
        if time.monotonic() - said > 5:
            logger.info("waiting for %d replica(s) to finish their requests", len(left))
            said = time.monotonic()
        time.sleep(0.5)
    logger.warning("replicas of %r still running after the graceful shutdown timeout", config.name)


def endpoints(config: AppConfig) -> list[str]:
    lines = [
        f"HTTP (OpenAI):  http://{config.http.host}:{config.http.port}/v1  "
        f"(model {config.served_model_name!r}; /health, /metrics, /tokenize)"
    ]
    if config.grpc.enabled:
        if _direct_ports == (config.http.port, config.grpc.port):
            where = f"{config.http.host}:{config.grpc.port}"  # the ingress binds --host (serve_patches)
        else:  # Ray Serve 2.60's proxy binds gRPC to [::] whatever --host says
            where = f"[::]:{config.grpc.port} (every interface: Ray Serve's proxy)"
        lines.append(f"gRPC:           {where}  (service fleetserve.v1.FleetServe, metadata application={config.name})")
    return lines
