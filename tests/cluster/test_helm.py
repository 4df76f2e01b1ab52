"""The Helm chart (helm/fleetserve), checked as far as this machine allows: no API
server, no KubeRay operator (see helm/fleetserve/README.md).

For each values file in helm/fleetserve/ci/: `helm lint --strict`, `helm template`,
built-in kinds through kubernetes-validate --strict, the RayService against KubeRay's
CRD schema the way a strict API server would, KubeRay's operator-side rules,
serveConfigV2 through Ray's ServeDeploySchema and fleetserve's own AppConfig, and the
placement the chart promises. Then bad values: each rejected, naming the key.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.cluster.k8s_tools import REPO, crd_dir, helm_binary, kuberay_rule_errors, strict_crd_validator

CHART = REPO / "helm" / "fleetserve"
VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
K8S_VERSION = "1.33.0"
POOL = "fleetserve.io/pool"


@pytest.fixture(scope="session")
def helm():
    path, why = helm_binary()
    if path is None:
        pytest.skip(why)
    return path


@pytest.fixture(scope="session")
def rayservice_validator():
    crds = crd_dir()
    if crds is None:
        pytest.skip("KubeRay CRDs not found: set FLEETSERVE_K8S_CRDS or put ../shared/k8s/crds beside the checkout")
    return strict_crd_validator(crds / "ray.io_rayservices.yaml")


def run_helm(helm, *args) -> subprocess.CompletedProcess:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=60)


def render(helm, values: list[Path] = (), sets: list[str] = ()) -> list[dict]:
    args = ["template", "rel", str(CHART)]
    for v in values:
        args += ["-f", str(v)]
    for s in sets:
        args += ["--set", s]
    r = run_helm(helm, *args)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def only(docs, kind) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def serve_config(rs: dict) -> dict:
    return yaml.safe_load(rs["spec"]["serveConfigV2"])


@pytest.mark.parametrize("values", VALUES, ids=lambda p: p.name.removesuffix("-values.yaml"))
def test_values_file_renders_valid_objects(helm, rayservice_validator, values):
    import kubernetes_validate
    from ray.serve.schema import ServeDeploySchema

    from fleetserve.cluster.app_spec import APP_BUILDER, validate_args

    r = run_helm(helm, "lint", "--strict", str(CHART), "-f", str(values))
    assert r.returncode == 0, r.stdout + r.stderr
    docs = render(helm, [values])
    for doc in docs:
        if doc["apiVersion"] in ("v1", "apps/v1"):
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    rs = only(docs, "RayService")
    errors = sorted(rayservice_validator.iter_errors(rs), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors[:10])
    assert kuberay_rule_errors(rs) == []
    doc = serve_config(rs)
    (app,) = ServeDeploySchema.model_validate(doc).applications
    assert app.import_path == APP_BUILDER
    config = validate_args(app.args)  # fleetserve's strict schema: unknown keys fail
    check_topology(rs, config, yaml.safe_load(values.read_text()))


def check_topology(rs, config, values):
    """The head serves nothing; GPUs per pod = TP; each pool's replicas can only land on
    that pool's pods (their label selector matches exactly one group's Ray labels)."""
    cluster = rs["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0" and head["rayStartParams"]["num-cpus"] == "0"
    head_res = head["template"]["spec"]["containers"][0].get("resources", {})
    assert not any("gpu" in k for part in head_res.values() for k in part)
    assert POOL not in head.get("labels", {})
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    tp = config.engine.tensor_parallel_size
    gpu = values.get("accelerator", {}).get("type", "nvidia") != "none"
    gpu_key = values.get("accelerator", {}).get("resourceName") or "nvidia.com/gpu"
    for name, g in groups.items():
        container = g["template"]["spec"]["containers"][0]
        limits = container["resources"]["limits"]
        assert limits.get(gpu_key, 0) == (tp if gpu else 0), name
        assert g["rayStartParams"]["num-gpus"] == str(tp if gpu else 0)
        assert g["labels"] == {POOL: name}
        probe = container["startupProbe"]
        assert probe["httpGet"]["path"] == "/health"
        budget = values.get("probes", {}).get("modelLoadSeconds", 1200)
        assert probe["periodSeconds"] * probe["failureThreshold"] >= budget
    pools = (
        {"prefill": config.pd.prefill.placement, "decode": config.pd.decode.placement}
        if config.pd.enabled
        else {"engine": config.placement}
    )
    assert set(pools) == set(groups)
    for pool, placement in pools.items():
        matching = [
            n for n, g in groups.items() if all(g["labels"].get(k) == v for k, v in placement.label_selector.items())
        ]
        assert placement.label_selector and matching == [pool]
        assert placement.num_gpus == (1 if gpu and tp == 1 else 0)


def test_gpu_values_details(helm):
    docs = render(helm, [CHART / "ci" / "gpu-values.yaml"])
    rs = only(docs, "RayService")
    (group,) = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    pod = group["template"]["spec"]
    c = pod["containers"][0]
    assert pod["runtimeClassName"] == "nvidia" and pod["priorityClassName"] == "llm-serving"
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["nodeSelector"] and pod["affinity"] and pod["topologySpreadConstraints"]
    assert {"secretRef": {"name": "hf-token"}} in c["envFrom"]
    api = [e for e in c["env"] if e["name"] == "FLEETSERVE_API_KEY"]
    assert api[0]["valueFrom"]["secretKeyRef"] == {"name": "fleetserve-api", "key": "api-key"}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
    assert vols["model"]["persistentVolumeClaim"]["claimName"] == "models-rox"
    args = serve_config(rs)["applications"][0]["args"]
    assert args["engine"]["model"] == "/models/llama-3.1-8b-instruct"
    assert args["api_key_env"] == "FLEETSERVE_API_KEY" and "api_key" not in args
    assert "hf-token" not in rs["spec"]["serveConfigV2"]
    svc = only(docs, "Service")
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"http": 8000, "grpc": 9000}
    assert svc["spec"]["selector"]["ray.io/serve"] == "true"
    kinds = {d["kind"] for d in docs}
    assert {"ServiceMonitor", "PodMonitor", "ConfigMap"} <= kinds
    dashboard = json.loads(only(docs, "ConfigMap")["data"]["fleetserve.json"])
    assert dashboard["uid"] == "fleetserve"


def test_notes_tell_how_to_reach_the_endpoints(helm):
    r = run_helm(helm, "install", "llm", str(CHART), "--dry-run=client", "-f", str(CHART / "ci" / "gpu-values.yaml"))
    assert r.returncode == 0, r.stderr
    notes = r.stdout[r.stdout.index("NOTES:") :]
    assert "port-forward svc/llama-8b 8000 9000" in notes
    assert "Authorization: Bearer" in notes and "fleetserve.v1.FleetServe/Health" in notes
    assert "twice the GPUs" in notes


def test_autoscaling_and_upgrade_strategy(helm):
    rs = only(render(helm, [CHART / "ci" / "autoscaling-values.yaml"]), "RayService")
    cluster = rs["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    (g,) = cluster["workerGroupSpecs"]
    assert (g["minReplicas"], g["maxReplicas"]) == (1, 6)
    args = serve_config(rs)["applications"][0]["args"]
    assert args["autoscaling"]["max_replicas"] == 6 and "num_replicas" not in args
    assert rs["spec"]["upgradeStrategy"]["clusterUpgradeOptions"]["gatewayClassName"] == "istio"
    # default: NewCluster, KubeRay's default, so nothing is written
    assert "upgradeStrategy" not in only(render(helm), "RayService")["spec"]


def test_cpu_values_serve_config_matches_fleetserve_build(helm, tmp_path):
    """serveConfigV2 is the document `fleetserve build` writes for the same app config."""
    from fleetserve.cluster.build import build_document

    rs = only(render(helm, [CHART / "ci" / "cpu-small-values.yaml"]), "RayService")
    chart_doc = serve_config(rs)
    app = tmp_path / "app.yaml"
    app.write_text(yaml.safe_dump(chart_doc["applications"][0]["args"]))
    assert build_document(str(app)) == chart_doc


def test_lora_values_reach_the_app_config(helm):
    """LoRA adapters from the values: engine.lora_modules (folders on the engine pods) and
    app.allowRuntimeLoraUpdating; the app config the head builds from them validates."""
    from fleetserve.cluster.config import AppConfig

    rs = only(
        render(
            helm,
            [CHART / "ci" / "cpu-small-values.yaml"],
            [
                "engine.lora_modules[0]=sql=/models/adapters/sql",
                "engine.lora_roots[0]=/models/adapters",
                "engine.max_loras=2",
                "app.allowRuntimeLoraUpdating=true",
            ],
        ),
        "RayService",
    )
    config = AppConfig.model_validate(serve_config(rs)["applications"][0]["args"])
    assert config.allow_runtime_lora_updating and config.engine.enable_lora
    assert config.lora_adapters == {"sql": "/models/adapters/sql"} and config.engine.max_loras == 2
    assert config.engine.lora_roots == ("/models/adapters",)


def test_tracing_values_reach_the_app_config(helm):
    """app.tracing is the app config's `tracing` block (docs/serving/tracing.md)."""
    from fleetserve.cluster.config import AppConfig

    rs = only(
        render(
            helm,
            [CHART / "ci" / "cpu-small-values.yaml"],
            [
                "app.tracing.otlp_traces_endpoint=http://otel-collector.observability:4318/v1/traces",
                "app.tracing.collect_detailed_traces=true",
            ],
        ),
        "RayService",
    )
    config = AppConfig.model_validate(serve_config(rs)["applications"][0]["args"])
    assert config.tracing.otlp_traces_endpoint == "http://otel-collector.observability:4318/v1/traces"
    assert config.tracing.collect_detailed_traces and config.tracing.otlp_traces_protocol == "http/protobuf"


