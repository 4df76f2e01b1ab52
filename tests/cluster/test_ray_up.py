"""The `ray up` cluster files in cluster/ray-up/, checked offline with Ray's own code:
its JSON schema on the file as written, `prepare_config` then `validate_config`; for AWS
also Ray's `bootstrap_aws` against moto's mocked AWS (which rejects unknown instance
types and fills GPU counts from the instance type); GCP gets our own checks. The app
configs they deploy validate with fleetserve's AppConfig and build to a Serve config.
The on-prem file really runs against this machine: tests/cluster/test_ray_up_local.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from tests.cluster.k8s_tools import REPO

RAY_UP = REPO / "cluster" / "ray-up"
FILES = ["onprem.yaml", "aws-gpu.yaml", "gcp-gpu.yaml"]
POOL = "fleetserve.io/pool"


def load(name: str) -> dict:
    return yaml.safe_load((RAY_UP / name).read_text())


@pytest.mark.parametrize("name", FILES)
def test_cluster_file_passes_ray_schema_and_validation(name):
    import jsonschema
    import ray.autoscaler
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = load(name)
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(config, schema)  # the file as written
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    # every local path mounted exists in the checkout (ray up runs from its root)
    for remote, local in config.get("file_mounts", {}).items():
        assert (REPO / local).exists(), f"{name}: file_mounts {remote}: {local} missing"
    starts = " ".join(config["head_start_ray_commands"])
    assert "fleetserve build ~/fleetserve-app.yaml" in starts and "serve deploy" in starts
    assert any("pip install" in c and "fleetserve-src" in c for c in config["setup_commands"])


@pytest.mark.parametrize("name", ["aws-gpu.yaml", "gcp-gpu.yaml"])
def test_cloud_files_keep_engines_off_the_cpu_head(name):
    from fleetserve.cluster.app_spec import validate_args

    config = load(name)
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"].get("GPU") == 0
    assert "--num-gpus=0" in " ".join(config["head_start_ray_commands"])
    workers = [t for n, t in types.items() if n != config["head_node_type"]]
    assert workers and all(t["labels"] == {POOL: "engine"} for t in workers)
    app_file = REPO / config["file_mounts"]["~/fleetserve-app.yaml"]
    app = validate_args(yaml.safe_load(app_file.read_text()))
    # engines need a GPU and a label only GPU workers carry
    assert app.placement.num_gpus >= 1 and app.placement.label_selector == {POOL: "engine"}


def test_gcp_file_own_checks():
    config = load("gcp-gpu.yaml")
    assert config["provider"]["project_id"]
    for name, t in config["available_node_types"].items():
        node = t["node_config"]
        if node.get("guestAccelerators"):
            # a mapping: GCP rejects Ray's example's list form
            assert node["scheduling"] == {"onHostMaintenance": "TERMINATE"}, name
            assert t["resources"]["GPU"] == sum(a["acceleratorCount"] for a in node["guestAccelerators"])
    assert any("nvidia-smi" in c for c in config["worker_setup_commands"])


def only_these_instance_types(types):
    """Ray's list_ec2_instances pages through every EC2 instance type (~50 s under moto
    on 2 cores); ask moto about the config's types only, dropping the unknown ones as a
    region that lacks them would, so Ray's own fill-out code decides the rest."""
    from botocore.exceptions import ClientError
    from ray.autoscaler._private.aws.utils import client_cache

    def list_ec2_instances(region, aws_credentials=None):
        ec2 = client_cache("ec2", region, 1, **(aws_credentials or {}))
        found = []
        for t in sorted(types):
            try:
                found += ec2.describe_instance_types(InstanceTypes=[t])["InstanceTypes"]
            except ClientError as e:
                assert "InvalidInstanceType" in str(e), e
        return found

    return list_ec2_instances


def test_aws_file_bootstraps_against_mocked_aws(tmp_path, monkeypatch):
    moto = pytest.importorskip("moto")
    monkeypatch.setenv("MOTO_IAM_LOAD_MANAGED_POLICIES", "true")
    monkeypatch.setenv("HOME", str(tmp_path))  # bootstrap writes an ssh key under ~/.ssh
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(key, "testing")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    import time

    monkeypatch.setattr(time, "sleep", lambda s: None)  # IAM propagation waits
    from ray.autoscaler._private.aws import node_provider
    from ray.autoscaler._private.aws.config import bootstrap_aws
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(load("aws-gpu.yaml"))
    validate_config(config)
    types = {t["node_config"]["InstanceType"] for t in config["available_node_types"].values()}
    monkeypatch.setattr(node_provider, "list_ec2_instances", only_these_instance_types(types | {"g5.huge"}))
    fill = node_provider.AWSNodeProvider.fillout_available_node_types_resources
    with moto.mock_aws():
        boot = bootstrap_aws(config)
        filled = fill(boot)["available_node_types"]
        bad = copy.deepcopy(boot)
        bad["available_node_types"]["gpu_worker"]["node_config"]["InstanceType"] = "g5.huge"
        with pytest.raises(ValueError, match="g5.huge"):
            fill(bad)
    worker = filled["gpu_worker"]
    assert worker["resources"]["GPU"] == 1 and worker["resources"]["CPU"] == 4
    assert "accelerator_type:A10G" in worker["resources"]
    assert filled["head"]["resources"]["GPU"] == 0
    assert boot["head_node"]["IamInstanceProfile"]
    assert Path(boot["auth"]["ssh_private_key"]).expanduser().exists()
