"""`fleetserve profile` (cluster/profile_cmd.py): one replica's steps timed on a tiny random model
with the small grid, fitted and written as a calibrated profile the simulator loads."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from fleetserve.cluster.profile_cmd import add_profile_parser, replica_engine


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fleetserve")
    add_profile_parser(ap.add_subparsers(dest="command", required=True))
    return ap


def _cores() -> int:
    return len(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def profiled(tiny_model_dir, tmp_path_factory):
    import torch

    out = tmp_path_factory.mktemp("profile") / "tiny.json"
    argv = [
        "profile",
        "--model",
        str(tiny_model_dir),
        "--quick",
        "--num-replicas",
        "2",
        "--max-model-len",
        "512",
        "--max-num-batched-tokens",
        "32",  # the small grid's 48-token prompt is chunked
        "--output",
        str(out),
        "--no-progress",
    ]
    threads = torch.get_num_threads()
    args = _parser().parse_args(argv)
    try:
        rc = args.func(args)
    finally:
        torch.set_num_threads(threads)  # the replica's share was set in this process
    assert rc == 0
    return out


def _points(path) -> list[dict]:
    return json.loads(path.read_text())["fit"]["grid"]["points"]


def test_profile_file_loads_and_names_what_was_measured(profiled, tiny_model_dir):
    import torch

    from fleetserve.sim.profile import load_profile

    p = load_profile(profiled)
    assert p.kind == "calibrated"
    assert p.model == str(tiny_model_dir)
    from fleetserve.replica.worker.device import select_dtype

    # --dtype auto: bfloat16 where the CPU has AVX-512 bf16, float32 elsewhere
    assert p.dtype == str(select_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    assert p.tensor_parallel_size == 1
    threads = max(1, _cores() // 2)  # --num-replicas 2 splits this machine's cores
    assert p.threads == threads
    assert f"{threads} thread" in p.hardware
    assert p.model_shape.num_layers == 2 and p.model_shape.hidden_size == 64
    assert p.model_shape.num_kv_heads == 2 and p.model_shape.num_attention_heads == 4
    assert p.source.startswith("fleetserve profile ")
    assert p.kv_transfer == {}  # not measured here: not invented either
    fit = p.fit
    assert fit is not None and fit.samples == len(_points(profiled))
    assert 0 <= fit.median_rel_error <= fit.p90_rel_error <= fit.max_rel_error
    assert p.kv_cache_memory_bytes and p.kv_cache_memory_bytes > 0


def test_fit_predicts_the_measured_steps(profiled):
    from fleetserve.sim.profile import load_profile
    from fleetserve.sim.shape import StepShape

    cost = load_profile(profiled).cost_model()
    errs = []
    for pt in _points(profiled):
        t = pt["seconds"]
        assert t > 0
        errs.append(abs(cost.step_seconds(StepShape(**pt["shape"])) - t) / t)
    errs.sort()
    # Tiny-model steps are ~1 ms and the cores are shared: a loose bound, on most points.
    assert errs[len(errs) // 2] < 0.5, errs
    assert errs[int(len(errs) * 0.8)] < 1.0, errs


def test_steps_were_really_varied(profiled):
    pts = _points(profiled)
    kinds = {p["kind"] for p in pts}
    assert kinds == {"prefill", "decode", "mixed"}
    for p in pts:
        s = p["shape"]
        if p["kind"] == "prefill":
            assert s["prefill_tokens"] > 0 and s["decode_seqs"] == 0
        elif p["kind"] == "decode":
            assert s["prefill_tokens"] == 0 and s["decode_seqs"] > 0
        else:
            assert s["prefill_tokens"] > 0 and s["decode_seqs"] > 0
    # prefix-cache hits: fewer prefill tokens than the prompt, attending to the cached context
    hits = [p for p in pts if p["scenario"].startswith("hit")]
    assert hits
    for p in hits:
        n = p["shape"]["prefill_tokens"]
        assert n < p["prompt_tokens"]
        assert p["shape"]["prefill_attn_tokens"] > n * n / 2
    # chunked prefill: the 48-token prompt in 32 + 16, the second chunk after 32 tokens
    chunks = [p["shape"] for p in pts if p["scenario"] == "prefill 48"]
    assert [c["prefill_tokens"] for c in chunks] == [32, 16]
    assert chunks[1]["prefill_attn_tokens"] == 16 * (32 + 8)
    decodes = [p["shape"] for p in pts if p["kind"] == "decode"]
    assert len({d["decode_seqs"] for d in decodes}) >= 2  # batch sizes
    assert len({d["decode_context_tokens"] // d["decode_seqs"] for d in decodes}) >= 2  # context lengths
    assert all(p["samples"] >= 1 for p in pts)
    assert any(p["samples"] >= 3 for p in pts)  # repeats


def test_threads_as_serve_gives_a_replica():
    from fleetserve.cluster.config import AppConfig

    engine, threads = replica_engine(AppConfig.model_validate({"num_replicas": 2}))
    assert threads == max(1, _cores() // 2) and engine.num_threads == threads
    _, threads = replica_engine(AppConfig.model_validate({"num_replicas": 1}))
    assert threads == _cores()
    _, threads = replica_engine(AppConfig.model_validate({"num_replicas": 2, "engine": {"num_threads": 3}}))
    assert threads == 3
    _, threads = replica_engine(AppConfig.model_validate({"num_replicas": 1, "address": "auto"}))
    assert threads == 1  # a joined cluster: the 1 CPU Ray reserves


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--max-num-seqs", "0"], ["invalid configuration", "max_num_seqs"]),
        (["--tensor-parallel-size", "2"], ["tensor_parallel_size=2"]),
        (["--model", "/no/such/model-dir"], ["/no/such/model-dir"]),
        (["--output", "/no/such/dir/p.json"], ["/no/such/dir"]),
    ],
)
def test_bad_config_is_rc_2_with_a_message(flags, words, tiny_model_dir, capsys):
    argv = ["profile", "--model", str(tiny_model_dir), "--quick", "--no-progress", *flags]
    args = _parser().parse_args(argv)
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for w in words:
        assert w in err


def test_bad_flag_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["profile", "--repeats", "0"])
    assert e.value.code == 2
    assert "--repeats" in capsys.readouterr().err


def test_kv_transfer_is_measured_not_invented():
    from fleetserve.cluster.profile_cmd import measure_kv_transfer
    from fleetserve.sim.profile import KVLink

    links = measure_kv_transfer(["storage"], sizes=(64, 512), repeats=1)
    assert set(links) == {"shared_storage"}
    link = KVLink(**links["shared_storage"])
    assert link.bandwidth_bytes_s > 1e6 and link.latency_s >= 0
    assert "measured" in link.source and "64, 512 tokens" in link.source


def test_unknown_kv_connector_is_rc_2(tiny_model_dir, capsys):
    args = _parser().parse_args(["profile", "--model", str(tiny_model_dir), "--quick", "--kv-transfer", "carrier"])
    assert args.func(args) == 2
    assert "--kv-transfer carrier: choose from storage, ray, p2p" in capsys.readouterr().err