def test_slo_values_reach_the_app_config(helm):
    """app.slo is the app config's `slo` block (docs/serving/slo.md); its bounds are the config's."""
    from fleetserve.cluster.config import AppConfig

    rs = only(
        render(helm, [CHART / "ci" / "cpu-small-values.yaml"], ["app.slo.ttft_ms=2000", "app.slo.itl_ms=100"]),
        "RayService",
    )
    config = AppConfig.model_validate(serve_config(rs)["applications"][0]["args"])
    assert (config.slo.ttft_ms, config.slo.itl_ms, config.slo.headroom) == (2000, 100, 0.6)


BAD = [
    # (--set arguments, what the error must name)
    (["app.slo.ttft_ms=0"], "/app/slo/ttft_ms"),
    (["workers.engine.replicass=2"], "replicass"),
    (["workers.engine.replicas=two"], "/workers/engine/replicas"),
    (["engine.max_num_seqs=0"], "/engine/max_num_seqs"),
    (["engine.bogus=1"], "bogus"),
    (["app.routingPolicy=random"], "/app/routingPolicy"),
    (["app.tracing.otlp_traces_protocol=udp"], "/app/tracing/otlp_traces_protocol"),
    (["engine.tensor_parallel_size=2", "workers.engine.gpus=4"], "workers.engine.gpus"),
    (
        ["engine.tensor_parallel_size=2", "workers.engine.resources.limits.nvidia\\.com/gpu=1"],
        "workers.engine.resources.limits.nvidia.com/gpu",
    ),
    (["head.resources.limits.nvidia\\.com/gpu=1"], "head.resources"),
    (["workers.engine.minReplicas=3", "workers.engine.maxReplicas=2"], "workers.engine.minReplicas"),
    (["fullnameOverride=" + "x" * 48], "47"),
    (["fullnameOverride=Bad_Name"], "DNS-1035"),
    (["workers.engine.rayStartParams.labels=a=b"], "workers.engine.rayStartParams.labels"),
    (["string:workers.engine.rayStartParams.num-gpus=2"], "workers.engine.rayStartParams.num-gpus"),
    (["workers.engine.rayStartParams.num-gpus=2"], "/workers/engine/rayStartParams/num-gpus"),
    (["upgradeStrategy.type=NewClusterWithIncrementalUpgrade"], "autoscaling.enabled"),
    (["upgradeStrategy.type=Rolling"], "/upgradeStrategy/type"),
    (
        [
            "autoscaling.enabled=true",
            "upgradeStrategy.type=NewClusterWithIncrementalUpgrade",
            "upgradeStrategy.clusterUpgradeOptions.gatewayClassName=gw",
            "upgradeStrategy.clusterUpgradeOptions.stepSizePercent=50",
        ],
        "stepSizePercent",
    ),
    (["pd.enabled=true", "autoscaling.enabled=true"], "autoscaling.enabled"),
    (["model.source=pvc"], "model.pvc.claimName"),
    (["model.source=image"], "model.path"),
    (["engine.model=x"], "engine.model"),
    (["engine.served_model_name=x"], "model.servedModelName"),
]


