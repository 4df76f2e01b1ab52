"""The application config: CLI flags and YAML produce one validated AppConfig."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from fleetserve.cluster.cli import build_parser, config_from_args, main
from fleetserve.cluster.config import AppConfig


def from_cli(*argv: str) -> AppConfig:
    return config_from_args(build_parser().parse_args(["serve", *argv]))


def test_defaults_match_the_design():
    c = AppConfig()
    assert c.num_replicas == 2 and c.http.host == "127.0.0.1" and c.http.port == 8000
    assert c.grpc.port == 9000 and c.address is None and c.engine.model == "smollm2-135m"
    assert from_cli() == c


def test_cli_flags_use_vllm_names():
    c = from_cli(
        "--model",
        "/m",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "512",
        "--max-model-len",
        "1024",
        "--tensor-parallel-size",
        "2",
        "--no-enable-prefix-caching",
        "--dtype",
        "float32",
        "--block-size",
        "32",
        "--num-gpu-blocks-override",
        "100",
        "--kv-cache-memory-bytes",
        "1000000",
        "--num-replicas",
        "3",
        "--routing-policy",
        "prefix_aware",
        "--api-key",
        "k",
        "--port",
        "8100",
        "--grpc-port",
        "9100",
        "--address",
        "auto",
        "--return-tokens-as-token-ids",
        "--reasoning-parser",
        "deepseek_r1",
    )
    e = c.engine
    assert (e.model, e.max_num_seqs, e.max_num_batched_tokens, e.max_model_len) == ("/m", 4, 512, 1024)
    assert (e.tensor_parallel_size, e.enable_prefix_caching, e.dtype, e.block_size) == (2, False, "float32", 32)
    assert (e.num_gpu_blocks_override, e.kv_cache_memory_bytes) == (100, 1000000)
    assert (c.num_replicas, c.routing_policy, c.api_key) == (3, "prefix_aware", "k")
    assert (c.http.port, c.grpc.port, c.address) == (8100, 9100, "auto")
    assert c.reasoning_parser == "deepseek_r1"
    assert c.http.return_tokens_as_token_ids and not from_cli("--model", "/m").http.return_tokens_as_token_ids


def test_yaml_then_flags_override(tmp_path):
    f = tmp_path / "app.yaml"
    f.write_text(
        "engine:\n  model: /from/yaml\n  max_num_seqs: 7\nnum_replicas: 3\n"
        "routing_policy: least_loaded\nhttp:\n  port: 8200\n"
    )
    c = from_cli("--config", str(f), "--num-replicas", "1", "--max-num-seqs", "9")
    assert c.engine.model == "/from/yaml" and c.engine.max_num_seqs == 9
    assert c.num_replicas == 1 and c.routing_policy == "least_loaded" and c.http.port == 8200


@pytest.mark.parametrize(
    "data,field",
    [
        ({"num_replicas": 0}, "num_replicas"),
        ({"routing_policy": "random"}, "routing_policy"),
        ({"engine": {"max_num_seqs": 0}}, "engine.max_num_seqs"),
        ({"engine": {"block_size": 0}}, "engine.block_size"),
        ({"engine": {"dtype": "int3"}}, "engine.dtype"),
        ({"engine": {"max_num_sequences": 4}}, "engine.max_num_sequences"),
        ({"http": {"port": 70000}}, "http.port"),
        ({"grpc": {"port": -1}}, "grpc.port"),
        ({"routing": {"min_match_fraction": 0}}, "routing.min_match_fraction"),
        ({"replicas": 2}, "replicas"),
    ],
)
def test_invalid_config_names_the_field(data, field):
    with pytest.raises(ValidationError) as e:
        AppConfig.model_validate(data)
    assert field in str(e.value)


def test_invalid_yaml_names_the_field(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("engine:\n  max_num_seqs: -1\n")
    with pytest.raises(ValidationError, match="engine.max_num_seqs"):
        AppConfig.from_yaml(f)
    f.write_text("- just\n- a list\n")
    with pytest.raises(ValueError, match="mapping"):
        AppConfig.from_yaml(f)


def test_serve_with_invalid_config_exits_2_naming_the_field(capsys):
    assert main(["serve", "--num-replicas", "0"]) == 2
    assert "num_replicas" in capsys.readouterr().err


def test_serve_with_an_unknown_kv_connector_exits_2_before_ray_starts(capsys, monkeypatch):
    """It used to start Ray and Serve, and every engine replica then failed at start-up with a
    stack trace in the logs."""
    import sys

    from fleetserve.cluster import lifecycle

    def must_not_start(config):
        raise AssertionError("fleetserve serve went on to start Ray and Serve")

    # run_server is what starts Ray; the check below alone depends on no earlier test in this
    # process having left a Ray up (the router suite's does).
    monkeypatch.setattr(lifecycle, "run_server", must_not_start)
    ray_was_up = "ray" in sys.modules and __import__("ray").is_initialized()
    assert main(["serve", "--pd", "--kv-connector", "p2pp"]) == 2
    err = capsys.readouterr().err
    assert "pd.connector" in err and "unknown KV connector 'p2pp'" in err and "'p2p'" in err
    assert main(["serve", "--kv-transfer-config", '{"kv_connector": "Nope"}']) == 2
    assert "unknown KV connector 'Nope'" in capsys.readouterr().err
    # A connector without an option it cannot start without, likewise (the shared folder).
    assert main(["serve", "--pd", "--kv-connector", "shared_storage"]) == 2
    err = capsys.readouterr().err
    assert "SharedStorageConnector needs kv_connector_extra_config.path" in err
    assert "--pd-kv-connector-extra-config" in err and "Traceback" not in err
    assert ray_was_up or "ray" not in sys.modules or not __import__("ray").is_initialized()


def test_direct_ingress_only_for_an_embedded_ray(monkeypatch):
    from fleetserve.cluster.deploy import direct_ingress

    monkeypatch.delenv("RAY_SERVE_ENABLE_DIRECT_INGRESS", raising=False)
    assert direct_ingress(AppConfig())
    assert not direct_ingress(AppConfig(address="auto"))  # a joined cluster keeps its proxy
    monkeypatch.setenv("RAY_SERVE_ENABLE_DIRECT_INGRESS", "0")
    assert not direct_ingress(AppConfig())


def test_serve_on_a_port_in_use_exits_2_before_ray_starts(capsys, monkeypatch):
    """It used to start Ray and Serve, whose ingress then failed to bind ("No available ports
    on node ...") and Serve gave up ~30 s later."""
    import socket

    from fleetserve.cluster import lifecycle
    from fleetserve.cluster.topology import check_ports

    monkeypatch.setattr(lifecycle, "run_server", lambda config: pytest.fail("serve went on to start Ray"))
    with socket.socket() as busy, socket.socket() as free:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        free.bind(("127.0.0.1", 0))
        taken, other = busy.getsockname()[1], free.getsockname()[1]
        free.close()
        assert main(["serve", "--port", str(taken), "--grpc-port", str(other)]) == 2
        err = capsys.readouterr().err
        assert f"HTTP port {taken} on 127.0.0.1 is not free" in err and "--port" in err
        assert "Traceback" not in err
        assert main(["serve", "--port", str(other), "--grpc-port", str(taken)]) == 2
        assert f"gRPC port {taken} on 127.0.0.1 is not free" in capsys.readouterr().err
        # gRPC off: its port is not needed; a joined cluster's ports are on its head node.
        check_ports(AppConfig(http={"port": other}, grpc={"enabled": False, "port": taken}))
        check_ports(AppConfig(address="auto", http={"port": taken}))


def test_serve_with_a_max_model_len_past_the_model_s_exits_2_before_ray_starts(capsys, monkeypatch, tiny_model_dir):
    """The engine refuses it at start-up: it used to do so in every replica, one after another,
    until Serve gave up ~50 s later."""
    from fleetserve.cluster import lifecycle

    monkeypatch.setattr(lifecycle, "run_server", lambda config: pytest.fail("serve went on to start Ray"))
    model, free = str(tiny_model_dir), ["--port", "0", "--grpc-port", "0"]  # (no port probe)
    assert main(["serve", "--model", model, "--max-model-len", "100000", *free]) == 2
    err = capsys.readouterr().err
    assert "max_model_len=100000 exceeds the model's max_position_embeddings=2048" in err, err
    # A P/D pool's own setting too.
    assert main(["serve", "--model", model, "--pd", "--pd-decode-engine", '{"max_model_len": 4096}', *free]) == 2
    assert "max_model_len=4096 exceeds" in capsys.readouterr().err


def test_kv_caches_that_cannot_fit_in_memory_are_refused_before_ray_starts(capsys, monkeypatch, tiny_model_dir):
    """Replicas would fault their caches in until the OOM killer ended one, again and again."""
    from fleetserve.cluster import lifecycle, topology
    from fleetserve.replica.model_loader.model_info import read_model_shape
    from fleetserve.replica.model_loader.registry import resolve_model

    model = str(tiny_model_dir)
    shape = read_model_shape(resolve_model(model))
    block32 = shape.kv_bytes_per_block(16, 4)  # float32, as the engine allocates it
    gib = 2**30

    def check(available: int, **fields) -> None:
        topology.check_kv_memory(AppConfig.model_validate({"engine": {"model": model}, **fields}), available)

    check(3 * gib, num_replicas=2, engine={"model": model, "kv_cache_memory_bytes": gib})
    with pytest.raises(
        ValueError,
        match=r"2 replicas x 1\.00 GiB \(--kv-cache-memory-bytes\) = 2\.00 GiB, "
        r"and this machine has 1\.50 GiB",
    ):
        check(int(1.5 * gib), num_replicas=2, engine={"model": model, "kv_cache_memory_bytes": gib})
    # --num-gpu-blocks-override: blocks x the block's bytes (float32 here: exact), every TP rank
    over = {"model": model, "dtype": "float32", "num_gpu_blocks_override": 1000, "tensor_parallel_size": 2}
    need = 1000 * shape.kv_bytes_per_block(16, 4, tp=2) * 2
    check(need, num_replicas=1, engine=over)
    with pytest.raises(ValueError, match=r"1 replica x 2 ranks x .* \(--num-gpu-blocks-override\)"):
        check(need - 1, num_replicas=1, engine=over)
    # P/D: both pools, each with its own engine settings
    pd = {
        "enabled": True,
        "connector": "ray_object_store",
        "prefill": {"engine": {"kv_cache_memory_bytes": gib}},
        "decode": {"num_replicas": 2},
    }
    with pytest.raises(ValueError, match=r"1 prefill replica x 1\.00 GiB .* \+ 2 decode replicas x 1\.00 GiB"):
        check(2 * gib, engine={"model": model, "kv_cache_memory_bytes": gib}, pd=pd)
    # Not checked: the default budget (a share of what is available), a joined cluster, a GPU.
    check(1, num_replicas=8)
    check(1, address="auto", engine={"model": model, "kv_cache_memory_bytes": gib})
    check(1, engine={"model": model, "kv_cache_memory_bytes": gib, "device": "cuda"})
    # A budget below one block, with the bytes a block takes (a lower bound for dtype auto).
    with pytest.raises(ValueError, match=rf"holds no block of 16 tokens: {block32} bytes; raise it"):
        check(64 * gib, engine={"model": model, "kv_cache_memory_bytes": 10, "dtype": "float32"})
    with pytest.raises(ValueError, match=rf"the decode pool's .* at least {block32 // 2} bytes \(bfloat16\)"):
        check(64 * gib, pd={**pd, "decode": {"engine": {"kv_cache_memory_bytes": 10}}})

    monkeypatch.setattr(lifecycle, "run_server", lambda config: pytest.fail("serve went on to start Ray"))
    huge = str(64 * (topology._mem_available() or 2**40))
    assert main(["serve", "--model", model, "--kv-cache-memory-bytes", huge, "--port", "0", "--grpc-port", "0"]) == 2
    err = capsys.readouterr().err
    assert "fleetserve serve: the KV caches need 2 replicas x" in err and "memory available" in err, err


@pytest.mark.parametrize("value", [123, "", [], ["a", ""], [1]])
def test_served_model_names_must_be_names(value):
    with pytest.raises(ValidationError, match="one or more non-empty names"):
        AppConfig.model_validate({"engine": {"served_model_name": value}})
    assert from_cli("serve", "--served-model-name", "a", "b", "a").engine.served_model_names == ("a", "b")


def test_the_tracing_endpoint_must_suit_its_protocol():
    ok = AppConfig.model_validate({"tracing": {"otlp_traces_endpoint": "http://collector:4318/v1/traces"}})
    assert ok.tracing.settings()["endpoint"] == "http://collector:4318/v1/traces"
    AppConfig.model_validate({"tracing": {"otlp_traces_endpoint": "collector:4317", "otlp_traces_protocol": "grpc"}})
    for bad in (
        {"otlp_traces_endpoint": "collector:4318"},  # no scheme for OTLP/HTTP
        {"otlp_traces_endpoint": "collector", "otlp_traces_protocol": "grpc"},  # no port
    ):
        with pytest.raises(ValidationError, match="otlp_traces_endpoint"):
            AppConfig.model_validate({"tracing": bad})


def test_slo_flags_and_tenant_targets(tmp_path):
    """SLO-aware admission: off by default; --slo-* flags and a tenant's `slo` in the keys file
    build the router's settings with the engines' step budget; a bad profile is named."""
    from pathlib import Path

    assert AppConfig().slo_settings() is None
    profile = Path(__file__).resolve().parents[2] / "sim" / "profiles" / "h100-llama-3.1-8b.json"
    keys = tmp_path / "keys.yaml"
    keys.write_text("gold: {key: g, slo: {ttft_ms: 300, itl_ms: 40}}\nplain: {key: p}\n")
    c = from_cli(
        "--slo-ttft-ms", "1500", "--slo-profile", str(profile), "--slo-headroom", "0.8",
        "--max-num-batched-tokens", "4096", "--api-keys-file", str(keys),
    )  # fmt: skip
    s = c.slo_settings()
    assert s.default.ttft_s == 1.5 and s.default.itl_s is None and s.headroom == 0.8
    assert s.tenants["gold"].ttft_s == 0.3 and s.tenants["gold"].itl_s == 0.04 and "plain" not in s.tenants
    assert s.max_num_batched_tokens == 4096 and s.profile["name"] == "h100-llama-3.1-8b"
    only_tenants = from_cli("--api-keys-file", str(keys)).slo_settings()  # a tenant's target turns it on
    assert only_tenants is not None and not only_tenants.default.active
    bad = tmp_path / "bad.json"
    bad.write_text('{"step": {"form": "roofline", "overhead_s": 0.001}}')
    with pytest.raises(ValidationError, match="peak_flops"):
        AppConfig.model_validate({"slo": {"profile": str(bad)}})
    with pytest.raises(ValidationError, match="slo.ttft_ms"):
        AppConfig.model_validate({"slo": {"ttft_ms": 0}})
