"""Writes helm/fleetserve/values.schema.json (JSON Schema 2020-12, which Helm checks on
`lint`, `install` and `template`). Run after changing values.yaml's shape or EngineArgs:

    python helm/gen_values_schema.py

Chart-owned keys are closed (`additionalProperties: false`): a typo fails with the key
named. Kubernetes pass-through objects (affinity, tolerations, env, volumes, ...) stay
open; the API server checks them. The `engine` block is derived from fleetserve's
EngineArgs, so its keys, types, enums and minimums are the engine's own.
tests/cluster/test_helm.py fails when the committed file differs from this output.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SCHEMA_PATH = Path(__file__).parent / "fleetserve" / "values.schema.json"
# Set through `model:` (they depend on the model source), not `engine:`. The schema
# lets them through so that the chart's own rule can say where they go instead.
ENGINE_KEYS_FROM_MODEL = ("model", "served_model_name")


def obj(props: dict, required: tuple = ()) -> dict:
    out = {"type": "object", "additionalProperties": False, "properties": props}
    if required:
        out["required"] = list(required)
    return out


STR = {"type": "string"}
BOOL = {"type": "boolean"}
OPEN_OBJ = {"type": "object"}
OPEN_LIST = {"type": "array", "items": {"type": "object"}}
STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
QUANTITY = {"type": ["string", "integer", "number"]}
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}


def int_min(n: int) -> dict:
    return {"type": "integer", "minimum": n}


def engine_schema() -> dict:
    from fleetserve.replica.engine.engine_args import EngineArgs

    props = {}
    for name, spec in EngineArgs.model_json_schema()["properties"].items():
        props[name] = {} if name in ENGINE_KEYS_FROM_MODEL else strip(spec)
    return obj(props)


def strip(spec: dict) -> dict:
    keep = ("type", "enum", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
    if "anyOf" in spec:
        return {"anyOf": [strip(s) for s in spec["anyOf"]]}
    return {k: v for k, v in spec.items() if k in keep}


def resources() -> dict:
    return obj(
        {
            "requests": {"type": "object", "additionalProperties": QUANTITY},
            "limits": {"type": "object", "additionalProperties": QUANTITY},
            "claims": OPEN_LIST,
        }
    )


def pod_keys() -> dict:
    """The keys every group (head and workers) takes."""
    return {
        "resources": resources(),
        "nodeSelector": STR_MAP,
        "tolerations": OPEN_LIST,
        "affinity": OPEN_OBJ,
        "topologySpreadConstraints": OPEN_LIST,
        "priorityClassName": STR,
        "runtimeClassName": STR,
        "annotations": STR_MAP,
        "labels": STR_MAP,
        "env": OPEN_LIST,
        "envFrom": OPEN_LIST,
        "volumes": OPEN_LIST,
        "volumeMounts": OPEN_LIST,
        "shmSize": {"type": "string", "pattern": "^([0-9]+(\\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?)?$"},
        "rayStartParams": STR_MAP,
    }


def worker_group() -> dict:
    return obj(
        {"replicas": int_min(0), "minReplicas": int_min(0), "maxReplicas": int_min(0), "gpus": int_min(0), **pod_keys()}
    )


def monitor() -> dict:
    return obj({"enabled": BOOL, "interval": STR, "labels": STR_MAP})


def app_schema() -> dict:
    """The app config the chart renders for Serve."""
    return obj(
        {
            "name": {"type": "string", "minLength": 1},
            "routingPolicy": {"enum": ["power_of_two", "least_loaded", "prefix_aware"]},
            "routing": obj(
                {
                    "imbalance_threshold": int_min(1),
                    "min_match_fraction": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                    "max_table_entries": int_min(16),
                    "stats_period_s": {"type": "number", "exclusiveMinimum": 0},
                }
            ),
            "numCpusPerReplica": {"type": "number", "minimum": 0},
            "httpMaxBodyBytes": int_min(1024),
            "allowRuntimeLoraUpdating": BOOL,
            "tracing": options_schema("TracingOptions"),
            "slo": options_schema("SloOptions"),
        }
    )


def options_schema(model: str) -> dict:
    """app.tracing / app.slo: the app config's `tracing` / `slo` block (cluster/config.py
    TracingOptions / SloOptions), their keys, types and bounds the config's own."""
    from fleetserve.cluster import config

    props = {}
    for name, spec in getattr(config, model).model_json_schema()["properties"].items():
        spec = {k: v for k, v in spec.items() if k not in ("title", "default")}
        props[name] = spec
    return obj(props)


