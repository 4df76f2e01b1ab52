"""The docs site and the front page.

- `mkdocs build --strict` succeeds (every page in the nav, every relative link and anchor
  resolves, the CLI reference hook runs);
- README.md stays a short front page that still starts with the two commands, the second
  of which is exactly what `.ci/run` runs;
- nothing of the old front pages was lost: every section heading of the old README.md,
  router/README.md and benchmarks/README.md (docs/_readme_sections.txt) is a heading of the
  docs page that now holds it;
- the links of the Markdown files GitHub renders outside the site (README.md, router/README.md,
  benchmarks/README.md) point at files that exist.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
SECTIONS = DOCS / "_readme_sections.txt"
README_MAX_LINES = 220


def _first_code_block(text: str) -> list[str]:
    m = re.search(r"^```[^\n]*\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    assert m, "README.md has no fenced code block"
    return [line for line in m.group(1).splitlines() if line.strip()]


def _ci_command() -> str:
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    commands = [line for line in lines if line and not line.startswith(("#", "set ", "cd "))]
    assert commands, ".ci/run runs no command"
    return commands[-1]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        reason = "mkdocs / mkdocs-material not installed (pip install -e '.[docs]'): docs build not checked"
        print(reason)
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(out),
        ],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def test_site_builds_strict(site: Path):
    assert (site / "index.html").is_file()
    assert (site / "serving" / "cli" / "index.html").is_file()


def test_cli_reference_lists_every_flag(site: Path):
    """The generated page carries every flag of every subcommand's `--help` (the hook ran)."""
    from fleetserve.cluster.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    html = (site / "serving" / "cli" / "index.html").read_text()
    missing = [
        opt
        for name, sp in sub.choices.items()
        for a in sp._actions
        if not isinstance(a, argparse._HelpAction)
        for opt in a.option_strings
        if opt.startswith("--") and f"<code>{opt}</code>" not in html
    ]
    assert not missing, f"flags missing from the CLI reference: {missing}"


def test_readme_is_a_short_front_page_with_the_two_commands():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    assert lines[0] == "# fleetserve"
    assert lines[2] == "```bash", "the first thing after the title is the bash block of the two commands"
    block = _first_code_block(text)
    assert len(block) == 2, f"the first code block holds the two commands, found {block}"
    assert block[0].endswith("fleetserve serve"), block[0]
    assert block[1] == _ci_command(), (
        f"README's second command must be what .ci/run runs:\n  README: {block[1]}\n  .ci/run: {_ci_command()}"
    )


def _sections() -> list[tuple[str, str, str, str]]:
    rows: list[tuple[str, str, str, str]] = []
    for line in SECTIONS.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(" | ")]
        assert len(parts) == 4, f"bad line in {SECTIONS.name}: {line!r}"
        rows.append((parts[0], parts[1], parts[2], parts[3]))
    return rows


def test_section_list_covers_the_old_readmes_headings():
    rows = _sections()
    readme = [old for src, old, _, _ in rows if src == "README.md"]
    assert len(readme) == 15 and len(set(readme)) == 15, "one line per ## heading of the old README.md"
    assert {src for src, _, _, _ in rows} == {"README.md", "router/README.md", "benchmarks/README.md"}


def _section_id(row: tuple[str, str, str, str]) -> str:
    return f"{row[0]}:{row[1].lstrip('# ')}"


@pytest.mark.parametrize("src,old,page,heading", _sections(), ids=[_section_id(r) for r in _sections()])
def test_old_section_lives_on(src, old, page, heading):
    path = DOCS / page
    assert path.is_file(), f"{src} {old!r} maps to {page}, which does not exist"
    text = path.read_text()
    in_code = False
    headings = []
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"^#{1,6}\s+(.*?)\s*$", line)):
            headings.append(m.group(1))
    assert heading in headings, f"{page} has no heading {heading!r} (for {src} {old!r}); it has {headings}"


@pytest.mark.parametrize("md", ["README.md", "router/README.md", "benchmarks/README.md"])
def test_github_markdown_links_resolve(md):
    path = ROOT / md
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.DOTALL | re.MULTILINE)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target) or target.startswith("#"):
            continue
        if not (path.parent / target.split("#", 1)[0]).exists():
            broken.append(target)
    assert not broken, f"{md} links to missing files: {broken}"