SCHEMA_KEYS = {"replicass", "bogus"}


@pytest.mark.parametrize("sets, named", BAD, ids=[b[1] for b in BAD])
def test_bad_values_fail_naming_the_key(helm, sets, named):
    flags = [
        x
        for s in sets
        for x in (("--set-string", s.removeprefix("string:")) if s.startswith("string:") else ("--set", s))
    ]
    r = run_helm(helm, "template", "rel", str(CHART), *flags)
    assert r.returncode != 0, f"{sets} rendered:\n{r.stdout[:2000]}"
    assert named in r.stderr, r.stderr
    assert "goroutine" not in r.stderr and "panic" not in r.stderr
    if named.startswith("/") or named in SCHEMA_KEYS:
        # schema errors fail `helm lint` too (template `fail`s are only logged there:
        # Helm's lint mode tolerates `fail`; template and install do not)
        lint = run_helm(helm, "lint", "--strict", str(CHART), *flags)
        assert lint.returncode != 0 and named in lint.stdout + lint.stderr


def test_values_schema_is_generated_from_engine_args():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen", REPO / "helm" / "gen_values_schema.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (CHART / "values.schema.json").read_text() == gen.render(), (
        "values.schema.json is stale: run python helm/gen_values_schema.py"
    )


def test_dashboard_queries_name_real_metrics():
    from fleetserve.replica.engine.metrics import EngineMetrics

    text = (CHART / "dashboards" / "fleetserve.json").read_text()
    metrics = EngineMetrics("m")
    metrics.request_finished("stop")  # a labelled counter shows once it has a sample
    exposed = set(re.findall(r"^([a-z0-9_:]+)(?:\{| )", metrics.text(), re.M))
    used = set(re.findall(r"(vllm:[a-z0-9_]+)", text))
    assert used and used <= exposed, used - exposed
    # fleetserve's own: the phase histograms and the span exports (router/tracing.py)
    from fleetserve.router.tracing import ExportCounts, PhaseHistograms

    phases = PhaseHistograms()
    phases.observe("engine", {"queue": 0.1})
    ours = phases.text("engine", ExportCounts())
    exposed_ours = set(re.findall(r"^([a-z0-9_:]+)(?:\{| )", ours, re.M))
    exposed_ours |= {n.replace("fleetserve:trace_spans", "fleetserve:router_trace_spans") for n in exposed_ours}
    used_ours = set(re.findall(r"(fleetserve:[a-z0-9_]+)", text))
    assert used_ours and used_ours <= exposed_ours, used_ours - exposed_ours


