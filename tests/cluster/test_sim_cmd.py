"""`fleetserve sim`: the command line over the simulator, with the schema of `fleetserve serve`."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fleetserve.cluster.cli import main

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "sim" / "samples"
REQUIRED = (
    "requests",
    "completed",
    "output_tokens_per_s",
    "ttft_s",
    "itl_s",
    "e2e_s",
    "prefix_hit_rate",
    "preemptions",
    "kv_bytes_moved",
    "utilization",
)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["sim", "--no-progress", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_help_names_the_simulation_flags_and_the_serve_flags():
    out = subprocess.run(
        [sys.executable, "-m", "fleetserve.cluster.cli", "sim", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for flag in ("--trace", "--profile", "--pd [P:D]", "--sweep", "--slo-ttft-s", "--max-num-seqs", "--routing-policy"):
        assert flag in out, flag


def test_a_sample_trace_writes_the_result_json(tmp_path, capsys):
    out_path = tmp_path / "r.json"
    rc, out, err = run(
        capsys,
        "--trace",
        str(SAMPLES / "poisson.jsonl"),
        "--num-replicas",
        "2",
        "--max-num-seqs",
        "16",
        "--slo-ttft-s",
        "1",
        "--slo-itl-s",
        "0.1",
        "--output",
        str(out_path),
    )
    assert rc == 0, err
    d = json.loads(out_path.read_text())
    for key in (*REQUIRED, "goodput"):
        assert key in d, key
    # A sample prompt longer than max_model_len is refused, with its reason, as the engine would.
    assert d["completed"] + d["refused"] == d["requests"] > 0
    assert d["completed"] >= 0.95 * d["requests"]
    assert sum(d["refused_reasons"].values()) == d["refused"]
    assert set(d["ttft_s"]) >= {"p50", "p90", "p99"}
    assert len(d["utilization"]) == 2
    assert d["config"]["max_num_seqs"] == 16
    assert d["profile"]["name"] == "h100-llama-3.1-8b"
    assert "TTFT" in out and "goodput" in out


def test_the_config_file_and_flags_over_it_are_the_serve_schema(tmp_path, capsys):
    cfg = tmp_path / "app.yaml"
    cfg.write_text("num_replicas: 3\nrouting_policy: least_loaded\nengine: {max_num_seqs: 8, block_size: 32}\n")
    out_path = tmp_path / "r.json"
    args = ["--config", str(cfg), "--trace", str(SAMPLES / "bursty.jsonl"), "-o", str(out_path)]
    rc, _, err = run(capsys, *args, "--max-num-seqs", "4")
    assert rc == 0, err
    d = json.loads(out_path.read_text())
    assert len(d["replicas"]) == 3
    assert d["config"]["policy"] == "least_loaded"
    assert d["config"]["max_num_seqs"] == 4  # the flag over the file
    assert d["config"]["block_size"] == 32


def test_generated_shared_prefix_trace_with_prefix_routing_hits_the_cache(tmp_path, capsys):
    out_path = tmp_path / "r.json"
    rc, _, err = run(
        capsys,
        "--generate",
        "shared_prefix",
        "--num-requests",
        "300",
        "--request-rate",
        "20",
        "--gen",
        "num_tenants=4",
        "--gen",
        "system_prompt_tokens=1024",
        "--num-replicas",
        "4",
        "--routing-policy",
        "prefix_aware",
        "-o",
        str(out_path),
    )
    assert rc == 0, err
    d = json.loads(out_path.read_text())
    assert d["completed"] == 300
    assert d["prefix_hit_rate"] > 0.5


def test_a_sweep_writes_one_row_per_point_and_a_png(tmp_path, capsys):
    out_path = tmp_path / "sweep.json"
    rc, out, err = run(
        capsys,
        "--generate",
        "poisson",
        "--num-requests",
        "200",
        "--request-rate",
        "30",
        "--sweep",
        "num_replicas=1,2",
        "--sweep",
        "routing_policy=power_of_two,least_loaded",
        "--slo-ttft-s",
        "2",
        "-o",
        str(out_path),
    )
    assert rc == 0, err
    d = json.loads(out_path.read_text())
    assert [(r["num_replicas"], r["routing_policy"]) for r in d["rows"]] == [
        (1, "power_of_two"),
        (1, "least_loaded"),
        (2, "power_of_two"),
        (2, "least_loaded"),
    ]
    assert all(r["goodput"] is not None for r in d["rows"])
    png = out_path.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # More replicas at the same load: TTFT does not get worse.
    by = {(r["num_replicas"], r["routing_policy"]): r for r in d["rows"]}
    assert by[(2, "least_loaded")]["ttft_p90_s"] <= by[(1, "least_loaded")]["ttft_p90_s"]


def test_a_request_rate_sweep_needs_a_generated_trace(tmp_path, capsys):
    rc, _, err = run(capsys, "--trace", str(SAMPLES / "poisson.jsonl"), "--sweep", "request_rate=1,2")
    assert rc == 2 and "needs --generate" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--pd", "two:six"], "expected P:D"),
        (["--pd", "0:2"], "at least one replica"),
        (["--sweep", "colour=red"], "expected KEY=V1,V2"),
        (["--sweep", "num_replicas=4,x"], "is not a number"),
        (["--sweep", "routing_policy=random"], "not one of"),
        (["--max-num-seqs", "0"], "max_num_seqs"),
        (["--profile", "no-such-gpu"], "no-such-gpu"),
        (["--generate", "poisson", "--gen", "colour=1"], "colour"),
        (["--generate", "zipf"], "zipf"),
        (["--generate", "zipf", "--sweep", "request_rate=1,2"], "zipf"),
    ],
)
def test_bad_flags_get_a_message_and_exit_code_2(tmp_path, capsys, argv, message):
    base = [] if "--generate" in argv else ["--trace", str(SAMPLES / "poisson.jsonl")]
    rc, _, err = run(capsys, *base, *argv, "-o", str(tmp_path / "r.json"))
    assert rc == 2
    assert message in err
    assert "Traceback" not in err
    assert not (tmp_path / "r.json").exists()


def test_a_bad_trace_names_the_file_line_and_field(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    good = {"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 3}
    bad = {"arrival_s": 1, "prompt_tokens": -4, "output_tokens": 3}
    trace.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    rc, _, err = run(capsys, "--trace", str(trace), "-o", str(tmp_path / "r.json"))
    assert rc == 2
    assert "t.jsonl line 2" in err and "prompt_tokens" in err
    assert "Traceback" not in err


def test_a_bad_profile_file_names_the_field(tmp_path, capsys):
    from fleetserve.sim.profile import load_profile

    good = json.loads(load_profile("h100-llama-3.1-8b").model_dump_json())
    good["tensor_parallel_size"] = "many"
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps(good))
    rc, _, err = run(
        capsys, "--trace", str(SAMPLES / "poisson.jsonl"), "--profile", str(bad), "-o", str(tmp_path / "r.json")
    )
    assert rc == 2
    assert "p.json" in err and "tensor_parallel_size" in err
    assert "Traceback" not in err


def test_the_cli_module_does_not_import_the_simulator():
    code = "import sys, fleetserve.cluster.cli as c; c.build_parser(); print('fleetserve.sim' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# Modules outside sim/ that may import it, and only inside their command functions.
SIM_COMMANDS = {"cluster/sim_cmd.py", "cluster/profile_cmd.py"}


def test_nothing_imports_the_simulator_but_its_commands_inside_functions():
    """DESIGN.md: nothing imports `sim`. The `fleetserve sim` / `fleetserve profile` commands
    are its user interface and import it lazily, inside the command."""
    offenders = []
    for folder in ("scheduler", "replica", "router", "cluster", "kv_transfer"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            tree = ast.parse(path.read_text(), rel)
            top_level = {id(n) for n in tree.body}
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                if not any(n == "fleetserve.sim" or n.startswith("fleetserve.sim.") for n in names):
                    continue
                if rel not in SIM_COMMANDS or id(node) in top_level:
                    offenders.append(f"{rel}:{node.lineno}")
    assert not offenders, offenders


def test_pd_ratio_runs_two_pools_and_loaded_kv_is_not_a_prefix_hit(tmp_path, capsys):
    out_path = tmp_path / "r.json"
    rc, _, err = run(
        capsys,
        "--generate",
        "poisson",
        "--num-requests",
        "120",
        "--request-rate",
        "4",
        "--gen",
        'prompt={"median": 1500, "sigma": 0.3, "hi": 4000}',
        "--pd",
        "1:2",
        "--pd-min-prefill-tokens",
        "64",
        "-o",
        str(out_path),
    )
    assert rc == 0, err
    d = json.loads(out_path.read_text())
    assert d["pd"]["prefill_replicas"] == 1 and d["pd"]["decode_replicas"] == 2
    assert d["pd"]["paths"]["pd"] == d["completed"] == 120
    assert d["kv_bytes_moved"] > 0
    # Unique prompts: the decode pool loaded their KV, it did not find it in its cache.
    assert d["prefix_hit_rate"] < 0.05


def test_a_bad_length_option_is_named(tmp_path, capsys):
    rc, _, err = run(capsys, "--generate", "poisson", "--gen", 'prompt={"mean": 3}', "-o", str(tmp_path / "r.json"))
    assert rc == 2 and "a length has median" in err
