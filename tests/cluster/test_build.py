"""`fleetserve build`: the app config as a Ray Serve deploy config.

The written file passes Ray's own ServeDeploySchema, its `args` round-trip through
AppConfig, and bad configs fail naming the field. That the file really deploys with
`serve deploy` and serves: tests/cluster/test_ray_up_local.py (ray up runs
`fleetserve build` + `serve deploy` on the head).
"""

from __future__ import annotations

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from fleetserve.cluster.app_spec import APP_BUILDER, AppConfigError, validate_args
from fleetserve.cluster.cli import main
from fleetserve.cluster.config import AppConfig
from fleetserve.cluster.serve_app import app_builder

APP = {
    "name": "chat",
    "engine": {"model": "smollm2-135m", "max_num_seqs": 8, "tensor_parallel_size": 1},
    "num_replicas": 3,
    "routing_policy": "prefix_aware",
    "api_key": "k",
    "http": {"host": "0.0.0.0", "port": 8100},
    "grpc": {"port": 9100},
    "placement": {"num_gpus": 1, "label_selector": {"fleetserve.io/pool": "engine"}},
    "autoscaling": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 32},
    "address": "auto",
}


def write(path, data) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_build_writes_a_serve_deploy_config_that_round_trips(tmp_path, capsys):
    out = tmp_path / "serve.yaml"
    assert main(["build", write(tmp_path / "app.yaml", APP), "-o", str(out)]) == 0
    doc = yaml.safe_load(out.read_text())
    schema = ServeDeploySchema.model_validate(doc)
    assert schema.http_options.host == "0.0.0.0" and schema.http_options.port == 8100
    assert schema.grpc_options.port == 9100 and schema.grpc_options.grpc_servicer_functions
    (app,) = schema.applications
    assert (app.name, app.route_prefix, app.import_path) == ("chat", "/", APP_BUILDER)
    # args are the app config minus the process-only key (which cluster to join)
    expected = {k: v for k, v in APP.items() if k != "address"}
    assert AppConfig.model_validate(app.args) == AppConfig.model_validate(expected)
    assert validate_args(app.args).placement.label_selector == {"fleetserve.io/pool": "engine"}


def test_build_grpc_disabled_and_stdout(tmp_path, capsys):
    assert main(["build", write(tmp_path / "a.yaml", {"grpc": {"enabled": False}})]) == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    assert "grpc_options" not in ServeDeploySchema.model_validate(doc).model_dump(exclude_unset=True)


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"engine": {"max_num_seqs": 0}}, "engine.max_num_seqs"),
        ({"num_replicas": "two"}, "num_replicas"),
        ({"enigne": {}}, "enigne"),
        ({"autoscaling": {"min_replicas": 5, "max_replicas": 2}}, "autoscaling"),
        ({"placement": {"num_gpus": -1}}, "placement.num_gpus"),
    ],
)
def test_build_rejects_bad_config_naming_the_field(tmp_path, capsys, bad, field):
    out = tmp_path / "serve.yaml"
    assert main(["build", write(tmp_path / "app.yaml", bad), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert field in err and "Traceback" not in err
    assert not out.exists()


def test_build_rejects_unreadable_files(tmp_path, capsys):
    assert main(["build", str(tmp_path / "missing.yaml")]) == 2
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    assert main(["build", str(tmp_path / "list.yaml")]) == 2
    assert "mapping" in capsys.readouterr().err


def test_app_builder_validates_strictly_before_building():
    with pytest.raises(AppConfigError, match=r"engine\.block_size"):
        app_builder({"engine": {"block_size": "big"}})
    with pytest.raises(AppConfigError, match="address"):
        app_builder({"address": "auto"})  # meaningless under serve deploy
    with pytest.raises(AppConfigError, match=r"pd\.connector"):
        app_builder({"pd": {"enabled": True, "connector": ""}})
    assert app_builder({"pd": {"enabled": True}}) is not None  # P/D is served (router/routing/pd.py)


def test_api_key_from_the_environment(monkeypatch):
    from fleetserve.cluster.app_spec import resolve_api_key

    config = validate_args({"api_key_env": "FLEETSERVE_TEST_KEY"})
    monkeypatch.delenv("FLEETSERVE_TEST_KEY", raising=False)
    with pytest.raises(AppConfigError, match="api_key_env.*FLEETSERVE_TEST_KEY"):
        resolve_api_key(config)
    monkeypatch.setenv("FLEETSERVE_TEST_KEY", "s3cret")
    assert resolve_api_key(config) == "s3cret"
    assert resolve_api_key(validate_args({"api_key": "inline"})) == "inline"
    assert resolve_api_key(validate_args({})) is None