def autoscaling_schema() -> dict:
    """Serve's autoscaling of the engine deployment."""
    return obj(
        {
            "enabled": BOOL,
            "minReplicas": int_min(0),
            "maxReplicas": int_min(1),
            "targetOngoingRequests": {"type": "number", "exclusiveMinimum": 0},
            "upscaleDelaySeconds": {"type": "number", "minimum": 0},
            "downscaleDelaySeconds": {"type": "number", "minimum": 0},
            "idleTimeoutSeconds": int_min(0),
        }
    )


def upgrade_schema() -> dict:
    """KubeRay's RayService upgrade strategy."""
    return obj(
        {
            "type": {"enum": ["NewCluster", "NewClusterWithIncrementalUpgrade", "None"]},
            "clusterUpgradeOptions": obj(
                {
                    "gatewayClassName": STR,
                    "stepSizePercent": {"type": "integer", "minimum": 1, "maximum": 100},
                    "maxSurgePercent": {"type": "integer", "minimum": 1, "maximum": 100},
                    "intervalSeconds": int_min(1),
                }
            ),
        }
    )


def schema() -> dict:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "fleetserve Helm chart values (generated by helm/gen_values_schema.py)",
        **obj(
            {
                "nameOverride": STR,
                "fullnameOverride": STR,
                "global": OPEN_OBJ,
                "image": obj(
                    {
                        "repository": {"type": "string", "minLength": 1},
                        "tag": STR,
                        "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
                    }
                ),
                "imagePullSecrets": OPEN_LIST,
                "rayVersion": STR,
                "model": obj(
                    {
                        "source": {"enum": ["registry", "image", "pvc"]},
                        "name": STR,
                        "path": STR,
                        "servedModelName": STR,
                        "pvc": obj({"claimName": STR, "mountPath": STR, "readOnly": BOOL}),
                    }
                ),
                "engine": engine_schema(),
                "app": app_schema(),
                "accelerator": obj({"type": {"enum": ["nvidia", "amd", "none"]}, "resourceName": STR}),
                "auth": obj({"apiKeySecret": obj({"name": STR, "key": STR})}),
                "modelCredentials": obj({"secretName": STR}),
                "service": obj(
                    {
                        "type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                        "httpPort": PORT,
                        "grpcPort": PORT,
                        "grpc": BOOL,
                        "annotations": STR_MAP,
                    }
                ),
                "head": obj(pod_keys()),
                "workers": obj({"engine": worker_group(), "prefill": worker_group(), "decode": worker_group()}),
                "pd": obj({"enabled": BOOL, "connector": {"type": "string", "minLength": 1}}),
                "autoscaling": autoscaling_schema(),
                "upgradeStrategy": upgrade_schema(),
                "probes": obj({"modelLoadSeconds": int_min(10), "periodSeconds": int_min(1)}),
                "monitoring": obj(
                    {
                        "serviceMonitor": monitor(),
                        "podMonitor": monitor(),
                        "grafanaDashboard": obj({"enabled": BOOL, "labels": STR_MAP}),
                    }
                ),
            }
        ),
    }


def render() -> str:
    return json.dumps(schema(), indent=2) + "\n"


if __name__ == "__main__":
    SCHEMA_PATH.write_text(render())
    print(f"wrote {SCHEMA_PATH}", file=sys.stderr)
