"""Configuration as vLLM spells it (CLI flag, app YAML, EngineArgs) and the engine API's
refusals: params only when a connector is configured, well-formed, JSON only."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from fleetserve.cluster.cli_engine import add_engine_flags, engine_kwargs
from fleetserve.cluster.config import AppConfig
from fleetserve.kv_transfer.connectors.shared_storage import SharedStorageConnector
from fleetserve.kv_transfer.factory import resolve_connector_class
from fleetserve.kv_transfer.params import validate_kv_transfer_params
from fleetserve.replica.engine.engine_args import EngineArgs
from tests.kv_transfer.utils import collect, engine, greedy, run


def parse(argv):
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    return engine_kwargs(p.parse_args(argv))


def test_cli_flag_and_yaml_build_the_same_config(tmp_path):
    flag = (
        '{"kv_connector": "SharedStorageConnector", "kv_role": "kv_consumer", '
        '"kv_connector_extra_config": {"path": "/tmp/kv"}, "kv_load_failure_policy": "recompute"}'
    )
    args = EngineArgs(**parse(["--kv-transfer-config", flag]))
    cfg = args.kv_transfer_config
    assert cfg.kv_role == "kv_consumer" and cfg.is_consumer and not cfg.is_producer
    assert cfg.kv_load_failure_policy == "recompute"
    yaml_file = tmp_path / "app.yaml"
    yaml_file.write_text(
        "engine:\n  kv_transfer_config:\n    kv_connector: SharedStorageConnector\n"
        "    kv_role: kv_consumer\n    kv_connector_extra_config: {path: /tmp/kv}\n"
        "    kv_load_failure_policy: recompute\n"
    )
    assert AppConfig.from_yaml(yaml_file).engine.kv_transfer_config == cfg
    # It survives the trip to the engine-core process (model_dump -> model_validate).
    assert EngineArgs.model_validate(args.model_dump()).kv_transfer_config == cfg


@pytest.mark.parametrize(
    "bad,field",
    [
        ({"kv_connector": "SharedStorageConnector", "kv_role": "sender"}, "kv_role"),
        ({"kv_connector": "SharedStorageConnector", "kv_load_failure_policy": "retry"}, "kv_load_failure_policy"),
        ({"kv_connector": "SharedStorageConnector", "kv_lease_s": 0}, "kv_lease_s"),
        ({"kv_role": "kv_both"}, "kv_connector"),
    ],
)
def test_bad_config_names_the_field(bad, field):
    with pytest.raises(ValidationError, match=field):
        EngineArgs(kv_transfer_config=bad)


@pytest.mark.parametrize(
    "name,extra,message",
    [
        ("shared_storage", {}, "SharedStorageConnector needs kv_connector_extra_config.path"),
        ("SharedStorageConnector", {"path": "  "}, "needs kv_connector_extra_config.path"),
        ("shared_storage", {"path": 3}, "path of SharedStorageConnector must be a string, not 3"),
        ("shared_storage", {"path": "/kv", "max_bytes": 0}, "max_bytes must be >= 1"),
        ("shared_storage", {"path": "/kv", "fsync": "yes"}, "fsync of SharedStorageConnector must be true or false"),
        ("p2p", {"p2p_max_groups": "8"}, "p2p_max_groups of P2PConnector must be an integer"),
        ("p2p", {"p2p_max_groups": True}, "must be an integer, not True"),
        ("p2p", {"stream_chunk_bytes": 0}, "stream_chunk_bytes must be >= 1"),
        ("ray_object_store", {"staging_max_bytes": -1}, "staging_max_bytes must be >= 0"),
        ("FaultInjectionConnector", {}, "FaultInjectionConnector needs kv_connector_extra_config.inner"),
        ("FaultInjectionConnector", {"inner": "shared_storage"}, "SharedStorageConnector needs"),
        ("FaultInjectionConnector", {"inner": "nope"}, "unknown KV connector 'nope'"),
    ],
)
def test_a_connector_missing_or_mistyping_an_option_is_refused_with_the_config(name, extra, message):
    """Checked where the config is parsed: it used to start Ray and Serve, and every engine
    replica then failed at start-up with a stack trace (Serve gave up ~50 s later)."""
    with pytest.raises(ValidationError, match=message):
        EngineArgs(kv_transfer_config={"kv_connector": name, "kv_connector_extra_config": extra})
    with pytest.raises(ValidationError, match="--pd-kv-connector-extra-config"):
        AppConfig(pd={"enabled": True, "connector": name, "kv_connector_extra_config": extra})
    with pytest.raises(ValidationError, match="--cluster-reuse-kv-connector-extra-config"):
        AppConfig(
            routing_policy="prefix_aware",
            cluster_reuse={"enabled": True, "kv_connector": name, "kv_connector_extra_config": extra},
        )


def test_well_formed_connector_options_pass():
    ok = [
        ("shared_storage", {"path": "/kv", "max_bytes": 1 << 30, "fsync": True, "layerwise_save": True}),
        (
            "p2p",
            {
                "host": "127.0.0.1",
                "p2p_max_groups": 4,
                "owner_name": "o",
                "anything_else": 1,
                "stream_chunk_bytes": 1 << 20,
            },
        ),
        ("ray_object_store", {"durable_owner": True, "staging_max_bytes": 0}),
        (
            "FaultInjectionConnector",
            {"inner": "SharedStorageConnector", "inner_extra": {"path": "/kv"}, "faults": {"drop": 1.0}, "seed": 3},
        ),
    ]
    for name, extra in ok:
        EngineArgs(kv_transfer_config={"kv_connector": name, "kv_connector_extra_config": extra})
    # P/D or cluster reuse switched off: their (default) connector's options are not needed.
    AppConfig(pd={"enabled": False, "connector": "shared_storage"})
    AppConfig(cluster_reuse={"enabled": False, "kv_connector": "shared_storage"})


def test_cli_flag_that_is_not_json_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        parse(["--kv-transfer-config", "{not json"])
    assert "not valid JSON" in capsys.readouterr().err


def test_connectors_by_name_or_qualified_name():
    assert resolve_connector_class("SharedStorageConnector") is SharedStorageConnector
    assert (
        resolve_connector_class("fleetserve.kv_transfer.connectors.shared_storage:SharedStorageConnector")
        is SharedStorageConnector
    )
    with pytest.raises(ValueError, match="unknown KV connector|cannot load"):
        resolve_connector_class("NoSuchConnector")
    with pytest.raises(ValueError, match="not a KVConnectorBase"):
        resolve_connector_class("fleetserve.kv_transfer.config:KVTransferConfig")


def test_short_names_resolve_and_unknown_names_fail_where_the_config_is_parsed():
    from fleetserve.kv_transfer.connectors.p2p import P2PConnector
    from fleetserve.kv_transfer.connectors.ray_store import RayObjectStoreConnector

    assert resolve_connector_class("p2p") is P2PConnector
    assert resolve_connector_class("ray_object_store") is RayObjectStoreConnector
    assert resolve_connector_class("shared_storage") is SharedStorageConnector
    assert EngineArgs(kv_transfer_config={"kv_connector": "p2p"}).kv_transfer_config.kv_connector == "p2p"
    # A typo is refused by the config itself (CLI flag, YAML), not first by every engine
    # replica at start-up, and the message names the choices.
    with pytest.raises(ValidationError, match="unknown KV connector 'p2pp'.*'p2p'"):
        EngineArgs(kv_transfer_config={"kv_connector": "p2pp"})
    with pytest.raises(ValidationError, match="KV connector .no_such_module:Connector. cannot be imported"):
        EngineArgs(kv_transfer_config={"kv_connector": "no_such_module:Connector"})
    with pytest.raises(ValidationError, match="not a KVConnectorBase subclass"):
        EngineArgs(kv_transfer_config={"kv_connector": "fleetserve.kv_transfer.config:KVTransferConfig"})
    for bad in (
        {"pd": {"enabled": True, "connector": "p2pp"}},
        {"cluster_reuse": {"enabled": True, "kv_connector": "p2pp"}},
    ):
        with pytest.raises(ValidationError, match="unknown KV connector"):
            AppConfig.model_validate(bad)
    pd = AppConfig.model_validate({"pd": {"enabled": True, "connector": "p2p"}}).pd
    assert pd.kv_transfer_config("kv_consumer")["kv_connector"] == "P2PConnector"


def test_checking_a_connector_name_imports_no_torch():
    import subprocess
    import sys

    code = (
        "import sys; from fleetserve.cluster.config import AppConfig; "
        "AppConfig.model_validate({'pd': {'enabled': True, 'connector': 'p2p'}}); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize(
    "params,message",
    [
        ({"do_remote_decode": True}, "transfer_id"),
        ({"do_remote_prefill": True, "transfer_id": "t"}, "remote_num_tokens"),
        ({"do_remote_decode": True, "transfer_id": "a b"}, "transfer_id"),
        ({"do_remote_decode": True, "do_remote_prefill": True, "transfer_id": "t"}, "exclusive"),
        ({"transfer_id": "t", "evil": 1}, "unknown key"),
        ({"do_remote_decode": True, "transfer_id": "t", "remote_x": {"nested": 1}}, "string, number"),
        ("not a dict", "must be an object"),
    ],
)
def test_malformed_params_are_refused(params, message):
    with pytest.raises(ValueError, match=message):
        validate_kv_transfer_params(params)


def test_engine_refuses_params_without_a_connector_and_serves_on(tiny_model_dir):
    eng = engine(tiny_model_dir, core_process=False)
    try:
        with pytest.raises(ValueError, match="no KV connector"):
            run(collect(eng, [5, 6, 7, 8, 9], greedy(2), {"do_remote_decode": True, "transfer_id": "t"}))
        tokens, final = run(collect(eng, [5, 6, 7, 8, 9], greedy(2)))
        assert len(tokens) == 2 and final.kv_transfer_params is None
        assert eng.get_load()["num_free_blocks"] == eng.get_load()["num_blocks"]
    finally:
        eng.shutdown()


def test_engine_with_a_connector_refuses_malformed_params(tiny_model_dir, tmp_path):
    kv = {"kv_connector": "SharedStorageConnector", "kv_connector_extra_config": {"path": str(tmp_path)}}
    eng = engine(tiny_model_dir, kv, core_process=False)
    try:
        with pytest.raises(ValueError, match="remote_num_tokens"):
            run(collect(eng, [5, 6, 7, 8, 9], greedy(2), {"do_remote_prefill": True, "transfer_id": "t"}))
        tokens, _ = run(collect(eng, [5, 6, 7, 8, 9], greedy(2)))
        assert len(tokens) == 2
    finally:
        eng.shutdown()