@pytest.mark.parametrize(
    "mutate, where",
    [
        (
            lambda rs: rs["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].__setitem__("num-cpus", 0),
            "rayStartParams",
        ),
        (lambda rs: rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].__setitem__("replicas", "2"), "replicas"),
        (
            lambda rs: rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][
                0
            ].__setitem__("imagePullPolicyy", "Always"),
            "imagePullPolicyy",
        ),
    ],
)
def test_crd_check_catches_what_a_strict_api_server_would(helm, rayservice_validator, mutate, where):
    """The CRD check is not vacuous: the mistakes KubeRay users make are caught."""
    rs = only(render(helm), "RayService")
    assert not list(rayservice_validator.iter_errors(rs))
    mutate(rs)
    errors = list(rayservice_validator.iter_errors(rs))
    assert errors and any(where in (e.message + str(list(e.absolute_path))) for e in errors)


def test_kuberay_rules_catch_operator_side_mistakes(helm):
    rs = only(render(helm), "RayService")
    group = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    group["minReplicas"], group["maxReplicas"] = 3, 2
    group["rayStartParams"]["labels"] = "a=b"
    rs["metadata"]["name"] = "x" * 48
    rs["spec"]["upgradeStrategy"] = {"type": "Rolling"}
    errors = "\n".join(kuberay_rule_errors(rs))
    for fragment in ("47 characters", "minReplicas", "labels", "upgradeStrategy.type"):
        assert fragment in errors
