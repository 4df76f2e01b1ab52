"""One import name: an install puts only `fleetserve` on the import path, the code never
imports the bare folder names, and the public API is lazy."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"scheduler", "replica", "router", "cluster", "kv_transfer"}


def _python_files():
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in {".git", "build", "dist", ".venv"} or "egg-info" in rel.parts[0]:
            continue
        yield path, rel


def test_no_bare_imports_of_the_folders():
    offenders = []
    for path, rel in _python_files():
        tree = ast.parse(path.read_text(), str(rel))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            offenders += [f"{rel}:{node.lineno} {n}" for n in names if n.split(".")[0] in FOLDERS]
    assert not offenders, "import through `fleetserve.`:\n" + "\n".join(offenders)


def test_wheel_has_one_top_level_name(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode != 0 and "No module named" in out.stderr:
        pytest.skip(f"cannot build a wheel here: {out.stderr.strip()[-300:]}")
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = tmp_path.glob("fleetserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"fleetserve", next(t for t in tops if t.endswith(".dist-info"))}, tops
    for needed in (
        "fleetserve/__init__.py",
        "fleetserve/scheduler/scheduler.py",
        "fleetserve/replica/engine/engine_core.py",
        "fleetserve/replica/kernels/cpu_ops.cpp",
        "fleetserve/router/grpc/proto/fleetserve.proto",
        "fleetserve/cluster/cli.py",
        "fleetserve/kv_transfer/__init__.py",
    ):
        assert needed in names, needed
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "fleetserve = fleetserve.cluster.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_public_api_is_lazy():
    code = (
        "import sys, fleetserve, fleetserve.scheduler\n"
        "assert 'torch' not in sys.modules and 'ray' not in sys.modules, 'eager import'\n"
        "from fleetserve import LLM, SamplingParams, AsyncEngine, EngineArgs\n"
        "from fleetserve.replica.llm import LLM as L2\n"
        "assert LLM is L2 and SamplingParams.__module__ == 'fleetserve.scheduler.sampling_params'\n"
        "assert 'AsyncEngine' in dir(fleetserve)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd="/")
    assert out.returncode == 0, out.stderr[-2000:]
    out = subprocess.run(
        [sys.executable, "-c", "import fleetserve; fleetserve.Nope"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    assert "has no attribute 'Nope'" in out.stderr


def test_serve_takes_the_model_as_a_positional_argument():
    from fleetserve.cluster.cli import build_parser, config_from_args

    config = config_from_args(build_parser().parse_args(["serve", "/models/my.gguf", "--num-replicas", "1"]))
    assert config.engine.model == "/models/my.gguf" and config.num_replicas == 1
    config = config_from_args(build_parser().parse_args(["serve", "--model", "other"]))
    assert config.engine.model == "other"


def test_the_cli_deploys_without_importing_torch():
    """`fleetserve serve` imports what it deploys (Serve pickles the deployment classes by
    reference) but never loads torch or transformers itself: the replicas do. Importing them
    in the CLI cost ~2 s before Ray even started, on every `fleetserve serve`."""
    code = (
        "import sys, fleetserve.cluster.cli, fleetserve.cluster.deploy; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
