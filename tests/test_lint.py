"""The code stays linted, formatted and type-checked: ruff (lint and format) and mypy, with
the settings in pyproject.toml (mypy strict on scheduler/ and kv_transfer/), run over the
whole package as a contributor runs them:

    ruff check . && ruff format --check . && mypy
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(module: str, *args: str, timeout_s: int = 600) -> subprocess.CompletedProcess:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install -e '.[lint]')")
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s
    )


def test_ruff_check():
    out = _run("ruff", "check", "--no-cache", ".")
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


def test_ruff_format():
    out = _run("ruff", "format", "--check", "--no-cache", ".")
    assert out.returncode == 0, "run `ruff format .`:\n" + out.stdout[-6000:] + out.stderr[-2000:]


def test_mypy():
    out = _run("mypy")
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-2000:]
